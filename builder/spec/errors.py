"""The wording of spec errors: pydantic's validation errors as one line naming the YAML path."""
from __future__ import annotations

import difflib
import typing

from pydantic import BaseModel, ValidationError

from ..errors import SpecError


class FieldError(ValueError):
    """Raised by a section validator: the sub-field it is about, and the message."""

    def __init__(self, path: str, message: str):
        self.path, self.message = path, message
        super().__init__(message)


def did_you_mean(name: str, choices) -> str:
    close = difflib.get_close_matches(name, list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _model_at(root: type[BaseModel], loc: tuple) -> type[BaseModel] | None:
    model: type[BaseModel] | None = root
    for part in loc:
        field = model.model_fields.get(part) if model else None
        ann = field.annotation if field else None
        # `Section | None` (calibration, medusa): the section inside the Optional
        options = [a for a in (typing.get_args(ann) or (ann,)) if isinstance(a, type) and issubclass(a, BaseModel)]
        model = options[0] if options else None
    return model


def spec_error(root: type[BaseModel], exc: ValidationError) -> SpecError:
    """pydantic's first error as one line naming the YAML path and what would be valid."""
    err = exc.errors()[0]
    loc = tuple(str(p) for p in err["loc"])
    path = ".".join(loc)
    kind = err["type"]
    if kind == "extra_forbidden":
        parent = _model_at(root, loc[:-1])
        fields = list(parent.model_fields) if parent else []
        return SpecError(path, f"unknown key{did_you_mean(loc[-1], fields)}; valid keys here: "
                               f"{', '.join(fields)}")
    if kind == "missing":
        return SpecError(path, "required")
    if kind in ("enum", "literal_error"):
        return SpecError(path, f"{err['input']!r} is not valid; valid: {err['ctx']['expected']}")
    ctx_err = err.get("ctx", {}).get("error")
    if isinstance(ctx_err, FieldError):
        return SpecError(".".join(loc + (ctx_err.path,)), ctx_err.message)
    message = err["msg"].removeprefix("Value error, ")
    return SpecError(path, f"{message} (got {err['input']!r})" if kind != "value_error" else message)

"""Spec resolution: the YAML file → ``SpecDocument`` (validated plain data) → ``Spec`` (the
document with its paths made absolute and the facts read from disk: the checkpoint's
architecture, the Medusa heads and their tree), then the cross-checks against the checkpoint.

Done once, here; the ``Spec`` that results flows down the build read-only.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import yaml
from pydantic import ValidationError

from ..errors import SpecError, UserError
from ..frontend.checkpoint import ArchConfig, arch_config
from .document import SpecDocument
from .model import ResolvedDraftHead, Spec
from .checks import check_against_checkpoint
from .errors import FieldError, did_you_mean, spec_error


def resolve(document: SpecDocument, base_dir: Path = Path("."),
            absent_checkpoint: Callable[[Path], ArchConfig | None] | None = None) -> Spec:
    """``absent_checkpoint``: for readers that need only the architecture (``plan``), the facts
    to use when the checkpoint dir is not here (None: refuse, as a build must)."""
    base_dir = Path(base_dir)
    _check_pass_names(document.passes.disable)
    checkpoint = _absolute(document.model.checkpoint, base_dir)
    stand_in = absent_checkpoint(checkpoint) if absent_checkpoint and not checkpoint.exists() else None
    try:
        arch = stand_in or arch_config(checkpoint)
    except UserError as exc:
        raise SpecError("model.checkpoint", str(exc)) from None
    update: dict = {"model": document.model.model_copy(update={"checkpoint": checkpoint})}
    calibration = document.quantization.calibration
    if calibration is not None:
        calibration = calibration.model_copy(update={"data": tuple(_absolute(p, base_dir) for p in calibration.data)})
        update["quantization"] = document.quantization.model_copy(update={"calibration": calibration})
    medusa = None
    if document.speculative.medusa is not None:
        from ..medusa.resolve import resolve_medusa  # the heads' modules load only for Medusa specs

        section = document.speculative.medusa
        section = section.model_copy(update={"heads": _absolute(section.heads, base_dir)})
        update["speculative"] = document.speculative.model_copy(update={"medusa": section})
        medusa = resolve_medusa(section, arch)
    draft_head = None
    if document.speculative.draft_head is not None:
        section = document.speculative.draft_head
        section = section.model_copy(update={"path": _absolute(section.path, base_dir)})
        speculative = update.get("speculative", document.speculative)
        update["speculative"] = speculative.model_copy(update={"draft_head": section})
        draft_head = _resolve_draft_head(section, arch)
    spec = Spec(document=document.model_copy(update=update), arch=arch, medusa=medusa, draft_head=draft_head)
    check_against_checkpoint(spec)
    return spec


def _resolve_draft_head(section, arch: ArchConfig) -> ResolvedDraftHead:
    """The draft dir's config, refused where it does not fit the target (both sides named)."""
    from ..draft_head.model import read_draft_config  # torch loads only for draft head specs

    field = "speculative.draft_head.path"
    try:
        config = read_draft_config(section.path)
    except UserError as exc:
        raise SpecError(field, str(exc)) from None
    problem = config.fit_problem(arch.hidden_size, arch.num_layers, arch.vocab_size)
    if problem is not None:
        raise SpecError(field, f"{section.path}: {problem}")
    return ResolvedDraftHead(path=section.path, config=config, num_tokens=section.num_tokens)


def spec_from_dict(data: dict, base_dir: Path = Path("."),
                   absent_checkpoint: Callable[[Path], ArchConfig | None] | None = None) -> Spec:
    """A spec's mapping (as YAML gives it) validated and resolved; paths relative to ``base_dir``."""
    if not isinstance(data, dict):
        raise SpecError("", f"a spec is a YAML mapping with sections {', '.join(SpecDocument.model_fields)}")
    try:
        document = SpecDocument.model_validate(data)
    except ValidationError as exc:
        raise spec_error(SpecDocument, exc) from None
    except FieldError as exc:  # raised by a section validator outside pydantic's wrapping
        raise SpecError(exc.path, exc.message) from None
    return resolve(document, base_dir, absent_checkpoint)


def load_spec(path: Path, absent_checkpoint: Callable[[Path], ArchConfig | None] | None = None) -> Spec:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: spec file does not exist")
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)
    except UnicodeDecodeError:
        raise UserError(f"{path}: not UTF-8 text") from None
    except _DuplicateKey as exc:
        raise UserError(f"{path}: key {exc.key!r} appears twice at line {exc.line}; give each key once") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise UserError(f"{path}: not valid YAML{where}: {getattr(exc, 'problem', exc)}") from None
    return spec_from_dict(data, base_dir=path.parent, absent_checkpoint=absent_checkpoint)


def _absolute(path: Path, base_dir: Path) -> Path:
    return path if path.is_absolute() else (base_dir / path).resolve()


def _check_pass_names(names: tuple[str, ...]) -> None:
    if not names:
        return
    from ..passes import PIPELINE  # the one list of passes; loaded only when a spec names some

    known = [p.name for p in PIPELINE]
    for name in names:
        if name not in known:
            raise SpecError("passes.disable", f"unknown pass {name!r}{did_you_mean(name, known)}; "
                                              f"valid: {', '.join(known)}")


class _DuplicateKey(yaml.YAMLError):
    def __init__(self, key, line: int):
        super().__init__(f"duplicate key {key!r}")
        self.key, self.line = key, line


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's own rule, which PyYAML does not enforce: mapping keys are unique (else the last
    silently wins, and a spec means something other than it reads)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, (str, int, float, bool)) and key is not None:
                raise yaml.constructor.ConstructorError(None, None, f"a mapping key must be a name, got {key!r}",
                                                        key_node.start_mark)
            if key in seen:
                raise _DuplicateKey(key, key_node.start_mark.line + 1)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)

"""What a request's output must match: the constraint kinds ``SamplingParams.constraint`` takes.

Each is a small frozen value (hashable: the compiler caches by it) that knows its grammar in
llguidance's format; nothing here compiles. ``ConstraintError`` is a ``ValueError`` whose text
starts with the constraint kind, so a caller (the server) can name the field at fault."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Union


# JSON on one line with json.dumps's separators: a grammar that allows any whitespace lets a model
# (the bundled one, and small real ones) spend its tokens on blanks and hit max_tokens mid-object.
# A schema's own "x-guidance" options still override these.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class ConstraintError(ValueError):
    """A constraint that cannot be compiled (bad schema, regex, grammar; or over the engine's limits)."""


@dataclass(frozen=True)
class JsonSchema:
    """JSON text that validates against ``schema`` (a dict or its JSON text; kept as compact
    JSON text so equal schemas share one compiled grammar). Key order is kept: properties come
    out in the schema's order."""
    schema: str

    def __post_init__(self):
        schema = self.schema
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise ConstraintError(f"json schema: not JSON ({exc.msg} at character {exc.pos})") from None
        if not isinstance(schema, (dict, bool)):
            raise ConstraintError(f"json schema: must be a JSON object, got {type(schema).__name__}")
        object.__setattr__(self, "schema", json.dumps(schema, separators=(",", ":")))

    kind = "json schema"

    def grammar(self) -> str:
        from llguidance import LLMatcher

        return LLMatcher.grammar_from_json_schema(self.schema, defaults=JSON_LAYOUT)


@dataclass(frozen=True)
class JsonObject:
    """Any JSON object (OpenAI's ``response_format: {"type": "json_object"}``)."""

    kind = "json object"

    def grammar(self) -> str:
        from llguidance import LLMatcher

        return LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_LAYOUT)


@dataclass(frozen=True)
class Regex:
    """Text that the regular expression matches whole (Rust ``regex`` syntax)."""
    pattern: str

    def __post_init__(self):
        if not isinstance(self.pattern, str) or not self.pattern:
            raise ConstraintError("regex: must be a non-empty string")

    kind = "regex"

    def grammar(self) -> str:
        from llguidance import LLMatcher

        return LLMatcher.grammar_from_regex(self.pattern)


@dataclass(frozen=True)
class Grammar:
    """Text in a context-free grammar: llguidance's Lark syntax, or llama.cpp's GBNF (a grammar
    with a ``root ::=`` rule)."""
    text: str

    def __post_init__(self):
        if not isinstance(self.text, str) or not self.text.strip():
            raise ConstraintError("grammar: must be a non-empty string")

    kind = "grammar"

    def grammar(self) -> str:
        from llguidance import grammar_from

        return grammar_from("grammar", self.text)  # ValueError: the compiler names the kind


@dataclass(frozen=True)
class Choice:
    """Exactly one of ``options``."""
    options: tuple[str, ...]

    def __post_init__(self):
        options = tuple(self.options) if isinstance(self.options, (list, tuple)) else None
        if not options or not all(isinstance(o, str) and o for o in options):
            raise ConstraintError("choice: must be a non-empty list of non-empty strings")
        object.__setattr__(self, "options", options)

    kind = "choice"

    def grammar(self) -> str:
        from llguidance import grammar_from

        return grammar_from("choice", json.dumps(list(self.options)))


Constraint = Union[JsonSchema, JsonObject, Regex, Grammar, Choice]
CONSTRAINT_TYPES = (JsonSchema, JsonObject, Regex, Grammar, Choice)

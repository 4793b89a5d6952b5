"""The request fields that constrain output: OpenAI's ``response_format`` and vLLM's
``structured_outputs`` extension (``json``, ``regex``, ``choice``, ``grammar``, ``json_object``),
turned into one ``Constraint`` (runtime/structured/), and compiled off the event loop in the
LLM's compile pool under a deadline. Every refusal is a 400 naming the field (a 503 when the
pool is full); nothing is ever silently left unconstrained."""
from __future__ import annotations

from ..structured import (Choice, CompilePool, CompilerBusy, CompileTimeout, Constraint, ConstraintError, Grammar,
                          JsonObject, JsonSchema, Regex)
from ..structured.compile_pool import TIMEOUT_S
from .protocol import ApiError
from .structured_fields import ResponseFormat, StructuredOutputs

COMPILE_TIMEOUT_S = TIMEOUT_S  # a schema that takes longer is refused (llguidance's own limits stop most sooner)


def requested(response_format: ResponseFormat | None, structured: StructuredOutputs | None
              ) -> tuple[Constraint, str] | None:
    """The body's constraint and the field that asked for it (named in errors); None if none."""
    if response_format is not None and response_format.type != "text" and structured is not None:
        raise ApiError(400, "structured_outputs: send either it or response_format, not both",
                       param="structured_outputs")
    if response_format is not None and response_format.type == "json_object":
        return JsonObject(), "response_format"
    if response_format is not None and response_format.type == "json_schema":
        where = "response_format.json_schema"
        if response_format.json_schema is None or response_format.json_schema.schema_ is None:
            raise ApiError(400, f"{where}: type json_schema needs json_schema.schema", param=where)
        return _made(lambda: JsonSchema(response_format.json_schema.schema_), f"{where}.schema")
    if structured is None:
        return None
    asked = [name for name in ("json_", "regex", "choice", "grammar") if getattr(structured, name) is not None]
    asked += ["json_object"] if structured.json_object else []
    if len(asked) != 1:
        raise ApiError(400, "structured_outputs: give exactly one of json, regex, choice, grammar, json_object "
                            f"(got {len(asked)})", param="structured_outputs")
    name = asked[0]
    where = f"structured_outputs.{name.rstrip('_')}"
    kinds = {"json_": JsonSchema, "regex": Regex, "choice": Choice, "grammar": Grammar}
    if name == "json_object":
        return JsonObject(), where
    return _made(lambda: kinds[name](getattr(structured, name)), where)


def _made(make, where: str) -> tuple[Constraint, str]:
    try:
        return make(), where
    except ConstraintError as exc:
        raise ApiError(400, f"{where}: {exc}", param=where) from None


async def compiled(pool: CompilePool, constraint: Constraint, where: str, timeout_s: float = COMPILE_TIMEOUT_S):
    """The constraint compiled by ``pool`` (a cache hit at once; else in one of its threads, never
    on the event loop), refused with a 400 naming ``where`` if it cannot be compiled or runs over
    ``timeout_s`` from when its compile started, and a 503 when the pool's threads and its wait
    are full (each request with a new schema would otherwise queue behind the slowest)."""
    try:
        return await pool.compile(constraint, timeout_s)
    except CompilerBusy as exc:
        raise ApiError(503, f"{where}: {exc}", param=where, kind="server_error", code="constraint_compiler_busy") from None
    except CompileTimeout:
        raise ApiError(400, f"{where}: took over {timeout_s:g} s to compile; simplify it", param=where,
                       code="constraint_too_complex") from None
    except ConstraintError as exc:
        raise ApiError(400, f"{where}: {exc}", param=where) from None

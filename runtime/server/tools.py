"""Function tools on /v1/chat/completions: ``tools`` with ``tool_choice`` "required" or a named
function constrain the answer to one JSON call, ``{"name": ..., "arguments": {...}}``, whose
arguments match that function's ``parameters`` schema (runtime/structured/: a JSON Schema
``anyOf`` over the callable tools). The call comes back as the message's ``tool_calls``
(runtime/server/tool_calls.py). ``tool_choice`` "auto" (the default with tools) is refused: this
server does not parse free-form tool calls out of text. "none": the tools are ignored.

The model is told about the tools by the engine dir's chat template when it takes ``tools``
(Hugging Face templates that support tool use do), else by one system line (``system_line``)."""
from __future__ import annotations

import json
from dataclasses import dataclass

from ..structured import ConstraintError, JsonSchema
from .protocol import ApiError
from .tool_fields import FunctionTool, NamedToolChoice, ToolChoice

NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True)
class ToolCalling:
    """A request's tools as they shape its prompt and its output."""
    tools: tuple[dict, ...]   # every tool as the client sent it (what a chat template takes)
    callable: tuple[str, ...]  # the functions the answer may call
    constraint: JsonSchema

    def system_line(self) -> str:
        """The tools told in one system message, for a chat template that does not take them."""
        functions = {t["function"]["name"]: t["function"] for t in self.tools}
        lines = [f"- {name}: {functions[name].get('description') or 'no description'}; arguments: "
                 f"{json.dumps(functions[name].get('parameters') or NO_ARGUMENTS, separators=(',', ':'))}"
                 for name in self.callable]
        which = "this function" if len(self.callable) == 1 else "one of these functions"
        return (f"Call {which}, answering with only a JSON object "
                f'{{"name": <the function\'s name>, "arguments": <its arguments>}}:\n' + "\n".join(lines))


def tool_calling(tools: list[FunctionTool] | None, tool_choice: ToolChoice | None) -> ToolCalling | None:
    """What ``tools`` and ``tool_choice`` ask for: None when the output is free (no tools, or
    tool_choice "none"); a 400 naming the field for a bad tool, an unknown name, or "auto"."""
    tools = tools or []
    names = [tool.function.name for tool in tools]
    for index, name in enumerate(names):
        if name in names[:index]:
            raise ApiError(400, f"tools.{index}.function.name: {name!r} is also tools.{names.index(name)}'s; "
                                "function names must differ", param=f"tools.{index}.function.name")
    schemas = [_arguments_schema(tool, index) for index, tool in enumerate(tools)]
    if not tools:
        if tool_choice is None or tool_choice == "none":
            return None
        raise ApiError(400, "tool_choice: needs tools (a list of function tools), or leave it out", param="tool_choice")
    if tool_choice == "none":
        return None
    if tool_choice is None or tool_choice == "auto":
        raise ApiError(400, 'tool_choice: "auto" (the default with tools) is not supported: this server does not '
                            'parse free-form tool calls; send "required", {"type": "function", "function": '
                            '{"name": ...}}, or "none"', param="tool_choice", code="unsupported_parameter")
    if isinstance(tool_choice, NamedToolChoice):
        wanted = tool_choice.function.name
        if wanted not in names:
            raise ApiError(400, f"tool_choice.function.name: {wanted!r} is not one of the tools ({', '.join(names)})",
                           param="tool_choice.function.name")
        callable_ = [names.index(wanted)]
    else:   # "required": any of them
        callable_ = list(range(len(tools)))
    return ToolCalling(tuple(tool.model_dump(exclude_none=True) for tool in tools),
                       tuple(names[i] for i in callable_), _call_schema([(names[i], schemas[i], i) for i in callable_]))


def _arguments_schema(tool: FunctionTool, index: int) -> dict:
    """The function's ``parameters`` as the schema of an arguments object; a 400 naming it if
    it is not a valid JSON Schema of an object (checked without a tokenizer: cheap)."""
    from llguidance import LLMatcher

    where = f"tools.{index}.function.parameters"
    parameters = tool.function.parameters
    if parameters is None:
        return NO_ARGUMENTS
    if parameters.get("type", "object") != "object":
        raise ApiError(400, f"{where}: the arguments are a JSON object: type must be \"object\" "
                            f"(got {json.dumps(parameters['type'])})", param=where)
    schema = {**parameters, "type": "object"}
    try:
        error = LLMatcher.validate_grammar(JsonSchema(schema).grammar())
    except (ConstraintError, ValueError) as exc:
        error = str(exc)
    if error:
        raise ApiError(400, f"{where}: not a valid JSON Schema: {error.splitlines()[0]}", param=where)
    return schema


def _call_schema(tools: list[tuple[str, dict, int]]) -> JsonSchema:
    """One call's JSON: ``{"name": <const>, "arguments": <its schema>}`` for each callable tool
    (``anyOf`` when several). Each tool's definitions move to the root's ``$defs`` (renamed
    ``tool<i>_<name>``) and its local references with them, so they still resolve when its
    schema sits under ``arguments``."""
    defs, calls = {}, []
    for name, schema, index in tools:
        prefix = f"tool{index}"
        own = {**schema.get("$defs", {}), **schema.get("definitions", {})}
        body = {k: v for k, v in schema.items() if k not in ("$defs", "definitions")}
        defs[prefix] = _moved(body, prefix)
        defs.update({f"{prefix}_{key}": _moved(value, prefix) for key, value in own.items()})
        calls.append({"type": "object", "properties": {"name": {"const": name}, "arguments": {"$ref": f"#/$defs/{prefix}"}},
                      "required": ["name", "arguments"], "additionalProperties": False})
    return JsonSchema({**(calls[0] if len(calls) == 1 else {"anyOf": calls}), "$defs": defs})


def _moved(node, prefix: str):
    """``node`` with its local references (``#...``) pointing where ``_call_schema`` put them."""
    if isinstance(node, list):
        return [_moved(item, prefix) for item in node]
    if not isinstance(node, dict):
        return node
    moved = {key: _moved(value, prefix) for key, value in node.items()}
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        pointer = ref[1:]
        for section in ("/$defs/", "/definitions/"):
            if pointer.startswith(section):
                name, _, rest = pointer[len(section):].partition("/")
                moved["$ref"] = f"#/$defs/{prefix}_{name}" + (f"/{rest}" if rest else "")
                break
        else:
            moved["$ref"] = f"#/$defs/{prefix}{pointer}"
    return moved

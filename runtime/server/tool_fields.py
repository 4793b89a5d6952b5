"""The wire shape of OpenAI's function tools on /v1/chat/completions: ``tools`` and
``tool_choice`` (runtime/server/tools.py turns them into a constraint and a prompt), and the
calls an assistant message made, sent back in ``messages``."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_TOOLS = 128   # OpenAI's own limit on tools per request


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    # OpenAI's rule for function names: what a client's own dispatch table may key on.
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None   # a JSON Schema for the arguments object; None: no arguments
    strict: bool | None = None                 # always enforced here: the grammar admits only valid arguments


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    name: str = Field(min_length=1)


class NamedToolChoice(BaseModel):
    """``{"type": "function", "function": {"name": ...}}``: call that tool."""
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["function"]
    function: FunctionName


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    name: str = Field(min_length=1)
    arguments: str   # JSON text, as the answer's tool_calls gave it


class ToolCallMessage(BaseModel):
    """A call an earlier assistant message made, sent back in ``messages``."""
    model_config = ConfigDict(extra="ignore", strict=True)
    id: str
    type: Literal["function"]
    function: CalledFunction


Tools = list[FunctionTool]
ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice
TOOLS_FIELD = Field(None, max_length=MAX_TOOLS)

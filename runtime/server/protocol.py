"""The OpenAI wire format: request bodies (strictly typed and ranged: "0.5" is not a number and
"yes" not a boolean), the OpenAI fields this server does not implement (refused by name unless
neutral), and the response / stream-chunk bodies built from completions."""
from __future__ import annotations

import json
import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from .structured_fields import ResponseFormat, StructuredOutputs
from .tool_fields import TOOLS_FIELD, ToolCallMessage, ToolChoice, Tools

MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_SEED = 2**63 - 1
MAX_JSON_DEPTH = 200   # pydantic's JSON parser (jiter) refuses a body nested deeper, below its top level

# OpenAI fields with no implementation here, and the values that ask for nothing (accepted, so
# clients that always send them work). Any other value is refused naming the field.
UNSUPPORTED = {
    "frequency_penalty": (0, 0.0), "presence_penalty": (0, 0.0), "logit_bias": (None, {}),
    "best_of": (None, 1), "suffix": (None, ""), "echo": (None, False),
    "tools": (None, []), "tool_choice": (None, "none"),
    "functions": (None, []), "function_call": (None, "none"), "parallel_tool_calls": (None, False),
    "audio": (None,), "modalities": (None, ["text"]), "prediction": (None,), "reasoning_effort": (None,),
    "web_search_options": (None,), "min_tokens": (None, 0), "repetition_penalty": (None, 1, 1.0),
}
# vLLM's older structured-output fields: a client sending them expects a constraint, so they are
# refused (never silently unconstrained), pointing at the field this server reads.
GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
          "guided_whitespace_pattern")


class ApiError(Exception):
    """An OpenAI-style error: HTTP status, message, type, the parameter at fault and a code."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False


class SamplingRequest(BaseModel):
    # extra="allow": unknown fields are ignored as the reference server does, but kept, so the
    # OpenAI ones this server does not implement can be refused by name (see ``unsupported``).
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

    model: str
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)   # 0 and -1 (vLLM's "disabled"): every token
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = Field([], max_length=MAX_STOP_TOKEN_IDS)
    n: int = Field(1, ge=1, le=16)
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None        # json_object / json_schema (structured_outputs.py)
    structured_outputs: StructuredOutputs | None = None  # vLLM's extension: json, regex, choice, grammar
    # Extension: the draft sources this request may speculate with (medusa, prompt_lookup, suffix, draft_head);
    # [] for none; absent: the engine's. Greedy output is the same either way.
    speculation: list[str] | None = Field(None, max_length=3)

    @field_validator("stop")
    @classmethod
    def _stops(cls, value):
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > MAX_STOP_STRINGS or any(not 0 < len(s) <= MAX_STOP_CHARS for s in stops):
            raise ValueError(f"up to {MAX_STOP_STRINGS} stop strings of 1 to {MAX_STOP_CHARS} characters")
        return stops

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, value):
        if any(t < 0 for t in value):
            raise ValueError("token ids are ≥ 0")
        return value

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def unsupported(self) -> ApiError | None:
        """The first OpenAI field sent with a value that asks for something not implemented, or
        that would be silently dropped (``stream_options`` without ``stream``)."""
        if self.stream_options is not None and not self.stream:
            return ApiError(400, "stream_options: only with stream: true (send both, or leave stream_options out)",
                            param="stream_options", code="unsupported_parameter")
        for name, value in (self.model_extra or {}).items():
            if name in GUIDED and value is not None:
                return ApiError(400, f"{name}: not read by this server; send the constraint as structured_outputs "
                                     f"(json, regex, choice, grammar) or response_format", param=name,
                                code="unsupported_parameter")
            neutral = UNSUPPORTED.get(name)
            if neutral is not None and not any(type(value) is type(n) and value == n for n in neutral):
                return ApiError(400, f"{name}: not supported by this server (send it only as one of "
                                     f"{', '.join(json.dumps(n) for n in neutral)}, or leave it out)",
                                param=name, code="unsupported_parameter")
        return None


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallMessage] | None = None   # an assistant's calls (runtime/server/tool_messages.py)
    tool_call_id: str | None = None                    # a tool message: the call it answers

    def refused_field(self) -> tuple[str, str] | None:
        """The tool-calling field this message gets wrong, and why: a tool message without the
        id of its call, an id or calls on a message of another role."""
        if self.role == "tool" and self.tool_call_id is None:
            return "tool_call_id", "a tool message needs the id of the call it answers"
        if self.role != "tool" and self.tool_call_id is not None:
            return "tool_call_id", "only tool messages answer a call"
        if self.role != "assistant" and self.tool_calls:
            return "tool_calls", "only assistant messages make tool calls"
        return None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: Tools | None = TOOLS_FIELD          # function tools (runtime/server/tools.py)
    tool_choice: ToolChoice | None = None

    def unsupported(self) -> ApiError | None:
        """As SamplingRequest's, and: ``top_logprobs`` without ``logprobs`` (it would be silently
        dropped), and tool-calling fields on messages of the wrong role."""
        refused = super().unsupported()
        if refused is not None:
            return refused
        if self.top_logprobs and not self.logprobs:
            return ApiError(400, "top_logprobs: needs logprobs: true (send both, or leave top_logprobs out)",
                            param="top_logprobs", code="unsupported_parameter")
        for index, message in enumerate(self.messages):
            refused = message.refused_field()
            if refused is not None:
                return ApiError(400, f"messages.{index}.{refused[0]}: {refused[1]}", param=f"messages.{index}.{refused[0]}")
        return None


def parse(raw: bytes, kind: type[SamplingRequest]) -> SamplingRequest:
    """The body as ``kind``, or an ApiError naming the field at fault."""
    try:
        return kind.model_validate_json(raw)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        if err["type"] == "json_invalid" and "recursion limit exceeded" in err["msg"]:
            raise ApiError(400, f"the body nests objects and arrays over {MAX_JSON_DEPTH} levels below its top "
                                "level (this server's JSON parser's limit)",
                           code="body_too_deep") from None
        if err["type"] == "json_invalid":
            raise ApiError(400, f"the body is not valid JSON: {err['msg']}", code="invalid_json") from None
        # Union members add their type name to the location (prompt.list[int].0): drop those.
        loc = [str(p) for p in err["loc"] if not (isinstance(p, str) and ("[" in p or p in ("str", "int", "float")))]
        param = ".".join(loc) or None
        raise ApiError(400, f"{param or 'body'}: {err['msg']}", param=param) from None


def usage(prompt_tokens: int, completion_tokens: int, accepted_draft_tokens: int = 0) -> dict:
    """OpenAI's usage; ``completion_tokens_details.accepted_prediction_tokens``: the completion
    tokens that came from verified drafts (speculative decoding), each one a decode step saved."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens_details": {"accepted_prediction_tokens": accepted_draft_tokens}}


def completion_body(rid: str, model: str, choices: list[dict], used: dict, chat: bool) -> dict:
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": choices, "usage": used}


def chunk_body(rid: str, model: str, choices: list[dict], chat: bool, used: dict | None = None) -> dict:
    body = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": choices}
    if used is not None:
        body["usage"] = used
    return body

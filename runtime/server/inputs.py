"""A request body → the engine requests it asks for. Runs in a worker thread, never on the event
loop: parsing, chat-template rendering and tokenization are CPU work that grows with the body.
The cheap checks come first (model, fields, sizes, counts, stop ids) so an oversized or
impossible request is refused before anything is tokenized. What comes out is checked once and
for all: ``ValidRequest``s, which the engine takes without checking them again."""
from __future__ import annotations

from dataclasses import dataclass, replace

from ...contract.speculation import Source
from ..input_processor import CheckedPrompt, InputProcessor, InputRefused, ValidRequest
from ..core.sampling import SamplingParams
from ..structured import CompiledConstraint, Constraint
from .chat import ChatTemplate, TemplateFault, TemplateRefused
from .protocol import ApiError, ChatRequest, CompletionRequest, SamplingRequest, parse
from .structured_outputs import COMPILE_TIMEOUT_S, requested
from .tool_messages import template_messages
from .tools import ToolCalling, tool_calling


@dataclass(frozen=True)
class Limits:
    """What one request may ask for (``trtbuild serve`` flags)."""

    max_body_bytes: int
    max_prompt_chars: int
    max_queue: int
    body_timeout: float   # seconds per MB a body may take to arrive (--body-timeout)
    compile_timeout: float = COMPILE_TIMEOUT_S   # seconds a constraint may take to compile (--compile-timeout)

    def body_deadline(self, declared: int | None) -> float:
        """Seconds to read a body of ``declared`` bytes (None: chunked, so up to --max-body-bytes),
        never less than one MB's worth."""
        size = self.max_body_bytes if declared is None else declared
        return self.body_timeout * max(1.0, size / 1_000_000)


@dataclass(frozen=True)
class Prepared:
    body: SamplingRequest
    jobs: list[ValidRequest]   # one per prompt × n, in choice order
    prompt_tokens: int
    chat: bool
    constraint: tuple[Constraint, str] | None = None   # every job's, and the field that asked for it
    tools: ToolCalling | None = None   # the answer is a call of one of these (runtime/server/tools.py)
    # With a constraint, the jobs wait here (checked but for it) until the server has compiled it
    # under its deadline, in the LLM's compile pool (runtime/server/app.py): see ``compiled``.
    pending: tuple[tuple[CheckedPrompt, SamplingParams], ...] = ()

    def compiled(self, processor: InputProcessor, constraint: CompiledConstraint) -> "Prepared":
        """The pending jobs as requests, with their constraint compiled (cheap: a length check each)."""
        jobs = [_refusing(processor.request, prompt, params, "prompt", constraint) for prompt, params in self.pending]
        return replace(self, jobs=jobs, pending=())


@dataclass(frozen=True)
class Inputs:
    """What turning a body into requests needs: read-only, shared by the worker threads."""

    processor: InputProcessor   # the LLM's: its rules for prompts, ids and lengths
    model: str
    limits: Limits
    template: ChatTemplate

    def completion(self, raw: bytes) -> Prepared:
        body = self._checked(parse(raw, CompletionRequest))
        prompts = _prompts(body.prompt)
        self._fits(len(prompts) * body.n, "prompt")
        wheres = ["prompt" if len(prompts) == 1 else f"prompt.{index}" for index in range(len(prompts))]
        for where, prompt in zip(wheres, prompts):
            if isinstance(prompt, str) and len(prompt) > self.limits.max_prompt_chars:
                raise ApiError(400, f"{where}: {len(prompt)} characters; this server takes at most "
                                    f"{self.limits.max_prompt_chars} (--max-prompt-chars)", param="prompt",
                               code="prompt_too_long")
        return self._prepared(body, [self._tokens(p, where) for where, p in zip(wheres, prompts)], chat=False)

    def chat(self, raw: bytes) -> Prepared:
        body = self._checked(parse(raw, ChatRequest))
        self._fits(body.n, "n")
        messages = template_messages(body.messages, self.template.takes_tools)
        tools = tool_calling(body.tools, body.tool_choice)
        if tools is not None and (body.response_format is not None and body.response_format.type != "text"
                                  or body.structured_outputs is not None):
            raise ApiError(400, "tools: a tool call is JSON of its own; send tool_choice \"none\" or leave out "
                                "response_format / structured_outputs", param="tools")
        if tools is not None and not self.template.takes_tools:
            messages = _with_system_line(messages, tools.system_line())
        chars = sum(len(m["content"]) for m in messages)
        if chars > self.limits.max_prompt_chars:
            raise ApiError(400, f"messages: {chars} characters of content; this server takes at most "
                                f"{self.limits.max_prompt_chars} (--max-prompt-chars)", param="messages",
                           code="prompt_too_long")
        try:
            text = self.template.render(messages, list(tools.tools) if tools is not None else None)
        except TemplateRefused as exc:
            raise ApiError(400, f"messages: the chat template refused them: {exc}", param="messages") from None
        except TemplateFault as exc:
            raise ApiError(500, str(exc), kind="server_error", code="chat_template_failed") from None
        return self._prepared(body, [self._tokens(text, "prompt")], chat=True, tools=tools)

    # -- checks before any tokenizing -----------------------------------------------------------
    def _checked(self, body: SamplingRequest) -> SamplingRequest:
        if body.model != self.model:
            raise ApiError(404, f"model {body.model!r} does not exist; this server serves {self.model!r}",
                           param="model", code="model_not_found")
        refused = body.unsupported()
        if refused is not None:
            raise refused
        vocab = self.processor.engine_dir.vocab_size
        bad = next((t for t in body.stop_token_ids if t >= vocab), None)
        if bad is not None:
            raise ApiError(400, f"stop_token_ids: token id {bad} is outside the vocabulary [0, {vocab})",
                           param="stop_token_ids")
        return body

    def _fits(self, requests: int, param: str) -> None:
        if requests > self.limits.max_queue:  # a 429 would ask the client to retry what can never pass
            raise ApiError(400, f"{requests} requests (prompts × n) can never fit a queue of {self.limits.max_queue} "
                                f"(--max-queue); send fewer at once", param=param, code="too_many_requests_in_one")

    def _tokens(self, prompt: str | list[int], where: str) -> CheckedPrompt:
        return _refusing(self.processor.prompt, prompt, where)

    # -- sampling ---------------------------------------------------------------------------------
    def _prepared(self, body: SamplingRequest, prompts: list[CheckedPrompt], chat: bool,
                  tools: ToolCalling | None = None) -> Prepared:
        constraint = (tools.constraint, "tools") if tools is not None else requested(body.response_format,
                                                                                     body.structured_outputs)
        pending = [(prompt, self._params(body, prompt, i, chat, constraint[0] if constraint else None))
                   for prompt in prompts for i in range(body.n)]
        tokens = sum(len(prompt.tokens) for prompt in prompts)
        if constraint is not None:
            return Prepared(body, [], tokens, chat, constraint, tools, tuple(pending))
        return Prepared(body, [_refusing(self.processor.request, *job) for job in pending], tokens, chat)

    def _params(self, body: SamplingRequest, prompt: CheckedPrompt, index: int, chat: bool,
                constraint: Constraint | None) -> SamplingParams:
        # the prompt leaves room (checked when tokenized), so the chat default is ≥ 1
        room = self.processor.engine_dir.max_seq_len - len(prompt.tokens)
        requested = body.max_completion_tokens or body.max_tokens
        max_tokens = requested or (min(self.processor.default_params().max_tokens, room) if chat else 16)
        # completions: logprobs=N asks for the sampled tokens' and N alternatives; chat: logprobs + top_logprobs=N
        logprobs = body.logprobs is not None if not chat else body.logprobs
        alternatives = (body.logprobs or 0) if not chat else (body.top_logprobs or 0)
        try:
            speculation = None if body.speculation is None else tuple(Source(s) for s in body.speculation)
        except ValueError:
            raise ApiError(400, f"speculation: {body.speculation!r}; valid: a list of "
                                f"{', '.join(s.value for s in Source)} ([] for none)", param="speculation") from None
        try:
            params = SamplingParams(max_tokens=max_tokens, temperature=body.temperature, top_k=max(body.top_k, 0), top_p=body.top_p,
                                    seed=None if body.seed is None else body.seed + index, stop=tuple(body.stop or ()),
                                    stop_token_ids=tuple(body.stop_token_ids), ignore_eos=body.ignore_eos,
                                    logprobs=logprobs, top_logprobs=alternatives if logprobs else 0,
                                    constraint=constraint, speculation=speculation)
        except ValueError as exc:
            raise ApiError(400, str(exc)) from None
        return params


def _refusing(check, *args):
    """``check(*args)``, its InputRefused as the OpenAI-shaped 400 naming the same field and code."""
    try:
        return check(*args)
    except InputRefused as exc:
        raise ApiError(400, str(exc), param=exc.param, code=exc.code) from None


def _with_system_line(messages: list[dict], line: str) -> list[dict]:
    """``line`` told first: appended to a leading system message, else one of its own."""
    if messages[0]["role"] == "system":
        return [{"role": "system", "content": f"{messages[0]['content']}\n\n{line}"}, *messages[1:]]
    return [{"role": "system", "content": line}, *messages]


def _prompts(prompt) -> list:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise ApiError(400, "prompt: an empty list; send a string, token ids, or a list of either", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    return list(prompt)

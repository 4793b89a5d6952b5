"""The FastAPI app: OpenAI routes over one ``AsyncLLM``, auth, a bounded queue, disconnects
that abort, and a draining state for SIGTERM."""
from __future__ import annotations

import asyncio
import itertools
import json
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..async_llm import AsyncLLM
from ..outputs import Completion
from ..sampling import SamplingParams
from . import chat
from .gate import Gate
from .metrics import Metrics
from .protocol import ApiError, ChatRequest, CompletionRequest, chunk_body, completion_body, usage

OPEN_ROUTES = ("/health",)                    # no API key needed
DISCONNECT_POLL_S = 0.05


@dataclass
class ServerState:
    engine: AsyncLLM
    model: str
    api_key: str | None
    max_queue: int
    template: str
    metrics: Metrics = field(default_factory=Metrics)
    draining: bool = False
    inflight: int = 0
    ids: itertools.count = field(default_factory=itertools.count)

    @property
    def llm(self):
        return self.engine.llm


def create_app(engine: AsyncLLM, model: str, api_key: str | None = None, max_queue: int = 64) -> FastAPI:
    app = FastAPI(title="trtbuild", docs_url=None, redoc_url=None, openapi_url=None)
    state = ServerState(engine, model, api_key, max_queue, chat.chat_template(engine.llm.engine_dir.path))
    app.state.trtbuild = state

    app.add_middleware(Gate, state=state, error_response=_error, open_routes=OPEN_ROUTES)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        return _error(exc)

    @app.exception_handler(Exception)
    async def failed(request: Request, exc: Exception):  # a bug or an engine failure: no traceback to the client
        return _error(ApiError(500, f"internal error: {type(exc).__name__}: {exc}", kind="server_error"))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        err = exc.errors()[0]
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        if err.get("type") == "json_invalid":
            return _error(ApiError(400, "the body is not valid JSON", code="invalid_json"))
        param = ".".join(loc) or None
        return _error(ApiError(400, f"{param or 'body'}: {err.get('msg', 'invalid')}", param=param))

    @app.get("/health")
    async def health():
        return JSONResponse({"status": "draining" if state.draining else "ok"}, status_code=503 if state.draining else 200)

    @app.get("/metrics")
    async def metrics():
        state.metrics.observe_engine(state.llm)
        return Response(state.metrics.text(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": state.model, "object": "model", "created": 0, "owned_by": "trtbuild"}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        prompts = _prompts(body.prompt)
        return await _serve(state, request, body, [_tokens(state, p) for p in prompts], chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            text = chat.render(state.template, messages)
        except Exception as exc:  # noqa: BLE001  (a template error is the engine dir's, reported)
            raise ApiError(400, f"messages: the chat template failed: {exc}", param="messages") from None
        return await _serve(state, request, body, [_tokens(state, text)], chat=True)

    return app


def _error(exc: ApiError) -> JSONResponse:
    headers = {"Retry-After": "1"} if exc.status == 429 else None
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


def _prompts(prompt) -> list:
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    return list(prompt)


def _tokens(state: ServerState, prompt) -> list[int]:
    try:
        return state.llm.tokens(prompt)
    except ValueError as exc:
        raise ApiError(400, str(exc), param="prompt") from None


def _params(state: ServerState, body, prompt_len: int, index: int, chat: bool) -> SamplingParams:
    limit = state.llm.engine_dir.max_seq_len
    requested = body.max_completion_tokens or body.max_tokens
    max_tokens = requested or (min(state.llm.default_params().max_tokens, limit - prompt_len) if chat else 16)
    if prompt_len + max_tokens > limit:
        raise ApiError(400, f"the prompt's {prompt_len} tokens + max_tokens {max_tokens} exceed the engine's "
                            f"max_seq_len {limit}", param="max_tokens", code="context_length_exceeded")
    if max_tokens < 1 or prompt_len == 0:
        raise ApiError(400, "the prompt is empty or fills the context", param="prompt")
    # completions: logprobs=N asks for the sampled tokens' and N alternatives; chat: logprobs + top_logprobs=N
    logprobs = body.logprobs is not None if not chat else body.logprobs
    alternatives = (body.logprobs or 0) if not chat else (body.top_logprobs or 0)
    try:
        return SamplingParams(max_tokens=max_tokens, temperature=body.temperature, top_k=body.top_k, top_p=body.top_p,
                              seed=None if body.seed is None else body.seed + index, stop=tuple(body.stop or ()),
                              stop_token_ids=tuple(body.stop_token_ids), ignore_eos=body.ignore_eos, logprobs=logprobs,
                              top_logprobs=alternatives if logprobs else 0)
    except ValueError as exc:
        raise ApiError(400, str(exc)) from None


async def _serve(state: ServerState, request: Request, body, prompts: list[list[int]], chat: bool):
    if body.model != state.model:
        raise ApiError(404, f"model {body.model!r} does not exist; this server serves {state.model!r}",
                       param="model", code="model_not_found")
    jobs = [(tokens, _params(state, body, len(tokens), i, chat)) for tokens in prompts for i in range(body.n)]
    if state.llm.queue_depth() + len(jobs) > state.max_queue:
        raise ApiError(429, f"the queue is full ({state.max_queue} requests waiting); retry shortly",
                       kind="rate_limit_error", code="queue_full")
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{next(state.ids)}"
    streams = [state.engine.stream(tokens, params, rid=f"{rid}-{i}") for i, (tokens, params) in enumerate(jobs)]
    prompt_tokens = sum(len(tokens) for tokens in prompts)
    if body.stream:
        return StreamingResponse(_sse(state, rid, body, streams, prompt_tokens, chat), media_type="text/event-stream")
    done = await _until_done_or_disconnect(request, [_collect(s) for s in streams])
    if done is None:  # the client left: its requests were aborted; nobody reads this
        state.metrics.aborted(len(streams))
        return Response(status_code=499)
    for completion in done:
        state.metrics.finished(completion)
    choices = [_choice(i, c, chat, state.llm.tokenizer) for i, c in enumerate(done)]
    return completion_body(rid, state.model, choices, usage(prompt_tokens, sum(len(c.token_ids) for c in done)), chat)


async def _collect(stream) -> Completion:
    async for delta in stream:
        if delta.finished:
            return delta.completion


async def _until_done_or_disconnect(request: Request, coroutines: list) -> list[Completion] | None:
    """The completions, or None if the client goes away first: then every request is aborted
    (the streams' cleanup frees their KV slots within a step)."""
    work = asyncio.ensure_future(asyncio.gather(*coroutines))
    while not work.done():
        if await request.is_disconnected():
            work.cancel()
            try:
                await work
            except asyncio.CancelledError:
                pass
            return None
        await asyncio.wait({work}, timeout=DISCONNECT_POLL_S)
    return work.result()


def _choice(index: int, completion: Completion, chat: bool, tokenizer) -> dict:
    finish = "stop" if completion.finish_reason == "stop" else completion.finish_reason
    text = lambda token: tokenizer.decode([token])  # noqa: E731
    alternatives = completion.top_logprobs or [()] * len(completion.token_ids)
    if chat:
        choice = {"index": index, "message": {"role": "assistant", "content": completion.text}, "finish_reason": finish}
        if completion.logprobs is not None:
            choice["logprobs"] = {"content": [
                {"token": text(t), "logprob": lp, "top_logprobs": [{"token": text(a), "logprob": alp} for a, alp in alts]}
                for t, lp, alts in zip(completion.token_ids, completion.logprobs, alternatives)]}
        return choice
    choice = {"index": index, "text": completion.text, "finish_reason": finish, "logprobs": None}
    if completion.logprobs is not None:
        choice["logprobs"] = {"tokens": [text(t) for t in completion.token_ids], "token_logprobs": completion.logprobs,
                              "top_logprobs": [{text(a): alp for a, alp in alts} for alts in alternatives]
                              if completion.top_logprobs else None, "text_offset": None}
    return choice


async def _sse(state: ServerState, rid: str, body, streams: list, prompt_tokens: int, chat: bool):
    """Server-sent events: one chunk per delta of any choice, usage last if asked, then [DONE].
    A client that disconnects cancels this generator; the merged streams then abort."""
    merged: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream):
        try:
            async for delta in stream:
                await merged.put((index, delta))
        except Exception as exc:  # noqa: BLE001  (the engine failed: tell the client, then end)
            await merged.put((index, exc))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    generated, open_choices, failed = 0, len(streams), False
    try:
        if chat:
            for index in range(len(streams)):
                yield _event(chunk_body(rid, state.model, [{"index": index, "delta": {"role": "assistant"},
                                                            "finish_reason": None}], chat))
        while open_choices:
            index, delta = await merged.get()
            if isinstance(delta, Exception):
                failed = True
                yield _event(ApiError(500, f"generation failed: {delta}", kind="server_error").body())
                return
            finish = delta.finish_reason if delta.finished else None
            piece = {"content": delta.text} if chat else None
            choice = ({"index": index, "delta": piece, "finish_reason": finish} if chat else
                      {"index": index, "text": delta.text, "finish_reason": finish, "logprobs": None})
            if delta.text or finish:
                yield _event(chunk_body(rid, state.model, [choice], chat))
            if delta.finished:
                open_choices -= 1
                generated += len(delta.completion.token_ids)
                state.metrics.finished(delta.completion)
        if body.include_usage:
            yield _event(chunk_body(rid, state.model, [], chat, usage(prompt_tokens, generated)))
        yield "data: [DONE]\n\n"
    finally:
        for task in tasks:
            task.cancel()
        if open_choices and not failed:  # the client left mid-stream: the open choices were aborted
            state.metrics.aborted(open_choices)


def _event(body: dict) -> str:
    return f"data: {json.dumps(body)}\n\n"

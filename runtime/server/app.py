"""The FastAPI app: OpenAI routes over one ``AsyncLLM``, auth, a bounded queue, disconnects
that abort, a draining state for SIGTERM, and request preparation off the event loop."""
from __future__ import annotations

import asyncio
import itertools
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from ..async_llm import AsyncLLM, EngineFailure, RequestGroup
from ..outputs import Completion
from . import chat
from .admission import Admission
from .gate import Gate
from .inputs import Inputs, Limits, Prepared
from .metrics import Metrics
from .protocol import ApiError, chunk_body, completion_body, usage

OPEN_ROUTES = ("/health",)                    # no API key needed
DISCONNECT_POLL_S = 0.05
PREPARE_WORKERS = 2   # bodies parsed, rendered and tokenized at once; engine steps use the default executor


@dataclass
class ServerState:
    engine: AsyncLLM
    model: str
    api_key: str | None
    inputs: Inputs
    admission: Admission
    metrics: Metrics = field(default_factory=Metrics)
    workers: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(PREPARE_WORKERS, "trtbuild-inputs"))
    draining: bool = False
    inflight: int = 0
    stopping: asyncio.Event = field(default_factory=asyncio.Event)   # the grace period is over
    open_streams: set = field(default_factory=set)                     # the SSE responses' request groups
    ids: itertools.count = field(default_factory=itertools.count)

    @property
    def llm(self):
        return self.engine.llm

    @property
    def limits(self) -> Limits:
        return self.inputs.limits

    def stop(self) -> None:
        """The grace period is over: open requests end now with a shutdown error (event loop only)."""
        self.stopping.set()
        for group in self.open_streams:
            group.interrupt(_ShutDown())


def create_app(engine: AsyncLLM, model: str, limits: Limits, api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="trtbuild", docs_url=None, redoc_url=None, openapi_url=None)
    template = chat.chat_template(engine.llm.engine_dir)
    state = ServerState(engine, model, api_key, Inputs(engine.llm.inputs, model, limits, template),
                        Admission(engine.llm, limits.max_queue))
    app.state.trtbuild = state

    app.add_middleware(Gate, state=state, error_response=_error, open_routes=OPEN_ROUTES)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        return _error(exc)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):  # unknown routes, wrong methods
        message = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"}
        error = ApiError(exc.status_code, message.get(exc.status_code, str(exc.detail)),
                         code={404: "unknown_route", 405: "method_not_allowed"}.get(exc.status_code))
        return _error(error, exc.headers)

    @app.exception_handler(Exception)
    async def failed(request: Request, exc: Exception):  # a bug or an engine failure: no traceback to the client
        return _error(ApiError(500, f"internal error: {type(exc).__name__}: {exc}", kind="server_error"))

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
    async def completions(request: Request):
        return await _serve(state, request, state.inputs.completion)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _serve(state, request, state.inputs.chat)

    return app


def _error(exc: ApiError, headers: dict | None = None) -> JSONResponse:
    headers = {**(headers or {}), **({"Retry-After": "1"} if exc.status == 429 else {})}
    if exc.status == 401:
        headers["WWW-Authenticate"] = 'Bearer realm="trtbuild"'
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers or None)


async def _body(request: Request, limit: int) -> bytes:
    """The raw body, refused (413) past ``limit`` bytes before it is all read."""
    too_large = ApiError(413, f"the request body is over {limit} bytes (--max-body-bytes)", code="body_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


async def _serve(state: ServerState, request: Request, prepare):
    raw = await _body(request, state.limits.max_body_bytes)
    prepared: Prepared = await asyncio.get_running_loop().run_in_executor(state.workers, prepare, raw)
    state.admission.admit(len(prepared.jobs))   # no await between this check and the submission
    chat, body = prepared.chat, prepared.body
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{next(state.ids)}"
    try:
        group = state.engine.submit(prepared.jobs, [f"{rid}-{i}" for i in range(len(prepared.jobs))])
    except ValueError as exc:
        raise ApiError(400, str(exc)) from None
    if body.stream:
        return _GroupStream(group, _sse(state, rid, body, group, prepared.prompt_tokens, chat),
                            media_type="text/event-stream")
    try:
        done = await _until_done_or_disconnect(state, request, _completions(group))
    finally:
        group.close()
    if done is None:  # the client left: its requests were aborted; nobody reads this
        state.metrics.aborted(len(prepared.jobs))
        return Response(status_code=499)
    for completion in done:
        state.metrics.finished(completion)
    choices = [_choice(i, c, chat, state.llm.tokenizer) for i, c in enumerate(done)]
    used = usage(prepared.prompt_tokens, sum(len(c.token_ids) for c in done))
    return completion_body(rid, state.model, choices, used, chat)


class _GroupStream(StreamingResponse):
    """Closes the request group however the response ends, even if its body was never iterated
    (the client left before the first byte): what still runs is aborted."""

    def __init__(self, group: RequestGroup, content, media_type: str):
        super().__init__(content, media_type=media_type)
        self.group = group

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.group.close()


class _ShutDown(Exception):
    """Raised into an open SSE response's group when the grace period ends."""


def _shut_down() -> ApiError:
    return ApiError(503, "the server shut down before the request finished (--grace ended)", kind="server_error",
                    code="shutdown")


async def _completions(group: RequestGroup) -> list[Completion]:
    """The group's completions in submission order."""
    done: list[Completion] = [None] * len(group.rids)  # type: ignore[list-item]
    async for index, delta in group:
        if delta.finished:
            done[index] = delta.completion
    return done


async def _until_done_or_disconnect(state: ServerState, request: Request, completions) -> list[Completion] | None:
    """The completions, or None if the client goes away first: then every request is aborted
    (closing the group frees their KV slots within a step). 503 if the grace period ends first."""
    work = asyncio.ensure_future(completions)
    while not work.done():
        gone = await request.is_disconnected()
        if gone or state.stopping.is_set():
            work.cancel()
            try:
                await work
            except asyncio.CancelledError:
                pass
            if gone:
                return None
            raise _shut_down()
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


async def _sse(state: ServerState, rid: str, body, group: RequestGroup, prompt_tokens: int, chat: bool):
    """Server-sent events: one chunk per delta of any choice, usage last if asked, then [DONE].
    A client that disconnects cancels this generator; the response then closes the group, which
    aborts what still runs."""
    generated, failed = 0, False
    state.open_streams.add(group)
    try:
        if chat:
            for index in range(len(group.rids)):
                yield _event(chunk_body(rid, state.model, [{"index": index, "delta": {"role": "assistant"},
                                                            "finish_reason": None}], chat))
        try:
            async for index, delta in group:
                finish = delta.finish_reason if delta.finished else None
                if delta.text or finish:
                    choice = ({"index": index, "delta": {"content": delta.text}, "finish_reason": finish} if chat else
                              {"index": index, "text": delta.text, "finish_reason": finish, "logprobs": None})
                    yield _event(chunk_body(rid, state.model, [choice], chat))
                if delta.finished:
                    generated += len(delta.completion.token_ids)
                    state.metrics.finished(delta.completion)
        except _ShutDown:  # the grace period ended: say so before the connection closes
            failed = True
            state.metrics.aborted(group.unfinished)
            yield _event(_shut_down().body())
            return
        except EngineFailure as exc:
            failed = True
            yield _event(ApiError(500, str(exc), kind="server_error").body())
            return
        if body.include_usage:
            yield _event(chunk_body(rid, state.model, [], chat, usage(prompt_tokens, generated)))
        yield "data: [DONE]\n\n"
    finally:
        state.open_streams.discard(group)
        if group.unfinished and not failed:  # the client left mid-stream: the rest is aborted
            state.metrics.aborted(group.unfinished)


def _event(body: dict) -> str:
    return f"data: {json.dumps(body)}\n\n"

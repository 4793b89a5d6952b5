"""The FastAPI app: OpenAI routes over one ``AsyncLLM``, auth, a bounded queue, disconnects
that abort, a draining state for SIGTERM, and request preparation off the event loop."""
from __future__ import annotations

import asyncio
import json
import uuid
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
from .logprobs import chat_logprobs, completion_logprobs
from .metrics import Metrics
from .protocol import ApiError, chunk_body, completion_body, usage
from .structured_outputs import compiled
from .tool_calls import ToolCallStream, tool_call

OPEN_ROUTES = ("/health",)                    # no API key needed
DISCONNECT_POLL_S = 0.05
PREPARE_WORKERS = 2   # bodies parsed, rendered and tokenized at once; engine steps run in the LLM's engine loop thread


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
    busy = exc.status == 429 or exc.code == "constraint_compiler_busy"
    headers = {**(headers or {}), **({"Retry-After": "1"} if busy else {})}
    if exc.status == 401:
        headers["WWW-Authenticate"] = 'Bearer realm="trtbuild"'
    if exc.status == 408:  # the rest of the body may still be coming: the connection cannot serve another request
        headers["Connection"] = "close"
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers or None)


async def _body(request: Request, limits: Limits) -> bytes:
    """The raw body, refused (413) past ``--max-body-bytes`` before it is all read, and (408) if
    it is not all there within the deadline its declared size allows (a trickling client would
    otherwise hold its connection, and a descriptor, for as long as it likes)."""
    limit = limits.max_body_bytes
    too_large = ApiError(413, f"the request body is over {limit} bytes (--max-body-bytes)", code="body_too_large")
    header = request.headers.get("content-length", "")
    declared = int(header) if header.isdigit() else None
    if declared is not None and declared > limit:
        raise too_large
    seconds = limits.body_deadline(declared)
    chunks, size = [], 0
    try:
        async with asyncio.timeout(seconds):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise too_large
                chunks.append(chunk)
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {seconds:g} s ({size} bytes came; "
                            f"--body-timeout {limits.body_timeout:g} s per MB)", code="body_timeout") from None
    return b"".join(chunks)


async def _serve(state: ServerState, request: Request, prepare):
    raw = await _body(request, state.limits)
    prepared: Prepared = await asyncio.get_running_loop().run_in_executor(state.workers, prepare, raw)
    if prepared.constraint is not None:  # in the LLM's compile pool under a deadline, never on the loop
        prepared = prepared.compiled(state.llm.inputs, await compiled(
            state.llm.compile_pool, *prepared.constraint, state.limits.compile_timeout))
    state.admission.admit(len(prepared.jobs))   # no await between this check and the submission
    chat, body = prepared.chat, prepared.body
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"   # unique across restarts, as OpenAI's are
    try:
        group = state.engine.submit(prepared.jobs, [f"{rid}-{i}" for i in range(len(prepared.jobs))])
    except ValueError as exc:
        raise ApiError(400, str(exc)) from None
    if body.stream:
        return _GroupStream(group, _sse(state, rid, prepared, group), media_type="text/event-stream")
    done: list[Completion | None] = [None] * len(group.rids)
    entries: list[list] = [[] for _ in group.rids]   # each choice's logprob entries
    try:
        finished = await _until_done_or_disconnect(state, request, _completions(group, done, entries))
    finally:
        group.close()
        # What finished before the client left (or the grace period ended) counts as finished.
        for completion in filter(None, done):
            state.metrics.finished(completion)
        if group.unfinished:
            state.metrics.aborted(group.unfinished)
    if not finished:  # the client left: its unfinished requests were aborted; nobody reads this
        return Response(status_code=499)
    choices = [_choice(i, c, entries[i], prepared) for i, c in enumerate(done)]
    used = usage(prepared.prompt_tokens, sum(len(c.token_ids) for c in done), sum(c.accepted_tokens for c in done))
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


async def _completions(group: RequestGroup, done: list, entries: list[list]) -> None:
    """Reads the group to its end: each request's completion into ``done`` and its logprob
    entries into ``entries``, in submission order, as they come."""
    async for index, delta in group:
        entries[index] += delta.logprobs
        if delta.finished:
            done[index] = delta.completion


async def _until_done_or_disconnect(state: ServerState, request: Request, completions) -> bool:
    """True when ``completions`` ran to its end, False if the client went away first: then the
    caller closes the group, which aborts what still runs (their KV slots are free within a
    step). 503 if the grace period ends first."""
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
                return False
            raise _shut_down()
        await asyncio.wait({work}, timeout=DISCONNECT_POLL_S)
    work.result()   # raises what the group raised (an engine failure)
    return True


def _logprobs(entries, prepared: Prepared) -> dict | None:
    """A choice's (or a chunk's) ``logprobs`` for these entries; None when not asked for."""
    params = prepared.jobs[0].params   # every job of a request asks for the same logprobs
    if not params.logprobs:
        return None
    return chat_logprobs(entries) if prepared.chat else completion_logprobs(entries, params.top_logprobs > 0)


def _choice(index: int, completion: Completion, entries: list, prepared: Prepared) -> dict:
    logprobs = _logprobs(entries, prepared)
    if prepared.chat:
        if prepared.tools is not None:
            message, finish = tool_call(completion.text, completion.finish_reason)
        else:
            message, finish = {"role": "assistant", "content": completion.text}, completion.finish_reason
        choice = {"index": index, "message": message, "finish_reason": finish}
        if logprobs is not None:
            choice["logprobs"] = logprobs
        return choice
    return {"index": index, "text": completion.text, "finish_reason": completion.finish_reason, "logprobs": logprobs}


def _chunk_choice(index: int, delta, finish: str | None, prepared: Prepared) -> dict:
    logprobs = _logprobs(delta.logprobs, prepared)
    if prepared.chat:
        return {"index": index, "delta": {"content": delta.text}, "logprobs": logprobs, "finish_reason": finish}
    return {"index": index, "text": delta.text, "logprobs": logprobs, "finish_reason": finish}


def _tool_chunks(calls: ToolCallStream, index: int, delta, prepared: Prepared) -> list[dict]:
    """A tool-calling choice's chunk choices for one delta: the answer as ``ToolCallStream`` gives
    it (the whole call, or the text as content, at the end), the delta's logprobs with the first,
    the finish reason with the last."""
    pieces = calls.feed(delta.text)
    finish = None
    if delta.finished:
        last, finish = calls.finish(delta.finish_reason)
        pieces += last
    if not pieces and (finish or delta.logprobs):
        pieces = [{}]
    logprobs = _logprobs(delta.logprobs, prepared)
    return [{"index": index, "delta": piece, "logprobs": logprobs if i == 0 else None,
             "finish_reason": finish if i == len(pieces) - 1 else None} for i, piece in enumerate(pieces)]


async def _sse(state: ServerState, rid: str, prepared: Prepared, group: RequestGroup):
    """Server-sent events: one chunk per delta of any choice (its tokens' logprobs with it, if
    asked), usage last if asked, then [DONE], which also follows a final error event. A client
    that disconnects cancels this generator; the response then closes the group, which aborts
    what still runs."""
    chat, generated, accepted, failed = prepared.chat, 0, 0, False
    state.open_streams.add(group)
    try:
        if chat:
            for index in range(len(group.rids)):
                yield _event(chunk_body(rid, state.model, [{"index": index, "delta": {"role": "assistant"},
                                                            "logprobs": None, "finish_reason": None}], chat))
        try:
            calls = [ToolCallStream() for _ in group.rids] if prepared.tools is not None else None
            async for index, delta in group:
                finish = delta.finish_reason if delta.finished else None
                if calls is not None:
                    for choice in _tool_chunks(calls[index], index, delta, prepared):
                        yield _event(chunk_body(rid, state.model, [choice], chat))
                elif delta.text or finish or delta.logprobs:
                    yield _event(chunk_body(rid, state.model, [_chunk_choice(index, delta, finish, prepared)], chat))
                if delta.finished:
                    generated += len(delta.completion.token_ids)
                    accepted += delta.completion.accepted_tokens
                    state.metrics.finished(delta.completion)
        except _ShutDown:  # the grace period ended: say so before the connection closes
            failed = True
            state.metrics.aborted(group.unfinished)
            yield _event(_shut_down().body())
            yield "data: [DONE]\n\n"   # the stream's end, as after any last event
            return
        except EngineFailure as exc:
            failed = True
            yield _event(ApiError(500, str(exc), kind="server_error").body())
            yield "data: [DONE]\n\n"
            return
        if prepared.body.include_usage:
            yield _event(chunk_body(rid, state.model, [], chat, usage(prepared.prompt_tokens, generated, accepted)))
        yield "data: [DONE]\n\n"
    finally:
        state.open_streams.discard(group)
        if group.unfinished and not failed:  # the client left mid-stream: the rest is aborted
            state.metrics.aborted(group.unfinished)


def _event(body: dict) -> str:
    return f"data: {json.dumps(body)}\n\n"

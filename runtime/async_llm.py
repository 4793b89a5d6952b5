"""``AsyncLLM``: async streaming over one ``LLM`` (what the server builds on), a thin front like
``LLM`` itself: requests are checked by LLM's input processor (or arrive checked, as the server's
do), stepped by its engine loop, and their deltas made by its output processor (streamed text
holds back what could begin a stop string, so the pieces join to the completion's text).

A ``RequestGroup`` is the requests submitted together (a server request's choices) and their
reader: the engine loop's thread hands it each request's delta of a step (a greedy run's pieces
joined) through the event loop's mailbox, one wake-up of the event loop per step for all its
groups, so a token passes one queue between the engine and the response. Submitting never waits
for a running step, a group that is left early (a client disconnects, a task is cancelled)
aborts what still runs, and a failure that touches a group's requests ends it with that error.
Nor does it compile a constraint on the event loop: one not cached goes to the LLM's compile
pool, and the group reaches the engine once it has compiled (runtime/structured/compile_pool.py).
Whatever state a group is in when the LLM closes (compiling, queued, running), its reads end with
``EngineFailure`` ("the LLM is closed")."""
from __future__ import annotations

import asyncio
import threading
from typing import AsyncIterator

from .engine_loop import Sink
from .input_processor import CheckedPrompt, ValidRequest
from .llm import LLM
from .outputs import Delta
from .core.sampling import SamplingParams
from .structured.compile_pool import CompilePoolClosed

__all__ = ["AsyncLLM", "EngineFailure", "RequestGroup"]


class EngineFailure(RuntimeError):
    """A step failed (or the LLM was closed) while the group's requests were open."""

    @classmethod
    def of(cls, error: BaseException) -> "EngineFailure":
        return cls(f"generation failed: {type(error).__name__}: {error}")


class _StepFailed:
    """What a failed step queues: the group raises its EngineFailure from it."""

    def __init__(self, error: Exception):
        self.error = error


class _Mailbox:
    """Items from the stepping thread to one event loop: one ``call_soon_threadsafe`` (a wake-up)
    for what a step posts, not one per item."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._lock = threading.Lock()
        self._items: list[tuple[asyncio.Queue, tuple]] = []

    def post(self, queue: asyncio.Queue, item: tuple) -> None:
        with self._lock:
            self._items.append((queue, item))
            if len(self._items) > 1:  # a delivery is already scheduled
                return
        try:
            self.loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # the event loop is closed: nobody reads these
            with self._lock:
                self._items.clear()

    def _deliver(self) -> None:
        with self._lock:
            items, self._items = self._items, []
        for queue, item in items:
            queue.put_nowait(item)


class RequestGroup:
    """Requests submitted together, read as one stream of ``(index, Delta)`` in the order steps
    make them (the index: the request's place in the submission); it ends when each has sent
    its finished delta. ``close()`` (or leaving ``async with``) aborts those still running."""

    def __init__(self, llm: LLM, rids: list[str | None], mailbox: _Mailbox):
        self.rids, self._llm, self._mailbox = list(rids), llm, mailbox   # a None: named at submission
        # (index, Delta); (-1, an exception interrupt() raises); or (-1, _StepFailed)
        self.queue: asyncio.Queue = asyncio.Queue()
        self._open = set(range(len(rids)))
        self._closed = False
        self._refused: Exception | None = None   # why the group never reached the engine
        self.compiling: asyncio.Task | None = None   # submits the group once its constraints compile

    @property
    def unfinished(self) -> int:
        """Requests of the group that have not sent their finished delta (at close: were aborted)."""
        return len(self._open)

    def __aiter__(self) -> "RequestGroup":
        return self

    @property
    def closed(self) -> bool:
        return self._closed

    async def __anext__(self) -> tuple[int, Delta]:
        if self._refused is not None:
            raise self._refused
        if not self._open:
            raise StopAsyncIteration
        index, item = await self.queue.get()
        if isinstance(item, _StepFailed):
            raise EngineFailure.of(item.error) from item.error
        if isinstance(item, BaseException):
            raise item
        if item.finished:
            self._open.discard(index)
        return index, item

    def interrupt(self, exc: BaseException) -> None:
        """The next read raises ``exc`` (the server's grace period ended); the group stays open."""
        self.queue.put_nowait((-1, exc))

    def refuse(self, exc: Exception) -> None:
        """The group was never submitted (its constraint did not compile): every read raises ``exc``."""
        self._refused, self._open = exc, set()
        self.queue.put_nowait((-1, exc))

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            for index in self._open:
                if self.rids[index] is not None:   # None: never submitted (still compiling)
                    self._llm.abort(self.rids[index])  # the slot is freed at the next step

    # -- the engine loop's side (its thread): a Subscriber -------------------------------------
    def put(self, index: int, pieces: list[Delta]) -> None:
        # One delta per request per step: a greedy run's tokens reach the stream (and a server's
        # client) as one piece, not as many wake-ups, events and writes.
        self._mailbox.post(self.queue, (index, Delta.joined(pieces)))

    def fail(self, error: Exception) -> None:
        self._mailbox.post(self.queue, (-1, _StepFailed(error)))

    async def __aenter__(self) -> "RequestGroup":
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()


class AsyncLLM:
    def __init__(self, llm: LLM):
        self.llm = llm
        self._mailbox: _Mailbox | None = None

    def submit(self, jobs: list[ValidRequest | tuple[str | list[int], SamplingParams]],
               rids: list[str | None]) -> RequestGroup:
        """Submits every job, all or none: a ``(prompt, params)`` pair is checked here (an
        InputRefused, a ValueError, if one cannot run), a ValidRequest (the server's) is not.
        A ``None`` rid is given one by the engine loop when the job is submitted (``group.rids``).

        A constraint the compiler has not cached is never compiled here, on the event loop: it
        goes to the LLM's compile pool (``CompilerBusy`` here if the pool is full), and the
        group reaches the engine once every constraint has compiled; one that cannot compile
        (``ConstraintError``, or ``CompileTimeout`` past the pool's deadline) is raised by the
        group's first read, with nothing submitted."""
        loop = asyncio.get_running_loop()  # first: called outside a loop, it raises having submitted nothing
        if len(jobs) != len(rids):
            raise ValueError(f"{len(jobs)} jobs for {len(rids)} request ids")
        checked = [job if isinstance(job, ValidRequest) else self._checked(*job) for job in jobs]
        pool = self.llm.compile_pool
        compiling = {job[1].constraint: pool.submit(job[1].constraint) for job in checked if isinstance(job, tuple)}
        if self._mailbox is None or self._mailbox.loop is not loop:
            self._mailbox = _Mailbox(loop)
        group = RequestGroup(self.llm, rids, self._mailbox)
        if compiling:
            group.compiling = loop.create_task(self._submit_compiled(group, checked, compiling))
        else:
            self._enter(group, checked)
        return group

    def _checked(self, prompt: str | list[int], params: SamplingParams) -> ValidRequest | tuple[CheckedPrompt, SamplingParams]:
        """A request, or (its checked prompt, params) while its constraint is not compiled yet."""
        inputs, constraint = self.llm.inputs, params.constraint
        if constraint is None or self.llm.compile_pool.compiler.cached(constraint) is not None:
            return inputs.process(prompt, params)   # a cached constraint: no compile
        checked = inputs.prompt(prompt)
        inputs.check_room(checked, params)
        return checked, params

    async def _submit_compiled(self, group: RequestGroup, checked: list, compiling: dict) -> None:
        """Every reader hears how this ends (nothing was submitted unless it entered): a compile
        error as raised, the LLM's close as EngineFailure, this task's cancellation too."""
        pool = self.llm.compile_pool
        try:
            compiled = {constraint: await job.wait(pool.timeout_s) for constraint, job in compiling.items()}
            if not group.closed:
                self._enter(group, [job if isinstance(job, ValidRequest) else
                                    self.llm.inputs.request(*job, compiled=compiled[job[1].constraint])
                                    for job in checked])
        except CompilePoolClosed:
            group.refuse(EngineFailure.of(RuntimeError("the LLM is closed")))
        except Exception as exc:  # noqa: BLE001  (the reader gets it: nothing was submitted)
            group.refuse(EngineFailure.of(exc) if self.llm.loop.closed else exc)
        except BaseException as exc:  # cancelled (the event loop shuts down): its reader must not wait on
            group.refuse(EngineFailure.of(exc))
            raise

    def _enter(self, group: RequestGroup, requests: list[ValidRequest]) -> None:
        group.rids = self.llm.loop.submit([(rid, request, Sink(group, index))
                                           for index, (rid, request) in enumerate(zip(group.rids, requests))])

    async def stream(self, prompt: str | list[int], params: SamplingParams | None = None,
                     rid: str | None = None) -> AsyncIterator[Delta]:
        """Yields one request's deltas; the last one (finished) carries its Completion. ``rid``:
        the request's id (None: one the engine loop gives)."""
        async with self.submit([(prompt, params or self.llm.default_params())], [rid]) as group:
            async for _, delta in group:
                yield delta

"""``AsyncLLM``: async streaming over one ``LLM`` (what the server builds on), a thin front like
``LLM`` itself: requests are validated by LLM's input processor, stepped by its engine core,
and their deltas made by its output processor (streamed text holds back what could begin a
stop string, so the pieces join to the completion's text).

A driver task runs engine steps in a worker thread while any request lives and puts each
request's delta of a step (the pieces of a multi-step greedy run joined) straight into the queue
of the group it was submitted in: a server request's choices are one group, read as one stream,
so a token passes one queue between the engine and the response.
Submitting never waits for a running step (LLM.submit takes the request into an inbox), a group
that is left early (a client disconnects, a task is cancelled) aborts what is still running, and
a failing step ends every open group with that error instead of leaving it hanging.
"""
from __future__ import annotations

import asyncio
from typing import AsyncIterator

from .llm import LLM
from .outputs import Delta
from .sampling import SamplingParams


class EngineFailure(RuntimeError):
    """The step loop failed; every request in flight ends with this."""


class _StepFailed:
    """What the driver queues when a step fails: each group raises its own EngineFailure from it."""

    def __init__(self, error: Exception):
        self.error = error


class RequestGroup:
    """Requests submitted together, read as one stream of ``(index, Delta)`` in the order steps
    make them (the index: the request's place in the submission); it ends when each has sent
    its finished delta. ``close()`` (or leaving ``async with``) aborts those still running."""

    def __init__(self, owner: "AsyncLLM", rids: list[str]):
        self.rids, self._owner = rids, owner
        # (index, Delta); (-1, an exception interrupt() raises); or (-1, _StepFailed)
        self.queue: asyncio.Queue = asyncio.Queue()
        self._open = set(range(len(rids)))
        self._closed = False

    @property
    def unfinished(self) -> int:
        """Requests of the group that have not sent their finished delta (at close: were aborted)."""
        return len(self._open)

    def __aiter__(self) -> "RequestGroup":
        return self

    async def __anext__(self) -> tuple[int, Delta]:
        if not self._open:
            raise StopAsyncIteration
        index, item = await self.queue.get()
        if isinstance(item, _StepFailed):
            raise EngineFailure(f"generation failed: {type(item.error).__name__}: {item.error}") from item.error
        if isinstance(item, BaseException):
            raise item
        if item.finished:
            self._open.discard(index)
        return index, item

    def interrupt(self, exc: BaseException) -> None:
        """The next read raises ``exc`` (the server's grace period ended); the group stays open."""
        self.queue.put_nowait((-1, exc))

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._owner._release(self, [self.rids[i] for i in self._open])

    async def __aenter__(self) -> "RequestGroup":
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()


class AsyncLLM:
    def __init__(self, llm: LLM):
        self.llm = llm
        self._routes: dict[str, tuple[RequestGroup, int]] = {}   # rid → its group and index there
        self._driver: asyncio.Task | None = None

    def submit(self, jobs: list[tuple[str | list[int], SamplingParams]], rids: list[str]) -> RequestGroup:
        """Submits every job now (each validated by LLM.submit; if one is refused, those before it
        are aborted and the ValueError raised), and starts stepping."""
        loop = asyncio.get_running_loop()  # first: called outside a loop, it raises having submitted nothing
        group = RequestGroup(self, rids)
        try:
            for index, ((prompt, params), rid) in enumerate(zip(jobs, rids, strict=True)):
                self.llm.submit(prompt, params, rid=rid)
                self._routes[rid] = (group, index)
        except BaseException:
            self._release(group, self._routes_of(group))
            raise
        if self._driver is None or self._driver.done():
            self._driver = loop.create_task(self._drive())
        return group

    async def stream(self, prompt: str | list[int], params: SamplingParams | None = None,
                     rid: str | None = None) -> AsyncIterator[Delta]:
        """Yields one request's deltas; the last one (finished) carries its Completion."""
        rid = rid or self.llm.new_rid()
        async with self.submit([(prompt, params or self.llm.default_params())], [rid]) as group:
            async for _, delta in group:
                yield delta

    def _routes_of(self, group: RequestGroup) -> list[str]:
        return [rid for rid in group.rids if self._routes.get(rid, (None,))[0] is group]

    def _release(self, group: RequestGroup, unfinished: list[str]) -> None:
        for rid in self._routes_of(group):
            del self._routes[rid]
        for rid in unfinished:
            self.llm.abort(rid)  # the slot is freed at the next step

    async def _drive(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while self.llm.has_work():
                deltas, _ = await loop.run_in_executor(None, self.llm.step)
                pieces: dict[str, list[Delta]] = {}
                for delta in deltas:
                    pieces.setdefault(delta.rid, []).append(delta)
                # One delta per request per step: a greedy run's tokens reach its stream (and a
                # server's client) as one piece, not as many wake-ups, events and writes.
                for rid, mine in pieces.items():
                    route = self._routes.get(rid)
                    if route is not None:
                        route[0].queue.put_nowait((route[1], Delta.joined(mine)))
        except Exception as exc:  # noqa: BLE001  (every stream must hear of it, not hang)
            for group in {id(g): g for g, _ in self._routes.values()}.values():
                group.queue.put_nowait((-1, _StepFailed(exc)))

"""``AsyncLLM``: async streaming over one ``LLM`` (what the server builds on), a thin front like
``LLM`` itself: requests are validated by LLM's input processor, stepped by its engine core,
and their deltas made by its output processor (streamed text holds back what could begin a
stop string, so the pieces join to the completion's text).

A driver task runs engine steps in a worker thread while any request lives and hands each
stream its deltas, one per step (the pieces of a multi-step greedy run joined). Submitting never
waits for a running step (LLM.submit takes the request into an inbox), a stream that is left
early (a client disconnects, a task is cancelled) aborts its request, and a failing step ends
every waiting stream with that error instead of leaving it hanging.
"""
from __future__ import annotations

import asyncio
from typing import AsyncIterator

from .llm import LLM
from .outputs import Delta
from .sampling import SamplingParams


class EngineFailure(RuntimeError):
    """The step loop failed; every request in flight ends with this."""


class AsyncLLM:
    def __init__(self, llm: LLM):
        self.llm = llm
        self._queues: dict[str, asyncio.Queue] = {}
        self._driver: asyncio.Task | None = None

    async def stream(self, prompt: str | list[int], params: SamplingParams | None = None,
                     rid: str | None = None) -> AsyncIterator[Delta]:
        """Yields the request's deltas; the last one (finished) carries its Completion."""
        rid = self.llm.submit(prompt, params or self.llm.default_params(), rid=rid)
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = queue
        if self._driver is None or self._driver.done():
            self._driver = asyncio.get_running_loop().create_task(self._drive())
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise EngineFailure(f"generation failed: {type(item).__name__}: {item}") from item
                finished = item.finished
                yield item
        finally:
            self._queues.pop(rid, None)
            if not finished:
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
                for rid, group in pieces.items():
                    queue = self._queues.get(rid)
                    if queue is not None:
                        queue.put_nowait(Delta.joined(group))
        except Exception as exc:  # noqa: BLE001  (every stream must hear of it, not hang)
            for queue in list(self._queues.values()):
                queue.put_nowait(exc)

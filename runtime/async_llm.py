"""``AsyncLLM``: async streaming over one ``LLM`` (what a server builds on)."""
from __future__ import annotations

import asyncio
from typing import AsyncIterator

from .llm import LLM
from .outputs import Delta
from .sampling import SamplingParams


class AsyncLLM:
    """Async streaming over one LLM: a driver task runs steps in a worker thread while any request lives."""

    def __init__(self, llm: LLM):
        self.llm = llm
        self._queues: dict[str, asyncio.Queue] = {}
        self._driver: asyncio.Task | None = None

    async def stream(self, prompt: str | list[int], params: SamplingParams | None = None) -> AsyncIterator[Delta]:
        rid = self.llm.submit(prompt, params or self.llm.default_params())
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = queue
        if self._driver is None or self._driver.done():
            self._driver = asyncio.get_running_loop().create_task(self._drive())
        while True:
            delta = await queue.get()
            yield delta
            if delta.finished:
                self._queues.pop(rid, None)
                return

    async def _drive(self) -> None:
        loop = asyncio.get_running_loop()
        while self.llm.scheduler.has_work():
            deltas, _ = await loop.run_in_executor(None, self.llm.step)
            for delta in deltas:
                queue = self._queues.get(delta.rid)
                if queue is not None:
                    queue.put_nowait(delta)

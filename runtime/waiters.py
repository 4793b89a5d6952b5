"""What ``LLM.generate`` and ``LLM.stream`` read their own requests' outputs from: subscribers
(runtime/engine_loop.py) that the stepping thread fills and the caller's thread blocks on. A
failed step's error is raised to the caller as it was raised (a tensor-parallel RankFailure
stays one, for the CLI to name the rank)."""
from __future__ import annotations

import queue
import threading

from .outputs import Completion, Delta


class CompletionWaiter:
    """``generate``'s requests, by index: ``wait()`` returns their completions once all have one."""

    def __init__(self, count: int):
        self.done: list[Completion | None] = [None] * count
        self._left = count
        self._error: Exception | None = None
        self._event = threading.Event()
        if not count:
            self._event.set()

    def put(self, index: int, pieces: list[Delta]) -> None:
        if pieces[-1].finished:
            self.done[index] = pieces[-1].completion
            self._left -= 1   # puts come from one step at a time (the step lock)
            if not self._left:
                self._event.set()

    def fail(self, error: Exception) -> None:
        self._error = error
        self._event.set()

    def wait(self) -> list[Completion]:
        self._event.wait()
        if self._error is not None:
            raise self._error
        return self.done


class DeltaQueue:
    """``stream``'s request: ``get()`` blocks for its next step's pieces."""

    def __init__(self):
        self._queue: queue.SimpleQueue[list[Delta] | Exception] = queue.SimpleQueue()

    def put(self, index: int, pieces: list[Delta]) -> None:
        self._queue.put(pieces)

    def fail(self, error: Exception) -> None:
        self._queue.put(error)

    def get(self) -> list[Delta]:
        item = self._queue.get()
        if isinstance(item, Exception):
            raise item
        return item

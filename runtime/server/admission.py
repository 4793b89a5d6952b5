"""``--max-queue`` for bursts: a request counts as waiting from the moment the server accepts it.

The server submits a request's prompts to the engine (``AsyncLLM.submit``) right after this
check, with no await between, so the engine's queue (``LLM.queue_depth``) already counts a burst
that is still being answered.
"""
from __future__ import annotations

from .protocol import ApiError


class Admission:
    def __init__(self, llm, max_queue: int):
        self.llm, self.max_queue = llm, max_queue

    def admit(self, requests: int) -> None:
        """Nothing, or 429 if the queue cannot take ``requests`` more now (called on the event
        loop, with no await between the check and the submission)."""
        if self.llm.queue_depth() + requests > self.max_queue:
            raise ApiError(429, f"the queue is full ({self.max_queue} requests waiting); retry shortly",
                           kind="rate_limit_error", code="queue_full")

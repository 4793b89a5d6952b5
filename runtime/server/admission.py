"""``--max-queue`` for bursts: a request counts as waiting from the moment the server accepts it.

The engine's queue (``LLM.queue_depth``) sees a request only once its stream is first read, which
for a streamed response is after the handler returned: a burst could pass the check before any
of it was submitted. The server therefore also counts what it accepted and has not yet handed
to the engine, and bounds the sum.
"""
from __future__ import annotations

from .protocol import ApiError


class Admission:
    def __init__(self, llm, max_queue: int):
        self.llm, self.max_queue = llm, max_queue
        self.accepted = 0   # accepted by the server, not yet submitted to the engine

    def waiting(self) -> int:
        return self.llm.queue_depth() + self.accepted

    def admit(self, requests: int) -> "Ticket":
        """A ticket for ``requests`` engine requests, or 429 if the queue cannot take them now
        (called on the event loop, with no await between the check and the count)."""
        if self.waiting() + requests > self.max_queue:
            raise ApiError(429, f"the queue is full ({self.max_queue} requests waiting); retry shortly",
                           kind="rate_limit_error", code="queue_full")
        self.accepted += requests
        return Ticket(self, requests)


class Ticket:
    """The requests of one HTTP request that the engine has not been handed yet."""

    def __init__(self, admission: Admission, requests: int):
        self.admission, self.left = admission, requests

    def handed_over(self) -> None:
        """One request goes to the engine now: from here its queue counts it."""
        if self.left:
            self.left -= 1
            self.admission.accepted -= 1

    def close(self) -> None:
        """The HTTP request ended: what was never handed over (a client that left first) is no
        longer waiting."""
        self.admission.accepted -= self.left
        self.left = 0

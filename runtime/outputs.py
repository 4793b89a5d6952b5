"""What requests produce: ``RequestOutput`` while running (incremental text, stop strings,
logprobs, timings), ``Delta`` per streamed piece, ``Completion`` at the end."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from .detokenize import ByteStream, IncrementalDecoder
from .sampling import Sampler
from .scheduler import Request, Scheduler


@dataclass
class Completion:
    rid: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list[float] | None
    cached_tokens: int
    decode_steps: int        # engine steps that produced this request's tokens after the first
    accepted_tokens: int     # Medusa guesses accepted (each saved one decode step)
    arrival_s: float
    first_token_s: float
    finish_s: float
    top_logprobs: list[tuple[tuple[int, float], ...]] | None = None  # per token: the likeliest (id, logprob)

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s


@dataclass(frozen=True)
class Delta:
    """A streamed piece of one request's output; the last one (``finished``) carries the
    request's ``Completion`` (token ids, logprobs, timings, usage)."""
    rid: str
    text: str
    token_id: int                      # -1 for the closing piece of an aborted request
    finished: bool
    finish_reason: str | None = None
    completion: "Completion | None" = None


@dataclass
class RequestOutput:
    """What one request has produced so far: its text, timings, logprobs and Medusa counts."""

    request: Request
    sampler: Sampler
    decoder: ByteStream | IncrementalDecoder
    arrival_s: float
    first_token_s: float | None = None
    decode_steps: int = 0
    accepted_tokens: int = 0
    text: str = ""
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[tuple[tuple[int, float], ...]] = field(default_factory=list)

    def push(self, token: int, scheduler: Scheduler) -> Delta:
        """Detokenizes the request's newest token; a stop string ends the request (and the text
        before it). Token-level endings (eos, stop ids, length) are the scheduler's."""
        request = self.request
        if self.first_token_s is None:
            self.first_token_s = time.perf_counter()
        before = len(self.text)
        self.text += self.decoder.push(request.output)
        stops, stopped_by_string = request.params.stop, False
        if stops:  # search only where a stop string could newly complete
            start = max(0, before - max(map(len, stops)) + 1)
            stop_at = min((i for i in (self.text.find(s, start) for s in stops) if i >= 0), default=-1)
            if stop_at >= 0:
                self.text, stopped_by_string = self.text[:stop_at], True
                scheduler.finish(request.rid, "stop")
        if request.finish_reason is not None and not stopped_by_string:
            self.text += self.decoder.flush(request.output)  # text held back mid-character, if any
        return Delta(rid=request.rid, text=self.text[before:], token_id=token,
                     finished=request.finish_reason is not None, finish_reason=request.finish_reason)

    def complete(self) -> Completion:
        request, now = self.request, time.perf_counter()
        return Completion(rid=request.rid, prompt_token_ids=request.prompt, token_ids=list(request.output),
                          text=self.text, finish_reason=request.finish_reason or "abort",
                          logprobs=self.logprobs[:len(request.output)] if request.params.logprobs else None,
                          cached_tokens=request.cached_tokens, decode_steps=self.decode_steps,
                          accepted_tokens=self.accepted_tokens, arrival_s=self.arrival_s,
                          first_token_s=self.first_token_s or now, finish_s=now,
                          top_logprobs=(self.top_logprobs[:len(request.output)]
                                        if request.params.logprobs and request.params.top_logprobs else None))

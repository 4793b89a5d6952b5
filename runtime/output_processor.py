"""The output processor: each request's text as its tokens are committed, stop strings, and
what callers receive (``Delta`` pieces, the final ``Completion``).

Every committed token comes through ``on_token`` one at a time (the engine core's callback),
so a stop string ends the request at the token that completes it on every decoding path: a
plain step, a greedy run, a Medusa step's accepted path. Streamed pieces hold back the tail of
the text that could still begin a stop string (as vLLM's output processor does), so the
pieces always join to exactly the completion's text."""
from __future__ import annotations

import time
from dataclasses import dataclass, replace

from .detokenize import ByteStream, Detokenizer, IncrementalDecoder
from .engine_core import Sampling
from .outputs import Completion, Delta, TokenLogprob
from .core.scheduler import Request


def held_back(text: str, stops: tuple[str, ...]) -> int:
    """Characters at the end of ``text`` that could be the start of a stop string."""
    longest = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:size]):
                longest = size
                break
    return longest


@dataclass
class RequestText:
    """One request's text so far and how much of it was streamed."""

    decoder: ByteStream | IncrementalDecoder
    arrival_s: float
    first_token_s: float | None = None
    text: str = ""
    sent: int = 0   # characters already in streamed pieces
    pushed: int = 0  # tokens pushed so far (a Medusa step's tokens are all in request.output at its first)

    def push(self, request: Request, token: int, sampling: Sampling, detokenizer: Detokenizer) -> tuple[Delta, bool]:
        """Detokenizes the request's newest token (``request.output[-1]``): the piece to stream
        and whether a stop string completed (the text ends before it). Token-level endings (eos,
        stop ids, max_tokens) are already the scheduler's, in ``request.finish_reason``."""
        if self.first_token_s is None:
            self.first_token_s = time.perf_counter()
        before = len(self.text)
        entry = _logprob_entry(token, self.pushed, before, sampling, detokenizer) if request.params.logprobs else None
        self.pushed += 1
        self.text += self.decoder.push(request.output)
        if request.finish_reason is not None:
            self.text += self.decoder.flush(request.output)  # text held back mid-character, if any
        stops, stopped = request.params.stop, False
        if stops:  # search only where a stop string could newly complete
            start = max(0, before - max(map(len, stops)) + 1)
            stop_at = min((i for i in (self.text.find(s, start) for s in stops) if i >= 0), default=-1)
            if stop_at >= 0:
                self.text, stopped = self.text[:stop_at], True
        finished = stopped or request.finish_reason is not None
        end = len(self.text) if finished or not stops else len(self.text) - held_back(self.text, stops)
        piece, self.sent = self.text[self.sent:end], max(self.sent, end)
        return Delta(rid=request.rid, text=piece, token_id=token, finished=finished,
                     finish_reason="stop" if stopped else request.finish_reason,
                     logprobs=(entry,) if entry is not None else ()), stopped

    def complete(self, request: Request, sampling: Sampling) -> Completion:
        now, params, count = time.perf_counter(), request.params, len(request.output)
        return Completion(rid=request.rid, prompt_token_ids=request.prompt, token_ids=list(request.output),
                          text=self.text, finish_reason=request.finish_reason or "abort",
                          logprobs=sampling.logprobs[:count] if params.logprobs else None,
                          cached_tokens=request.cached_tokens, decode_steps=sampling.decode_steps,
                          accepted_tokens=sampling.accepted_tokens, arrival_s=self.arrival_s,
                          first_token_s=self.first_token_s or now, finish_s=now,
                          top_logprobs=(sampling.top_logprobs[:count]
                                        if params.logprobs and params.top_logprobs else None))


def _logprob_entry(token: int, position: int, offset: int, sampling: Sampling, detokenizer: Detokenizer) -> TokenLogprob:
    """The token's logprob entry; sampling recorded its logprob (and alternatives) before the
    commit that brought the token here."""
    alternatives = sampling.top_logprobs[position] if position < len(sampling.top_logprobs) else ()
    return TokenLogprob(token, detokenizer.token_bytes(token), sampling.logprobs[position], offset,
                        tuple((a, detokenizer.token_bytes(a), lp) for a, lp in alternatives))


class OutputProcessor:
    """Text and deliverables for every live request; ``on_token`` is the engine core's sink.
    ``sampling``: the engine core's per-request sampling state, read for logprob entries."""

    def __init__(self, detokenizer: Detokenizer, sampling: dict[str, Sampling]):
        self.detokenizer, self.sampling = detokenizer, sampling
        self.texts: dict[str, RequestText] = {}
        self._deltas: list[Delta] = []

    def add(self, rid: str, arrival_s: float) -> None:
        self.texts[rid] = RequestText(self.detokenizer.stream(), arrival_s)

    def on_token(self, request: Request, token: int) -> bool:
        delta, stopped = self.texts[request.rid].push(request, token, self.sampling[request.rid], self.detokenizer)
        self._deltas.append(delta)
        return stopped

    def pending(self) -> set[str]:
        """The requests with pieces made since the last ``finish`` (kept if ``finish`` raised)."""
        return {delta.rid for delta in self._deltas}

    def drop(self, rids: set[str]) -> None:
        """Forgets these requests (a failure ended them): their text and their pieces not yet
        finished; unknown ids are ignored."""
        for rid in rids:
            self.texts.pop(rid, None)
        if rids and self._deltas:
            self._deltas = [delta for delta in self._deltas if delta.rid not in rids]

    def finish(self, finished: list[tuple[Request, Sampling]]) -> tuple[list[Delta], list[Completion]]:
        """This step's deltas and completions. Each finishing request's last delta carries its
        completion; one that made no token this step (an abort) gets a closing delta with the
        text still held back, so its pieces too join to its completion's text."""
        deltas = self._deltas
        if not finished:  # most steps
            self._deltas = []
            return deltas, []
        completions = {r.rid: self.texts[r.rid].complete(r, s) for r, s in finished}
        self._deltas = []   # only now: had a completion failed, ``pending`` names whose pieces were lost
        closed = set()
        for index, delta in enumerate(deltas):
            if delta.finished and delta.rid in completions:
                deltas[index] = replace(delta, completion=completions[delta.rid])
                closed.add(delta.rid)
        for rid, completion in completions.items():
            text = self.texts.pop(rid)
            if rid not in closed:
                deltas.append(Delta(rid=rid, text=text.text[text.sent:], token_id=-1, finished=True,
                                    finish_reason=completion.finish_reason, completion=completion))
        return deltas, list(completions.values())

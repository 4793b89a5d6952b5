"""What requests produce: ``Delta`` per streamed piece, ``Completion`` at the end (made by
the output processor, runtime/output_processor.py)."""
from __future__ import annotations

from dataclasses import dataclass, replace


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
    accepted_tokens: int     # draft tokens accepted, any source (each saved one decode step)
    arrival_s: float
    first_token_s: float
    finish_s: float
    top_logprobs: list[tuple[tuple[int, float], ...]] | None = None  # per token: the likeliest (id, logprob)

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's logprob entry, made where the text is made (the output processor),
    so a server formats it with no tokenizer work of its own."""
    token_id: int
    token: bytes                 # the bytes the token adds to the text (maybe part of a character)
    logprob: float
    text_offset: int             # characters of the completion's text before this token's text
    top: tuple[tuple[int, bytes, float], ...] = ()   # the likeliest tokens here: (id, bytes, logprob)


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
    logprobs: tuple[TokenLogprob, ...] = ()   # the piece's tokens' entries, when the request asked for logprobs

    @staticmethod
    def joined(pieces: "list[Delta]") -> "Delta":
        """One request's consecutive pieces as one (``token_id`` the newest token's): what a
        stream sends for an engine-core step, whose greedy run may commit many tokens at once."""
        if len(pieces) == 1:
            return pieces[0]
        return replace(pieces[-1], text="".join(p.text for p in pieces),
                       logprobs=tuple(entry for p in pieces for entry in p.logprobs))

"""What a host draft source hands the engine core, and the protocol every such source follows.

A host source reads only token ids (the request's prompt and committed output), never the
model, so it drafts on the CPU between steps; the verification step checks its chain like any
other draft.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

from ....contract.speculation import Source


@dataclass(frozen=True)
class Proposal:
    tokens: tuple[int, ...]            # a chain of draft tokens that follow the request's last token
    probabilities: tuple[float, ...]   # the source's own P(token i is right | the tokens before it are), same length
    # A draft model's runners-up at each depth: (token, its probability there), likeliest first;
    # the draft is then a tree over the chain (host.py). Empty: a chain.
    alternatives: tuple[tuple[tuple[int, float], ...], ...] = ()


EMPTY = Proposal((), ())


class HostDraftSource(Protocol):
    source: Source

    def propose(self, rid: str, context: Sequence[int], max_tokens: int) -> Proposal:
        """``context``: the request's prompt and committed output so far; it only grows between
        calls for one ``rid``, so a source indexes ``context[len(seen):]`` as new. The chain has
        at most ``max_tokens`` (>= 0) tokens."""
        ...

    def close(self, rid: str, context: Sequence[int]) -> None:
        """The request ended: forget its state (a suffix source may keep its output)."""
        ...


def new_tokens(rid: str, seen: int, context: Sequence[int]) -> list[int]:
    """The tokens of ``context`` after the ``seen`` a source has indexed for ``rid``, as ints."""
    if len(context) < seen:
        raise ValueError(f"context of request {rid!r} shrank from {seen} to {len(context)} tokens; "
                         "a request's context only grows between propose calls")
    return [int(t) for t in context[seen:]]


def check_max_tokens(max_tokens: int) -> None:
    if max_tokens < 0:
        raise ValueError(f"max_tokens {max_tokens}: valid 0 or more")

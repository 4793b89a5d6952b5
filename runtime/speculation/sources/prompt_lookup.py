"""Prompt lookup: the request's last n tokens found earlier in its own prompt and output, and
the tokens that followed them there, as a chain (vLLM's ``ngram`` method).

The longest n (max_ngram down to min_ngram) wins, and among its earlier occurrences the most
recent one (an edit in progress is more like its latest copy than its first). Each request
keeps an index n-gram -> start of its latest occurrence that has a token after it, extended
only by the tokens new since the last call, so a call costs O(new tokens x n-gram sizes), not
O(context).

When the copied continuation reaches the end of the context it keeps copying from the draft
itself (draft[j] = (context + draft)[start + n + j]): a repeating pattern is extrapolated, as
the model would continue it if the match holds.

Probabilities are a fixed prior, not a measurement: token j of a chain matched on n tokens
has m = n + j tokens of agreeing context behind it once the tokens before it are right, and
gets P = m / (m + 1) (Laplace's rule of succession: longer matches repeat more often). The
engine's policy learns the real acceptance per (source, depth) online; this only orders
proposals before it has data.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from ....contract.speculation import PromptLookupConfig, Source
from .base import EMPTY, Proposal, check_max_tokens, new_tokens


@dataclass
class _RequestIndex:
    tokens: list[int] = field(default_factory=list)
    latest: dict[tuple[int, ...], int] = field(default_factory=dict)  # n-gram -> start of its latest followed occurrence


class PromptLookupSource:
    source = Source.prompt_lookup

    def __init__(self, config: PromptLookupConfig):
        if (problem := config.problem()) is not None:
            raise ValueError(f"prompt_lookup: {problem}")
        self.config = config
        self._requests: dict[str, _RequestIndex] = {}

    def propose(self, rid: str, context: Sequence[int], max_tokens: int) -> Proposal:
        check_max_tokens(max_tokens)
        index = self._requests.setdefault(rid, _RequestIndex())
        self._extend(index, new_tokens(rid, len(index.tokens), context))
        limit = min(self.config.num_tokens, max_tokens)
        tokens = index.tokens
        if limit == 0:
            return EMPTY
        for n in range(min(self.config.max_ngram, len(tokens)), self.config.min_ngram - 1, -1):
            start = index.latest.get(tuple(tokens[len(tokens) - n:]))
            if start is not None:
                return self._chain(tokens, start + n, n, limit)
        return EMPTY

    def close(self, rid: str, context: Sequence[int]) -> None:
        self._requests.pop(rid, None)

    def _extend(self, index: _RequestIndex, new: list[int]) -> None:
        tokens, latest = index.tokens, index.latest
        low, high = self.config.min_ngram, self.config.max_ngram
        for token in new:
            end = len(tokens)  # the n-grams ending just before the new token now have a follower
            for n in range(low, min(high, end) + 1):
                latest[tuple(tokens[end - n:end])] = end - n
            tokens.append(token)

    @staticmethod
    def _chain(tokens: list[int], follow: int, n: int, limit: int) -> Proposal:
        length = len(tokens)
        draft: list[int] = []
        for j in range(limit):
            at = follow + j  # < length + j: inside the context or the draft already made
            draft.append(tokens[at] if at < length else draft[at - length])
        return Proposal(tuple(draft), tuple((n + j) / (n + j + 1) for j in range(limit)))

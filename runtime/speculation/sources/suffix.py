"""Suffix drafting (SuffixDecoding, Oliaro et al. 2024; vLLM/Arctic's ``suffix`` method): the
continuation of the request's longest matched suffix, grown by frequency.

Each request has a suffix trie over its prompt and output (suffix_trie.py, depth
max_depth + 1, a matched token and up to max_depth after it: memory bounded by max_depth + 1
nodes per token, updated per new token in O(max_depth)); one shared trie holds the outputs of
the last ``cross_request`` finished requests (0: none), the oldest uncounted when a newer one
arrives. Outputs are the tokens after the context the source first saw for the request (its
prompt, or the prompt and first token); a request it never proposed for adds nothing.

A proposal, in each trie: the longest suffix of the context (at most ``max_match`` tokens, and
at most max_depth, so that it can have a continuation in the trie) that occurs followed by
some token, then greedily the most frequent next token (ties: the most
recent), its probability the conditional frequency count(child) / count(followed node). Where
the walk reaches a node with no continuation (the trie's depth, or the text's end) it drops the
oldest matched tokens along suffix links until one has (at least one token matched: the
bare frequencies of single tokens are no match). The walk stops when the path's
probability (the product so far) would fall under ``min_probability``, as the contract says,
or at min(max_depth, max_tokens) tokens. Of the two tries' chains the one with more expected
accepted tokens (sum of path probabilities) wins; on a tie the request's own.

The proposal is a chain (the greedy path of the tree SuffixDecoding would grow), which is
what the engine core verifies for host sources.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

from ....contract.speculation import Source, SuffixConfig
from .base import EMPTY, Proposal, check_max_tokens, new_tokens
from .suffix_trie import Node, SuffixTrie


@dataclass
class _RequestTrie:
    trie: SuffixTrie
    output_start: int                     # context length when first seen: the output follows
    seen: int = 0
    open_suffixes: list[Node] = field(default_factory=list)


class SuffixSource:
    source = Source.suffix

    def __init__(self, config: SuffixConfig):
        if (problem := config.problem()) is not None:
            raise ValueError(f"suffix: {problem}")
        self.config = config
        self.match_window = min(config.max_match, config.max_depth)
        self.trie_depth = config.max_depth + 1
        self._requests: dict[str, _RequestTrie] = {}
        self._recent = SuffixTrie(self.trie_depth)  # outputs of recently finished requests
        self._recent_outputs: deque[list[int]] = deque()

    def propose(self, rid: str, context: Sequence[int], max_tokens: int) -> Proposal:
        check_max_tokens(max_tokens)
        request = self._requests.get(rid)
        if request is None:
            request = self._requests[rid] = _RequestTrie(SuffixTrie(self.trie_depth), len(context))
        self._index(request, new_tokens(rid, request.seen, context))
        limit = min(self.config.max_depth, max_tokens)
        if limit == 0 or not request.open_suffixes:
            return EMPTY
        own_match = request.open_suffixes[min(self.match_window, len(request.open_suffixes)) - 1]
        best = self._walk(own_match, limit)
        if self._recent_outputs:
            window = [int(t) for t in context[max(0, len(context) - self.match_window):]]
            recent = self._walk(self._recent.longest_suffix(window), limit)
            if _expected_accepted(recent) > _expected_accepted(best):
                best = recent
        return best

    def close(self, rid: str, context: Sequence[int]) -> None:
        request = self._requests.pop(rid, None)
        if request is None or self.config.cross_request == 0:
            return
        output = [int(t) for t in context[request.output_start:]]
        self._recent.extend(output)
        self._recent_outputs.append(output)
        if len(self._recent_outputs) > self.config.cross_request:
            self._recent.retract(self._recent_outputs.popleft())

    @staticmethod
    def _index(request: _RequestTrie, new: list[int]) -> None:
        trie, open_suffixes = request.trie, request.open_suffixes
        for token in new:
            open_suffixes = trie.append(open_suffixes, token)
        request.open_suffixes = open_suffixes
        request.seen += len(new)

    def _walk(self, node: Node, limit: int) -> Proposal:
        """The greedy chain from ``node``, a matched suffix of the context (where it has no
        continuation, from its longest suffix that has one)."""
        tokens: list[int] = []
        probabilities: list[float] = []
        path = 1.0
        while len(tokens) < limit:
            while node.continued == 0 or node.depth == 0:
                if node.depth <= 1:  # no context token left to match: the root's counts are no match
                    return Proposal(tuple(tokens), tuple(probabilities)) if tokens else EMPTY
                node = node.link
            token, child = max(node.children(), key=lambda item: (item[1].count, item[1].last))
            probability = child.count / node.continued
            if path * probability < self.config.min_probability:
                break
            path *= probability
            tokens.append(token)
            probabilities.append(probability)
            node = child
        return Proposal(tuple(tokens), tuple(probabilities)) if tokens else EMPTY


def _expected_accepted(proposal: Proposal) -> float:
    """Expected accepted tokens of a chain under its own probabilities: the sum of path products."""
    total, path = 0.0, 1.0
    for probability in proposal.probabilities:
        path *= probability
        total += path
    return total

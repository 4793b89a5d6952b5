"""Chains: a host source's draft (prompt lookup, suffix) as the tree a verification step takes.

A chain of n tokens is the Medusa tree whose choices are (0,), (0, 0), ... (n zeros): every
node's only child is the next token, so the same step (tree mask, logits at every node) and the
same walks verify it: ``accept_greedy``, and for sampled requests ``accept_sampled``
(runtime/speculation/medusa.py), the exact rule of speculative sampling for a point-mass draft,
drawn from the request's seeded per-position randomness so a seed gives plain sampling's tokens
however many drafts were tried.
"""
from __future__ import annotations

from functools import lru_cache

from ..core.tree import Tree


@lru_cache(maxsize=256)
def chain_tree(length: int) -> Tree:
    """The tree of a chain of ``length`` draft tokens after the root."""
    return Tree(tuple((0,) * depth for depth in range(1, length + 1)))


@lru_cache(maxsize=512)
def tree_of(choices: tuple[tuple[int, ...], ...]) -> Tree:
    """A draft model's tree over its chain (host.py), checked once per shape."""
    return Tree(choices)

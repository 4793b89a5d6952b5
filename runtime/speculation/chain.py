"""Chains: a host source's draft (prompt lookup, suffix) as the tree a verification step takes,
and exact acceptance of a chain for sampled requests.

A chain of n tokens is the Medusa tree whose choices are (0,), (0, 0), ... (n zeros): every
node's only child is the next token, so the same step (tree mask, logits at every node) and the
same greedy walk (``accept_greedy``) verify it. A host draft is one token per position, a
point mass, so sampled requests get the exact rule of speculative sampling (Leviathan et al.
2023, Chen et al. 2023) with q = δ(draft): keep the draft token x with probability p(x) under
the request's own distribution; at the first rejection the next token comes from p with x
removed. The output is then distributed exactly as plain sampling's, which Medusa's typical
acceptance (a heuristic) is not.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from ..core.sampling import Sampler
from .medusa import Accepted, Tree


@lru_cache(maxsize=256)
def chain_tree(length: int) -> Tree:
    """The tree of a chain of ``length`` draft tokens after the root."""
    return Tree(tuple((0,) * depth for depth in range(1, length + 1)))


def accept_sampled_chain(tree: Tree, tokens: list[int], logits, sampler: Sampler) -> tuple[Accepted, int | None]:
    """Walks the chain keeping each draft token with probability p(token) under ``sampler``'s
    distribution at its parent's row (``logits[node]``: [V], masked rows for a constrained
    request). Returns the accepted path and the token rejected at its end (None when the whole
    chain was kept): the caller samples the next token at the path's end excluding it."""
    node, nodes = 0, []
    while tree.children[node]:
        child = tree.children[node][0]
        probs = sampler.distribution(np.asarray(logits[node]))  # [V]
        if sampler.rng.random() >= probs[tokens[child]]:
            return Accepted(tuple(nodes), tuple(tokens[n] for n in nodes)), tokens[child]
        nodes.append(child)
        node = child
    return Accepted(tuple(nodes), tuple(tokens[n] for n in nodes)), None

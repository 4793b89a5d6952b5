"""Medusa drafting and path acceptance over a tree (runtime/core/tree.py: the tree, its mask
and the accepted path are the step format's): the candidate tokens from the heads' top-k, and
the path of the tree the base model keeps, greedy or sampled. All of it is plain numpy over one
row's logits; the engine only sees tokens, positions and the mask.
"""
from __future__ import annotations

import numpy as np

from ..core.sampling import Sampler
from ..core.tree import Accepted, Tree

# Up to this k, top-k is k argmaxes (vectorized, ~1 µs each over 4096 logits) rather than an
# argpartition (~45 µs whatever k): drafting runs every verification, whose step is ~2 ms on CPU.
ARGMAX_TOP_K = 16


def _top_k(logits: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest logits, largest first, the lower index first among equals."""
    if k <= ARGMAX_TOP_K and k < len(logits):
        work, top = logits.copy(), np.empty(k, np.int64)
        for i in range(k):
            top[i] = np.argmax(work)
            work[top[i]] = -np.inf
        return top
    top = np.argpartition(-logits, k - 1)[:k] if k < len(logits) else np.arange(len(logits))
    return top[np.lexsort((top, -logits[top]))]


def candidates(tree: Tree, root: int, medusa_logits: np.ndarray) -> list[int]:
    """Tokens of all of ``tree``'s nodes, root first, from one position's head logits [K, V]."""
    ranked = [_top_k(medusa_logits[head], k) for head, k in enumerate(tree.top_k)]
    return [root, *(int(ranked[len(path) - 1][path[-1]]) for path in tree.choices)]


def accept_greedy(tree: Tree, tokens: list[int], logits: np.ndarray) -> Accepted:
    """Walks from the root while a child holds the base model's argmax; ``logits`` [T, V]."""
    node, nodes = 0, []
    while True:
        target = int(np.argmax(logits[node]))
        match = next((c for c in tree.children[node] if tokens[c] == target), None)
        if match is None:
            return Accepted(tuple(nodes), tuple(tokens[n] for n in nodes))
        nodes.append(match)
        node = match


def accept_sampled(tree: Tree, tokens: list[int], logits, sampler: Sampler, position: int) -> Accepted:
    """Walks from the root while a child holds the token the request samples there: at depth d
    the token plain sampling gives output position ``position + d`` (the sampler's seeded draw
    from its distribution at the parent's row, ``logits[node]``: [V], masked rows for a
    constrained request). The caller then samples position ``position + len(path)`` at the
    path's end, which gives the token that matched no child.

    For a point-mass draft x this is the exact rule of speculative sampling (Leviathan et al.
    2023, Chen et al. 2023) with q = δ(x): x is kept with probability p(x) = min(1, p(x)/q(x)),
    and at a rejection the token comes from norm(max(0, p − δ(x))), p without x. A node's
    children hold distinct tokens (ranks of one head, or a chain's one child), each a point mass,
    so the token at every position is plain sampling's for the same seed, token for token, and
    distributed as p whether or not the position was drafted. (A draft drawn at random from a q
    would keep the same output only if accepted exactly when it equals the seeded token:
    probability Σ p·q, below the rule's Σ min(p, q) unless the draft shares the position's
    randomness.)"""
    node, nodes = 0, []
    while tree.children[node]:
        target = sampler.draw(sampler.distribution(np.asarray(logits[node])), position + len(nodes))
        match = next((c for c in tree.children[node] if tokens[c] == target), None)
        if match is None:
            break
        nodes.append(match)
        node = match
    return Accepted(tuple(nodes), tuple(tokens[n] for n in nodes))

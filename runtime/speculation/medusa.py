"""Medusa trees: candidate tokens from the heads, the tree mask, and path acceptance.

A tree is a list of "choices": each a path of top-k ranks, one per head. Node 0 is the root
(the last sampled token, not yet in the cache); node i > 0 is ``choices[i - 1]``, whose token
is head ``depth - 1``'s rank-``r`` guess. Every choice's parent path must come earlier, so any
prefix of the list is a tree too (the runtime picks a prefix size per batch). All of it is
plain numpy over one row's logits; the engine only sees tokens, positions and the mask.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from ...contract.medusa_acceptance import tree_problem
from ..core.sampling import Sampler


@dataclass(frozen=True)
class Tree:
    choices: tuple[tuple[int, ...], ...]

    def __post_init__(self):
        problem = tree_problem(self.choices, parents_first=True)
        if problem is not None:
            raise ValueError(f"tree choice {problem}")

    @property
    def size(self) -> int:
        """Tokens one verification scores: the root plus every choice."""
        return 1 + len(self.choices)

    @property
    def depth(self) -> int:
        return max((len(p) for p in self.choices), default=0)

    def prefix(self, num_choices: int) -> "Tree":
        return Tree(self.choices[:num_choices])

    @cached_property
    def parents(self) -> tuple[int, ...]:
        index = {(): 0, **{path: i + 1 for i, path in enumerate(self.choices)}}
        return (-1, *(index[path[:-1]] for path in self.choices))

    @cached_property
    def depths(self) -> np.ndarray:
        return np.array([0, *(len(p) for p in self.choices)], np.int64)  # [T]

    @cached_property
    def ancestors(self) -> np.ndarray:
        """[T, T] bool: node j is node i or one of its ancestors (the tree attention mask)."""
        mask = np.eye(self.size, dtype=bool)
        for node in range(1, self.size):
            mask[node] |= mask[self.parents[node]]
        return mask

    @cached_property
    def children(self) -> tuple[tuple[int, ...], ...]:
        kids: list[list[int]] = [[] for _ in range(self.size)]
        for node in range(1, self.size):
            kids[self.parents[node]].append(node)
        return tuple(tuple(k) for k in kids)

    @cached_property
    def top_k(self) -> tuple[int, ...]:
        """How many ranks each head must supply."""
        need = [0] * self.depth
        for path in self.choices:
            need[len(path) - 1] = max(need[len(path) - 1], path[-1] + 1)
        return tuple(need)

    def candidates(self, root: int, medusa_logits: np.ndarray) -> list[int]:
        """Tokens of all nodes, root first, from one position's head logits [K, V]."""
        ranked = [_top_k(medusa_logits[head], k) for head, k in enumerate(self.top_k)]
        return [root, *(int(ranked[len(path) - 1][path[-1]]) for path in self.choices)]


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


@dataclass(frozen=True)
class Accepted:
    """The longest path the base model agrees with: its nodes (root excluded) and tokens."""

    nodes: tuple[int, ...]
    tokens: tuple[int, ...]

    @property
    def last_node(self) -> int:
        return self.nodes[-1] if self.nodes else 0


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

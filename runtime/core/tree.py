"""A speculation tree, as a step carries it: the tree every verification row scores, and the
path of it the base model accepted.

A tree is a list of "choices": each a path of top-k ranks, one per head. Node 0 is the root
(the last sampled token, not yet in the cache); node i > 0 is ``choices[i - 1]``, whose token
is head ``depth - 1``'s rank-``r`` guess (a host draft's chain is a tree of rank-0 choices).
Every choice's parent path must come earlier, so any prefix of the list is a tree too (the
runtime picks a prefix size per batch). The scheduler plans with these, a step's arrays carry
the tree's mask, and speculation/ drafts into them and accepts paths of them.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from ...contract.medusa_acceptance import tree_problem


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


@dataclass(frozen=True)
class Accepted:
    """The longest path the base model agrees with: its nodes (root excluded) and tokens."""

    nodes: tuple[int, ...]
    tokens: tuple[int, ...]

    @property
    def last_node(self) -> int:
        return self.nodes[-1] if self.nodes else 0

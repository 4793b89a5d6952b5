"""Medusa's trees as a draft source for the adaptive policy (adaptive.py): the built tree, kept
ordered by the current acceptance estimates, and its prefixes' expected kept tokens.

The acceptance estimates are per (head, rank) (acceptance.py): the heads' held-out accuracy,
updated from every verification. Every REORDER_EVERY verifications the tree is re-ordered by them,
so a prefix of n choices is the n likeliest paths now, not at build time: e.g. deeper chains when
later heads agree more often than expected. Whether a tree is verified, and how much of it, is the
policy's: this model offers the series "expected kept tokens verifying the first n choices".
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np

from ...contract.speculation import Source
from .acceptance import AcceptanceModel, SpeculationStats
from .adaptive import Candidate
from ..core.tree import Accepted, Tree

if TYPE_CHECKING:
    from ..core.scheduler import Draft

REESTIMATE_EVERY = 16   # verifications between re-computing the prefixes' expected tokens (~1 ms)


class MedusaTrees:
    """The engine's Medusa tree and its acceptance; ``fixed`` pins the prefix verified (0: off)."""

    REORDER_EVERY = 32

    def __init__(self, tree: Tree, acceptance: AcceptanceModel, stats: SpeculationStats, fixed: int | None = None):
        if fixed is not None and not 0 <= fixed <= len(tree.choices):
            raise ValueError(f"medusa tree size {fixed}: valid 0 (off) to {len(tree.choices)} (the built tree)")
        self.tree, self.acceptance, self.stats, self.fixed = tree, acceptance, stats, fixed
        if not stats.head_tried:
            stats.head_tried, stats.head_accepted = [0] * tree.depth, [0] * tree.depth
        self._order = tree.choices
        self._trees: dict[tuple, Tree] = {}
        self._since_reorder = 0
        self._expected: np.ndarray | None = None  # [N + 1], for the current order
        self._since_estimate = 0

    def prefix(self, n: int) -> Tree:
        """The first n choices in the current order, as a tree (cached)."""
        choices = self._order[:n]  # a fixed size is never re-ordered
        if choices not in self._trees:
            if len(self._trees) > 512:
                self._trees.clear()
            self._trees[choices] = Tree(choices)
        return self._trees[choices]

    def candidate(self) -> Candidate | None:
        """The tree as a row's candidate: its prefixes' expected kept tokens, pinned where the size
        is fixed (None where it is fixed at 0)."""
        if self.fixed is not None:
            if self.fixed == 0:
                return None
            return Candidate(Source.medusa, self.acceptance.expected_accepted(self.prefix(self.fixed)), pinned=True)
        if self._expected is None:
            self._expected = self.acceptance.expected_accepted(self.prefix(len(self._order)))
        return Candidate(Source.medusa, self._expected)

    def _reorder(self) -> None:
        probs = self.acceptance.path_probabilities(self.tree.choices)
        # A path is never likelier than its parent (probabilities ≤ 1): parents stay first.
        self._order = tuple(sorted(self.tree.choices, key=lambda p: (-probs[p], len(p), p)))

    def verified(self, rid: str, draft: "Draft", path: Accepted) -> None:
        self.record(draft.tree, path)

    def close(self, rid: str, context: Sequence[int]) -> None:
        """Nothing per request."""

    def record(self, tree: Tree, accepted: Accepted) -> None:
        """One row's verification: acceptance estimates and the per-head metrics."""
        self.acceptance.record(tree, accepted)
        self._since_reorder += 1
        self._since_estimate += 1
        if self.fixed is None and self._since_reorder >= self.REORDER_EVERY:
            self._reorder()
            self._since_reorder = 0
            self._expected = None
        if self._since_estimate >= REESTIMATE_EVERY:
            self._expected, self._since_estimate = None, 0
        stats = self.stats
        # Head h was tried when the path reached depth h and that node has guesses below it.
        for head in range(tree.depth):
            parent = 0 if head == 0 else accepted.nodes[head - 1] if head <= len(accepted.nodes) else None
            if parent is None or not tree.children[parent]:
                break
            stats.head_tried[head] += 1
            stats.head_accepted[head] += len(accepted.nodes) > head

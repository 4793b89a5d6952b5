"""Medusa trees at build time: the default tree from the heads' measured accuracy, and order.

A tree is a tuple of paths of top-k ranks (``(0,)`` is head 0's best guess, ``(0, 1)`` that
followed by head 1's second guess). A path's acceptance is estimated as the product of its
(head, rank) accuracies, as in the Medusa paper's tree construction. Trees are stored
likeliest-first with every parent before its children, so each prefix of the list is itself
a tree: the runtime verifies a prefix whose size pays on the device at hand.
"""
from __future__ import annotations

import heapq

from ...contract.medusa_acceptance import path_probability

# Heads without measured accuracy (public checkpoints that record none): a conservative
# guess per head of the chance that its rank-r token is right, decaying with distance.
GENERIC_TOP1 = (0.55, 0.35, 0.25, 0.18, 0.13)


def rank_accuracy(topk_accuracy: tuple[tuple[float, ...], ...] | None, num_heads: int) -> list[list[float]]:
    """Per head, the probability that exactly rank r is right (differences of top-k accuracy)."""
    if topk_accuracy is None:
        rows = []
        for k in range(num_heads):
            top1 = GENERIC_TOP1[min(k, len(GENERIC_TOP1) - 1)]
            rows.append([top1 * 0.5 ** r for r in range(10)])  # ranks 0..9 roughly halving
        return rows
    rows = []
    for cumulative in topk_accuracy[:num_heads]:
        exact = [cumulative[0], *(b - a for a, b in zip(cumulative, cumulative[1:]))]
        rows.append([max(p, 1e-4) for p in exact])
    return rows


def default_tree(accuracy: list[list[float]], nodes: int) -> tuple[tuple[int, ...], ...]:
    """The ``nodes`` paths of highest estimated acceptance, grown greedily from the root.

    With accuracies falling in rank, a child or next sibling is never likelier than the node
    that spawned it, so popping the likeliest frontier node gives the best tree of each size.
    """
    heap = [(-path_probability((0,), accuracy), (0,))]
    chosen: list[tuple[int, ...]] = []
    while heap and len(chosen) < nodes:
        neg, path = heapq.heappop(heap)
        chosen.append(path)
        sibling = (*path[:-1], path[-1] + 1)
        if path[-1] + 1 < len(accuracy[len(path) - 1]):
            heapq.heappush(heap, (-path_probability(sibling, accuracy), sibling))
        if len(path) < len(accuracy):
            child = (*path, 0)
            heapq.heappush(heap, (-path_probability(child, accuracy), child))
    return tuple(chosen)


def ordered(tree: tuple[tuple[int, ...], ...], accuracy: list[list[float]]) -> tuple[tuple[int, ...], ...]:
    """A user's tree in likeliest-first order, parents before children (ties: shallower first)."""
    # Accuracies are ≤ 1, so a path is never likelier than its parent: the order is prefix-closed.
    return tuple(sorted(tree, key=lambda p: (-path_probability(p, accuracy), len(p), p)))

"""Medusa acceptance arithmetic shared by the build (default tree, plan) and the runtime policy."""
from __future__ import annotations

# Speculate only for an expected ≥ 10 % more tokens per second than plain decoding (step
# timings are noisy): the runtime policy and `trtbuild plan` apply the same rule.
MIN_GAIN = 1.10


def rank_probability(row: list[float], rank: int) -> float:
    """P(rank ``rank`` of one head is right) from that head's per-rank accuracy ``row``; ranks
    past the measured ones halve from the last measured figure."""
    return row[rank] if rank < len(row) else row[-1] * 0.5 ** (rank - len(row) + 1)


def path_probability(path: tuple[int, ...], accuracy: list[list[float]]) -> float:
    """P(every guess on ``path`` is right): the product of its (head, rank) accuracies."""
    p = 1.0
    for head, rank in enumerate(path):
        p *= rank_probability(accuracy[head], rank)
    return p

"""Medusa acceptance arithmetic shared by the build (default tree, plan) and the runtime policy."""
from __future__ import annotations

from typing import Callable, Sequence

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


def expected_accepted(path_probabilities: Sequence[float]) -> list[float]:
    """[N + 1]: expected accepted guesses with the first n choices of a tree, n = 0..N, from
    P(each choice's whole path is accepted), in the tree's order."""
    out = [0.0]
    for p in path_probabilities:
        out.append(out[-1] + p)
    return out


def best_tree_prefix(expected: Sequence[float], step_seconds: Callable[[int], float],
                     plain_seconds: float | None = None) -> tuple[int, float]:
    """(n, tokens per second over plain decoding) for the tree prefix of n choices that maximises
    (1 + expected[n]) / step_seconds(1 + n), where ``step_seconds(S)`` is a step of S tokens a
    row; n = 0 (plain decoding, ratio 1) unless the best beats it by MIN_GAIN. Plain decoding
    costs ``plain_seconds`` a token where given (the runtime's multi-step runs make it cheaper
    than a one-token step), else ``step_seconds(1)``."""
    plain_rate = 1.0 / (step_seconds(1) if plain_seconds is None else plain_seconds)
    rates = [(1 + e) / step_seconds(1 + n) for n, e in enumerate(expected)]
    rates[0] = plain_rate
    best = max(range(len(rates)), key=rates.__getitem__)  # the first of equals: the smaller tree
    if rates[best] < MIN_GAIN * plain_rate:
        return 0, 1.0
    return best, rates[best] / plain_rate

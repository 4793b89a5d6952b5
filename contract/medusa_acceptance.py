"""Medusa trees, well formed or not, and acceptance arithmetic, shared by the build (the spec's tree,
the default tree, plan) and the runtime (the manifest's tree, the policy)."""
from __future__ import annotations

from typing import Callable, Sequence

# Speculate only for an expected ≥ 10 % more tokens per second than plain decoding (step
# timings are noisy): the runtime policy and `trtbuild plan` apply the same rule.
MIN_GAIN = 1.10


def tree_problem(choices: Sequence[tuple[int, ...]], num_heads: int | None = None,
                 parents_first: bool = False) -> str | None:
    """None if ``choices`` (paths of top-k ranks, one per head) form a tree, else what is wrong
    with the first bad path: empty, a negative rank, deeper than ``num_heads`` (where given), twice,
    its parent missing, or (``parents_first``: the order the runtime relies on, every prefix a
    tree) its parent later in the list."""
    every = set(choices)
    seen: set[tuple[int, ...]] = {()}
    for path in choices:
        if not path:
            return "an empty path; each choice is a non-empty list of ranks ≥ 0 like [0, 1]"
        if any(rank < 0 for rank in path):
            return f"{list(path)} has a negative rank; each choice is a non-empty list of ranks ≥ 0"
        if num_heads is not None and len(path) > num_heads:
            return f"{list(path)} is {len(path)} deep but there are num_heads={num_heads} heads"
        if path in seen:
            return f"{list(path)} appears twice"
        if len(path) > 1 and path[:-1] not in every:
            return f"{list(path)} has no parent {list(path[:-1])} in the tree"
        if parents_first and path[:-1] not in seen:
            return f"{list(path)} comes before its parent {list(path[:-1])}"
        seen.add(path)
    return None


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

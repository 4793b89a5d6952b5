"""What the heads' guesses are worth: P(accepted) per (head, rank), from the heads' held-out
accuracy and every verification since, and the speculation counters the runtime reports."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from ...contract.medusa_acceptance import expected_accepted, rank_probability
from ..core.tree import Accepted, Tree

PRIOR_WEIGHT = 20.0   # the held-out accuracy counts as this many observed verifications


class AcceptanceModel:
    """P(a node is accepted | its parent was), per (head, rank): prior plus observed counts."""

    def __init__(self, rank_accuracy: list[list[float]]):
        self.prior = [list(row) for row in rank_accuracy]
        width = max(len(row) for row in self.prior)
        self.hits = np.zeros((len(self.prior), width))
        self.trials = np.zeros((len(self.prior), width))

    def probability(self, head: int, rank: int) -> float:
        prior = rank_probability(self.prior[head], rank)
        if rank >= self.hits.shape[1]:
            return prior
        return float((self.hits[head, rank] + PRIOR_WEIGHT * prior) / (self.trials[head, rank] + PRIOR_WEIGHT))

    def record(self, tree: Tree, accepted: Accepted) -> None:
        """Counts a trial for every node whose parent was accepted (the root always is)."""
        reached = {0, *accepted.nodes}
        for node in range(1, tree.size):
            if tree.parents[node] in reached:
                path = tree.choices[node - 1]
                head, rank = len(path) - 1, path[-1]
                if rank < self.hits.shape[1]:
                    self.trials[head, rank] += 1
                    self.hits[head, rank] += node in reached

    def path_probabilities(self, choices: tuple[tuple[int, ...], ...]) -> dict[tuple[int, ...], float]:
        """P(the whole path is accepted) for each choice (and its ancestors)."""
        probs = {(): 1.0}
        for path in sorted(choices, key=len):
            probs[path] = probs[path[:-1]] * self.probability(len(path) - 1, path[-1])
        return probs

    def expected_accepted(self, tree: Tree) -> np.ndarray:
        """[N + 1]: expected accepted guesses with the first n choices of ``tree``, n = 0..N."""
        probs = self.path_probabilities(tree.choices)
        return np.array(expected_accepted([probs[path] for path in tree.choices]))


@dataclass
class SpeculationStats:
    verify_steps: int = 0
    plain_steps: int = 0            # decode steps where speculation stepped aside
    verified_rows: int = 0
    accepted_tokens: int = 0        # guesses kept: each is a decode step saved for its request
    head_tried: list[int] = field(default_factory=list)
    head_accepted: list[int] = field(default_factory=list)
    tree_sizes: Counter = field(default_factory=Counter)  # verification steps by S
    # per draft source (medusa, prompt_lookup, suffix, draft_head): rows verified, guesses kept
    source_rows: Counter = field(default_factory=Counter)
    source_accepted: Counter = field(default_factory=Counter)

    def count_row(self, source: str, accepted: int) -> None:
        """One row's verification, whichever source drafted it."""
        self.verified_rows += 1
        self.accepted_tokens += accepted
        self.source_rows[source] += 1
        self.source_accepted[source] += accepted

    @property
    def mean_accepted_per_step(self) -> float:
        """Tokens a verifying row gains per engine step: accepted guesses + the sampled one."""
        return 1 + self.accepted_tokens / self.verified_rows if self.verified_rows else 1.0

    def head_acceptance(self) -> list[float]:
        """Per head: how often its guess was accepted when the previous head's was."""
        return [a / t if t else 0.0 for a, t in zip(self.head_accepted, self.head_tried)]

    def as_dict(self) -> dict:
        return {"verify_steps": self.verify_steps, "plain_steps": self.plain_steps,
                "verified_rows": self.verified_rows, "accepted_tokens": self.accepted_tokens,
                "mean_tokens_per_step": round(self.mean_accepted_per_step, 3), "steps_saved": self.accepted_tokens,
                "head_acceptance": [round(a, 3) for a in self.head_acceptance()],
                "tree_sizes": dict(sorted(self.tree_sizes.items())),
                "sources": {source: {"verified_rows": rows, "accepted_tokens": self.source_accepted[source],
                                     "mean_tokens_per_step": round(1 + self.source_accepted[source] / rows, 3)}
                            for source, rows in sorted(self.source_rows.items())}}

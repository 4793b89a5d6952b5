"""Whether and how much to speculate: Medusa only pays when verifying T tokens costs little
more than decoding one.

On a bandwidth-bound device (a GPU at small batch) a step's time hardly grows with its
tokens; on a compute-bound one (a CPU, or a GPU at large batch) it grows with B × T. The
policy keeps two measurements: the step time by (rows, tokens per row) — the engine's,
calibrated at load and refined from every decode step, plus the host's per-row work — and
each (head, rank)'s acceptance, starting from the heads' held-out accuracy and updated from
every verification. For a batch of B rows it picks the tree prefix n maximising expected
tokens per second, (1 + E[accepted | n]) / t(B, 1 + n), and n = 0 (plain decoding) unless
that beats plain decoding by MIN_GAIN. Plain decoding is what the runtime really does when it
steps aside: multi-step greedy runs (runtime/engine_core.py), whose cost per token is
calibrated and observed separately from a single plain step's (on the CPU a run's step skips
the heads and costs a third of even a one-guess verification, which computes them and grows
with its tokens: on the bundled model no tree pays at any batch there, docs/benchmarks.md; on
a GPU at small batch a verification costs about one step, and trees pay). Calibration runs B in
powers of two up to max_batch × 8 tree sizes, five steps each, and one greedy run per B: ~2 s
for the bundled model on 2 CPU cores.

The step times and their calibration live in step_times.py, the acceptance estimates and the
speculation counters in acceptance.py; this file makes Medusa's choice, host drafts' is host.py's,
and speculation.py builds both for an engine dir.
"""
from __future__ import annotations

import numpy as np

from ...contract.medusa_acceptance import best_tree_prefix
from .acceptance import AcceptanceModel, SpeculationStats
from ..core.tree import Accepted, Tree
from .step_times import EMPTY, Context, StepTimes

REDECIDE_EVERY = 16   # decisions between re-choosing a batch size's tree (choosing costs ~1 ms)
# Standing aside, a batch size verifies the likeliest-to-pay tree once when the plain decoding it
# did since the last such verification took EXPLORE_AFTER times that verification's estimated
# cost, so a step time measured in a slow spell (calibration, one noisy step) cannot keep a batch
# size off trees for good: its estimate comes from a fresh step. Exploring costs at most
# 1 / EXPLORE_AFTER of plain decoding's time where trees do not pay.
EXPLORE_AFTER = 100


class SpeculationPolicy:
    """Chooses each decode batch's tree; ``fixed`` pins the size (0 turns speculation off).

    Adaptive mode also re-orders the built tree by the current acceptance estimates (every
    ``REORDER_EVERY`` verifications), so a prefix of n choices is the n likeliest paths now,
    not at build time: e.g. deeper chains when later heads agree more often than expected."""

    REORDER_EVERY = 32

    def __init__(self, tree: Tree, acceptance: AcceptanceModel, times: StepTimes, fixed: int | None = None):
        if fixed is not None and not 0 <= fixed <= len(tree.choices):
            raise ValueError(f"medusa tree size {fixed}: valid 0 (off) to {len(tree.choices)} (the built tree)")
        self.tree, self.acceptance, self.times, self.fixed = tree, acceptance, times, fixed
        self.stats = SpeculationStats(head_tried=[0] * tree.depth, head_accepted=[0] * tree.depth)
        self._order = tree.choices
        self._trees: dict[tuple, Tree] = {}
        self._since_reorder = 0
        self._decided: dict[int, tuple[int, int]] = {}  # batch → (choices, decisions it stands for)
        self._aside_seconds: dict[int, float] = {}  # batch → plain decoding's estimated seconds since it explored

    def prefix(self, n: int) -> Tree:
        """The first n choices in the current order, as a tree (cached)."""
        choices = self._order[:n]
        if choices not in self._trees:
            if len(self._trees) > 512:
                self._trees.clear()
            self._trees[choices] = Tree(choices)
        return self._trees[choices]

    def choose(self, batch: int, context: Context = EMPTY) -> int:
        """Number of tree choices to verify for a decode batch of ``batch`` rows that have
        ``context`` cached (0: plain)."""
        if self.fixed is not None or batch == 0:
            return self.fixed or 0
        size, left = self._decided.get(batch, (0, 0))
        if left > 0:
            self._decided[batch] = (size, left - 1)
            return size
        size, likeliest = self._best(batch, context)
        self._decided[batch] = (size, REDECIDE_EVERY)
        budget = self._aside_seconds.get(batch, 0.0)
        if size == 0 and likeliest and budget >= EXPLORE_AFTER * self._explore_cost(batch, likeliest, context):
            # This choice and the next (the step's drafting) say ``likeliest``: one verification.
            self._aside_seconds[batch] = 0.0
            self._decided[batch] = (likeliest, 1)
            return likeliest
        return size

    def _explore_cost(self, batch: int, size: int, context: Context) -> float:
        """What exploring costs: the verification, and a single plain step that computes the heads
        (to draft its tree) in place of a run's step."""
        extra = max(0.0, self.times.estimate(batch, 1, context) - self.times.plain_estimate(batch, context))
        return self.times.estimate(batch, 1 + size, context) + extra

    def _best(self, batch: int, context: Context) -> tuple[int, int]:
        """(the tree prefix to verify, 0 for plain; the prefix of the highest expected rate)."""
        expected = self.acceptance.expected_accepted(self.prefix(len(self._order)))  # [N + 1]
        if len(expected) == 1:
            return 0, 0
        seconds = self.times.estimates(batch, 1 + np.arange(len(expected)), context)  # [N + 1] a step of 1 + n tokens a row
        likeliest = 1 + int(np.argmax((1 + expected[1:]) / seconds[1:]))
        return best_tree_prefix(list(expected), lambda tokens: float(seconds[tokens - 1]),
                                plain_seconds=self.times.plain_estimate(batch, context))[0], likeliest

    def _reorder(self) -> None:
        probs = self.acceptance.path_probabilities(self.tree.choices)
        # A path is never likelier than its parent (probabilities ≤ 1): parents stay first.
        self._order = tuple(sorted(self.tree.choices, key=lambda p: (-probs[p], len(p), p)))

    def count_step(self, batch: int, verifies: bool, seq_len: int) -> None:
        """One decode step of ``batch`` rows: a verification of ``seq_len`` tokens per row, or plain."""
        if verifies:
            self.stats.verify_steps += 1
            self.stats.tree_sizes[seq_len] += 1
            self._aside_seconds[batch] = 0.0  # a fresh verification: no need to explore for a while
        else:
            self.stood_aside(batch, 1)

    def stood_aside(self, batch: int, steps: int, context: Context = EMPTY) -> None:
        """``steps`` plain decode steps of ``batch`` rows (one, or a multi-step run's) from ``context``."""
        self.stats.plain_steps += steps
        if self.fixed is None and self.times.table:  # a pinned tree size never explores
            self._aside_seconds[batch] = (self._aside_seconds.get(batch, 0.0)
                                          + steps * self.times.plain_estimate(batch, context))

    def record(self, tree: Tree, accepted: Accepted) -> None:
        """One row's verification: acceptance estimates and the per-head metrics."""
        self.acceptance.record(tree, accepted)
        self._since_reorder += 1
        if self.fixed is None and self._since_reorder >= self.REORDER_EVERY:
            self._reorder()
            self._since_reorder = 0
        stats = self.stats
        stats.count_row("medusa", len(accepted.nodes))
        # Head h was tried when the path reached depth h and that node has guesses below it.
        for head in range(tree.depth):
            parent = 0 if head == 0 else accepted.nodes[head - 1] if head <= len(accepted.nodes) else None
            if parent is None or not tree.children[parent]:
                break
            stats.head_tried[head] += 1
            stats.head_accepted[head] += len(accepted.nodes) > head

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
steps aside: multi-step greedy runs (runtime/core/engine_core.py), whose cost per token is
calibrated and observed separately from a single plain step's (on the CPU a run's step skips
the heads and costs a third of even a one-guess verification, which computes them and grows
with its tokens: on the bundled model no tree pays at any batch there, docs/benchmarks.md; on
a GPU at small batch a verification costs about one step, and trees pay). Calibration runs B in
powers of two up to max_batch × 8 tree sizes, five steps each, and one greedy run per B: ~2 s
for the bundled model on 2 CPU cores.
"""
from __future__ import annotations

import statistics
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ...medusa_math.acceptance import best_tree_prefix, expected_accepted, rank_probability
from .medusa import Accepted, Tree

if TYPE_CHECKING:
    from ..backends.engine import Engine
    from ..engine_dir import EngineDir

PRIOR_WEIGHT = 20.0   # the held-out accuracy counts as this many observed verifications
RECENT = 15           # step times kept per (B, S): the median of these is the estimate
REDECIDE_EVERY = 16   # decisions between re-choosing a batch size's tree (choosing costs ~1 ms)
# Standing aside, a batch size verifies the likeliest-to-pay tree once when the plain decoding it
# did since the last such verification took EXPLORE_AFTER times that verification's estimated
# cost, so a step time measured in a slow spell (calibration, one noisy step) cannot keep a batch
# size off trees for good: its estimate comes from a fresh step. Exploring costs at most
# 1 / EXPLORE_AFTER of plain decoding's time where trees do not pay.
EXPLORE_AFTER = 100


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


class StepTimes:
    """Step seconds by (rows B, tokens per row S): the engine's, interpolated between measured
    points, plus the host's per-row work around it (acceptance, drafting, K/V moves), which
    for a verification is several times a plain step's and matters when steps take ~ms."""

    def __init__(self):
        self.table: dict[int, dict[int, float]] = {}
        self._recent: dict[tuple[int, int], deque] = {}
        self._host_per_row: dict[bool, deque] = {False: deque([0.0], maxlen=RECENT),
                                                 True: deque([0.0], maxlen=RECENT)}
        self.runs: dict[int, float] = {}   # batch → seconds per step of a greedy run, host work included
        self._recent_runs: dict[int, deque] = {}

    def observe(self, batch: int, seq: int, seconds: float, loop_seconds: float | None = None) -> None:
        """Medians of recent steps: robust to the odd slow step (GC, the OS) on a busy host."""
        recent = self._recent.setdefault((batch, seq), deque(maxlen=RECENT))
        recent.append(seconds)
        self.table.setdefault(batch, {})[seq] = statistics.median(recent)  # (np.median: ~20× slower on 15 floats)
        if loop_seconds is not None:
            self._host_per_row[seq > 1].append(max(0.0, loop_seconds - seconds) / batch)

    def observe_run(self, batch: int, steps: int, seconds: float) -> None:
        """A multi-step greedy run of ``steps`` steps that took ``seconds``, its commit included."""
        recent = self._recent_runs.setdefault(batch, deque(maxlen=RECENT))
        recent.append(seconds / steps)
        self.runs[batch] = statistics.median(recent)

    def estimate(self, batch: int, seq: int) -> float:
        return self.engine_estimate(batch, seq) + batch * statistics.median(self._host_per_row[seq > 1])

    def estimates(self, batch: int, seqs: np.ndarray) -> np.ndarray:
        """``estimate(batch, s)`` for every s in ``seqs`` at once: the policy weighs every tree
        size each time it decides, which one at a time cost ~10 ms, a run's worth of steps."""
        if not self.table:
            raise ValueError("no step times measured")
        engine = _along_batch({b: self._along_seq_many(b, seqs) for b in self.table}, batch)
        host = np.where(seqs > 1, statistics.median(self._host_per_row[True]),
                        statistics.median(self._host_per_row[False]))
        return engine + batch * host

    def _along_seq_many(self, batch: int, seqs: np.ndarray) -> np.ndarray:
        points = sorted(self.table[batch].items())
        xs, ys = np.array([p[0] for p in points], float), np.array([p[1] for p in points])
        if len(xs) == 1:
            return ys[0] * np.maximum(1.0, seqs / xs[0])
        slope = max((ys[-1] - ys[-2]) / (xs[-1] - xs[-2]), 0.0)  # beyond the last point: its slope
        return np.where(seqs >= xs[-1], ys[-1] + slope * (seqs - xs[-1]), np.interp(seqs, xs, ys))

    def plain_estimate(self, batch: int) -> float:
        """Seconds per token-step of plain decoding: a greedy run's step where runs were measured
        (the cheaper of it and a single step), else a single plain step."""
        single = self.estimate(batch, 1)
        if not self.runs:
            return single
        return min(single, _along_batch(self.runs, batch))

    def engine_estimate(self, batch: int, seq: int) -> float:
        if not self.table:
            raise ValueError("no step times measured")
        return _along_batch({b: self._along_seq(b, seq) for b in self.table}, batch)

    def _along_seq(self, batch: int, seq: int) -> float:
        points = sorted(self.table[batch].items())
        xs, ys = [p[0] for p in points], [p[1] for p in points]
        if len(xs) == 1:
            return ys[0] * max(1.0, seq / xs[0])
        if seq >= xs[-1]:  # extrapolate with the last segment's slope
            slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
            return ys[-1] + max(slope, 0.0) * (seq - xs[-1])
        return float(np.interp(seq, xs, ys))


def _along_batch(times: dict[int, float], batch: int) -> float:
    """``times`` (by batch) interpolated at ``batch``; beyond the table rows scale time."""
    sizes = sorted(times)
    below = max((b for b in sizes if b <= batch), default=sizes[0])
    above = min((b for b in sizes if b >= batch), default=sizes[-1])
    low, high = times[below], times[above]
    if above == below:
        return low * (batch / below if batch > below else 1.0)
    return low + (high - low) * (batch - below) / (above - below)


@dataclass
class SpeculationStats:
    verify_steps: int = 0
    plain_steps: int = 0            # decode steps where speculation stepped aside
    verified_rows: int = 0
    accepted_tokens: int = 0        # guesses kept: each is a decode step saved for its request
    head_tried: list[int] = field(default_factory=list)
    head_accepted: list[int] = field(default_factory=list)
    tree_sizes: Counter = field(default_factory=Counter)  # verification steps by S

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
                "tree_sizes": dict(sorted(self.tree_sizes.items()))}


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

    def choose(self, batch: int) -> int:
        """Number of tree choices to verify for a decode batch of ``batch`` rows (0: plain)."""
        if self.fixed is not None or batch == 0:
            return self.fixed or 0
        size, left = self._decided.get(batch, (0, 0))
        if left > 0:
            self._decided[batch] = (size, left - 1)
            return size
        size, likeliest = self._best(batch)
        self._decided[batch] = (size, REDECIDE_EVERY)
        budget = self._aside_seconds.get(batch, 0.0)
        if size == 0 and likeliest and budget >= EXPLORE_AFTER * self._explore_cost(batch, likeliest):
            # This choice and the next (the step's drafting) say ``likeliest``: one verification.
            self._aside_seconds[batch] = 0.0
            self._decided[batch] = (likeliest, 1)
            return likeliest
        return size

    def _explore_cost(self, batch: int, size: int) -> float:
        """What exploring costs: the verification, and a single plain step that computes the heads
        (to draft its tree) in place of a run's step."""
        extra = max(0.0, self.times.estimate(batch, 1) - self.times.plain_estimate(batch))
        return self.times.estimate(batch, 1 + size) + extra

    def _best(self, batch: int) -> tuple[int, int]:
        """(the tree prefix to verify, 0 for plain; the prefix of the highest expected rate)."""
        expected = self.acceptance.expected_accepted(self.prefix(len(self._order)))  # [N + 1]
        if len(expected) == 1:
            return 0, 0
        seconds = self.times.estimates(batch, 1 + np.arange(len(expected)))  # [N + 1] a step of 1 + n tokens a row
        likeliest = 1 + int(np.argmax((1 + expected[1:]) / seconds[1:]))
        return best_tree_prefix(list(expected), lambda tokens: float(seconds[tokens - 1]),
                                plain_seconds=self.times.plain_estimate(batch))[0], likeliest

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

    def stood_aside(self, batch: int, steps: int) -> None:
        """``steps`` plain decode steps of ``batch`` rows (one, or a multi-step run's)."""
        self.stats.plain_steps += steps
        if self.fixed is None and self.times.table:  # a pinned tree size never explores
            self._aside_seconds[batch] = self._aside_seconds.get(batch, 0.0) + steps * self.times.plain_estimate(batch)

    def record(self, tree: Tree, accepted: Accepted) -> None:
        """One row's verification: acceptance estimates and the per-head metrics."""
        self.acceptance.record(tree, accepted)
        self._since_reorder += 1
        if self.fixed is None and self._since_reorder >= self.REORDER_EVERY:
            self._reorder()
            self._since_reorder = 0
        stats = self.stats
        stats.verified_rows += 1
        stats.accepted_tokens += len(accepted.nodes)
        # Head h was tried when the path reached depth h and that node has guesses below it.
        for head in range(tree.depth):
            parent = 0 if head == 0 else accepted.nodes[head - 1] if head <= len(accepted.nodes) else None
            if parent is None or not tree.children[parent]:
                break
            stats.head_tried[head] += 1
            stats.head_accepted[head] += len(accepted.nodes) > head


def calibrate(engine, tree: Tree, max_batch: int, run_steps: int = 1, repeats: int = 3) -> StepTimes:
    """Times verification steps of B rows × (1 + n) tokens into the still-free slots at load,
    and with ``run_steps`` > 1 a greedy run of that many plain steps per B.

    The steps are shaped as real ones: n = 0 is a plain decode (logits at one row), n > 0 a
    tree prefix with logits at every node and the heads' (at every node on the rank graph, at
    the greedy path's end on the CPU verification graph), which is what makes them cost.
    Each shape runs twice to warm up, then ``repeats`` times back to back (as a serving loop
    repeats a shape); their median counts, and decode steps and runs refine it as they run."""
    from ..core.step import Step, StepKind

    batches = sorted({*(b for b in (1, 2, 4, 8, 16, 32, 64) if b <= max_batch), max_batch})
    sizes = sorted({*(n for n in (0, 1, 2, 4, 8, 16, 32, 64, 128) if n < tree.size), tree.size - 1})
    steps = {(batch, n): Step(kind=StepKind.decode, first_slot=0,
                              rids=tuple(f"calibrate-{i}" for i in range(batch)),
                              tokens=((0,) * (1 + n),) * batch, starts=(0,) * batch, samples=(True,) * batch,
                              trees=(tree.prefix(n),) * batch if n else ())
             for batch in batches for n in sizes}
    for _ in range(8):  # the process's first steps run cold (allocations, thread pool start)
        engine.step(steps[(1, 0)])
    times = StepTimes()
    for (batch, n), step in steps.items():
        for run in range(2 + repeats):
            start = time.perf_counter()
            engine.step(step)
            if run >= 2:  # each repeat counts: one slow step later moves the median less
                times.observe(batch, 1 + n, time.perf_counter() - start)
    if run_steps > 1:
        for batch in batches:
            for _ in range(2 + repeats):
                run = engine.greedy_run(steps[(batch, 0)])
                start = time.perf_counter()
                for _ in range(run_steps):
                    run.advance()
                times.observe_run(batch, run_steps, time.perf_counter() - start)
    return times


def policy_for(engine_dir: "EngineDir", engine: "Engine", fixed: int | None, multi_step: int
               ) -> SpeculationPolicy | None:
    """The Medusa policy for engine dirs with heads: a pinned tree size, or adaptive from step
    times calibrated on ``engine`` (plain decoding as ``multi_step`` runs) and the heads'
    held-out acceptance."""
    medusa = engine_dir.medusa
    if medusa is None:
        if fixed:
            raise ValueError(f"medusa_tree_size {fixed}: {engine_dir.path} was built without Medusa heads")
        return None
    tree = Tree(tuple(tuple(path) for path in medusa["tree"]))
    acceptance = AcceptanceModel(medusa["rank_accuracy"])
    if fixed is not None:
        return SpeculationPolicy(tree, acceptance, StepTimes(), fixed)
    times = calibrate(engine, tree, engine_dir.max_batch_size, multi_step)
    return SpeculationPolicy(tree, acceptance, times)

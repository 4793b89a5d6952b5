"""Step seconds by (rows, tokens per row) for the speculation policy: calibrated at load
(``calibrate``) and refined from every decode step and greedy run while serving."""
from __future__ import annotations

import statistics
import time
from collections import deque

import numpy as np

from .medusa import Tree

RECENT = 15           # step times kept per (B, S): the median of these is the estimate


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


def calibrate(engine, tree: Tree, max_batch: int, run_steps: int = 1, repeats: int = 3) -> StepTimes:
    """Times verification steps of B rows × (1 + n) tokens into the still-free slots at load,
    and with ``run_steps`` > 1 a greedy run of that many plain steps per B.

    The steps are shaped as real ones: n = 0 is a plain decode (logits at one row), n > 0 a
    tree prefix with logits at every node and the heads' (at every node on the rank graph, at
    the greedy path's end on the CPU verification graph), which is what makes them cost.
    Each shape runs once to warm up, then ``repeats`` times back to back (as a serving loop
    repeats a shape); their median counts, and decode steps and runs refine it as they run."""
    from ..core.step import Step, StepKind

    # Powers of four, and the ends: times are interpolated between points, and each point costs
    # load time (a real model's batch-8 verification of 17 tokens takes ~0.3 s on 2 cores).
    batches = sorted({*(b for b in (1, 4, 16, 64) if b <= max_batch), max_batch})
    sizes = sorted({*(n for n in (0, 1, 4, 16, 64) if n < tree.size), tree.size - 1})
    steps = {(batch, n): Step(kind=StepKind.decode, first_slot=0,
                              rids=tuple(f"calibrate-{i}" for i in range(batch)),
                              tokens=((0,) * (1 + n),) * batch, starts=(0,) * batch, samples=(True,) * batch,
                              trees=(tree.prefix(n),) * batch if n else ())
             for batch in batches for n in sizes}
    for _ in range(8):  # the process's first steps run cold (allocations, thread pool start)
        engine.step(steps[(1, 0)])
    times = StepTimes()
    for (batch, n), step in steps.items():
        for run in range(1 + repeats):
            start = time.perf_counter()
            engine.step(step)
            if run >= 1:  # each repeat counts: one slow step later moves the median less
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

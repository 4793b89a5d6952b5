"""Step seconds by (rows, tokens per row, cached context) for the speculation policy: calibrated
at load (``calibrate``) and refined from every decode step and greedy run while serving.

A step's time grows with the context its rows attend to: on SmolLM2-135M float32 (2 CPU cores) a
batch-8 verification of 5 tokens a row takes 80 ms after 20 cached tokens and 112 ms after 300, a
plain batch-8 step 37 and 44 ms (benchmarks/cpu_verify_rows.py). Calibration at an empty cache
alone made the policy's estimates a third short at real contexts, and refining them from steps
at those contexts left some (B, S) points at one context and some at another: interpolated
between, a verification of 3 tokens read dearer than one of 4. So a step's time is held as
t(B, S) + c · (pairs of new token and cached position its attention reads): t in the table at an
empty cache, c per kind of step (plain or verifying) calibrated at load from the same steps after
CONTEXT_PROBE cached tokens; every observed step is brought back to an empty cache before it
refines the table, and every estimate adds its own context's term."""
from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..core.step import Step, StepKind
from ..core.tree import Tree

RECENT = 15           # step times kept per (B, S): the median of these is the estimate
CONTEXT_PROBE = 1024  # cached tokens the context calibration steps attend to (fewer where S_max is short)
CONTEXT_PROBE_SEQ = 5  # tokens a row of the verifying context calibration step


@dataclass(frozen=True)
class Context:
    """What a decode batch's rows have cached before a step: the sum and the longest."""
    total: int = 0
    longest: int = 0

    @classmethod
    def of(cls, cached: Sequence[int]) -> "Context":
        return cls(int(sum(cached)), int(max(cached, default=0)))

    def attended(self, batch: int, seq):
        """Pairs (new token, cached position) a step's attention reads: in a plain step each row
        its own length; in a verification every row from the longest (the CPU verification graph
        writes every row from one start, runtime/backends/onnxruntime/one_write_start.py).
        ``seq`` an int or an array of S."""
        return np.where(np.asarray(seq) > 1, np.asarray(seq) * batch * (self.longest + np.asarray(seq)),
                        self.total + batch)


EMPTY = Context()


class StepTimes:
    """Step seconds by (rows B, tokens per row S) at an empty cache: the engine's, interpolated
    between measured points, plus the context's term (``per_attended``: seconds per attended pair,
    plain and verifying) and the host's per-row work around it (acceptance, drafting, K/V moves),
    which for a verification is several times a plain step's and matters when steps take ~ms."""

    def __init__(self):
        self.table: dict[int, dict[int, float]] = {}
        self._recent: dict[tuple[int, int], deque] = {}
        self._host_per_row: dict[bool, deque] = {False: deque([0.0], maxlen=RECENT),
                                                 True: deque([0.0], maxlen=RECENT)}
        self.per_attended: dict[bool, float] = {False: 0.0, True: 0.0}  # by "verifies" (S > 1)
        self.runs: dict[int, float] = {}   # batch → seconds per step of a greedy run, host work included
        self._recent_runs: dict[int, deque] = {}

    def context_seconds(self, batch: int, seq, context: Context):
        """The context's part of a step's time (an array for an array of S)."""
        seq = np.asarray(seq)
        return np.where(seq > 1, self.per_attended[True], self.per_attended[False]) * context.attended(batch, seq)

    def observe(self, batch: int, seq: int, seconds: float, loop_seconds: float | None = None,
                context: Context = EMPTY) -> None:
        """Medians of recent steps: robust to the odd slow step (GC, the OS) on a busy host. The
        step's context term comes off first: the table holds times at an empty cache."""
        empty = max(0.0, seconds - float(self.context_seconds(batch, seq, context)))
        if batch not in self.table and self.table:
            # A batch size first met while serving (calibration measures powers of four): its other
            # S read from the neighbouring sizes, not scaled from this one point (a 16-token
            # verification of 7 rows made a plain step of 7 rows read 190 ms).
            seqs = sorted({s for row in self.table.values() for s in row})
            self.table[batch] = {s: self.engine_estimate(batch, s) for s in seqs}
        recent = self._recent.setdefault((batch, seq), deque(maxlen=RECENT))
        recent.append(empty)
        self.table.setdefault(batch, {})[seq] = statistics.median(recent)  # (np.median: ~20× slower on 15 floats)
        if loop_seconds is not None:
            self._host_per_row[seq > 1].append(max(0.0, loop_seconds - seconds) / batch)

    def observe_run(self, batch: int, steps: int, seconds: float, context: Context = EMPTY) -> None:
        """A multi-step greedy run of ``steps`` steps from ``context`` that took ``seconds``, its
        commit included (each step attends to one more token a row than the one before)."""
        mean = Context(context.total + batch * (steps - 1) // 2, context.longest + (steps - 1) // 2)
        per_step = max(0.0, seconds / steps - float(self.context_seconds(batch, 1, mean)))
        recent = self._recent_runs.setdefault(batch, deque(maxlen=RECENT))
        recent.append(per_step)
        self.runs[batch] = statistics.median(recent)

    def estimate(self, batch: int, seq: int, context: Context = EMPTY) -> float:
        return (self.engine_estimate(batch, seq) + float(self.context_seconds(batch, seq, context))
                + batch * statistics.median(self._host_per_row[seq > 1]))

    def estimates(self, batch: int, seqs: np.ndarray, context: Context = EMPTY) -> np.ndarray:
        """``estimate(batch, s, context)`` for every s in ``seqs`` at once: the policy weighs every
        tree size each time it decides, which one at a time cost ~10 ms, a run's worth of steps."""
        if not self.table:
            raise ValueError("no step times measured")
        engine = _along_batch({b: self._along_seq_many(b, seqs) for b in self.table}, batch)
        host = np.where(seqs > 1, statistics.median(self._host_per_row[True]),
                        statistics.median(self._host_per_row[False]))
        return engine + self.context_seconds(batch, seqs, context) + batch * host

    def _along_seq_many(self, batch: int, seqs: np.ndarray) -> np.ndarray:
        points = sorted(self.table[batch].items())
        xs, ys = np.array([p[0] for p in points], float), np.array([p[1] for p in points])
        if len(xs) == 1:
            return ys[0] * np.maximum(1.0, seqs / xs[0])
        slope = max((ys[-1] - ys[-2]) / (xs[-1] - xs[-2]), 0.0)  # beyond the last point: its slope
        return np.where(seqs >= xs[-1], ys[-1] + slope * (seqs - xs[-1]), np.interp(seqs, xs, ys))

    def plain_estimate(self, batch: int, context: Context = EMPTY) -> float:
        """Seconds per token-step of plain decoding: a greedy run's step where runs were measured
        (the cheaper of it and a single step), else a single plain step."""
        single = self.estimate(batch, 1, context)
        if not self.runs:
            return single
        return min(single, _along_batch(self.runs, batch) + float(self.context_seconds(batch, 1, context)))

    def engine_estimate(self, batch: int, seq: int) -> float:
        """The engine's seconds for a step at an empty cache."""
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


def calibrate(engine, tree: Tree, max_batch: int, max_seq_len: int, run_steps: int = 1,
              repeats: int = 3) -> StepTimes:
    """Times verification steps of B rows × (1 + n) tokens into the still-free slots at load,
    and with ``run_steps`` > 1 a greedy run of that many plain steps per B; first the context's
    cost: a plain step and a verification of the widest batch, at an empty cache and after
    CONTEXT_PROBE cached tokens a row (at most what ``max_seq_len`` leaves).

    The steps are shaped as real ones: n = 0 is a plain decode (logits at one row), n > 0 a
    tree prefix with logits at every node and the heads' (at every node on the rank graph, at
    the greedy path's end on the CPU verification graph), which is what makes them cost.
    Each shape runs once to warm up, then ``repeats`` times back to back (as a serving loop
    repeats a shape); their median counts, and decode steps and runs refine it as they run."""
    def step(batch: int, n: int, start: int = 0) -> Step:
        return Step(kind=StepKind.decode, first_slot=0, rids=tuple(f"calibrate-{i}" for i in range(batch)),
                    tokens=((0,) * (1 + n),) * batch, starts=(start,) * batch, samples=(True,) * batch,
                    trees=(tree.prefix(n),) * batch if n else ())

    def timed(s: Step) -> list[float]:
        """Seconds of each of ``repeats`` runs of ``s``, after one to warm up."""
        engine.step(s)
        seconds = []
        for _ in range(repeats):
            begin = time.perf_counter()
            engine.step(s)
            seconds.append(time.perf_counter() - begin)
        return seconds

    # Powers of four, and the ends: times are interpolated between points, and each point costs
    # load time (a real model's batch-8 verification of 17 tokens takes ~0.3 s on 2 cores).
    batches = sorted({*(b for b in (1, 4, 16, 64) if b <= max_batch), max_batch})
    sizes = sorted({*(n for n in (0, 1, 4, 16, 64) if n < tree.size), tree.size - 1})
    for _ in range(8):  # the process's first steps run cold (allocations, thread pool start)
        engine.step(step(1, 0))
    times = StepTimes()
    widest, probe_n = batches[-1], min(CONTEXT_PROBE_SEQ, tree.size) - 1
    for n in sorted({0, probe_n}):
        far = min(CONTEXT_PROBE, max_seq_len - 1 - n)
        if far <= 0:
            continue
        near_step, far_step = step(widest, n), step(widest, n, far)
        extra = (Context.of(far_step.starts).attended(widest, 1 + n)
                 - Context.of(near_step.starts).attended(widest, 1 + n))
        far_seconds, near_seconds = statistics.median(timed(far_step)), statistics.median(timed(near_step))
        times.per_attended[n > 0] = max(0.0, (far_seconds - near_seconds) / float(extra))
    for batch in batches:
        for n in sizes:
            s = step(batch, n)
            for seconds in timed(s):  # each repeat counts: one slow step later moves the median less
                times.observe(batch, 1 + n, seconds, context=Context.of(s.starts))
    if run_steps > 1:
        for batch in batches:
            for _ in range(2 + repeats):
                run = engine.greedy_run(step(batch, 0))
                start = time.perf_counter()
                for _ in range(run_steps):
                    run.advance()
                times.observe_run(batch, run_steps, time.perf_counter() - start)
    return times

"""Step times for the speculation policy: a step's cost at its context, calibrated and observed."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from trtbuild.runtime.speculation import step_times
from trtbuild.runtime.speculation.chain import chain_tree
from trtbuild.runtime.speculation.step_times import Context, StepTimes, calibrate

# A device whose step costs BASE + PER_TOKEN per new token of the step + the context's term:
# seconds per attended (new token, cached position) pair, plain and verifying.
BASE, PER_TOKEN = 0.010, 0.002
PER_ATTENDED = {False: 3e-6, True: 2e-6}


def _cost(batch: int, seq: int, context: Context) -> float:
    attended = float(context.attended(batch, seq))
    return BASE + PER_TOKEN * batch * seq + PER_ATTENDED[seq > 1] * attended


class _Clock:
    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


class _Device:
    """An engine whose steps take exactly ``_cost`` on ``clock``."""

    def __init__(self, clock: _Clock):
        self.clock, self.steps = clock, []

    def step(self, step):
        self.steps.append(step)
        self.clock.now += _cost(len(step.rids), step.seq_len, Context.of(step.starts))


def test_context_counts_each_rows_own_length_in_a_plain_step_and_the_longest_in_a_verification():
    context = Context.of([100, 40, 10])
    assert (context.total, context.longest) == (150, 100)
    assert context.attended(3, 1) == 153              # each row its cache and its new token
    assert context.attended(3, 5) == 5 * 3 * 105      # every row from the longest: one write start
    assert list(context.attended(3, np.array([1, 2]))) == [153, 2 * 3 * 102]


def test_calibration_measures_what_context_costs_and_estimates_every_step_at_its_own(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(step_times, "time", SimpleNamespace(perf_counter=clock.perf_counter))
    device = _Device(clock)
    times = calibrate(device, chain_tree(16), max_batch=8, max_seq_len=2048)

    assert times.per_attended[False] == pytest.approx(PER_ATTENDED[False])
    assert times.per_attended[True] == pytest.approx(PER_ATTENDED[True])
    probes = {(len(s.rids), s.seq_len, s.starts[0]) for s in device.steps if s.starts[0]}
    assert probes == {(8, 1, step_times.CONTEXT_PROBE), (8, 5, step_times.CONTEXT_PROBE)}
    # Calibrated at an empty cache, estimated at any context: exact for the measured points.
    for batch, seq in ((1, 1), (4, 5), (8, 17), (8, 2)):
        context = Context.of([300 + 7 * row for row in range(batch)])
        assert times.estimate(batch, seq, context) == pytest.approx(_cost(batch, seq, context))


def test_a_short_max_seq_len_probes_what_it_leaves(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(step_times, "time", SimpleNamespace(perf_counter=clock.perf_counter))
    device = _Device(clock)
    times = calibrate(device, chain_tree(4), max_batch=2, max_seq_len=64)
    assert max(s.starts[0] + s.seq_len for s in device.steps) == 64
    assert times.per_attended[True] == pytest.approx(PER_ATTENDED[True])


def test_steps_observed_at_long_contexts_refine_the_table_without_bending_it():
    """Observed at a long context, a 4-token verification used to enter the table as it was,
    beside points calibrated at an empty cache: interpolated, S = 4 then read dearer than S = 5.
    Its context term comes off first, so estimates stay monotone in S and match the device."""
    times = StepTimes()
    times.per_attended = dict(PER_ATTENDED)
    for seq in (1, 2, 5, 17):
        times.observe(8, seq, _cost(8, seq, Context()), context=Context())
    long = Context.of([600] * 8)
    times.observe(8, 4, _cost(8, 4, long), context=long)
    assert times.table[8][4] == pytest.approx(BASE + PER_TOKEN * 8 * 4)  # the attention's term taken off
    estimates = times.estimates(8, np.arange(1, 18), long)
    assert np.all(np.diff(estimates) > 0)
    assert estimates[3] == pytest.approx(_cost(8, 4, long))


def test_a_greedy_run_is_brought_back_to_an_empty_cache_too():
    times = StepTimes()
    times.per_attended = dict(PER_ATTENDED)
    times.observe(4, 1, _cost(4, 1, Context()))
    start = Context.of([500] * 4)
    steps = 8  # step i attends to 501 + i positions a row
    seconds = sum(_cost(4, 1, Context.of([500 + i] * 4)) for i in range(steps))
    times.observe_run(4, steps, seconds, start)
    assert times.runs[4] == pytest.approx(BASE + PER_TOKEN * 4, rel=1e-3)
    assert times.plain_estimate(4, start) == pytest.approx(_cost(4, 1, start), rel=1e-3)


def test_a_batch_size_first_met_while_serving_reads_its_other_steps_from_its_neighbours():
    times = StepTimes()
    for batch in (4, 8):
        for seq in (1, 5, 17):
            times.observe(batch, seq, _cost(batch, seq, Context()))
    times.observe(7, 17, _cost(7, 17, Context()))  # one 16-token verification of 7 rows
    between = times.engine_estimate(4, 1) + (times.engine_estimate(8, 1) - times.engine_estimate(4, 1)) * 3 / 4
    assert times.engine_estimate(7, 1) == pytest.approx(between)  # not the 17-token step's time
    assert times.engine_estimate(7, 17) == pytest.approx(_cost(7, 17, Context()))

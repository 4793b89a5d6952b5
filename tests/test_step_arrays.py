"""The engine step's host arrays: filled into reused buffers exactly as freshly built, without
allocations that grow with S_max (the CPU runtime fills one set per decode shape every step)."""
from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from trtbuild.contract.step import StepArrays, fill_step_arrays, step_arrays, step_shape
from trtbuild.runtime.medusa import Tree

TREE = Tree(((0,), (0, 0), (1,)))


@pytest.mark.parametrize("tokens, starts, trees", [
    ([[5], [7], [9]], [10, 3, 40], ()),                       # decode
    ([[1, 2, 3, 4], [5, 6]], [0, 8], ()),                     # prefill chunks of two lengths
    ([[4] * TREE.size, [8]], [12, 30], (TREE, None)),         # a verifying row beside a plain one
])
def test_filling_reused_buffers_equals_building_fresh_arrays(tokens, starts, trees):
    fresh = step_arrays(tokens, starts, 64, trees=trees)
    reused = StepArrays.empty(*step_shape(tokens, trees=trees), 64)
    fill_step_arrays(reused, [[99] * len(t) for t in tokens], [50] * len(tokens), 64, trees)  # stale contents
    fill_step_arrays(reused, tokens, starts, 64, trees)
    for name, value in fresh.as_dict().items():
        assert np.array_equal(reused.as_dict()[name], value), name


def test_a_decode_step_allocates_nothing_that_grows_with_the_cache():
    peaks = {}
    tracemalloc.start()
    try:
        for max_seq_len in (1024, 65536):
            out = StepArrays.empty(8, 1, 1, max_seq_len)
            fill_step_arrays(out, [[5]] * 8, list(range(8)), max_seq_len)  # the steady state: not the first step
            tracemalloc.reset_peak()
            before = tracemalloc.get_traced_memory()[0]
            fill_step_arrays(out, [[5]] * 8, list(range(100, 108)), max_seq_len)
            peaks[max_seq_len] = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    # A fresh [8, 1, 1, 65536] mask alone is 512 KiB; numpy's constant iterator buffer is below that.
    assert peaks[65536] < 64 * 1024 and peaks[1024] < 256 * 1024, peaks

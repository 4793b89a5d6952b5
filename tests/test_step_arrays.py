"""The engine step's host arrays: filled into reused buffers exactly as freshly built, without
allocations that grow with S_max (the CPU runtime fills one set per decode shape every step)."""
from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from trtbuild.contract.step import StepArrays, fill_step_arrays, step_arrays, step_shape
from trtbuild.runtime.core.tree import Tree

TREE = Tree(((0,), (0, 0), (1,)))


def _causal(slots: list[list[int]], max_seq_len: int = 64) -> np.ndarray:
    """[B, 1, S, S_max]: the token written at slots[b][s] sees cache positions 0..slots[b][s]."""
    return np.array([[[[p <= slot for p in range(max_seq_len)] for slot in row]] for row in slots])


def _expected(case: str) -> dict[str, np.ndarray]:
    if case == "decode":
        return dict(input_ids=[[5], [7], [9]], position_ids=[[10], [3], [40]], write_index=[10, 3, 40],
                    kv_length=[11, 4, 41], logits_index=[[0], [0], [0]], attention_mask=_causal([[10], [3], [40]]))
    if case == "prefill":  # the short row is right-padded; padding continues its positions
        return dict(input_ids=[[1, 2, 3, 4], [5, 6, 0, 0]], position_ids=[[0, 1, 2, 3], [8, 9, 10, 11]],
                    write_index=[0, 8], kv_length=[4, 10], logits_index=[[3], [1]],
                    attention_mask=_causal([[0, 1, 2, 3], [8, 9, 10, 11]]))
    # A verifying row: nodes at 12 + i, positions 12 + depth, each sees the cache before 12 and its ancestors.
    mask = _causal([[12, 13, 14, 15], [30, 31, 32, 33]])
    mask[0, 0, :, 12:16] = [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 1]]
    return dict(input_ids=[[4, 4, 4, 4], [8, 0, 0, 0]], position_ids=[[12, 13, 14, 13], [30, 31, 32, 33]],
                write_index=[12, 30], kv_length=[16, 31], logits_index=[[0, 1, 2, 3], [0, 1, 2, 3]],
                attention_mask=mask)


@pytest.mark.parametrize("case, tokens, starts, trees", [
    ("decode", [[5], [7], [9]], [10, 3, 40], ()),
    ("prefill", [[1, 2, 3, 4], [5, 6]], [0, 8], ()),                    # chunks of two lengths
    ("tree", [[4] * TREE.size, [8]], [12, 30], (TREE, None)),         # a verifying row beside a plain one
])
def test_step_arrays_hold_the_contract_values_fresh_and_refilled(case, tokens, starts, trees):
    expected = _expected(case)
    reused = StepArrays.empty(*step_shape(tokens, trees=trees), 64)
    fill_step_arrays(reused, [[99] * len(t) for t in tokens], [50] * len(tokens), 64, trees)  # stale contents
    fill_step_arrays(reused, tokens, starts, 64, trees)
    for arrays in (step_arrays(tokens, starts, 64, trees=trees), reused):
        for name, value in arrays.as_dict().items():
            assert value.tolist() == np.asarray(expected[name]).astype(value.dtype).tolist(), (case, name)


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

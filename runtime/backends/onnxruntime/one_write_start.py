"""Verifications of several rows on the CPU verification graph: every row writes from one start.

The verification graph folds a step's rows into GroupQueryAttention's heads (ONNX Runtime's CPU
kernel refuses S > 1 new tokens after a cached past for more than one row:
builder/passes/cpu_group_query_attention.py), and one row of heads has one filled length, so
every row's S new tokens are written at the step's largest write_index P. Before the run each
shorter row's mask moves its own columns [w, w + S) to [P, P + S) (its cache [0, w) stays
visible; positions, and so the rotary, are the row's own); after it, each such row's K/V moves
from [P, P + S) back to [w, w + S), so the pools hold what the rank graph would have written and
the scheduler's bookkeeping (KeepPath, prefix blocks) never sees the difference. Positions
[w + S, P + S) of a moved row held nothing live: they are past its filled length.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ....contract.step import StepArrays


@dataclass(frozen=True)
class Shifted:
    """Where a step's rows wrote: from ``start``, the rows ``rows`` (indices into the step) whose
    own write_index was ``own``."""
    start: int
    rows: np.ndarray   # int64 [n]
    own: np.ndarray    # int64 [n]


def write_from_one_start(arrays: StepArrays) -> Shifted:
    """``arrays`` (filled for the step as the rank graph takes it) rewritten so every row writes
    from the largest write_index, each row's mask columns shifted with its writes."""
    write, seq = arrays.write_index, arrays.input_ids.shape[1]
    start = int(write.max())
    rows = np.flatnonzero(write < start)
    own = write[rows].copy()
    for row, at in zip(rows, own):
        mask = arrays.attention_mask[row, 0]  # [S, S_max]
        tokens = mask[:, at:at + seq].copy()  # the row's own tokens: causal, or its tree's ancestors
        mask[:, at:at + seq] = False
        mask[:, start:start + seq] = tokens
    arrays.kv_length[rows] += start - own
    write[rows] = start
    return Shifted(start, rows, own)


def move_back(pools: dict[str, np.ndarray], first_slot: int, shifted: Shifted, seq: int) -> None:
    """Each shifted row's S written positions moved from the common start to its own (pools:
    [capacity, H_kv, S_max, D] each; the step's rows are slots first_slot + row)."""
    if not len(shifted.rows):
        return
    slots = (first_slot + shifted.rows)[:, None]                      # [n, 1]
    offsets = np.arange(seq)
    to, source = shifted.own[:, None] + offsets, shifted.start + offsets[None, :]  # [n, S], [1, S]
    for pool in pools.values():
        pool[slots, :, to] = pool[slots, :, source]  # [n, S, H_kv, D]; the gather copies first

"""The Engine protocol both backends satisfy, and the step-input arrays of the engine contract."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from .scheduler import Step


class Engine(Protocol):
    """Runs steps over contiguous KV slots it owns; everything above it is shared Python."""

    name: str

    def step(self, step: Step) -> np.ndarray:
        """Runs one step; returns float32 logits [B, V] for each row's last new token."""

    def copy_slot(self, src: int, dst: int) -> None: ...

    def save_block(self, slot: int, index: int, block: int) -> None: ...

    def load_block(self, block: int, slot: int, index: int) -> None: ...


@dataclass(frozen=True)
class StepArrays:
    """Host arrays of one step, shaped per the engine contract."""

    input_ids: np.ndarray       # int32 [B, S]
    position_ids: np.ndarray    # int32 [B, S]
    write_index: np.ndarray     # int64 [B]
    kv_length: np.ndarray       # int64 [B]
    attention_mask: np.ndarray  # bool [B, 1, S, S_max]
    logits_index: np.ndarray    # int64 [B, 1]

    def as_dict(self) -> dict[str, np.ndarray]:
        return dict(self.__dict__)


def step_arrays(step: Step, max_seq_len: int, pad_batch: int | None = None) -> StepArrays:
    """Right-padded arrays for ``step``; ``pad_batch`` adds dummy rows up to a CUDA-graph bucket.

    Padded tokens continue each row's positions; the scheduler guarantees their writes stay
    inside the cache. Dummy rows (decode only) write the last cache position of slots that
    are free or still prefilling, a position those slots cannot hold yet (a prompt plus its
    max_tokens fits in max_seq_len), so no live K/V is touched.
    """
    rows, seq = len(step.rids), step.seq_len
    batch = max(rows, pad_batch or rows)
    ids = np.zeros((batch, seq), np.int32)
    starts = np.full(batch, max_seq_len - seq, np.int64)
    lengths = np.full(batch, max_seq_len, np.int64)
    last = np.zeros((batch, 1), np.int64)
    for row, (tokens, start) in enumerate(zip(step.tokens, step.starts)):
        ids[row, : len(tokens)] = tokens
        starts[row], lengths[row], last[row, 0] = start, start + len(tokens), len(tokens) - 1
    positions = starts[:, None] + np.arange(seq)[None, :]  # [B, S]
    mask = np.arange(max_seq_len)[None, None, None, :] <= positions[:, None, :, None]  # [B, 1, S, S_max]
    return StepArrays(input_ids=ids, position_ids=positions.astype(np.int32), write_index=starts,
                      kv_length=lengths, attention_mask=mask, logits_index=last)

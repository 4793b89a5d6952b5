"""The Engine protocol both backends satisfy, and the step-input arrays of the engine contract."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from .scheduler import Step


@dataclass(frozen=True)
class StepOutput:
    """float32 logits [B, R, V] and, when the engine has Medusa heads, medusa [B, R, K, V].

    R = 1 (each row's last new token) for prefill and decode; R = S for verification."""

    logits: np.ndarray
    medusa: np.ndarray | None = None


class Engine(Protocol):
    """Runs steps over contiguous KV slots it owns; everything above it is shared Python."""

    name: str

    def step(self, step: Step) -> StepOutput: ...

    def copy_slot(self, src: int, dst: int) -> None: ...

    def keep_path(self, slot: int, start: int, nodes: tuple[int, ...]) -> None:
        """Moves cache positions start + nodes[i] to start + 1 + i in ``slot`` (in order: sources
        are never overwritten first, since nodes[i] ≥ i + 1)."""

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
    logits_index: np.ndarray    # int64 [B, R]: R = 1, or R = S when verifying

    def as_dict(self) -> dict[str, np.ndarray]:
        return dict(self.__dict__)


def step_arrays(step: Step, max_seq_len: int, pad_batch: int | None = None) -> StepArrays:
    """Right-padded arrays for ``step``; ``pad_batch`` adds dummy rows up to a CUDA-graph bucket.

    Padded tokens continue each row's positions; the scheduler guarantees their writes stay
    inside the cache. Dummy rows (decode only) write the last S cache positions of slots that
    are free or still prefilling, positions those slots cannot hold yet (a prompt plus its
    max_tokens fits in max_seq_len), so no live K/V is touched. A row verifying a Medusa tree
    writes its nodes in tree order at start + i, takes positions start + depth, and sees the
    cache before ``start`` plus its own ancestors.
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
    slots = starts[:, None] + np.arange(seq)[None, :]  # [B, S] where each token's K/V is written
    mask = np.arange(max_seq_len)[None, None, None, :] <= slots[:, None, :, None]  # [B, 1, S, S_max]
    positions = slots.copy()
    if step.verifies:
        for row, tree in enumerate(step.trees):
            if tree is None:
                continue
            start, size = starts[row], tree.size
            positions[row, :size] = start + tree.depths
            mask[row, 0, :size, start:start + size] = tree.ancestors
        last = np.broadcast_to(np.arange(seq, dtype=np.int64), (batch, seq)).copy()  # [B, S]
    return StepArrays(input_ids=ids, position_ids=positions.astype(np.int32), write_index=starts,
                      kv_length=lengths, attention_mask=mask, logits_index=last)

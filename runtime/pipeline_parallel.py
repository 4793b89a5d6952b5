"""Pipeline stages at run time: each rank's engine inside the T × P grid.

The ranks are the tensor-parallel engine's processes (runtime/tensor_parallel.py starts them,
broadcasts rank 0's commands and names a failed rank); this module adds what a stage does
around its step. Rank r = stage · T + tensor rank. A stage's tensor ranks run their
collectives over their stage's process group; the stages hand the residual stream on with
torch.distributed point-to-point (gloo on CPU): tensor rank t of stage s receives
``hidden_states`` [B, S, D] from tensor rank t of stage s − 1 (every tensor rank of a stage
ends with the same hidden states after its all-reduce) and sends its ``hidden_states_out`` to
tensor rank t of stage s + 1. Tensor rank 0 of the last stage sends the logits (and Medusa
logits) to rank 0, whose step returns them.

Each step runs the stages one after another (no micro-batches yet: while one stage works the
others wait, a bubble of (P − 1) / P of each rank's time).
"""
from __future__ import annotations

import time

import numpy as np

from ..contract.pipeline import HIDDEN_STATES_OUT
from ..contract.step import CACHE_DTYPES, LOGITS, MEDUSA_LOGITS
from .engine import StepOutput, step_arrays
from .engine_dir import EngineDir
from .scheduler import Step


def stage_groups(engine_dir: EngineDir):
    """Each stage's process group (every rank must create every group, in the same order);
    None for a single stage, whose tensor ranks use the whole world."""
    import torch.distributed as dist

    tensor, pipeline = engine_dir.tensor_parallel, engine_dir.pipeline_parallel
    if pipeline == 1:
        return [None]
    return [dist.new_group(list(range(stage * tensor, (stage + 1) * tensor))) for stage in range(pipeline)]


class StageRunner:
    """One rank's engine as a pipeline stage; the same Engine methods, the step wrapped in the
    stage's receive and send. Counts ``sent_bytes``, ``sends`` and ``wait_seconds`` (blocked in
    a receive) for benchmarks."""

    def __init__(self, engine, engine_dir: EngineDir, rank: int):
        self.engine, self.rank = engine, rank
        self.tensor, self.pipeline = engine_dir.tensor_parallel, engine_dir.pipeline_parallel
        self.stage, self.tensor_rank = divmod(rank, self.tensor)
        self.first, self.last = self.stage == 0, self.stage == self.pipeline - 1
        self.hidden_size, self.vocab_size = engine_dir.model["hidden_size"], engine_dir.vocab_size
        self.dtype = CACHE_DTYPES[engine_dir.dtype]
        self.max_seq_len = engine_dir.max_seq_len
        self.medusa_heads = engine_dir.medusa["num_heads"] if engine_dir.medusa else 0
        self.sent_bytes, self.sends, self.wait_seconds = 0, 0, 0.0

    def step(self, step: Step) -> StepOutput | None:
        """This stage's part of ``step``; on rank 0 the logits the last stage sent back."""
        arrays = step_arrays(step, self.max_seq_len)
        batch, seq = arrays.input_ids.shape
        rows = arrays.logits_index.shape[1]
        hidden = None
        if not self.first:
            hidden = self._recv((batch, seq, self.hidden_size), self.dtype, self.rank - self.tensor)
        outputs = self.engine.stage_step(step, hidden)
        if not self.last:
            self._send(outputs[HIDDEN_STATES_OUT], self.rank + self.tensor)
        elif self.tensor_rank == 0:
            self._send(outputs[LOGITS], 0)
            if self.medusa_heads:
                self._send(outputs[MEDUSA_LOGITS], 0)
        if self.rank != 0:
            return None
        source = (self.pipeline - 1) * self.tensor
        logits = self._recv((batch, rows, self.vocab_size), np.float32, source)  # [B, R, V]
        medusa = (self._recv((batch, rows, self.medusa_heads, self.vocab_size), np.float32, source)
                  if self.medusa_heads else None)                                # [B, R, K, V]
        return StepOutput(logits=logits, medusa=medusa)

    def _send(self, value: np.ndarray, dst: int) -> None:
        import torch
        import torch.distributed as dist

        dist.send(torch.from_numpy(np.ascontiguousarray(value)), dst=dst)
        self.sent_bytes += value.nbytes
        self.sends += 1

    def _recv(self, shape: tuple[int, ...], dtype, src: int) -> np.ndarray:
        import torch
        import torch.distributed as dist

        buffer = torch.from_numpy(np.empty(shape, dtype))
        start = time.perf_counter()
        dist.recv(buffer, src=src)
        self.wait_seconds += time.perf_counter() - start
        return buffer.numpy()

    def copy_slot(self, src: int, dst: int, length: int) -> None:
        self.engine.copy_slot(src, dst, length)

    def keep_path(self, slot: int, start: int, nodes: tuple[int, ...]) -> None:
        self.engine.keep_path(slot, start, nodes)

    def save_block(self, slot: int, index: int, block: int) -> None:
        self.engine.save_block(slot, index, block)

    def load_block(self, block: int, slot: int, index: int) -> None:
        self.engine.load_block(block, slot, index)

    def close(self) -> None:
        self.engine.close()

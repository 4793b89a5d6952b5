"""Pipeline stages at run time: each rank's engine inside the T × P grid.

The ranks are the tensor-parallel engine's processes (runtime/parallel/tensor_parallel.py starts them,
broadcasts rank 0's commands and names a failed rank); this module adds what a stage does
around its step. Rank r = stage · T + tensor rank. A stage's tensor ranks run their
collectives over their stage's process group; the stages hand the residual stream on with
torch.distributed point-to-point through a transport (runtime/parallel/transport.py: numpy over gloo
on CPU, device buffers over NCCL on GPUs): tensor rank t of stage s receives
``hidden_states`` [B, S, D] from tensor rank t of stage s − 1 (every tensor rank of a stage
ends with the same hidden states after its all-reduce) and sends its ``hidden_states_out`` to
tensor rank t of stage s + 1. Tensor rank 0 of the last stage sends the logits (and Medusa
logits) to rank 0, whose step returns them.

A step's rows split into micro-batches (up to ``micro_batches``, whole rows, each binding its
own slots): a stage sends micro-batch m on (without waiting for it to be received) and starts
on m + 1 while the next stage works on m, so the stages overlap. Rank 0 sends each micro-batch
in one batch (``batch_isend_irecv``) with its receives of that micro-batch's logits, so no send
waits behind a receive not yet posted (NCCL blocks a send over its buffer until its receive runs). With one micro-batch the
stages run one after another and each rank idles (P − 1) / P of a step.
"""
from __future__ import annotations

import time
from dataclasses import replace

import numpy as np

from ...contract.pipeline import HIDDEN_STATES_OUT
from ...contract.step import LOGITS, MEDUSA_LOGITS, step_shape
from ..core.engine import CacheOpsOfEngine, StepOutput
from ..engine_dir import EngineDir
from ..core.step import Step


def micro_batches(step: Step, count: int) -> list[Step]:
    """``step``'s rows in up to ``count`` contiguous runs, as even as whole rows allow (the first
    runs take one more); each binds its own slots."""
    rows = len(step.rids)
    count = max(1, min(count, rows))
    per, extra = divmod(rows, count)
    parts, start = [], 0
    for index in range(count):
        size = per + (1 if index < extra else 0)
        cut = slice(start, start + size)
        parts.append(replace(step, first_slot=step.first_slot + start, rids=step.rids[cut], tokens=step.tokens[cut],
                             starts=step.starts[cut], samples=step.samples[cut],
                             trees=step.trees[cut] if step.trees else (),
                             block_tables=step.block_tables[cut] if step.block_tables else ()))
        start += size
    return parts


def stage_groups(engine_dir: EngineDir):
    """Each stage's process group (every rank must create every group, in the same order);
    None for a single stage, whose tensor ranks use the whole world."""
    import torch.distributed as dist

    tensor, pipeline = engine_dir.tensor_parallel, engine_dir.pipeline_parallel
    if pipeline == 1:
        return [None]
    return [dist.new_group(list(range(stage * tensor, (stage + 1) * tensor))) for stage in range(pipeline)]


class StageRunner(CacheOpsOfEngine):
    """One rank's engine as a pipeline stage; the same Engine methods, the step wrapped in the
    stage's receives and sends. ``engine`` has ``stage_input`` (where a micro-batch's hidden states
    land) and ``stage_step``; ``transport`` moves what they hold (runtime/parallel/transport.py). Counts
    ``sent_bytes``, ``sends`` and ``wait_seconds`` (in a receive: on rank 0, waiting for the last
    stage's logits; a device transport's receives make its stream wait, not the host) for benchmarks."""

    def __init__(self, engine, engine_dir: EngineDir, rank: int, micro_batches: int, transport):
        self.engine, self.rank, self.micro_batches, self.transport = engine, rank, micro_batches, transport
        self.tensor, self.pipeline = engine_dir.tensor_parallel, engine_dir.pipeline_parallel
        self.stage, self.tensor_rank = divmod(rank, self.tensor)
        self.first, self.last = self.stage == 0, self.stage == self.pipeline - 1
        self.vocab_size = engine_dir.vocab_size
        self.medusa_heads = engine_dir.medusa["num_heads"] if engine_dir.medusa else 0
        self.sent_bytes, self.sends, self.wait_seconds = 0, 0, 0.0

    def step(self, step: Step) -> StepOutput | None:
        """This stage's part of ``step``, micro-batch by micro-batch; on rank 0 the logits the last
        stage sent back, the micro-batches' rows in order."""
        parts = micro_batches(step, self.micro_batches)
        shapes = [step_shape(part.tokens, trees=part.trees) for part in parts]  # each part's (B, S, R)
        receiving, pending = [], []  # rank 0's posted receives of logits; sends in flight (each keeps its buffer)
        for part, (b, _, r) in zip(parts, shapes):
            hidden = None
            if not self.first:
                hidden = self.engine.stage_input(part)  # [B, S, D]
                self._recv_into(hidden, self.rank - self.tensor)
            outputs = self.engine.stage_step(part, hidden)
            if self.rank == 0 and not self.last:
                # One batch of this micro-batch's send and its logits receives: NCCL runs a batch's
                # ops together, so the last stage's logits (over NCCL's buffer they wait for their
                # receive) never wait behind rank 0's next send on the same pair.
                wanted = [(b, r, self.vocab_size)] + ([(b, 1, self.medusa_heads, self.vocab_size)]
                                                      if self.medusa_heads else [])
                sending, posted = self.transport.send_and_receive(outputs[HIDDEN_STATES_OUT], self.rank + self.tensor,
                                                                  wanted, np.float32, (self.pipeline - 1) * self.tensor)
                pending.append(self._count(sending, outputs[HIDDEN_STATES_OUT]))
                receiving += posted
            elif not self.last:
                pending.append(self._send(outputs[HIDDEN_STATES_OUT], self.rank + self.tensor))
            elif self.tensor_rank == 0:
                pending.append(self._send(outputs[LOGITS], 0))
                if self.medusa_heads:
                    pending.append(self._send(outputs[MEDUSA_LOGITS], 0))
        result = self._gather_logits(shapes, receiving) if self.rank == 0 else None
        for sending in pending:
            sending.wait()
        return result

    def _gather_logits(self, shapes: list[tuple[int, int, int]], receiving: list) -> StepOutput:
        """Rank 0: each micro-batch's logits from the last stage, into one [B, R, V] (a micro-batch
        with fewer rows R, as a verification step of shorter trees, fills its first R)."""
        rows, batch = max(r for _, _, r in shapes), sum(b for b, _, _ in shapes)
        logits = np.zeros((batch, rows, self.vocab_size), np.float32)                    # [B, R, V]
        medusa = (np.zeros((batch, 1, self.medusa_heads, self.vocab_size), np.float32)  # [B, 1, K, V]
                  if self.medusa_heads else None)
        received = iter(receiving)
        start = 0
        for b, _, r in shapes:
            logits[start:start + b, :r] = self._wait(next(received))
            if medusa is not None:
                medusa[start:start + b] = self._wait(next(received))   # [b, 1, K, V]
            start += b
        return StepOutput(logits=logits, medusa=medusa)

    def _send(self, value, dst: int):
        """Starts sending ``value``; the returned sending keeps its buffer until it is done."""
        return self._count(self.transport.send(value, dst), value)

    def _count(self, sending, value):
        self.sent_bytes += value.nbytes
        self.sends += 1
        return sending

    def _recv_into(self, value, src: int) -> None:
        start = time.perf_counter()
        self.transport.recv_into(value, src)
        self.wait_seconds += time.perf_counter() - start

    def _wait(self, receiving) -> np.ndarray:
        start = time.perf_counter()
        out = receiving.wait()
        self.wait_seconds += time.perf_counter() - start
        return out

    def close(self) -> None:
        self.engine.close()

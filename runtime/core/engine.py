"""The Engine protocol both backends satisfy; a scheduler step as the contract's arrays."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np

from ...contract.step import PagedStepArrays, StepArrays
from ...contract.step import paged_step_arrays as contract_paged_step_arrays
from ...contract.step import step_arrays as contract_step_arrays
from .step import Step


@dataclass(frozen=True)
class StepOutput:
    """float32 logits [B, R, V] and, when the engine has Medusa heads, medusa [B, 1, K, V].

    R = 1 (each row's last new token) for prefill and decode; R = S for verification. The heads
    ran at one node a row, the end of the path greedy acceptance keeps (builder/passes/
    heads_at_path_end; node 0 where R = 1). With a draft head (the manifest's ``draft_head``),
    draft_features [B, S, D] float32: the draft's features (contract/draft_head.py DRAFT_FEATURES)
    at every new position of the step's rows (each prefill token, each verified node), None
    without one. The arrays are valid until the engine's next call (a backend may reuse its output
    buffers)."""

    logits: np.ndarray
    medusa: np.ndarray | None = None
    draft_features: np.ndarray | None = None


class Engine(Protocol):
    """Runs steps over the KV it owns (a slot per row, or a paged engine's pool of blocks:
    PagedEngine); everything above it is shared Python."""

    name: str

    def step(self, step: Step) -> StepOutput: ...

    def greedy_run(self, step: Step) -> "GreedyRun":
        """Plain decode steps from ``step`` (one token a row, no tree), run back to back, each
        row fed the argmax of its previous step's logits (the LLM's multi-step decoding)."""

    def copy_slot(self, src: int, dst: int, length: int) -> None:
        """Copies cache positions [0, length) of slot ``src`` into slot ``dst``."""

    def keep_path(self, slot: int, start: int, nodes: tuple[int, ...]) -> None:
        """Moves cache positions start + nodes[i] to start + 1 + i in ``slot`` (in order: sources
        are never overwritten first, since nodes[i] ≥ i + 1)."""

    def save_block(self, slot: int, index: int, block: int) -> None: ...

    def load_block(self, block: int, slot: int, index: int) -> None: ...

    def discard(self, slots: tuple[int, ...], blocks: tuple[int, ...]) -> None:
        """Those slots and prefix blocks hold nothing now: return their memory where the pools
        can (demand-paged host pools), else nothing."""

    def close(self) -> None:
        """Releases what the engine holds beyond Python objects (device memory, rank processes)."""


class PagedEngine(Engine, Protocol):
    """An Engine whose K/V lives in one pool of the KV budget's blocks, read and written through
    each step's block tables (``Step.block_tables``), not in a slot per row: the scheduler runs
    paged for it: prefix blocks are shared by reference (nothing copied), and of the slot moves
    only an accepted path's remains, within the row's blocks."""

    def keep_path_in_blocks(self, blocks: tuple[int, ...], start: int, nodes: tuple[int, ...]) -> None:
        """``keep_path`` for a row whose position p lives in blocks[p // block_size]."""


class GreedyRun(Protocol):
    """Plain greedy decode steps back to back. ``features``: after each ``advance()``, the step's
    draft features [B, 1, D] float32 (the position it consumed, each row's), valid until the next
    advance; None where the engine has no draft head."""

    features: np.ndarray | None

    def advance(self) -> list[int]:
        """Runs the next step; each row's argmax token."""


class StepwiseGreedyRun:
    """A GreedyRun through ``Engine.step``, one scheduler-shaped Step at a time: for engines
    whose step already keeps the host out of the way (TensorRT's CUDA graphs, tensor-parallel
    ranks); the CPU engine feeds its reused binding instead (runtime/backends/onnxruntime/engine.py)."""

    def __init__(self, engine: Engine, step: Step):
        self.engine, self.step = engine, step
        self.features: np.ndarray | None = None

    def advance(self) -> list[int]:
        output = self.engine.step(self.step)
        logits, self.features = output.logits, output.draft_features  # [B, 1, V], [B, 1, D]
        tokens = logits[:, 0].argmax(axis=-1).tolist()
        step = self.step
        self.step = replace(step, tokens=tuple((t,) for t in tokens), starts=tuple(s + 1 for s in step.starts))
        return tokens


class CacheOpsOfEngine:
    """For a wrapper around one rank's Engine (``self.engine``): the KV-cache operations are the
    engine's own."""

    engine: Engine

    def copy_slot(self, src: int, dst: int, length: int) -> None:
        self.engine.copy_slot(src, dst, length)

    def keep_path(self, slot: int, start: int, nodes: tuple[int, ...]) -> None:
        self.engine.keep_path(slot, start, nodes)

    def save_block(self, slot: int, index: int, block: int) -> None:
        self.engine.save_block(slot, index, block)

    def load_block(self, block: int, slot: int, index: int) -> None:
        self.engine.load_block(block, slot, index)

    def discard(self, slots: tuple[int, ...], blocks: tuple[int, ...]) -> None:
        self.engine.discard(slots, blocks)

    def keep_path_in_blocks(self, blocks: tuple[int, ...], start: int, nodes: tuple[int, ...]) -> None:
        self.engine.keep_path_in_blocks(blocks, start, nodes)


def step_arrays(step: Step, max_seq_len: int, pad_batch: int | None = None) -> StepArrays:
    """The contract's arrays for a scheduler step (``pad_batch``: a CUDA-graph bucket)."""
    return contract_step_arrays(step.tokens, step.starts, max_seq_len, pad_batch=pad_batch, trees=step.trees)


def paged_step_arrays(step: Step, block_size: int, width: int, pad_batch: int | None = None) -> PagedStepArrays:
    """The contract's arrays of a scheduler step for a paged engine, its table ``width`` blocks wide
    (a step without tables, a timing step, writes the scratch block)."""
    tables = step.block_tables or ((),) * len(step.rids)
    return contract_paged_step_arrays(tables, step.starts, step.tokens, block_size, width,
                                      pad_batch=pad_batch, trees=step.trees)

"""The engine step's I/O: names, dtypes, shapes, and the host arrays of one step.

inputs  ``input_ids``/``position_ids`` int32 [B, S], ``write_index``/``kv_length`` int64 [B],
        ``attention_mask`` bool [B, 1, S, S_max], ``logits_index`` int64 [B, R],
        ``past_{key,value}_{l}`` [B, H_kv, S_max, D] (updated in place)
outputs ``logits`` float32 [B, R, V], ``medusa_logits`` [B, 1, K, V] with heads (at each row's
        greedy path end: the deepest logits row whose token and ancestors' tokens are each
        their parent's argmax, parents from the mask; builder/passes/heads_at_path_end),
        ``present_{key,value}_{l}`` (the same buffers as the past caches)

A paged TensorRT engine (manifest ``kv_cache.layout: paged``) takes ``block_table``/``kv_slots``
instead of ``write_index``, pools [N, block_size, H_kv, D] as its caches and a mask over the
table's M·block_size positions (PAGED_INPUTS below; ``paged_step_arrays`` makes a step's arrays).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Protocol, Sequence

import numpy as np

from .dtypes import CPU_DTYPES, NUMPY_DTYPES

INPUT_NAMES = ("input_ids", "position_ids", "write_index", "kv_length", "attention_mask", "logits_index")
LOGITS, MEDUSA_LOGITS = "logits", "medusa_logits"
# Each input's element kind ("float": the model's dtype) and dims: B batch, S new tokens,
# R logits rows (dynamic); S_max, H_kv (per rank), D fixed by the model and spec. "past" is
# every past_{key,value}_{l}.
STEP_INPUTS: dict[str, tuple[str, tuple[str | int, ...]]] = {
    "input_ids": ("int32", ("B", "S")),
    "position_ids": ("int32", ("B", "S")),
    "write_index": ("int64", ("B",)),
    "kv_length": ("int64", ("B",)),
    "attention_mask": ("bool", ("B", 1, "S", "S_max")),
    "logits_index": ("int64", ("B", "R")),
    "past": ("float", ("B", "H_kv", "S_max", "D")),
}
CACHE_DTYPES = {name: NUMPY_DTYPES[name] for name in CPU_DTYPES}  # what ONNX Runtime runs on CPU

# The paged TensorRT step (manifest ``kv_cache.layout: paged``; builder/passes/page_kv_cache.py
# rewrites the rank graph into it for the engine): each past_{key,value}_{l} is one pool of blocks
# [N, block_size, H_kv, D] shared by every row, updated in place, and the step takes two more inputs
# instead of write_index. Pool block 0 is the scratch block: padding rows and positions past a row's
# blocks write there, and unused block-table entries point at it (nobody reads it unmasked).
BLOCK_TABLE = "block_table"  # int32 [B, M]: row b's blocks in order; position p is in block table[b, p // bs]
KV_SLOTS = "kv_slots"        # int64 [B, S, 2]: (block, offset in it) where each new token's K/V goes
PAGED_INPUTS: dict[str, tuple[str, tuple[str | int, ...]]] = {
    BLOCK_TABLE: ("int32", ("B", "M")),
    KV_SLOTS: ("int64", ("B", "S", 2)),
    "pool": ("float", ("N", "block_size", "H_kv", "D")),
}
SCRATCH_BLOCK = 0

# rankN.cpu.onnx (the CPU step model) takes the step's inputs plus PLAIN_DECODE, a bool scalar:
# true runs the CPU decode graph (plain decode steps, one token a row), false the rank graph or,
# where the model has TREE_VERIFY (built with any draft source), the CPU verification graph when
# that is true (a verification of up to VERIFY_ROWS rows, the caches bound with their rows folded
# into heads). Its outputs add NEXT_INPUTS: the next greedy decode
# step's inputs, as a plain decode step leaves them. Built with Medusa heads, it also takes
# DRAFT_HEADS: false skips the heads in a plain decode step (their logits come back as zeros), for
# steps whose heads nobody reads (a multi-step greedy run); every other step ignores it.
PLAIN_DECODE = "plain_decode"
TREE_VERIFY = "tree_verify"
DRAFT_HEADS = "draft_heads"
# The step model's metadata key for the most rows its verification graph verifies at once (it takes
# each step's caches as [1, B·H_kv, S_max, D]: builder/passes/cpu_group_query_attention.py).
VERIFY_ROWS = "cpu_verify_rows"
NEXT_INPUTS = {"input_ids": "next_input_ids", "write_index": "next_write_index", "kv_length": "next_kv_length"}
# The step inputs the CPU decode graph reads besides the caches: a plain decode step fills only these.
DECODE_READS = ("input_ids", "write_index", "kv_length")


def cache_names(num_layers: int) -> list[str]:
    """``key_0, value_0, key_1, …``: prefix with ``past_``/``present_`` for the graph's names."""
    return [f"{kind}_{layer}" for layer in range(num_layers) for kind in ("key", "value")]


def io_cache_names(num_layers: int, prefix: str) -> list[str]:
    return [f"{prefix}_{name}" for name in cache_names(num_layers)]


@dataclass(frozen=True)
class CacheShape:
    """One slot of one layer's cache: [H_kv, S_max, D] (H_kv is per rank in a sharded engine)."""

    num_kv_heads: int
    max_seq_len: int
    head_dim: int

    @property
    def slot(self) -> tuple[int, int, int]:
        return (self.num_kv_heads, self.max_seq_len, self.head_dim)

    def zeros(self, batch: int, dtype) -> np.ndarray:
        return np.zeros((batch, *self.slot), dtype)  # [B, H_kv, S_max, D]


class TreeRows(Protocol):
    """A Medusa tree as a verification row needs it (runtime/core/tree.py's Tree satisfies this)."""

    size: int
    depths: np.ndarray     # [T] depth of each node (root 0)
    ancestors: np.ndarray  # bool [T, T]: node i sees node j


@dataclass(frozen=True)
class StepArrays:
    """Host arrays of one step, shaped per the engine contract."""

    input_ids: np.ndarray       # int32 [B, S]
    position_ids: np.ndarray    # int32 [B, S]
    write_index: np.ndarray     # int64 [B]
    kv_length: np.ndarray       # int64 [B]
    attention_mask: np.ndarray  # bool [B, 1, S, S_max]
    logits_index: np.ndarray    # int64 [B, R]

    def as_dict(self) -> dict[str, np.ndarray]:
        return dict(self.__dict__)


    @classmethod
    def empty(cls, batch: int, seq: int, rows: int, max_seq_len: int) -> "StepArrays":
        """Buffers of one step shape, to fill with ``fill_step_arrays`` (and reuse across steps)."""
        return cls(input_ids=np.zeros((batch, seq), np.int32), position_ids=np.zeros((batch, seq), np.int32),
                   write_index=np.zeros(batch, np.int64), kv_length=np.zeros(batch, np.int64),
                   attention_mask=np.zeros((batch, 1, seq, max_seq_len), np.bool_),
                   logits_index=np.zeros((batch, rows), np.int64))


@lru_cache(maxsize=8)
def _positions(max_seq_len: int) -> np.ndarray:
    positions = np.arange(max_seq_len)
    positions.flags.writeable = False
    return positions


def step_shape(tokens: Sequence[Sequence[int]], pad_batch: int | None = None,
               trees: Sequence[TreeRows | None] = (), all_logits: bool = False) -> tuple[int, int, int]:
    """(B, S, R) of a step: rows padded to ``pad_batch``, the longest row, logits rows."""
    rows, seq = len(tokens), max(len(t) for t in tokens)
    every = all_logits or any(tree is not None for tree in trees)
    return max(rows, pad_batch or rows), seq, seq if every else 1


def step_arrays(tokens: Sequence[Sequence[int]], starts: Sequence[int], max_seq_len: int,
                pad_batch: int | None = None, trees: Sequence[TreeRows | None] = (),
                all_logits: bool = False) -> StepArrays:
    """Right-padded arrays for rows of new ``tokens`` written from ``starts`` (tokens cached).

    Logits: each row's last real token (R = 1), or every position (R = S) with ``all_logits``
    or when a row verifies a tree. ``pad_batch`` adds dummy rows up to a CUDA-graph bucket:
    they write the last S cache positions of slots that are free or still prefilling, which
    no prompt can hold yet (a prompt plus its max_tokens fits in max_seq_len), so no live K/V
    is touched. Padded tokens continue each row's positions; the scheduler keeps their writes
    inside the cache. A row verifying a tree writes its nodes in tree order at start + i,
    takes positions start + depth, and sees the cache before ``start`` plus its ancestors.
    """
    out = StepArrays.empty(*step_shape(tokens, pad_batch, trees, all_logits), max_seq_len)
    return fill_step_arrays(out, tokens, starts, max_seq_len, trees)


def fill_step_arrays(out: StepArrays, tokens: Sequence[Sequence[int]], starts: Sequence[int], max_seq_len: int,
                     trees: Sequence[TreeRows | None] = ()) -> StepArrays:
    """``step_arrays`` written into ``out`` (shaped by ``step_shape``): no allocation that grows
    with S_max, so a runtime can keep one set of buffers per step shape."""
    batch, seq = out.input_ids.shape
    ids, write, lengths, last = out.input_ids, out.write_index, out.kv_length, out.logits_index
    ids.fill(0)
    write.fill(max_seq_len - seq)
    lengths.fill(max_seq_len)
    last.fill(0)
    for row, (row_tokens, start) in enumerate(zip(tokens, starts)):
        ids[row, : len(row_tokens)] = row_tokens
        write[row], lengths[row], last[row, 0] = start, start + len(row_tokens), len(row_tokens) - 1
    slots = write[:, None] + np.arange(seq)[None, :]  # [B, S] where each token's K/V is written
    # Causal: the token written at slots[b, s] sees cache positions ≤ it.
    np.less_equal(_positions(max_seq_len)[None, None, None, :], slots[:, None, :, None],
                  out=out.attention_mask)  # [B, 1, S, S_max]
    positions = out.position_ids
    positions[:] = slots
    for row, tree in enumerate(trees):
        if tree is not None:
            start, size = write[row], tree.size
            positions[row, :size] = start + tree.depths
            out.attention_mask[row, 0, :size, start:start + size] = tree.ancestors
    if last.shape[1] > 1:
        last[:] = np.arange(seq, dtype=np.int64)[None, :]  # [B, S]
    return out


@dataclass(frozen=True)
class PagedStepArrays:
    """Host arrays of one paged step: ``step`` as ``step_arrays`` makes them over the M·bs positions
    the block table covers (its write_index is not an input of the paged graph), the block table
    and each new token's (block, offset)."""

    step: StepArrays
    block_table: np.ndarray  # int32 [B, M]
    kv_slots: np.ndarray     # int64 [B, S, 2]

    def as_dict(self) -> dict[str, np.ndarray]:
        """The paged graph's step inputs (the pools aside)."""
        arrays = {name: value for name, value in self.step.as_dict().items() if name != "write_index"}
        return {**arrays, BLOCK_TABLE: self.block_table, KV_SLOTS: self.kv_slots}


def paged_step_arrays(blocks: Sequence[Sequence[int]], starts: Sequence[int], tokens: Sequence[Sequence[int]],
                      block_size: int, table_blocks: int, pad_batch: int | None = None,
                      trees: Sequence[TreeRows | None] = (), all_logits: bool = False) -> PagedStepArrays:
    """The arrays of a paged step whose row b holds KV-manager blocks ``blocks[b]`` (in position
    order; pool block = id + 1, pool block 0 being the scratch) and writes ``tokens[b]`` from
    ``starts[b]``. The table is ``table_blocks`` (M) wide, unused entries the scratch block; the
    attention mask covers its M·block_size positions. A token goes to (table[b, p // bs], p % bs);
    to the scratch block (0, p % bs) where the row has no block for p, for the tokens that pad a
    row to S, and for every token of a padding row, so no real block takes a write nobody asked for.
    """
    if len(blocks) != len(tokens):
        raise ValueError(f"{len(blocks)} rows of blocks for {len(tokens)} rows of tokens")
    widest = max((len(row) for row in blocks), default=0)
    if widest > table_blocks:
        raise ValueError(f"a row holds {widest} blocks, over the table's {table_blocks}")
    step = step_arrays(tokens, starts, table_blocks * block_size, pad_batch, trees, all_logits)
    batch, seq = step.input_ids.shape
    table = np.full((batch, table_blocks), SCRATCH_BLOCK, np.int32)  # [B, M]
    for row, row_blocks in enumerate(blocks):
        table[row, :len(row_blocks)] = np.asarray(row_blocks, np.int64) + 1
    positions = step.write_index[:, None] + np.arange(seq)[None, :]  # [B, S] where each token's K/V goes
    slots = np.zeros((batch, seq, 2), np.int64)  # [B, S, 2]
    slots[:, :, 1] = positions % block_size
    real = np.zeros((batch, seq), np.bool_)  # [B, S]: tokens of a row, not padding
    for row, row_tokens in enumerate(tokens):
        real[row, :len(row_tokens)] = True
    index = positions // block_size
    owned = real & (index < np.array([len(row) for row in blocks] + [0] * (batch - len(blocks)))[:, None])
    rows = np.broadcast_to(np.arange(batch)[:, None], (batch, seq))
    slots[:, :, 0] = np.where(owned, table[rows, np.minimum(index, table_blocks - 1)], SCRATCH_BLOCK)
    return PagedStepArrays(step=step, block_table=table, kv_slots=slots)

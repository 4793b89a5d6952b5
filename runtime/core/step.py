"""One engine step and the cache operations applied before it: what the scheduler plans, the
engine core hands to an engine, and every backend (and the ranks of a parallel engine) runs.
Apart from the scheduler so the backends need not import it."""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from .tree import Tree


class StepKind(Enum):
    prefill = "prefill"
    decode = "decode"


@dataclass(frozen=True)
class KeepPath:
    """After a verification: move the K/V at slot positions ``start + nodes[i]`` to ``start + 1 + i``
    (the accepted path, written in tree order, becomes contiguous after the root at ``start``)."""
    slot: int
    start: int
    nodes: tuple[int, ...]


@dataclass(frozen=True)
class CopySlot:
    """Copy slot positions [0, length) of slot ``src`` into slot ``dst``: what the moved request
    has cached, not the whole [H_kv, S_max, D] slot (which for long S_max is most of it empty)."""
    src: int
    dst: int
    length: int


@dataclass(frozen=True)
class SaveBlock:
    """Store slot positions [index*bs, (index+1)*bs) into prefix block ``block``."""
    slot: int
    index: int
    block: int


@dataclass(frozen=True)
class LoadBlock:
    """Copy prefix block ``block`` into slot positions [index*bs, (index+1)*bs)."""
    block: int
    slot: int
    index: int


@dataclass(frozen=True)
class Discard:
    """Slots ``slots`` and prefix blocks ``blocks`` hold nothing anyone reads (freed slots, the
    scratch slot after a swap, evicted blocks): an engine may return their memory (the host
    pools do; they read back as zeros)."""
    slots: tuple[int, ...]
    blocks: tuple[int, ...]


@dataclass(frozen=True)
class KeepPathInBlocks:
    """KeepPath for a paged engine: the row's positions live in ``blocks`` (KV-manager ids, in
    order; position p in blocks[p // block_size])."""
    blocks: tuple[int, ...]
    start: int
    nodes: tuple[int, ...]


CacheOp = CopySlot | SaveBlock | LoadBlock | KeepPath | Discard | KeepPathInBlocks


@dataclass(frozen=True)
class Step:
    kind: StepKind
    first_slot: int            # rows bind slots [first_slot, first_slot + len(rids))
    rids: tuple[str, ...]
    tokens: tuple[tuple[int, ...], ...]   # new tokens per row
    starts: tuple[int, ...]               # write_index per row (= tokens already cached)
    samples: tuple[bool, ...]             # whether a row's logits yield a token this step
    trees: tuple[Tree | None, ...] = ()   # per row, the Medusa tree its tokens form (verification)
    # Whether a plain decode step computes the Medusa heads' logits: False where nobody drafts
    # from them (the engine core decides), and an engine that can skip them does.
    draft_heads: bool = True
    # A paged engine's rows: each row's KV-manager block ids, in position order, covering every
    # position the step writes (empty for engines that keep a slot per row).
    block_tables: tuple[tuple[int, ...], ...] = ()

    @property
    def row_trees(self) -> tuple[Tree | None, ...]:
        """Each row's tree, None for rows that decode plainly."""
        return self.trees or (None,) * len(self.rids)

    @property
    def verifies(self) -> bool:
        """A verification step: logits at every position (R = S), tree masks per row."""
        return any(tree is not None for tree in self.trees)

    @property
    def seq_len(self) -> int:
        return max(len(t) for t in self.tokens)


@dataclass
class Plan:
    ops: list[CacheOp]
    step: Step | None

"""What rank 0 tells the other ranks, as plain int64 tensors: no pickle on the rank path.

Every call of the tensor-parallel engine (a Step, a cache operation, or stop) becomes one
message: a fixed header [MAGIC, VERSION, kind, payload words] and a payload of int64 words,
broadcast over torch.distributed as two tensors. ``encode``/``decode`` are pure functions;
``decode`` checks every length against what follows (and each kind's payload size before a
rank allocates for it), so a malformed, truncated, oversized or unknown message is refused in
one line naming the receiving rank, never run. It accepts exactly what ``encode`` makes of a
well-formed message (``message_problem``: indices and token ids ≥ 0, every row a token, trees
only on a decode step, on some row, each row's tree as many nodes as its tokens), so any word
accepted re-encodes to itself; ``encode`` refuses an ill-formed message before it is sent.
Values are not checked against the engine's limits (slots, max_seq_len, vocabulary): rank 0 is
the same job's trusted peer, and the engine bounds its own inputs as it does for rank 0's steps.
The exception is a paged engine's block ids (``PagedLimits``): a block table wider than the
engine's widest (max_seq_len / block_size), and a kept path whose positions fall outside its
row's blocks, are refused, as block ids are (< 0), before any rank copies through them.

Step payload: kind, first_slot, rows, draft_heads, has_trees, has_tables; per row (rid bytes,
tokens, start, sample, tree choices or −1 for no tree, table blocks); then every row's rid as
UTF-8 bytes, its tokens, its block table (a paged engine's: KV-manager block ids), and its
tree's choices (each: its length, then its ranks). KeepPathInBlocks: start, blocks, the block
ids, nodes, the nodes. Discard: slots, the slots, blocks, the blocks (ids ≥ 0, at most
MAX_DISCARD of each).
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import numpy as np

from ..core.tree import Tree
from ..core.step import CopySlot, Discard, KeepPath, KeepPathInBlocks, LoadBlock, SaveBlock, Step, StepKind

MAGIC = 0x7472_7462_726B  # "trtbrk"
VERSION = 2
HEADER_WORDS = 4
# A Step of B rows × S tokens takes about B · (S + 6) words (a Medusa tree adds its choices): this
# is far above any engine's (256 rows of 8192 tokens take 2.1 M), and the receive buffer it bounds
# is 32 MiB. The other kinds have fixed sizes, so a header cannot make a rank allocate for them.
MAX_PAYLOAD_WORDS = 1 << 22
MAX_KEEP_NODES = 4096
MAX_KEEP_BLOCKS = 1 << 17  # a kept path's row: its blocks (max_seq_len / block_size) are far fewer
MAX_DISCARD = 1 << 18      # slots or store blocks one Discard names (a budget's blocks are fewer)
STEP_KINDS = (StepKind.prefill, StepKind.decode)   # index = its code on the wire
ROW_WORDS = 6  # rid bytes, tokens, start, sample, tree choices, table blocks


@dataclass(frozen=True)
class PagedLimits:
    """What bounds a paged engine's block ids on a rank: its blocks' positions, a table's widest,
    and its pool (KV-manager ids below ``num_blocks``)."""
    block_size: int
    max_blocks: int  # max_seq_len // block_size
    num_blocks: int  # the KV budget's blocks: every rank's pool holds them (and the scratch block)


@dataclass(frozen=True)
class Stop:
    """The last message: the other ranks stop serving."""


Message = Step | CopySlot | KeepPath | SaveBlock | LoadBlock | KeepPathInBlocks | Discard | Stop


class MessageKind(IntEnum):
    stop = 0
    step = 1
    copy_slot = 2
    keep_path = 3
    save_block = 4
    load_block = 5
    keep_path_in_blocks = 6
    discard = 7


class RankProtocolError(ValueError):
    """A message this rank refuses; the text names the rank and what was wrong."""


def encode(message: Message, limits: PagedLimits | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``message`` as (header [HEADER_WORDS], payload [N]) int64 arrays; ValueError for a
    message no rank would accept (``message_problem`` under ``limits``, or more words than a rank
    receives)."""
    problem = message_problem(message, limits)
    if problem is not None:
        raise ValueError(f"rank 0 cannot send {type(message).__name__}: {problem}")
    if isinstance(message, Step):
        kind, words = MessageKind.step, _step_words(message)
    elif isinstance(message, CopySlot):
        kind, words = MessageKind.copy_slot, [message.src, message.dst, message.length]
    elif isinstance(message, KeepPath):
        kind, words = MessageKind.keep_path, [message.slot, message.start, len(message.nodes), *message.nodes]
    elif isinstance(message, SaveBlock):
        kind, words = MessageKind.save_block, [message.slot, message.index, message.block]
    elif isinstance(message, LoadBlock):
        kind, words = MessageKind.load_block, [message.block, message.slot, message.index]
    elif isinstance(message, KeepPathInBlocks):
        kind, words = MessageKind.keep_path_in_blocks, [message.start, len(message.blocks), *message.blocks,
                                                        len(message.nodes), *message.nodes]
    elif isinstance(message, Discard):
        kind, words = MessageKind.discard, [len(message.slots), *message.slots, len(message.blocks), *message.blocks]
    elif isinstance(message, Stop):
        kind, words = MessageKind.stop, []
    else:
        raise TypeError(f"no rank message for {type(message).__name__}")
    payload = np.asarray(words, np.int64)
    if payload.size > _payload_limit(kind):
        raise ValueError(f"rank 0 cannot send {type(message).__name__}: {payload.size} words; "
                         f"a rank receives at most {_payload_limit(kind)}")
    return np.array([MAGIC, VERSION, kind, payload.size], np.int64), payload


def message_problem(message: Message, limits: PagedLimits | None = None) -> str | None:
    """What makes ``message`` one rank 0 never sends (so no rank runs it), or None; ``limits``: a
    paged engine's, which its block tables and kept paths must keep within (None: unchecked)."""
    if isinstance(message, Step):
        return _step_problem(message) or _tables_problem(message, limits)
    if isinstance(message, KeepPathInBlocks):
        return _keep_in_blocks_problem(message, limits)
    if isinstance(message, Discard):
        return _discard_problem(message)
    if isinstance(message, KeepPath):
        fields = {"slot": message.slot, "start": message.start, **{f"node {i}": n for i, n in enumerate(message.nodes)}}
    elif isinstance(message, (CopySlot, SaveBlock, LoadBlock)):
        fields = vars(message)
    else:
        return None
    return next((f"{name} {value} is negative" for name, value in fields.items() if value < 0), None)


def _step_problem(step: Step) -> str | None:
    rows = len(step.rids)
    if len(step.tokens) != rows or len(step.starts) != rows or len(step.samples) != rows:
        return (f"{rows} rids, {len(step.tokens)} token rows, {len(step.starts)} starts, {len(step.samples)} samples; "
                f"one of each per row")
    if step.first_slot < 0:
        return f"first_slot {step.first_slot} is negative"
    for row, (tokens, start) in enumerate(zip(step.tokens, step.starts)):
        if not tokens:
            return f"row {row} has no tokens (each row has at least one)"
        if min(tokens) < 0:
            return f"row {row} has token id {min(tokens)} (token ids are ≥ 0)"
        if start < 0:
            return f"row {row} starts at {start} (starts are ≥ 0)"
    if not step.trees:
        return None
    if step.kind != StepKind.decode:
        return f"a {step.kind.name} step with trees (only a decode step verifies)"
    if len(step.trees) != rows:
        return f"{len(step.trees)} trees for {rows} rows (one per row, or none)"
    if all(tree is None for tree in step.trees):
        return "trees on no row (a step that verifies nothing has none)"
    for row, (tokens, tree) in enumerate(zip(step.tokens, step.trees)):
        if tree is not None and len(tokens) != tree.size:
            return (f"row {row} has {len(tokens)} tokens for a tree of {tree.size} nodes "
                    f"(its root and {tree.size - 1} choices, one token each)")
    return None


def _tables_problem(step: Step, limits: PagedLimits | None) -> str | None:
    tables = step.block_tables
    if not tables:
        return None
    if len(tables) != len(step.rids):
        return f"{len(tables)} block tables for {len(step.rids)} rows (one per row, or none)"
    for row, blocks in enumerate(tables):
        if blocks and min(blocks) < 0:
            return f"row {row}'s block table holds block {min(blocks)} (block ids are ≥ 0)"
        if limits is not None and len(blocks) > limits.max_blocks:
            return (f"row {row}'s block table has {len(blocks)} blocks; the engine's widest is {limits.max_blocks} "
                    f"(max_seq_len / block_size)")
        if limits is not None and blocks and max(blocks) >= limits.num_blocks:
            return f"row {row}'s block table holds block {max(blocks)}; the pool holds blocks 0 to {limits.num_blocks - 1}"
    return None


def _discard_problem(discard: Discard) -> str | None:
    for what, ids in (("slot", discard.slots), ("block", discard.blocks)):
        if len(ids) > MAX_DISCARD:
            return f"{len(ids)} {what}s; a Discard names at most {MAX_DISCARD}"
        if ids and min(ids) < 0:
            return f"{what} {min(ids)} is negative"
    return None


def _keep_in_blocks_problem(keep: KeepPathInBlocks, limits: PagedLimits | None) -> str | None:
    if keep.start < 0:
        return f"start {keep.start} is negative"
    if keep.blocks and min(keep.blocks) < 0:
        return f"block {min(keep.blocks)} is negative (block ids are ≥ 0)"
    # The accepted path, in tree order: node i is at least i + 1, so no source is overwritten
    # before it is read (runtime/core/paged_pools.py).
    bad = next((i for i, node in enumerate(keep.nodes) if node < i + 1), None)
    if bad is not None:
        return f"node {bad} is {keep.nodes[bad]} (node i of a kept path is at least i + 1)"
    if limits is None:
        return None
    if len(keep.blocks) > limits.max_blocks:
        return f"{len(keep.blocks)} blocks; the engine's widest row is {limits.max_blocks} (max_seq_len / block_size)"
    if keep.blocks and max(keep.blocks) >= limits.num_blocks:
        return f"block {max(keep.blocks)} is outside the pool (blocks 0 to {limits.num_blocks - 1})"
    last = keep.start + max(keep.nodes, default=0)
    held = len(keep.blocks) * limits.block_size
    if keep.nodes and last >= held:
        return f"position {last} (start {keep.start} + node {max(keep.nodes)}) is outside its {held} positions' blocks"
    return None


def _step_words(step: Step) -> list[int]:
    trees, tables = step.row_trees, step.block_tables or ((),) * len(step.rids)
    words = [STEP_KINDS.index(step.kind), step.first_slot, len(step.rids), int(step.draft_heads), int(bool(step.trees)),
             int(bool(step.block_tables))]
    rids = [rid.encode() for rid in step.rids]
    for rid, tokens, start, sample, tree, blocks in zip(rids, step.tokens, step.starts, step.samples, trees, tables,
                                                        strict=True):
        words += [len(rid), len(tokens), start, int(sample), -1 if tree is None else len(tree.choices), len(blocks)]
    for rid in rids:
        words += list(rid)
    for tokens in step.tokens:
        words += tokens
    for blocks in tables:
        words += blocks
    for tree in trees:
        for path in tree.choices if tree is not None else ():
            words += [len(path), *path]
    return words


def payload_words(header: np.ndarray, rank: int) -> int:
    """How many payload words follow ``header``, once it is checked."""
    header = np.asarray(header)
    if header.shape != (HEADER_WORDS,) or header.dtype != np.int64:
        raise _refused(rank, f"header of shape {header.shape} {header.dtype}, not ({HEADER_WORDS},) int64")
    magic, version, kind, length = (int(w) for w in header)
    if magic != MAGIC:
        raise _refused(rank, f"header magic {magic:#x}, not {MAGIC:#x}")
    if version != VERSION:
        raise _refused(rank, f"protocol version {version}; this rank speaks {VERSION}")
    if kind not in MessageKind._value2member_map_:
        raise _refused(rank, f"unknown message kind {kind} (known: {', '.join(f'{k.value} {k.name}' for k in MessageKind)})")
    limit = _payload_limit(MessageKind(kind))
    if not 0 <= length <= limit:
        raise _refused(rank, f"{MessageKind(kind).name} payload of {length} words (0 to {limit})")
    return length


def _payload_limit(kind: MessageKind) -> int:
    return {MessageKind.stop: 0, MessageKind.copy_slot: 3, MessageKind.save_block: 3, MessageKind.load_block: 3,
            MessageKind.keep_path: 3 + MAX_KEEP_NODES,
            MessageKind.keep_path_in_blocks: 3 + MAX_KEEP_BLOCKS + MAX_KEEP_NODES,
            MessageKind.discard: 2 + 2 * MAX_DISCARD}.get(kind, MAX_PAYLOAD_WORDS)


def decode(header: np.ndarray, payload: np.ndarray, rank: int, limits: PagedLimits | None = None) -> Message:
    """The message ``header`` and ``payload`` encode, checked (a paged engine's block ids against
    ``limits``); ``rank``: the receiving rank (for the error)."""
    length = payload_words(header, rank)
    payload = np.asarray(payload)
    if payload.dtype != np.int64 or payload.shape != (length,):
        raise _refused(rank, f"payload of shape {payload.shape} {payload.dtype}; the header says ({length},) int64")
    kind = MessageKind(int(header[2]))
    words = _Words(payload.tolist(), rank, kind)
    if kind == MessageKind.step:
        message = _step(words)
    elif kind == MessageKind.keep_path:
        slot, start = words.count("slot"), words.count("start")
        message = KeepPath(slot, start, tuple(words.count("node") for _ in range(words.count("nodes"))))
    elif kind == MessageKind.keep_path_in_blocks:
        start = words.count("start")
        blocks = tuple(words.take(words.count("blocks"), "blocks"))
        message = KeepPathInBlocks(blocks, start, tuple(words.take(words.count("nodes"), "nodes")))
    elif kind == MessageKind.discard:
        slots = tuple(words.take(words.count("slots"), "slots"))
        message = Discard(slots, tuple(words.take(words.count("blocks"), "blocks")))
    elif kind == MessageKind.stop:
        message = Stop()
    else:
        a, b, c = (words.count(name) for name in _FIELDS[kind])
        message = {MessageKind.copy_slot: CopySlot, MessageKind.save_block: SaveBlock,
                   MessageKind.load_block: LoadBlock}[kind](a, b, c)
    words.end()
    problem = message_problem(message, limits)
    if problem is not None:
        raise _refused(rank, f"{kind.name}: {problem}")
    return message


_FIELDS = {MessageKind.copy_slot: ("src", "dst", "length"), MessageKind.save_block: ("slot", "index", "block"),
           MessageKind.load_block: ("block", "slot", "index")}


def _step(words: _Words) -> Step:
    kind = words.choice("step kind", len(STEP_KINDS))
    first_slot, rows = words.count("first_slot"), words.count("rows")
    draft_heads, has_trees = words.choice("draft_heads", 2), words.choice("has_trees", 2)
    has_tables = words.choice("has_tables", 2)
    table = [words.take(ROW_WORDS, "row table") for _ in range(rows)]
    for row, (rid_bytes, tokens, start, sample, choices, blocks) in enumerate(table):
        words.check(min(rid_bytes, tokens, start, blocks) >= 0 and sample in (0, 1) and choices >= -1,
                    f"row {row}: rid bytes {rid_bytes}, tokens {tokens}, start {start}, sample {sample}, "
                    f"tree choices {choices}, table blocks {blocks}")
        words.check(has_trees or choices == -1, f"row {row} has a tree in a step without trees")
        words.check(has_tables or blocks == 0, f"row {row} has a block table in a step without tables")
    words.check(not has_trees or any(row[4] != -1 for row in table), "has_trees 1 but no row has a tree")
    words.check(not has_tables or rows, "has_tables 1 in a step of no rows")
    rids = []
    for row, (rid_bytes, *_) in enumerate(table):
        raw = words.take(rid_bytes, f"row {row}'s rid")
        words.check(all(0 <= b < 256 for b in raw), f"row {row}'s rid holds a word that is not a byte")
        try:
            rids.append(bytes(raw).decode())
        except UnicodeDecodeError:
            raise _refused(words.rank, f"step: row {row}'s rid is not UTF-8") from None
    tokens = tuple(tuple(words.take(row[1], "tokens")) for row in table)
    tables = tuple(tuple(words.take(row[5], "block table")) for row in table)
    trees = tuple(None if row[4] == -1 else _tree(words, row[4]) for row in table)
    return Step(STEP_KINDS[kind], first_slot, tuple(rids), tokens, tuple(row[2] for row in table),
                tuple(bool(row[3]) for row in table), trees if has_trees else (), bool(draft_heads),
                tables if has_tables else ())


def _tree(words: _Words, choices: int) -> Tree:
    paths = tuple(tuple(words.take(words.count("path length"), "tree path")) for _ in range(choices))
    try:
        return Tree(paths)
    except ValueError as exc:
        raise _refused(words.rank, f"step: {exc}") from None


class _Words:
    """A cursor over a payload that refuses reading past its end or leaving words unread."""

    def __init__(self, words: list[int], rank: int, kind: MessageKind):
        self.words, self.rank, self.kind, self.at = words, rank, kind, 0

    def take(self, n: int, what: str) -> list[int]:
        if self.at + n > len(self.words):
            raise _refused(self.rank, f"{self.kind.name}: payload ends inside {what} (word {self.at} of {len(self.words)})")
        self.at += n
        return self.words[self.at - n:self.at]

    def count(self, what: str) -> int:
        value = self.take(1, what)[0]
        self.check(value >= 0, f"{what} {value} is negative")
        return value

    def choice(self, what: str, options: int) -> int:
        value = self.take(1, what)[0]
        self.check(0 <= value < options, f"{what} {value} (0 to {options - 1})")
        return value

    def check(self, ok: bool, what: str) -> None:
        if not ok:
            raise _refused(self.rank, f"{self.kind.name}: {what}")

    def end(self) -> None:
        self.check(self.at == len(self.words), f"{len(self.words) - self.at} words after the message")


def _refused(rank: int, what: str) -> RankProtocolError:
    return RankProtocolError(f"rank {rank} refused a message from rank 0: {what}")


def broadcast(message: Message, group=None, limits: PagedLimits | None = None) -> None:
    """Rank 0: ``message`` to every rank of ``group`` (header, then payload if any)."""
    import torch
    import torch.distributed as dist

    header, payload = encode(message, limits)
    dist.broadcast(torch.from_numpy(header), src=0, group=group)
    if payload.size:
        dist.broadcast(torch.from_numpy(payload), src=0, group=group)


def receive(rank: int, group=None, limits: PagedLimits | None = None) -> Message:
    """A non-zero rank: the next message rank 0 broadcasts, checked (RankProtocolError if malformed;
    a paged engine's block ids against ``limits``)."""
    import torch
    import torch.distributed as dist

    header = torch.zeros(HEADER_WORDS, dtype=torch.int64)
    dist.broadcast(header, src=0, group=group)
    payload = torch.empty(payload_words(header.numpy(), rank), dtype=torch.int64)
    if payload.numel():
        dist.broadcast(payload, src=0, group=group)
    return decode(header.numpy(), payload.numpy(), rank, limits)

"""Prefix cache index: KV of full token blocks, keyed by a hash of the whole prefix.

Plain Python: it decides which blocks exist, which match, and which to evict (LRU, bounded
by ``capacity`` blocks). The KV data lives in the engine's block store at the block ids
given here; the caller copies slot ↔ store.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass


def block_hashes(tokens: list[int], block_size: int) -> list[bytes]:
    """Chained hashes of each full block: block i's hash covers tokens[: (i + 1) * block_size]."""
    hashes, parent = [], b""
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = tokens[start:start + block_size]
        parent = hashlib.blake2b(parent + b"|" + ",".join(map(str, block)).encode(), digest_size=16).digest()
        hashes.append(parent)
    return hashes


@dataclass
class PrefixStats:
    hits: int = 0       # blocks reused
    misses: int = 0     # full prompt blocks that were not cached
    evictions: int = 0
    inserted: int = 0


class PrefixCache:
    def __init__(self, block_size: int, capacity: int):
        if block_size < 1 or capacity < 0:
            raise ValueError("block_size must be ≥ 1 and capacity ≥ 0")
        self.block_size, self.capacity = block_size, capacity
        self._blocks: OrderedDict[bytes, int] = OrderedDict()  # hash → block id, least recent first
        self._free = list(range(capacity - 1, -1, -1))       # pop() gives 0, 1, 2, …
        self.stats = PrefixStats()

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, prompt: list[int]) -> list[int]:
        """Block ids of the longest cached prefix of ``prompt``, leaving at least its last token
        to compute (the step that computes it produces the first output's logits)."""
        usable = (len(prompt) - 1) // self.block_size
        ids = []
        hashes = block_hashes(prompt, self.block_size)[:usable]
        for h in hashes:
            block = self._blocks.get(h)
            if block is None:
                break
            self._blocks.move_to_end(h)
            ids.append(block)
        self.stats.hits += len(ids)
        self.stats.misses += len(hashes) - len(ids)
        return ids

    def insert(self, tokens: list[int], pinned: frozenset[int] = frozenset()) -> list[tuple[int, int]]:
        """Allocates blocks for the full blocks of ``tokens`` not yet cached.

        Returns ``(block_index, block_id)`` pairs whose KV the caller must store (block
        ``block_index`` of the sequence covers tokens [i*bs, (i+1)*bs)). Evicts least
        recently used blocks, never those in ``pinned``; stops when nothing can be evicted.
        """
        new = []
        for index, h in enumerate(block_hashes(tokens, self.block_size)):
            if h in self._blocks:
                self._blocks.move_to_end(h)
                continue
            block = self._allocate(pinned | {b for _, b in new})
            if block is None:
                break
            self._blocks[h] = block
            new.append((index, block))
        self.stats.inserted += len(new)
        return new

    def _allocate(self, pinned: frozenset[int] | set[int]) -> int | None:
        if self._free:
            return self._free.pop()
        for h, block in self._blocks.items():
            if block not in pinned:
                del self._blocks[h]
                self.stats.evictions += 1
                return block
        return None

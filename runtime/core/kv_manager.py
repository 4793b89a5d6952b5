"""One KV budget counted in blocks of ``block_size`` tokens, shared by the rows of running
requests and the prefix cache. Plain Python: it decides which block ids are held, by whom,
which cached ones match a prompt and which to evict; the engine's pools hold the data.

Where the data lives with slot rows (the CPU graphs keep one contiguous KV row per request, which
ONNX Runtime's CPU GroupQueryAttention needs):
- a running request's K/V is in its row; it holds ceil(positions written / block_size) block
  ids (rejected speculative tree nodes count while written). The ids name budget units, not
  places: the host pools are demand-paged (runtime/core/kv_pools.py), so a row costs the pages
  it wrote, and the budget bounds the sum;
- a cached block's K/V is in the engine's block store at its id. A hit copies the block into the
  row once, at admission (LoadBlock), never per step; so while a request runs, its cached prompt
  blocks exist twice (row and store) and are counted twice.

With ``shared`` (the paged TensorRT engine, whose rows read their K/V through block tables from one
pool of these ids), the ids are places and nothing is copied: a hit's cached blocks become the
first blocks of the row's table, shared by reference; a computed prompt's full blocks are cached
where they are; a row that ends hands back the blocks nobody caches. A block in some row's table
is never evicted: only unreferenced cached blocks are.

Cached blocks are keyed by the chained hash of the whole prefix (``block_hashes``) and reference
counted by the running requests whose prompts they hold. Unreferenced ones stay cached and are
evicted least recently used first when the budget is needed; a row that must grow may also evict
referenced ones (its users have their own copies: that only costs future hits), so the cache
never forces a preemption; not so when ``shared``, where a referenced block is in a table. Blocks
are handed out lowest id first from the free list.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from dataclasses import dataclass

from ...contract.kv_budget import blocks_for_tokens as blocks_for


def block_hashes(tokens, block_size: int) -> list[bytes]:
    """Chained hashes of each full block: block i's hash covers tokens[: (i + 1) * block_size]."""
    hashes, parent = [], b""
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = tokens[start:start + block_size]
        parent = hashlib.blake2b(parent + b"|" + ",".join(map(str, block)).encode(), digest_size=16).digest()
        hashes.append(parent)
    return hashes


@dataclass
class KVStats:
    hits: int = 0          # prompt blocks served from the prefix cache
    misses: int = 0        # full prompt blocks (but the last token's) that were not cached
    evictions: int = 0     # cached blocks dropped for room
    inserted: int = 0      # blocks saved into the cache
    preemptions: int = 0   # requests sent back to the queue (the scheduler counts them)


class KVManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True, rows_reserved: bool = False,
                 shared: bool = False):
        """``rows_reserved``: the engine's rows are reserved in full (a slot TensorRT engine's device
        pools), so rows take no blocks and the budget is the prefix cache's alone. ``shared``: rows
        and the cache share blocks by reference (see above)."""
        if block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"block_size {block_size}: must be a power of two ≥ 1")
        if num_blocks < 1:
            raise ValueError(f"num_blocks {num_blocks}: the KV budget must hold at least one block")
        self.num_blocks, self.block_size, self.prefix_caching = num_blocks, block_size, prefix_caching
        self.rows_reserved, self.shared = rows_reserved, shared
        self._free: deque[int] = deque(range(num_blocks))
        self._rows: dict[str, list[int]] = {}                 # rid → blocks its row holds
        self._cached: dict[bytes, int] = {}                   # prefix hash → block id
        self._hash_of: dict[int, bytes] = {}
        self._users: dict[int, set[str]] = {}                 # cached block → running requests using it
        self._uses: dict[str, list[int]] = {}                 # rid → cached blocks it uses
        self._recent: OrderedDict[int, None] = OrderedDict()  # every cached block, least recently used first
        self._unused: OrderedDict[int, None] = OrderedDict()  # cached blocks no request uses, LRU first
        self._dropped: list[int] = []                         # evicted since take_dropped: their store pages can go
        self.stats = KVStats()

    # -- reading ------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks holding nothing (cached blocks not counted)."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def reclaimable(self, evict_used: bool) -> int:
        """Blocks a row could take now: free ones, unreferenced cached ones, and (``evict_used``,
        unless shared: a referenced block is in a row's table) referenced cached ones."""
        return len(self._free) + (len(self._cached) if evict_used and not self.shared else len(self._unused))

    def fits(self, rid: str, hit: list[int], positions: int) -> bool:
        """Whether ``rid``, admitted with ``hit`` (``match``'s), could hold positions [0, positions)
        from free and unreferenced cached blocks: shared, the hit's blocks are the row's first ones
        and no longer unreferenced once it uses them."""
        if not self.shared:
            return self.missing(rid, positions) <= self.reclaimable(evict_used=False)
        unused_hit = sum(block in self._unused for block in hit)
        return blocks_for(positions, self.block_size) - len(hit) <= self.reclaimable(False) - unused_hit

    def freed_by_release(self, rid: str) -> int:
        """Blocks ``release(rid)`` would make reclaimable: its row's own ones and, shared, the cached
        ones of its row that no other request uses."""
        return sum(1 for block in self._rows.get(rid, ())
                   if block not in self._hash_of or self._users.get(block, set()) <= {rid})

    def row(self, rid: str) -> list[int]:
        return list(self._rows.get(rid, ()))

    def uses(self, rid: str) -> list[int]:
        """The cached blocks ``rid`` holds references on."""
        return list(self._uses.get(rid, ()))

    def ref_count(self, block: int) -> int:
        return len(self._users.get(block, ()))

    def cached_blocks(self) -> list[int]:
        """Cached block ids, least recently used first."""
        return list(self._recent)

    def held_positions(self, rid: str) -> int:
        return len(self._rows.get(rid, ())) * self.block_size

    def missing(self, rid: str, positions: int) -> int:
        """Blocks ``rid``'s row lacks to hold positions [0, positions)."""
        if self.rows_reserved:
            return 0
        return max(0, blocks_for(positions, self.block_size) - len(self._rows.get(rid, ())))

    # -- rows ---------------------------------------------------------------------------------
    def grow(self, rid: str, positions: int, evict_used: bool = True) -> bool:
        """Makes ``rid``'s row hold positions [0, positions): takes free blocks, then evicts
        unreferenced cached ones (LRU), then (``evict_used``) referenced ones. False, taking
        nothing, when that is not enough."""
        need = self.missing(rid, positions)
        if need > self.reclaimable(evict_used):
            return False
        if self.rows_reserved:
            return True
        row = self._rows.setdefault(rid, [])
        for _ in range(need):
            row.append(self._take(evict_used))
        return True

    def release(self, rid: str) -> None:
        """``rid`` ended or was preempted: its row blocks are free (shared: those not cached), its
        cached blocks lose a user (unused ones stay cached, most recently used last)."""
        self._free.extend(block for block in self._rows.pop(rid, ()) if block not in self._hash_of)
        for block in self._uses.pop(rid, ()):
            users = self._users[block]
            users.discard(rid)
            if not users:
                self._unused[block] = None

    def _take(self, evict_used: bool) -> int:
        if self._free:
            return self._free.popleft()
        if self._unused:
            block = next(iter(self._unused))
        elif evict_used and self._recent and not self.shared:
            block = next(iter(self._recent))
        else:
            raise RuntimeError("the KV budget is exhausted")  # grow/save checked first
        self._evict(block)
        return block

    def _evict(self, block: int) -> None:
        del self._cached[self._hash_of.pop(block)]
        for rid in self._users.pop(block):
            self._uses[rid].remove(block)
        self._recent.pop(block)
        self._unused.pop(block, None)
        self._dropped.append(block)
        self.stats.evictions += 1

    def take_dropped(self) -> list[int]:
        """Cached blocks evicted since the last call: the store's copies are garbage now."""
        dropped, self._dropped = self._dropped, []
        return dropped

    # -- prefix cache -------------------------------------------------------------------------
    def match(self, prompt) -> list[int]:
        """Block ids of the longest cached prefix of ``prompt``, leaving at least its last token
        to compute (the step that computes it produces the first output's logits). Changes nothing."""
        if not self.prefix_caching:
            return []
        usable = (len(prompt) - 1) // self.block_size
        ids = []
        for h in block_hashes(prompt[:usable * self.block_size], self.block_size):
            block = self._cached.get(h)
            if block is None:
                break
            ids.append(block)
        return ids

    def hit(self, rid: str, prompt, blocks: list[int]) -> None:
        """``rid`` was admitted with ``blocks`` (``match``'s): they gain a user and become the most
        recently used; the hit and miss counts grow."""
        for block in blocks:
            self._use(rid, block)
        if self.shared:
            self._rows[rid] = list(blocks)  # the row's first blocks, by reference
        usable = (len(prompt) - 1) // self.block_size if self.prefix_caching else 0
        self.stats.hits += len(blocks)
        self.stats.misses += usable - len(blocks)

    def save(self, rid: str, prompt) -> list[tuple[int, int]]:
        """``rid``'s prompt is computed: its full blocks become cached (shared ones gain ``rid``
        as a user). Returns ``(block_index, block_id)`` for each new block whose K/V the caller
        copies from the row into the store. New blocks come from free ones or unreferenced
        cached ones, never from a referenced block or a preemption; saving stops when none is left."""
        if not self.prefix_caching:
            return []
        if self.shared:
            self._cache_in_place(rid, prompt)
            return []
        new = []
        for index, h in enumerate(block_hashes(prompt, self.block_size)):
            block = self._cached.get(h)
            if block is None:
                if not self._free and not self._unused:
                    break
                block = self._take(evict_used=False)
                self._cached[h], self._hash_of[block] = block, h
                self._users[block] = set()
                new.append((index, block))
            if rid not in self._users[block]:
                self._use(rid, block)
            else:
                self._recent.move_to_end(block)
        self.stats.inserted += len(new)
        return new

    def _cache_in_place(self, rid: str, prompt) -> None:
        """Shared: the row's full prompt blocks become cached where they are. Where another row
        cached the same prefix block first, this row keeps its own copy uncached (its table cannot
        change under it) and the cache keeps the other; the chain goes on in this row's blocks
        (a chained hash names content, not places)."""
        row = self._rows.get(rid, [])
        inserted = 0
        for index, h in enumerate(block_hashes(prompt, self.block_size)):
            block = self._cached.get(h)
            if block is None:
                block = row[index]
                self._cached[h], self._hash_of[block] = block, h
                self._users[block] = set()
                inserted += 1
            elif block != row[index]:
                continue
            if rid not in self._users[block]:
                self._use(rid, block)
            else:
                self._recent.move_to_end(block)
        self.stats.inserted += inserted

    def _use(self, rid: str, block: int) -> None:
        self._users[block].add(rid)
        self._uses.setdefault(rid, []).append(block)
        self._unused.pop(block, None)
        self._recent[block] = None
        self._recent.move_to_end(block)

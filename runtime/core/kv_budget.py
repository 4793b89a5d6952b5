"""The KV budget: ``kv_cache_memory`` (bytes, a size string, or a share of available memory) and
``block_size`` in, the KV manager's block count out.

A block is ``block_size`` tokens of K and V in every layer of a rank's caches. The budget is per
rank process (each rank's pools hold its layers and KV heads); rank 0's shape sizes it.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from ...contract.dtypes import HOST_DTYPES
from ...contract.kv_budget import block_size_problem, budget_bytes, max_pool_blocks, parse_kv_cache_memory
from ...contract.kv_budget import kv_bytes_per_token as per_token
from ...contract.processes import meminfo
from .kv_manager import KVManager, blocks_for


def check_block_size(value, max_seq_len: int) -> int:
    problem = ("not an integer" if isinstance(value, bool) or not isinstance(value, int)
               else block_size_problem(value, max_seq_len))
    if problem is not None:
        raise ValueError(f"block_size {value!r}: {problem}")
    return value


def available_memory() -> int:
    """MemAvailable from /proc/meminfo: what the CPU backend's share of memory is taken of."""
    available = meminfo().get("MemAvailable")
    if available is None:
        raise OSError("/proc/meminfo has no MemAvailable: give kv_cache_memory in bytes")
    return available


def kv_bytes_per_token(engine_dir, rank: int = 0) -> int:
    """K and V of one token in every layer of ``rank``'s caches."""
    d = engine_dir
    return per_token(len(d.rank_layers(rank)), d.num_kv_heads, d.head_dim, HOST_DTYPES[d.dtype].itemsize)


@dataclass(frozen=True)
class FreeMemory:
    """Bytes free where the pools live, and what measured them (for the refusal's wording)."""
    bytes: int
    what: str


def budget_in_bytes(kv_cache_memory, free: FreeMemory | None = None) -> int:
    """A budget (contract.kv_budget) in bytes: a share is of the memory free now (``free``: the
    host's MemAvailable unless told, e.g. the GPU's free memory for device pools); bytes beyond it
    are refused, since the pools would be backed as requests write them."""
    try:
        budget = parse_kv_cache_memory(kv_cache_memory)
    except ValueError as exc:
        raise ValueError(f"kv_cache_memory: {exc}") from None
    free = free or FreeMemory(available_memory(), "MemAvailable")
    if isinstance(budget, int) and budget > free.bytes:
        raise ValueError(f"kv_cache_memory {kv_cache_memory!r} = {budget} bytes exceeds the memory available now "
                         f"({free.bytes} bytes, {free.what}); give at most that, or a share such as 0.5")
    return budget_bytes(budget, free.bytes)


def default_kv_blocks(engine_dir, block_size: int, prefix_caching: bool) -> int:
    """Without a budget: every slot can reach max_seq_len (no preemption, as with reserved
    slots), plus a prefix cache of two slots' tokens."""
    d = engine_dir
    rows = d.max_batch_size * blocks_for(d.max_seq_len, block_size)
    return rows + (2 * d.max_seq_len // block_size if prefix_caching else 0)


def kv_blocks(engine_dir, kv_cache_memory, block_size: int, prefix_caching: bool,
              free: FreeMemory | None = None) -> int:
    """The budget's blocks: ``kv_cache_memory`` (None: the spec's runtime.kv_cache_memory where
    the engine dir has one, else ``default_kv_blocks``); a share is of ``free`` (None:
    ``available_memory()``)."""
    if kv_cache_memory is None:
        kv_cache_memory = engine_dir.kv_cache_memory
        if kv_cache_memory is None:
            return default_kv_blocks(engine_dir, block_size, prefix_caching)
    budget = budget_in_bytes(kv_cache_memory, free)
    block_bytes = block_size * kv_bytes_per_token(engine_dir)
    blocks = budget // block_bytes
    if blocks < 1:
        raise ValueError(f"kv_cache_memory {kv_cache_memory!r} = {budget} bytes holds no KV block of {block_size} "
                         f"tokens ({block_bytes} bytes); give at least {block_bytes}")
    return blocks


class RowMemory(Enum):
    """How an engine's rows hold their K/V, which decides what the budget counts."""
    pages = "pages"        # a demand-paged slot per row (the CPU's host pools): rows take blocks
    blocks = "blocks"      # one pool of the budget's blocks (a paged TensorRT engine): rows and the cache share them
    reserved = "reserved"  # a slot per row reserved in full (a slot TensorRT engine): the budget is the cache's


def kv_manager_for(engine_dir, kv_cache_memory, block_size: int, prefix_caching: bool, rows: RowMemory,
                   device_free: FreeMemory | None = None) -> KVManager:
    """The LLM's KV manager. Rows draw blocks from the budget (``pages``, ``blocks``; with
    ``blocks`` they share the prefix cache's by reference); a share is of ``device_free`` where
    given (the GPU's free memory), else of MemAvailable. ``reserved`` (a TensorRT engine built with slots: device
    memory cannot demand-page, every slot is reserved in full): the budget must cover the slots, capacity + 1 scratch rows of
    max_seq_len tokens, or it is refused; what remains is the prefix cache's (without a budget:
    two slots' tokens, as before budgets); a share is of ``device_free`` there (the GPU's free
    memory, which the caller measures), where host pools take it of MemAvailable."""
    d = engine_dir
    if rows != RowMemory.reserved:
        blocks = kv_blocks(d, kv_cache_memory, block_size, prefix_caching, device_free)
        if rows == RowMemory.blocks and kv_cache_memory is None and d.kv_cache_memory is None:
            # No budget given: every row's whole context, but no more than the engine's pools hold
            # (a budget given beyond that is refused by the engine, naming it).
            blocks = min(blocks, max_pool_blocks(block_size, d.num_kv_heads, d.head_dim) - 1)
        return KVManager(blocks, block_size, prefix_caching, shared=rows == RowMemory.blocks)
    if kv_cache_memory is None:
        kv_cache_memory = d.kv_cache_memory
    if kv_cache_memory is None:
        store = 2 * d.max_seq_len // block_size
    else:
        budget = budget_in_bytes(kv_cache_memory, device_free)
        reserved = (d.max_batch_size + 1) * d.max_seq_len * kv_bytes_per_token(d)
        if budget < reserved:
            raise ValueError(f"kv_cache_memory {kv_cache_memory!r} = {budget} bytes: TensorRT reserves every KV slot "
                             f"in full ({d.max_batch_size} + 1 scratch × max_seq_len {d.max_seq_len} = {reserved} "
                             f"bytes); give at least that, or build with a smaller max_batch_size/max_seq_len")
        store = (budget - reserved) // (block_size * kv_bytes_per_token(d))
    return KVManager(max(store, 1), block_size, prefix_caching, rows_reserved=True)

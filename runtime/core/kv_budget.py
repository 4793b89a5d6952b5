"""The KV budget: ``kv_cache_memory`` (bytes, a size string, or a share of available memory) and
``block_size`` in, the KV manager's block count out.

A block is ``block_size`` tokens of K and V in every layer of a rank's caches. The budget is per
rank process (each rank's pools hold its layers and KV heads); rank 0's shape sizes it.
"""
from __future__ import annotations

import re

from ...contract.dtypes import HOST_DTYPES
from .kv_manager import KVManager, blocks_for

DEFAULT_BLOCK_SIZE = 16
_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
          "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*")


def parse_kv_memory(value) -> int | float:
    """Bytes (an int ≥ 1, or a string such as "1GiB", "512MiB", "2GB") or a share of the memory
    available at load (a float in (0, 1]); one-line ValueError naming kv_cache_memory otherwise."""
    valid = 'valid: bytes (an int ≥ 1), a size such as "1GiB" or "512MiB", or a float in (0, 1] (share of available memory)'
    if isinstance(value, bool):
        raise ValueError(f"kv_cache_memory {value!r}: {valid}")
    if isinstance(value, int):
        if value < 1:
            raise ValueError(f"kv_cache_memory {value}: {valid}")
        return value
    if isinstance(value, float):
        if not 0 < value <= 1:
            raise ValueError(f"kv_cache_memory {value}: {valid}")
        return value
    if isinstance(value, str):
        match = _SIZE.fullmatch(value)
        unit = match and _UNITS.get(match.group(2).lower())
        if unit:
            size = int(float(match.group(1)) * unit)
            if size >= 1:
                return size
    raise ValueError(f"kv_cache_memory {value!r}: {valid}")


def check_block_size(value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1 or value & (value - 1):
        raise ValueError(f"block_size {value!r}: must be a power of two ≥ 1 (e.g. 16)")
    return value


def available_memory() -> int:
    """MemAvailable from /proc/meminfo: what the CPU backend's share of memory is taken of."""
    with open("/proc/meminfo") as handle:
        for line in handle:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise OSError("/proc/meminfo has no MemAvailable: give kv_cache_memory in bytes")


def kv_bytes_per_token(engine_dir, rank: int = 0) -> int:
    """K and V of one token in every layer of ``rank``'s caches."""
    d = engine_dir
    return 2 * len(d.rank_layers(rank)) * d.num_kv_heads * d.head_dim * HOST_DTYPES[d.dtype].itemsize


def default_kv_blocks(engine_dir, block_size: int, prefix_caching: bool) -> int:
    """Without a budget: every slot can reach max_seq_len (no preemption, as with reserved
    slots), plus a prefix cache of two slots' tokens."""
    d = engine_dir
    rows = d.max_batch_size * blocks_for(d.max_seq_len, block_size)
    return rows + (2 * d.max_seq_len // block_size if prefix_caching else 0)


def kv_blocks(engine_dir, kv_cache_memory, block_size: int, prefix_caching: bool) -> int:
    """The budget's blocks: ``kv_cache_memory`` (None: the spec's runtime.kv_cache_memory where
    the engine dir has one, else ``default_kv_blocks``); a share is of ``available_memory()``."""
    if kv_cache_memory is None:
        kv_cache_memory = engine_dir.runtime_defaults.get("kv_cache_memory")
        if kv_cache_memory is None:
            return default_kv_blocks(engine_dir, block_size, prefix_caching)
    memory = parse_kv_memory(kv_cache_memory)
    budget = int(memory * available_memory()) if isinstance(memory, float) else memory
    block_bytes = block_size * kv_bytes_per_token(engine_dir)
    blocks = budget // block_bytes
    if blocks < 1:
        raise ValueError(f"kv_cache_memory {kv_cache_memory!r} = {budget} bytes holds no KV block of {block_size} "
                         f"tokens ({block_bytes} bytes); give at least {block_bytes}")
    return blocks


def kv_manager_for(engine_dir, kv_cache_memory, block_size: int, prefix_caching: bool, rows_reserved: bool) -> KVManager:
    """The LLM's KV manager. ``rows_reserved`` (TensorRT: device pools cannot demand-page, every
    slot is reserved in full): the budget must cover the slots, capacity + 1 scratch rows of
    max_seq_len tokens, or it is refused; what remains is the prefix cache's (without a budget:
    two slots' tokens, as before budgets)."""
    d = engine_dir
    if not rows_reserved:
        return KVManager(kv_blocks(d, kv_cache_memory, block_size, prefix_caching), block_size, prefix_caching)
    if kv_cache_memory is None:
        kv_cache_memory = d.runtime_defaults.get("kv_cache_memory")
    if kv_cache_memory is None:
        store = 2 * d.max_seq_len // block_size
    else:
        memory = parse_kv_memory(kv_cache_memory)
        budget = int(memory * available_memory()) if isinstance(memory, float) else memory
        reserved = (d.max_batch_size + 1) * d.max_seq_len * kv_bytes_per_token(d)
        if budget < reserved:
            raise ValueError(f"kv_cache_memory {kv_cache_memory!r} = {budget} bytes: TensorRT reserves every KV slot "
                             f"in full ({d.max_batch_size} + 1 scratch × max_seq_len {d.max_seq_len} = {reserved} "
                             f"bytes); give at least that, or build with a smaller max_batch_size/max_seq_len")
        store = (budget - reserved) // (block_size * kv_bytes_per_token(d))
    return KVManager(max(store, 1), block_size, prefix_caching, rows_reserved=True)

"""The KV-cache budget (spec ``runtime.kv_cache_memory``, ``--kv-cache-memory``, ``LLM(kv_cache_memory=)``)
and the block arithmetic the builder's checks, ``trtbuild plan`` and the runtime must agree on.

A budget is either bytes (an integer, or a string with a unit: ``"1GiB"``, ``"512MiB"``, ``"2GB"``)
or a share of the memory free at load, a float in (0, 1] (as vLLM's ``gpu_memory_utilization``,
but of what is free once the weights are loaded, so it never counts them). Blocks hold
``block_size`` token positions of every layer's K and V; a request holds ceil(positions / block_size)
of them, so the budget bounds tokens in flight, not requests × max_seq_len.
"""
from __future__ import annotations

import re

UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
         "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_AMOUNT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")
VALID = ("bytes as an integer or a string with a unit (\"1GiB\", \"512MiB\", \"2GB\"), or a share of the "
         "memory free at load as a float in (0, 1]")
DEFAULT_BLOCK_SIZE = 16

KvBudget = int | float  # bytes, or a share of the free memory


def parse_kv_cache_memory(value) -> KvBudget:
    """``value`` as bytes (int ≥ 1) or a share (float in (0, 1]); ValueError naming what is valid."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a KV budget; give {VALID}")
    if isinstance(value, int):
        if value < 1:
            raise ValueError(f"{value} bytes is not a KV budget; give {VALID}")
        return value
    if isinstance(value, float):
        if not 0.0 < value <= 1.0:
            raise ValueError(f"{value} is not a share in (0, 1]; give {VALID}")
        return value
    if isinstance(value, str):
        text = value.strip()
        try:  # "0.5" from a command line is a share, "1073741824" bytes
            return parse_kv_cache_memory(float(text) if "." in text else int(text))
        except ValueError:
            pass
        match = _AMOUNT.match(text)
        unit = match.group(2).upper() if match else None
        if match is None or unit not in UNITS:
            raise ValueError(f"{value!r} is not a KV budget; give {VALID}")
        amount = int(float(match.group(1)) * UNITS[unit])
        if amount < 1:
            raise ValueError(f"{value!r} is not a KV budget; give {VALID}")
        return amount
    raise ValueError(f"{value!r} is not a KV budget; give {VALID}")


def budget_bytes(budget: KvBudget, free_bytes: int) -> int:
    """The budget in bytes: itself, or its share of ``free_bytes`` (the memory free at load)."""
    return int(budget * free_bytes) if isinstance(budget, float) else budget


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, element_bytes: int) -> int:
    """K and V of one token position in every layer (of one rank's KV heads)."""
    return 2 * num_layers * num_kv_heads * head_dim * element_bytes


def blocks_for_tokens(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def num_blocks(budget: int, block_size: int, bytes_per_token: int) -> int:
    """Whole blocks ``budget`` bytes hold."""
    return budget // (block_size * bytes_per_token)


def block_size_problem(block_size: int, max_seq_len: int) -> str | None:
    """Why ``block_size`` cannot serve an engine of ``max_seq_len`` positions, or None: a power of
    two that divides max_seq_len (the cache's length, so every block lies inside it)."""
    if block_size < 1 or block_size & (block_size - 1):
        return f"{block_size} is not a power of two; valid: a power of two dividing max_seq_len {max_seq_len} (e.g. 16)"
    if max_seq_len % block_size:
        return f"{block_size} does not divide max_seq_len {max_seq_len}; valid: a power of two that does (e.g. 16)"
    return None


# TensorRT's Scatter layer takes tensors of fewer than 2^31 elements: a paged engine's pool of
# blocks [N, block_size, H_kv, D] (the scratch block included) stays under it.
SCATTER_MAX_ELEMENTS = 2**31 - 1


def max_pool_blocks(block_size: int, num_kv_heads: int, head_dim: int) -> int:
    """The most blocks N a paged TensorRT engine's pool can have (its profile's maximum)."""
    return SCATTER_MAX_ELEMENTS // (block_size * num_kv_heads * head_dim)

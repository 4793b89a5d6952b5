"""Which heads each rank of a tensor-parallel engine holds (Megatron-style, by heads).

Query heads split evenly: rank r holds heads [r·H/N, (r+1)·H/N). KV heads split when N
divides them; when N is a multiple of them each KV head is replicated on N/H_kv consecutive
ranks (rank r holds KV head r·H_kv/N), so every rank's query heads find their group's KV.
"""
from __future__ import annotations

import numpy as np


def query_heads(rank: int, world: int, num_heads: int) -> range:
    per = num_heads // world
    return range(rank * per, (rank + 1) * per)


def kv_heads(rank: int, world: int, num_kv_heads: int) -> range:
    if world <= num_kv_heads:
        per = num_kv_heads // world
        return range(rank * per, (rank + 1) * per)
    head = rank * num_kv_heads // world
    return range(head, head + 1)


def kv_heads_per_rank(world: int, num_kv_heads: int) -> int:
    return len(kv_heads(0, world, num_kv_heads))


def shard_caches(feeds: dict[str, np.ndarray], world: int, num_kv_heads: int) -> list[dict[str, np.ndarray]]:
    """Each rank's feeds: the same step inputs, its KV heads of every ``past_*`` cache [B, H_kv, S_max, D]."""
    out = []
    for rank in range(world):
        heads = kv_heads(rank, world, num_kv_heads)
        out.append({name: np.ascontiguousarray(value[:, heads.start:heads.stop]) if name.startswith("past_")
                    else value for name, value in feeds.items()})
    return out


def gather_caches(outputs: list[dict[str, np.ndarray]], num_kv_heads: int) -> dict[str, np.ndarray]:
    """The whole model's ``present_*`` caches from the ranks' shards (a replicated head from its first rank)."""
    world = len(outputs)
    gathered = {}
    for name in (n for n in outputs[0] if n.startswith("present_")):
        parts, seen = [], set()
        for rank in range(world):
            heads = kv_heads(rank, world, num_kv_heads)
            if heads.start not in seen:
                seen.add(heads.start)
                parts.append(outputs[rank][name])
        gathered[name] = np.concatenate(parts, axis=1)
    return gathered


def vocab_range(rank: int, world: int, vocab_size: int) -> range:
    """The vocabulary slice of a vocab-parallel projection (lm_head, Medusa heads)."""
    per = vocab_size // world
    return range(rank * per, (rank + 1) * per)

"""The paged TensorRT engine's KV: per cache tensor (``key_0, value_0, …``) one pool of blocks
[N + 1, block_size, H_kv, D] in device memory, shared by every row and read and written by the
engine through each step's block table (contract/step.py, PAGED_INPUTS).

Pool block 0 is the scratch block (padding rows and unused table entries point there); the KV
manager's block k is pool block k + 1, so the manager's ids need no translation above this file.
A block holds its positions token-major, so one token's K (or V) of every KV head is one
contiguous run: moving an accepted speculative token is one copy per pool.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...contract.pipeline import stage_cache_names
from .kv_pools import device_alloc


@dataclass(frozen=True)
class BlockPoolShape:
    names: tuple[str, ...]  # the rank's caches: past_/present_ + name
    num_blocks: int         # the KV budget's blocks (the pool has one more: the scratch)
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: np.dtype

    @classmethod
    def of(cls, engine_dir, dtype, num_blocks: int, rank: int = 0) -> "BlockPoolShape":
        d = engine_dir
        return cls(names=tuple(stage_cache_names(d.rank_layers(rank))), num_blocks=num_blocks,
                   block_size=d.kv_cache.block_size, num_kv_heads=d.num_kv_heads, head_dim=d.head_dim,
                   dtype=np.dtype(dtype))

    @property
    def pool(self) -> tuple[int, int, int, int]:
        """One pool's shape as the engine binds it: [N + 1, block_size, H_kv, D]."""
        return (self.num_blocks + 1, self.block_size, self.num_kv_heads, self.head_dim)


def pool_block(block: int) -> int:
    """The pool block holding the KV manager's ``block`` (pool block 0 is the scratch)."""
    return block + 1


class DeviceBlockPools:
    """The pools in device memory (cuda-python), moved with copies on ``stream``."""

    def __init__(self, shape: BlockPoolShape, cudart, stream, ok):
        self.shape, self.cudart, self.stream, self.ok = shape, cudart, stream, ok
        self.token_bytes = shape.num_kv_heads * shape.head_dim * shape.dtype.itemsize
        self.block_bytes = shape.block_size * self.token_bytes
        self.pools = {name: device_alloc(cudart, ok, shape.pool[0] * self.block_bytes, zero=True)
                      for name in shape.names}

    @property
    def nbytes(self) -> int:
        return len(self.pools) * self.shape.pool[0] * self.block_bytes

    def _copy(self, dst: int, src: int, nbytes: int) -> None:
        self.ok(self.cudart.cudaMemcpyAsync(dst, src, nbytes, self.cudart.cudaMemcpyKind.cudaMemcpyDeviceToDevice,
                                            self.stream))

    def _token(self, name: str, blocks: tuple[int, ...], position: int) -> int:
        bs = self.shape.block_size
        return self.pools[name] + pool_block(blocks[position // bs]) * self.block_bytes + (position % bs) * self.token_bytes

    def keep_path_in_blocks(self, blocks: tuple[int, ...], start: int, nodes: tuple[int, ...]) -> None:
        """Positions start + nodes[i] → start + 1 + i, in order (nodes[i] ≥ i + 1: no source is
        overwritten before it is read), one token-sized copy per pool and kept token."""
        for name in self.pools:
            for i, node in enumerate(nodes):
                self._copy(self._token(name, blocks, start + 1 + i), self._token(name, blocks, start + node),
                           self.token_bytes)

    def read(self, name: str) -> np.ndarray:
        """A pool's contents on the host [N + 1, block_size, H_kv, D] (synchronizes the stream)."""
        out = np.empty(self.shape.pool, self.shape.dtype)
        self.ok(self.cudart.cudaStreamSynchronize(self.stream))
        self.ok(self.cudart.cudaMemcpy(out.ctypes.data, self.pools[name], out.nbytes,
                                       self.cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost))
        return out

    def close(self) -> None:
        for ptr in self.pools.values():
            self.cudart.cudaFree(ptr)

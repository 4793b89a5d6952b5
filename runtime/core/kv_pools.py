"""KV-cache pools and the four moves the scheduler asks of them, in host memory (the ONNX
Runtime backend) and in device memory (the TensorRT backend, cuda-python).

A pool per cache tensor (``key_0, value_0, …``): ``capacity`` slots of [H_kv, S_max, D] (the
last one the scratch slot the slot table swaps through); a prefix store of blocks
[H_kv, block_size, D] per cache tensor, one per block of the KV budget (runtime/core/kv_manager.py).
The host pools are demand-paged: an anonymous MAP_NORESERVE mapping the OS backs page by page as
it is written, and the pages of discarded slots and blocks are handed back (MADV_DONTNEED), so
rows and blocks cost what they hold and the KV budget bounds the sum. Device memory cannot be
demand-paged: the TensorRT pools reserve every slot in full. The two implementations must agree byte for byte:
tools/gpu_memory_check.py compares them on a real GPU, tests on the simulated device.
"""
from __future__ import annotations

import mmap
import sys
from dataclasses import dataclass

import numpy as np

from ...contract.pipeline import stage_cache_names


@dataclass(frozen=True)
class PoolShape:
    num_layers: int      # the caches' layers: first_layer … first_layer + num_layers - 1
    capacity: int        # slots, the scratch slot included
    num_kv_heads: int
    max_seq_len: int
    head_dim: int
    dtype: np.dtype      # numpy element type (bfloat16 pools hold uint16 on the host side)
    prefix_blocks: int
    block_size: int
    first_layer: int = 0  # a pipeline stage's first layer (its caches keep the global layer names)

    @classmethod
    def of(cls, engine_dir, dtype, prefix_blocks: int, block_size: int, rank: int = 0) -> "PoolShape":
        """The pools of ``rank``'s engine: its stage's layers, its KV heads."""
        d = engine_dir
        layers = d.rank_layers(rank)
        return cls(num_layers=len(layers), capacity=d.max_batch_size + 1, num_kv_heads=d.num_kv_heads,
                   max_seq_len=d.max_seq_len, head_dim=d.head_dim, dtype=np.dtype(dtype),
                   prefix_blocks=prefix_blocks, block_size=block_size, first_layer=layers.start)

    @property
    def names(self) -> list[str]:
        return stage_cache_names(range(self.first_layer, self.first_layer + self.num_layers))

    @property
    def slot(self) -> tuple[int, int, int]:
        return (self.num_kv_heads, self.max_seq_len, self.head_dim)

    @property
    def block(self) -> tuple[int, int, int]:
        return (self.num_kv_heads, self.block_size, self.head_dim)


# Linux's flag (not in Python's mmap module): reserve no swap for the mapping, so a large
# mostly-unwritten pool is not refused under strict overcommit.
MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux") else 0)
RETURNS_PAGES = hasattr(mmap, "MADV_DONTNEED") and hasattr(mmap.mmap, "madvise")


class PagedArray:
    """A zero-filled numpy array over an anonymous private mapping that the OS backs only where
    it is written; ``discard(start, stop)`` hands back the whole pages inside a byte range (they
    read back as zeros). Where the platform has no MADV_DONTNEED the range is zeroed instead:
    the contents agree, the memory is not returned (``RETURNS_PAGES`` says which)."""

    def __init__(self, shape: tuple[int, ...], dtype: np.dtype):
        count, page = int(np.prod(shape)), mmap.PAGESIZE
        self.nbytes = count * dtype.itemsize
        self.offset = page  # one PROT_NONE guard page each side: the kernel never merges this
        size = self.offset + max(-(-self.nbytes // page), 1) * page + page  # mapping with a neighbour
        self.map = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE)
        _guard(self.map, 0, page)
        _guard(self.map, size - page, page)
        if RETURNS_PAGES and hasattr(mmap, "MADV_NOHUGEPAGE"):
            # 4 KiB pages: a transparent huge page would back 2 MiB for a row's first write.
            self.map.madvise(mmap.MADV_NOHUGEPAGE, self.offset, size - 2 * page)
        self.array = np.frombuffer(self.map, dtype, count=count, offset=self.offset).reshape(shape)
        self._bytes = self.array.reshape(-1).view(np.uint8)

    def discard(self, start: int, stop: int) -> None:
        """Bytes [start, stop) hold nothing: their whole pages go back (the partial pages at
        either end stay, their bytes as they were)."""
        if not RETURNS_PAGES:
            self._bytes[start:stop] = 0
            return
        page = mmap.PAGESIZE
        first, last = -(-start // page) * page, stop // page * page
        if last > first:
            self.map.madvise(mmap.MADV_DONTNEED, self.offset + first, last - first)


def _guard(mapping: mmap.mmap, start: int, length: int) -> None:
    """PROT_NONE on [start, start + length) of ``mapping`` where libc has mprotect (else nothing)."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return
    buffer = ctypes.c_char.from_buffer(mapping, start)
    libc.mprotect(ctypes.c_void_p(ctypes.addressof(buffer)), ctypes.c_size_t(length), 0)
    del buffer


class HostPools:
    """numpy pools [capacity, H_kv, S_max, D] and blocks [prefix_blocks, H_kv, block_size, D],
    demand-paged (``PagedArray``)."""

    def __init__(self, shape: PoolShape):
        self.shape = shape
        self._paged = {n: PagedArray((shape.capacity, *shape.slot), shape.dtype) for n in shape.names}
        self._paged_blocks = {n: PagedArray((shape.prefix_blocks, *shape.block), shape.dtype) for n in shape.names}
        self.pools = {n: paged.array for n, paged in self._paged.items()}
        self.blocks = {n: paged.array for n, paged in self._paged_blocks.items()}
        itemsize = shape.dtype.itemsize
        self._position = shape.head_dim * itemsize                 # one position of one head
        self._head = shape.max_seq_len * self._position            # one head's positions in a slot
        self._slot = shape.num_kv_heads * self._head
        self._block = shape.num_kv_heads * shape.block_size * self._position

    def copy_slot(self, src: int, dst: int, length: int) -> None:
        for pool in self.pools.values():
            pool[dst, :, :length] = pool[src, :, :length]  # [H_kv, length, D]
        self.discard_tail(dst, length)  # what the slot held before past `length` is garbage now

    def discard_tail(self, slot: int, keep: int) -> None:
        """Positions [keep, S_max) of ``slot``'s heads hold nothing: their pages go back."""
        for paged in self._paged.values():
            for head in range(self.shape.num_kv_heads):
                base = slot * self._slot + head * self._head
                paged.discard(base + keep * self._position, base + self._head)

    def discard(self, slots: tuple[int, ...], blocks: tuple[int, ...]) -> None:
        for slot in slots:
            for paged in self._paged.values():
                paged.discard(slot * self._slot, (slot + 1) * self._slot)
        for block in blocks:
            for paged in self._paged_blocks.values():
                paged.discard(block * self._block, (block + 1) * self._block)

    def resident_bytes(self) -> int:
        """Bytes of the pools and blocks the OS backs now (Linux only: /proc/self/smaps)."""
        return sum(_resident(p) for p in [*self._paged.values(), *self._paged_blocks.values()])

    def keep_path(self, slot: int, start: int, nodes: tuple[int, ...]) -> None:
        source = start + np.asarray(nodes)
        for pool in self.pools.values():
            cache = pool[slot]  # [H_kv, S_max, D]
            cache[:, start + 1:start + 1 + len(nodes)] = cache[:, source]  # the gather copies first

    def _span(self, index: int) -> slice:
        return slice(index * self.shape.block_size, (index + 1) * self.shape.block_size)

    def save_block(self, slot: int, index: int, block: int) -> None:
        for name, pool in self.pools.items():
            self.blocks[name][block] = pool[slot, :, self._span(index)]

    def load_block(self, block: int, slot: int, index: int) -> None:
        for name, pool in self.pools.items():
            pool[slot, :, self._span(index)] = self.blocks[name][block]


def _resident(paged: PagedArray) -> int:
    """The mapping's Rss (pages read but never written map the shared zero page, which Rss does
    not count)."""
    return int(smaps_field(paged.array.ctypes.data, "Rss")[0]) * 1024


def smaps_field(address: int, field: str) -> list[str]:
    """The values of ``field`` (Rss, VmFlags, …) of the mapping holding ``address``, from
    /proc/self/smaps (Linux)."""
    with open("/proc/self/smaps") as handle:
        inside = False
        for line in handle:
            head = line.split(None, 1)[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == f"{field}:":
                return line.split()[1:]
    raise LookupError(f"no mapping holds {address:#x} in /proc/self/smaps")


def device_alloc(cudart, ok, nbytes: int, zero: bool = False) -> int:
    """cudaMalloc (and cudaMemset to 0 when asked): an address as an int."""
    ptr = int(ok(cudart.cudaMalloc(nbytes)))
    if zero:
        ok(cudart.cudaMemset(ptr, 0, nbytes))
    return ptr


class DevicePools:
    """The same pools in device memory, moved with 2-D copies on ``stream`` (rows = KV heads,
    pitch = one head's S_max positions), so a move costs the bytes it moves."""

    def __init__(self, shape: PoolShape, cudart, stream, ok):
        """``ok`` unwraps a cuda-python result tuple, raising on an error."""
        self.shape, self.cudart, self.stream, self.ok = shape, cudart, stream, ok
        s = shape
        self.position = s.head_dim * s.dtype.itemsize           # one position of one head
        self.row = s.max_seq_len * self.position                 # one head's positions in a slot
        self.slot_bytes = s.num_kv_heads * self.row
        self.block_bytes = s.num_kv_heads * s.block_size * self.position
        self.pools = {n: device_alloc(cudart, ok, s.capacity * self.slot_bytes, zero=True) for n in s.names}
        self.blocks = {n: device_alloc(cudart, ok, max(1, s.prefix_blocks) * self.block_bytes) for n in s.names}

    def slot_address(self, name: str, slot: int) -> int:
        return self.pools[name] + slot * self.slot_bytes

    def _copy2d(self, dst: int, dst_pitch: int, src: int, src_pitch: int, width: int) -> None:
        self.ok(self.cudart.cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, width, self.shape.num_kv_heads,
                                              self.cudart.cudaMemcpyKind.cudaMemcpyDeviceToDevice, self.stream))

    def copy_slot(self, src: int, dst: int, length: int) -> None:
        """Positions [0, length) of each KV head: one 2-D copy per pool."""
        for name in self.pools:
            self._copy2d(self.slot_address(name, dst), self.row, self.slot_address(name, src), self.row,
                         length * self.position)

    def keep_path(self, slot: int, start: int, nodes: tuple[int, ...]) -> None:
        for name in self.pools:
            base = self.slot_address(name, slot)
            for i, node in enumerate(nodes):  # in order: node ≥ i + 1, so no source is overwritten first
                self._copy2d(base + (start + 1 + i) * self.position, self.row, base + (start + node) * self.position,
                             self.row, self.position)

    def save_block(self, slot: int, index: int, block: int) -> None:
        offset, pitch = index * self.shape.block_size * self.position, self.block_bytes // self.shape.num_kv_heads
        for name in self.pools:
            self._copy2d(self.blocks[name] + block * self.block_bytes, pitch, self.slot_address(name, slot) + offset,
                         self.row, pitch)

    def load_block(self, block: int, slot: int, index: int) -> None:
        offset, pitch = index * self.shape.block_size * self.position, self.block_bytes // self.shape.num_kv_heads
        for name in self.pools:
            self._copy2d(self.slot_address(name, slot) + offset, self.row, self.blocks[name] + block * self.block_bytes,
                         pitch, pitch)

    def read(self, name: str) -> np.ndarray:
        """A pool's contents on the host [capacity, H_kv, S_max, D] (synchronizes the stream)."""
        out = np.empty((self.shape.capacity, *self.shape.slot), self.shape.dtype)
        self.ok(self.cudart.cudaStreamSynchronize(self.stream))
        self.ok(self.cudart.cudaMemcpy(out.ctypes.data, self.pools[name], out.nbytes,
                                       self.cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost))
        return out

    def write(self, name: str, values: np.ndarray) -> None:
        """Replaces a pool's contents from the host (synchronous)."""
        values = np.ascontiguousarray(values, self.shape.dtype)
        assert values.shape == (self.shape.capacity, *self.shape.slot), values.shape
        self.ok(self.cudart.cudaStreamSynchronize(self.stream))
        self.ok(self.cudart.cudaMemcpy(self.pools[name], values.ctypes.data, values.nbytes,
                                       self.cudart.cudaMemcpyKind.cudaMemcpyHostToDevice))

    def close(self) -> None:
        for ptr in [*self.pools.values(), *self.blocks.values()]:
            self.cudart.cudaFree(ptr)

"""A checkpoint's weights as a map read from the safetensors headers: name → file, offset,
dtype, shape. Nothing is loaded until a tensor is asked for, and then only that tensor (or
that slice of it), memory-mapped from its file.

This is how a build stays bounded by one tensor rather than by the model: export works on a
meta-device model, and whoever needs bytes (the weight writer, quantization, sharding, the
numerics check's truncated reference) reads them here, one at a time.

The files are untrusted input: every header is checked against its file's size before any
offset is used, each name appears once across the files, and only ``*.safetensors`` files
directly inside the checkpoint dir (not links leading out of it) are read.
"""
from __future__ import annotations

import json
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ...contract.checkpoint import CheckpointError, weight_files

MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit

# The tables indexed by token id: the numerics check of a large model keeps only their first rows.
VOCAB_KEYS = ("model.embed_tokens.weight", "lm_head.weight")

# safetensors dtype → (torch dtype, numpy dtype with the same width, read as raw bits)
DTYPES = {
    "F32": (torch.float32, np.float32), "F16": (torch.float16, np.float16), "BF16": (torch.bfloat16, np.uint16),
    "F64": (torch.float64, np.float64), "I64": (torch.int64, np.int64), "I32": (torch.int32, np.int32),
    "I16": (torch.int16, np.int16), "I8": (torch.int8, np.int8), "U8": (torch.uint8, np.uint8),
    "BOOL": (torch.bool, np.bool_),
}


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes lie: ``offset`` is absolute in ``file``."""

    name: str
    file: Path
    offset: int
    dtype: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape)) if self.shape else 1

    @property
    def nbytes(self) -> int:
        return self.numel * np.dtype(DTYPES[self.dtype][1]).itemsize

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype][0]


class WeightMap:
    """The tensors of a checkpoint dir's safetensors files, by name."""

    def __init__(self, entries: dict[str, TensorEntry]):
        self.entries = entries

    @classmethod
    def from_checkpoint(cls, checkpoint: Path) -> "WeightMap":
        checkpoint = Path(checkpoint)
        root = checkpoint.resolve()
        entries: dict[str, TensorEntry] = {}
        for path in weight_files(checkpoint):
            if path.resolve().parent != root:
                raise CheckpointError(f"{path}: leads outside the checkpoint dir {checkpoint}; "
                                      "copy the file into it")
            for entry in _read_header(path):
                if entry.name in entries:
                    raise CheckpointError(f"{path}: tensor {entry.name} is also in {entries[entry.name].file.name}; "
                                          "each tensor must be in one file")
                entries[entry.name] = entry
        return cls(entries)

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def names(self) -> list[str]:
        return list(self.entries)

    @property
    def total_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())

    def entry(self, name: str) -> TensorEntry:
        entry = self.entries.get(name)
        if entry is None:
            files = sorted({e.file.name for e in self.entries.values()})
            raise CheckpointError(f"tensor {name} is not in the checkpoint's safetensors files ({', '.join(files)})")
        return entry

    def tensor(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The whole tensor, memory-mapped copy-on-write: a write (fake quantization in place)
        lands in private memory, never in the checkpoint; converted to ``dtype`` as a copy."""
        entry = self.entry(name)
        array = np.memmap(entry.file, dtype=DTYPES[entry.dtype][1], mode="c", offset=entry.offset,
                          shape=(entry.numel,))
        return _as_torch(array, entry, entry.shape, dtype)

    def for_shape(self, name: str, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> torch.Tensor:
        """The tensor a model of ``shape`` holds: the whole tensor, or for a vocabulary table
        (VOCAB_KEYS) cut to fewer rows, only its first rows. Any other difference is the caller's
        shape error to report."""
        stored = self.entry(name).shape
        if name in VOCAB_KEYS and len(shape) == len(stored) and tuple(shape[1:]) == stored[1:] and shape[0] < stored[0]:
            return self.rows(name, 0, shape[0], dtype)
        return self.tensor(name, dtype)

    def rows(self, name: str, start: int, stop: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Rows ``[start, stop)`` of axis 0, reading only their bytes (a rank's slice of a
        column-parallel weight stored [out, in])."""
        entry = self.entry(name)
        if not entry.shape or not 0 <= start <= stop <= entry.shape[0]:
            raise ValueError(f"{name}: rows [{start}, {stop}) outside shape {entry.shape}")
        row = int(np.prod(entry.shape[1:])) if len(entry.shape) > 1 else 1
        width = np.dtype(DTYPES[entry.dtype][1]).itemsize
        array = np.memmap(entry.file, dtype=DTYPES[entry.dtype][1], mode="c", offset=entry.offset + start * row * width,
                          shape=((stop - start) * row,))
        return _as_torch(array, entry, (stop - start, *entry.shape[1:]), dtype)


def _as_torch(array: np.ndarray, entry: TensorEntry, shape: tuple[int, ...], dtype: torch.dtype | None) -> torch.Tensor:
    with warnings.catch_warnings():
        tensor = torch.from_numpy(array).view(entry.torch_dtype).reshape(shape)
    if dtype is not None and dtype != entry.torch_dtype:
        return tensor.to(dtype)
    return tensor


def _read_header(path: Path) -> list[TensorEntry]:
    size = path.stat().st_size
    with open(path, "rb") as handle:
        head = handle.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
        (length,) = struct.unpack("<Q", head)
        if length > min(MAX_HEADER_BYTES, size - 8):
            raise CheckpointError(f"{path}: safetensors header of {length} bytes does not fit the file ({size} bytes)")
        try:
            header = json.loads(handle.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{path}: safetensors header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: safetensors header is not a JSON object")
    base = 8 + length
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        entries.append(_entry(path, name, info, base, size))
    return entries


def _entry(path: Path, name: str, info, base: int, size: int) -> TensorEntry:
    if not isinstance(info, dict):
        raise CheckpointError(f"{path}: tensor {name}: header entry is not an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in DTYPES:
        raise CheckpointError(f"{path}: tensor {name}: dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if not (isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
        raise CheckpointError(f"{path}: tensor {name}: shape {shape!r} is not a list of sizes")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) and o >= 0 for o in offsets)):
        raise CheckpointError(f"{path}: tensor {name}: data_offsets {offsets!r} is not [begin, end]")
    entry = TensorEntry(name=name, file=path, offset=base + offsets[0], dtype=dtype, shape=tuple(shape))
    if offsets[1] - offsets[0] != entry.nbytes or base + offsets[1] > size:
        raise CheckpointError(f"{path}: tensor {name}: data_offsets {offsets} do not hold {entry.shape} of {dtype} "
                              f"within the file ({size} bytes)")
    return entry

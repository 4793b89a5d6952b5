"""A checkpoint's weights as a map read from the safetensors headers: name → file, offset,
dtype, shape. Nothing is loaded until a tensor is asked for, and then only that tensor (or
that slice of it), memory-mapped from its file.

This is how a build stays bounded by one tensor rather than by the model: export works on a
meta-device model, and whoever needs bytes (the weight writer, quantization, sharding, the
numerics check's truncated reference, Medusa heads, eval's checkpoint model) reads them here,
one at a time.

The files are untrusted input: each header is checked as the format defines it
(checkpoint.safetensors_header) before any offset is used, each name appears once across the
files, only files directly inside the dir (not links leading out of it) are read, and a
checkpoint's index must agree with its files' headers tensor for tensor.
"""
from __future__ import annotations

import math
import warnings
from pathlib import Path

import numpy as np
import torch

from .errors import CheckpointError
from .safetensors_files import INDEX_FILE, read_index, weight_files
from .safetensors_header import DTYPES, TensorEntry, read_header
from ..contract.paths import path_inside

# The tables indexed by token id: the numerics check of a large model keeps only their first rows.
VOCAB_KEYS = ("model.embed_tokens.weight", "lm_head.weight")


class WeightMap:
    """The tensors of a checkpoint dir's safetensors files, by name."""

    def __init__(self, entries: dict[str, TensorEntry]):
        self.entries = entries

    @classmethod
    def from_checkpoint(cls, checkpoint: Path) -> "WeightMap":
        """The files ``model.safetensors.index.json`` names, or without one every ``*.safetensors``."""
        checkpoint = Path(checkpoint)
        index = read_index(checkpoint)
        weights = cls.from_files(checkpoint, weight_files(checkpoint, index))
        if index is not None:
            _check_index(checkpoint / INDEX_FILE, index, weights)
        return weights

    @classmethod
    def from_files(cls, directory: Path, files: list[Path]) -> "WeightMap":
        """The tensors of ``files``, each a regular file directly inside ``directory``."""
        entries: dict[str, TensorEntry] = {}
        for path in files:
            if not Path(path).is_relative_to(directory) or path_inside(directory, Path(path).relative_to(directory)) is None:
                raise CheckpointError(f"{path}: leads outside the dir {directory}; copy the file into it")
            if not path.is_file():
                raise CheckpointError(f"{path}: not a file (a safetensors file is expected)")
            for entry in read_header(path):
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
        return _mapped(entry, 0, entry.numel, entry.shape, dtype)

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
        row = math.prod(entry.shape[1:])
        return _mapped(entry, start * row, (stop - start) * row, (stop - start, *entry.shape[1:]), dtype)


def _mapped(entry: TensorEntry, first: int, count: int, shape: tuple[int, ...],
            dtype: torch.dtype | None) -> torch.Tensor:
    """Elements [first, first + count) of ``entry`` as a tensor of ``shape``, memory-mapped."""
    array = np.memmap(entry.file, dtype=DTYPES[entry.dtype][1], mode="c",
                      offset=entry.offset + first * entry.itemsize, shape=(count,))
    return as_torch(array, entry, shape, dtype)


def as_torch(array: np.ndarray, entry: TensorEntry, shape: tuple[int, ...], dtype: torch.dtype | None) -> torch.Tensor:
    """``array`` (elements of ``entry``'s stored dtype, raw bits) as a tensor of ``shape``, converted
    to ``dtype`` (a copy) where given and different."""
    with warnings.catch_warnings():
        tensor = torch.from_numpy(array).view(entry.torch_dtype).reshape(shape)
    if dtype is not None and dtype != entry.torch_dtype:
        return tensor.to(dtype)
    return tensor


def _check_index(path: Path, index: dict[str, str], weights: WeightMap) -> None:
    """Every tensor the index names is in the file it says, and the files hold no other."""
    for name, file in index.items():
        entry = weights.entries.get(name)
        if entry is None or entry.file.name != file:
            found = f"it is in {entry.file.name}" if entry is not None else f"{file} does not hold it"
            raise CheckpointError(f"{path}: weight_map puts tensor {name} in {file}, but {found}")
    for name, entry in weights.entries.items():
        if name not in index:
            raise CheckpointError(f"{path}: weight_map does not name tensor {name}, which {entry.file.name} holds")

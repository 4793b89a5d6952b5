"""One safetensors file's header, checked as the safetensors format defines it before any offset
is used: 8 bytes of little-endian header length, a JSON object of at most 100 MiB and shallow
nesting (measured before parsing), then the data region, covered exactly by the tensors' byte
spans in order: no span inverted, none overlapping another, no gap, none past the file's end.

Sizes are Python integers throughout: a numpy product of a hostile shape wraps around int64
and can make a negative byte count agree with hostile offsets.
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .errors import CheckpointError
from ..contract.json_file import parse_json

MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit
# A header is {name: {"shape": [...]}} plus "__metadata__" {str: str}: three levels.
MAX_HEADER_NESTING = 3
MAX_DIM = 2**63 - 1  # torch and numpy index with int64

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
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return np.dtype(DTYPES[self.dtype][1]).itemsize

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype][0]


def read_header(path: Path) -> list[TensorEntry]:
    """The tensors of one safetensors file; raises CheckpointError naming the file (and the
    tensor) for anything the format does not allow."""
    size = path.stat().st_size
    with open(path, "rb") as handle:
        head = handle.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
        (length,) = struct.unpack("<Q", head)
        if length > MAX_HEADER_BYTES:
            raise CheckpointError(f"{path}: safetensors header of {length} bytes is over the format's "
                                  f"{MAX_HEADER_BYTES} bytes")
        if length > size - 8:
            raise CheckpointError(f"{path}: safetensors header of {length} bytes does not fit the file ({size} bytes)")
        raw = handle.read(length)
    if not raw.startswith(b"{"):
        raise CheckpointError(f"{path}: safetensors header is not a JSON object")
    try:
        header = parse_json(raw, f"{path}: safetensors header", MAX_HEADER_NESTING)
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: safetensors header is not a JSON object")
    metadata = header.pop("__metadata__", {})
    if not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        raise CheckpointError(f"{path}: __metadata__ is not an object of strings")
    spans = [_span(path, name, info) for name, info in header.items()]
    return _covering(path, spans, 8 + length, size)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _span(path: Path, name: str, info) -> tuple[int, int, str, str, tuple[int, ...]]:
    """(begin, end, name, dtype, shape) of one header entry, its own fields checked."""
    where = f"{path}: tensor {name}"
    if not isinstance(info, dict):
        raise CheckpointError(f"{where}: header entry is not an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in DTYPES:
        raise CheckpointError(f"{where}: dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if not (isinstance(shape, list) and all(_is_int(d) and 0 <= d <= MAX_DIM for d in shape)):
        raise CheckpointError(f"{where}: shape {shape!r} is not a list of sizes (integers 0 to 2**63 - 1)")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) and o >= 0 for o in offsets)):
        raise CheckpointError(f"{where}: data_offsets {offsets!r} is not [begin, end] (integers ≥ 0)")
    begin, end = offsets
    if begin > end:
        raise CheckpointError(f"{where}: data_offsets {offsets} are inverted (begin after end)")
    nbytes = math.prod(shape) * np.dtype(DTYPES[dtype][1]).itemsize
    if end - begin != nbytes:
        raise CheckpointError(f"{where}: data_offsets {offsets} span {end - begin} bytes; shape {shape} "
                              f"of {dtype} is {nbytes} bytes (they do not hold it)")
    return begin, end, name, dtype, tuple(shape)


def _covering(path: Path, spans: list, base: int, size: int) -> list[TensorEntry]:
    """The entries, once their spans, in order, cover the data region [0, size - base) exactly."""
    data = size - base
    entries, covered, previous = [], 0, None
    for begin, end, name, dtype, shape in sorted(spans):
        if end > data:
            raise CheckpointError(f"{path}: tensor {name}: data_offsets [{begin}, {end}] run past the end of the "
                                  f"file's data ({data} bytes)")
        if begin < covered:
            raise CheckpointError(f"{path}: tensor {name}: data_offsets [{begin}, {end}] overlap tensor {previous}'s "
                                  f"(which ends at {covered})")
        if begin > covered:
            raise CheckpointError(f"{path}: tensor {name}: data_offsets [{begin}, {end}] leave bytes "
                                  f"[{covered}, {begin}) of the data belonging to no tensor")
        entries.append(TensorEntry(name=name, file=path, offset=base + begin, dtype=dtype, shape=shape))
        covered, previous = end, name
    if covered != data:
        raise CheckpointError(f"{path}: bytes [{covered}, {data}) of the data belong to no tensor "
                              "(the tensors must cover the data region exactly)")
    return entries

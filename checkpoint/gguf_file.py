"""A GGUF file's header read under bounds: metadata (key → value) and the tensor table (name →
GGML type, dims, where its bytes lie). Nothing of the tensors' data is read here.

The file is untrusted input, and the `gguf` package's own reader trusts it (it loops over
whatever element count an array states, and checks no tensor against the file's size), so this
reader is the trust boundary: every count is checked against the bytes left before it is used,
strings and arrays have a ceiling, arrays do not nest, each tensor's type is one this builder
dequantizes, its dims are sane, its bytes lie aligned inside the file and overlap no other
tensor's. What passes is plain Python data; the `gguf` package supplies only the format's
constants (type ids, block sizes) and, later, the dequantization. The file stays open
(checkpoint/opened_file.py): its tensors are read through the handle the header was read from.
"""
from __future__ import annotations

import functools
import math
import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .errors import CheckpointError
from .opened_file import FileIdentity, OpenedFile

MAGIC = b"GGUF"
VERSIONS = (2, 3)  # version 1 had 32-bit counts; llama.cpp writes 3
DEFAULT_ALIGNMENT = 32
MAX_ALIGNMENT = 1 << 16
MAX_KEY_BYTES = 1024
MAX_STRING_BYTES = 16 * 2**20      # a chat template is kilobytes; a whole file's worth is hostile
MAX_ARRAY_ITEMS = 4 * 2**20        # a vocabulary is ~10^5 tokens (Gemma's 2.6·10^5), its merges as many
# Items of all arrays together: each string item becomes a Python object (~50 bytes), so the
# budget bounds the header's memory (≈ 0.4 GB at worst) whatever the file's size. Above
# MAX_ARRAY_ITEMS, so each bound refuses something the other lets through.
MAX_TOTAL_ITEMS = 8 * 2**20
MAX_ITEMS = 65536                  # metadata keys, tensors
MAX_DIMS = 4                       # GGML_MAX_DIMS
MAX_ELEMENTS = 2**40               # per tensor: far above any model, far below an overflow

# GGUF metadata value types → (struct code, numpy dtype) for the fixed-width ones.
SCALARS = {0: ("<B", np.uint8), 1: ("<b", np.int8), 2: ("<H", np.uint16), 3: ("<h", np.int16),
           4: ("<I", np.uint32), 5: ("<i", np.int32), 6: ("<f", np.float32), 7: ("<?", np.bool_),
           10: ("<Q", np.uint64), 11: ("<q", np.int64), 12: ("<d", np.float64)}
STRING, ARRAY = 8, 9

# The GGML tensor types this builder reads, by the name the `gguf` package gives them.
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                   "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of the table: ``dims`` in GGML order (innermost first), ``offset`` absolute."""

    name: str
    type_name: str
    dims: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """The row-major shape (PyTorch's and Hugging Face's): GGML's dims reversed."""
        return tuple(reversed(self.dims))


@dataclass(frozen=True)
class GGUFFile:
    path: Path
    metadata: dict[str, object]
    tensors: dict[str, GGUFTensor]
    opened: OpenedFile = field(compare=False, repr=False)  # the file the header was read from, still open


def read_gguf(path: Path) -> GGUFFile:
    """The header of the GGUF file at ``path``; a CheckpointError naming the file and what is
    wrong if it is not a well-formed GGUF file this builder can read. Parsed once per file
    version: a build asks for it from several places (spec, side files, weights, tokenizer)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: GGUF file does not exist")
    return _parsed(path, FileIdentity.of(path.stat()))


@functools.lru_cache(maxsize=4)
def _parsed(path: Path, identity: FileIdentity) -> GGUFFile:
    """The header of the file ``path`` named as ``identity`` (another file there, or this one
    changed, is read again), read from the handle its tensors will be read through."""
    size = identity.size
    if size < 24:
        raise CheckpointError(f"{path}: not a GGUF file ({size} bytes, shorter than its header)")
    opened = OpenedFile(path)
    if opened.identity != identity:
        opened.close()
        raise CheckpointError(f"{path}: changed while its header was being read; "
                              "leave the file unchanged during a build")
    try:
        with mmap.mmap(opened.fileno(), 0, access=mmap.ACCESS_READ) as view:
            metadata, tensors = _Parser(path, view, size).file()
    except BaseException:
        opened.close()
        raise
    return GGUFFile(path, metadata, tensors, opened)


class _Parser:
    """A cursor over the mapped file; every read checks the bytes it needs are there."""

    def __init__(self, path: Path, view: mmap.mmap, size: int):
        self.path, self.view, self.size, self.pos = path, view, size, 0
        self.items_left = MAX_TOTAL_ITEMS

    def fail(self, message: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: {message}")

    def take(self, count: int, what: str) -> int:
        """Advances past ``count`` bytes; returns where they start."""
        if count > self.size - self.pos:
            raise self.fail(f"{what} at byte {self.pos} needs {count} bytes; the file ends at {self.size}")
        start, self.pos = self.pos, self.pos + count
        return start

    def scalar(self, code: str, what: str):
        return struct.unpack_from(code, self.view, self.take(struct.calcsize(code), what))[0]

    def string(self, what: str, limit: int = MAX_STRING_BYTES) -> str:
        length = self.scalar("<Q", what)
        if length > limit:
            raise self.fail(f"{what} is {length} bytes long; at most {limit} are accepted")
        start = self.take(length, what)
        try:
            return self.view[start:start + length].decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not UTF-8") from None

    def count(self, what: str, limit: int, item_bytes: int) -> int:
        """A stated count, refused above ``limit`` or where its items (each at least
        ``item_bytes``) cannot fit the bytes left."""
        value = self.scalar("<Q", what)
        if value > limit or value * item_bytes > self.size - self.pos:
            raise self.fail(f"{what} is {value}, more than {'the file can hold' if value <= limit else limit}")
        return value

    def file(self) -> tuple[dict[str, object], dict[str, GGUFTensor]]:
        """The metadata and the tensor table."""
        if bytes(self.view[:4]) != MAGIC:
            raise self.fail(f"not a GGUF file (starts with {bytes(self.view[:4])!r}, not {MAGIC!r})")
        self.pos = 4
        version = self.scalar("<I", "version")
        if version not in VERSIONS:
            raise self.fail(f"GGUF version {version} is not supported; supported: {', '.join(map(str, VERSIONS))}")
        tensor_count = self.count("tensor count", MAX_ITEMS, 8 + 4 + 8 + 4 + 8)
        kv_count = self.count("metadata key count", MAX_ITEMS, 8 + 4 + 1)
        metadata: dict[str, object] = {}
        for _ in range(kv_count):
            key = self.string("a metadata key", MAX_KEY_BYTES)
            if key in metadata:
                raise self.fail(f"metadata key {key!r} appears twice")
            metadata[key] = self.value(self.scalar("<I", f"type of {key}"), key)
        alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if isinstance(alignment, bool) or not isinstance(alignment, int) or not 0 < alignment <= MAX_ALIGNMENT \
                or alignment & (alignment - 1):
            raise self.fail(f"general.alignment {alignment!r} is not a power of two up to {MAX_ALIGNMENT}")
        infos = [self.tensor_info() for _ in range(tensor_count)]
        data_start = -(-self.pos // alignment) * alignment
        tensors: dict[str, GGUFTensor] = {}
        for name, type_name, dims, relative, nbytes in infos:
            if name in tensors:
                raise self.fail(f"tensor {name} appears twice in the tensor table")
            if relative % alignment:
                raise self.fail(f"tensor {name}: offset {relative} is not a multiple of the alignment {alignment}")
            if data_start + relative + nbytes > self.size:
                raise self.fail(f"tensor {name}: its {nbytes} bytes at offset {relative} run past the end of "
                                f"the file ({self.size} bytes)")
            tensors[name] = GGUFTensor(name, type_name, dims, data_start + relative, nbytes)
        _check_disjoint(self, sorted(tensors.values(), key=lambda t: t.offset))
        return metadata, tensors

    def value(self, kind: int, key: str):
        if kind in SCALARS:
            code, _ = SCALARS[kind]
            return self.scalar(code, f"value of {key}")
        if kind == STRING:
            return self.string(f"value of {key}")
        if kind != ARRAY:
            raise self.fail(f"metadata {key}: value type {kind} is not a GGUF type (0-12)")
        item = self.scalar("<I", f"item type of {key}")
        if item == ARRAY:
            raise self.fail(f"metadata {key}: an array of arrays; Llama-family metadata has none")
        if item not in SCALARS and item != STRING:
            raise self.fail(f"metadata {key}: array item type {item} is not a GGUF type (0-12)")
        width = 8 if item == STRING else np.dtype(SCALARS[item][1]).itemsize
        length = self.count(f"length of {key}", MAX_ARRAY_ITEMS, width)
        if length > self.items_left:
            raise self.fail(f"length of {key} is {length}, more than the {self.items_left} items left of the "
                            f"{MAX_TOTAL_ITEMS} all of the header's arrays may hold")
        self.items_left -= length
        if item == STRING:
            return [self.string(f"item {index} of {key}") for index in range(length)]
        start = self.take(length * width, f"items of {key}")
        # Numbers stay a compact array ([N] of their own width); readers convert what they use.
        return np.frombuffer(self.view, dtype=SCALARS[item][1], count=length, offset=start).copy()

    def tensor_info(self) -> tuple[str, str, tuple[int, ...], int, int]:
        import gguf

        name = self.string("a tensor name", MAX_KEY_BYTES)
        ndims = self.scalar("<I", f"tensor {name}: dimension count")
        if not 1 <= ndims <= MAX_DIMS:
            raise self.fail(f"tensor {name}: {ndims} dimensions; GGML tensors have 1 to {MAX_DIMS}")
        dims = tuple(self.scalar("<Q", f"tensor {name}: dims") for _ in range(ndims))
        numel = math.prod(dims)
        if 0 in dims or numel > MAX_ELEMENTS:
            raise self.fail(f"tensor {name}: dims {list(dims)} are not sizes of a real tensor "
                            f"(each at least 1, at most {MAX_ELEMENTS} elements)")
        type_id = self.scalar("<I", f"tensor {name}: type")
        try:
            kind = gguf.GGMLQuantizationType(type_id)
        except ValueError:
            raise self.fail(f"tensor {name}: type {type_id} is not a GGML type") from None
        if kind.name not in SUPPORTED_TYPES:
            raise self.fail(f"tensor {name}: type {kind.name} is not supported; supported: {', '.join(SUPPORTED_TYPES)}")
        block, type_size = gguf.GGML_QUANT_SIZES[kind]
        if dims[0] % block:
            raise self.fail(f"tensor {name}: its rows of {dims[0]} are not whole {kind.name} blocks of {block}")
        relative = self.scalar("<Q", f"tensor {name}: offset")
        return name, kind.name, dims, relative, numel // block * type_size


def _check_disjoint(parser: _Parser, ordered: list[GGUFTensor]) -> None:
    for before, after in zip(ordered, ordered[1:]):
        if after.offset < before.offset + before.nbytes:
            raise parser.fail(f"tensors {before.name} and {after.name} overlap in the file")

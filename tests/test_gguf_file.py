"""GGUF in, on small files written here: each block type dequantized as the `gguf` package does,
rows read block-wise, llama.cpp's rotary permutation undone, and hostile headers refused in one
line naming the file and what is wrong."""
from __future__ import annotations

import os
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from trtbuild.checkpoint.gguf_weights import GGUFWeightMap
from trtbuild.checkpoint.gguf_file import MAX_ARRAY_ITEMS, MAX_TOTAL_ITEMS, SUPPORTED_TYPES, read_gguf
from trtbuild.checkpoint.errors import CheckpointError

QUANTIZABLE = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")  # gguf.quants.quantize does these
LLAMA = {"llama.block_count": 1, "llama.context_length": 64, "llama.embedding_length": 256,
         "llama.feed_forward_length": 256, "llama.attention.head_count": 4, "llama.attention.head_count_kv": 2,
         "llama.vocab_size": 16}


def write_llama(path: Path, tensors: dict[str, tuple[np.ndarray, str]], block_count: int = 1) -> Path:
    """A llama GGUF of ``tensors`` {GGUF name: (values [rows, cols] float32, GGML type name)}; the
    K-quant types take ``values`` as their raw blocks (uint8), since the package cannot quantize them."""
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in {**LLAMA, "llama.block_count": block_count}.items():
        writer.add_uint32(key, value)
    for name, (values, type_name) in tensors.items():
        kind = gguf.GGMLQuantizationType[type_name]
        if values.dtype == np.uint8:
            writer.add_tensor(name, values, raw_dtype=kind)
        else:
            writer.add_tensor(name, gguf.quants.quantize(values, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def k_quant_blocks(type_name: str, rows: int, cols: int, rng) -> np.ndarray:
    """Random raw blocks of a K-quant type, their f16 scales kept finite and small."""
    kind = gguf.GGMLQuantizationType[type_name]
    block, size = gguf.GGML_QUANT_SIZES[kind]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    halves = {"Q2_K": [size - 4, size - 2], "Q3_K": [size - 2], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [size - 2]}
    for at in halves[type_name]:
        raw[..., at:at + 2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    return raw.reshape(rows, cols // block * size)


@pytest.mark.parametrize("type_name", SUPPORTED_TYPES)
def test_each_block_type_dequantizes_as_the_gguf_package_does(tmp_path, type_name):
    rng = np.random.default_rng(0)
    rows, cols = 6, 512
    if type_name in QUANTIZABLE:
        values = rng.standard_normal((rows, cols)).astype(np.float32)
    else:
        values = k_quant_blocks(type_name, rows, cols, rng)
    path = write_llama(tmp_path / "m.gguf", {"blk.0.ffn_up.weight": (values, type_name)})
    weights = GGUFWeightMap.from_gguf(path)
    source = read_gguf(path).tensors["blk.0.ffn_up.weight"]
    raw = np.fromfile(path, np.uint8, count=source.nbytes, offset=source.offset).reshape(rows, -1)
    expected = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name]).astype(np.float32))
    name = "model.layers.0.mlp.up_proj.weight"
    assert weights.entry(name).shape == (rows, cols)
    assert torch.equal(weights.tensor(name, torch.float32), expected)
    assert torch.equal(weights.rows(name, 2, 5, torch.float32), expected[2:5])
    assert weights.tensor(name).dtype == {"F16": torch.float16, "BF16": torch.bfloat16}.get(type_name, torch.float32)


def test_q_and_k_rows_come_back_in_hugging_face_order(tmp_path):
    """convert_hf_to_gguf permutes each rotary head's rows (halves → interleaved pairs); the map undoes it,
    for whole tensors and for a row range that cuts heads."""
    rng = np.random.default_rng(1)
    q, k = (rng.standard_normal((n * 64, 256)).astype(np.float32) for n in (4, 2))  # head_dim 256 / 4 = 64
    permute = lambda w, heads: w.reshape(heads, 2, 32, 256).swapaxes(1, 2).reshape(w.shape)  # noqa: E731
    path = write_llama(tmp_path / "m.gguf", {"blk.0.attn_q.weight": (permute(q, 4), "F32"),
                                             "blk.0.attn_k.weight": (permute(k, 2), "F32"),
                                             "blk.0.attn_v.weight": (k, "F32")})
    weights = GGUFWeightMap.from_gguf(path)
    assert torch.equal(weights.tensor("model.layers.0.self_attn.q_proj.weight"), torch.from_numpy(q))
    assert torch.equal(weights.tensor("model.layers.0.self_attn.k_proj.weight"), torch.from_numpy(k))
    assert torch.equal(weights.rows("model.layers.0.self_attn.q_proj.weight", 40, 150), torch.from_numpy(q[40:150]))
    assert torch.equal(weights.tensor("model.layers.0.self_attn.v_proj.weight"), torch.from_numpy(k))  # not permuted


def test_no_output_tensor_means_tied_embeddings_and_names_map_to_hugging_face(tmp_path):
    from trtbuild.builder.frontend.checkpoint import arch_config

    table = np.ones((16, 256), np.float32)
    path = write_llama(tmp_path / "m.gguf", {"token_embd.weight": (table, "F32"),
                                             "output_norm.weight": (np.ones(256, np.float32), "F32")})
    assert GGUFWeightMap.from_gguf(path).names == ["model.embed_tokens.weight", "model.norm.weight"]
    arch = arch_config(path)
    assert (arch.tie_word_embeddings, arch.vocab_size, arch.head_dim, arch.num_kv_heads) == (True, 16, 64, 2)
    path = write_llama(tmp_path / "untied.gguf", {"token_embd.weight": (table, "F32"), "output.weight": (table, "F32")})
    assert arch_config(path).tie_word_embeddings is False


def _layers(*layers: int) -> dict[str, tuple[np.ndarray, str]]:
    """A norm vector for each of ``layers``, and the embedding table."""
    return {"token_embd.weight": (np.ones((16, 256), np.float32), "F32"),
            **{f"blk.{i}.attn_norm.weight": (np.full(256, i, np.float32), "F32") for i in layers}}


@pytest.mark.parametrize("block_count, layers, found", [
    (1, (0, 1), "0-1"),        # more layers than the metadata counts: a model cut short otherwise
    (3, (0, 1), "0-1"),        # fewer: refused before any layer is read, not at the missing one
    (3, (0, 1, 3), "0-1, 3"),  # as many, but not 0 .. N − 1
])
def test_layers_other_than_block_count_are_refused(tmp_path, block_count, layers, found):
    from trtbuild.checkpoint.source import open_weights

    path = write_llama(tmp_path / "m.gguf", _layers(*layers), block_count=block_count)
    with pytest.raises(CheckpointError) as error:
        open_weights(path)
    expected = "0" if block_count == 1 else f"0-{block_count - 1}"
    assert str(error.value) == (f"{path}: llama.block_count is {block_count}, so the tensors should be of layers "
                                f"{expected}; those in m.gguf are of layers {found}")
    assert open_weights(write_llama(tmp_path / "ok.gguf", _layers(*range(block_count)), block_count)).names[-1] == \
        f"model.layers.{block_count - 1}.input_layernorm.weight"


def _replace(path: Path, tensors: dict[str, tuple[np.ndarray, str]]) -> None:
    """Another GGUF moved over ``path`` (as a new download would be)."""
    write_llama(path.with_name("new.gguf"), tensors)
    path.with_name("new.gguf").replace(path)


SWAPS = {
    # a smaller file: the old reader's memmap raised numpy's "mmap length is greater than file size"
    "replaced by a smaller file": lambda p: _replace(p, {"blk.0.ffn_up.weight": (np.ones((2, 256), np.float32),
                                                                                  "F32")}),
    # the same layout, other values: the old reader returned the new file's bytes as the old header's tensors
    "replaced by another of the same size": lambda p: _replace(p, SWAP_TENSORS(2.0)),
    "truncated in place": lambda p: os.truncate(p, p.stat().st_size - 1024),
}


def SWAP_TENSORS(value: float) -> dict[str, tuple[np.ndarray, str]]:  # noqa: N802
    return {"blk.0.ffn_up.weight": (np.full((8, 256), value, np.float32), "F32"),
            "blk.0.ffn_down.weight": (np.full((8, 256), value, np.float32), "Q8_0")}


@pytest.mark.parametrize("swap", SWAPS)
@pytest.mark.parametrize("name", ["model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.down_proj.weight"])
def test_a_file_changed_after_its_header_was_read_is_refused(tmp_path, swap, name):
    path = write_llama(tmp_path / "m.gguf", SWAP_TENSORS(1.0))
    weights = GGUFWeightMap.from_gguf(path)
    # before: 1.0 (Q8_0's down_proj within its f16 scale's rounding)
    assert (weights.tensor(name, torch.float32) - 1.0).abs().max() < 1e-3
    SWAPS[swap](path)
    with pytest.raises(CheckpointError) as error:
        weights.tensor(name)
    message = str(error.value)
    assert message.startswith(f"{path}: ") and "since its header was read" in message and "\n" not in message
    with pytest.raises(CheckpointError, match="since its header was read"):
        weights.blocks("model.layers.0.mlp.down_proj.weight")
    if swap == "replaced by another of the same size":  # opened again, the map reads the file there now
        assert (GGUFWeightMap.from_gguf(path).tensor(name, torch.float32) - 2.0).abs().max() < 1e-2


def test_a_write_to_a_read_tensor_stays_private(tmp_path):
    """Float tensors are mapped copy-on-write: a caller's in-place write (fake quantization)
    reaches neither the file nor the next read of the tensor."""
    path = write_llama(tmp_path / "m.gguf", SWAP_TENSORS(1.0))
    before = path.read_bytes()
    weights = GGUFWeightMap.from_gguf(path)
    weights.tensor("model.layers.0.mlp.up_proj.weight").mul_(3.0)
    assert torch.equal(weights.tensor("model.layers.0.mlp.up_proj.weight"), torch.ones(8, 256))
    assert path.read_bytes() == before


# --- hostile files -------------------------------------------------------------------------------

def _s(text: str | bytes) -> bytes:
    data = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(data)) + data


def _kv_u32(key: str, value: int) -> bytes:
    return _s(key) + struct.pack("<II", 4, value)


def _tensor(name: str, dims: list[int], type_id: int = 0, offset: int = 0) -> bytes:
    return _s(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims) + struct.pack("<IQ", type_id, offset)


def _file(kvs: list[bytes], tensors: list[bytes], data: bytes = b"", counts: tuple[int, int] | None = None,
          version: int = 3, magic: bytes = b"GGUF", alignment: int = 32) -> bytes:
    counts = counts or (len(tensors), len(kvs))
    head = magic + struct.pack("<IQQ", version, *counts) + b"".join(kvs) + b"".join(tensors)
    return head + b"\0" * (-len(head) % alignment) + data


ARCH = _s("general.architecture") + struct.pack("<I", 8) + _s("llama")
SIZES = [_kv_u32(key, value) for key, value in LLAMA.items()]

HOSTILE = {
    "bad magic": (_file([ARCH], [], magic=b"GGML"), "not a GGUF file"),
    "version 1": (_file([ARCH], [], version=1), "GGUF version 1 is not supported"),
    "truncated header": (_file([ARCH], [])[:40], "the file ends at 40"),
    "huge tensor count": (_file([ARCH], [], counts=(2**63, 1)), "tensor count is 9223372036854775808"),
    "huge key count": (_file([ARCH], [], counts=(0, 2**40)), "metadata key count is 1099511627776"),
    "huge key": (_file([struct.pack("<Q", 2**62) + b"\0" * 8], [], counts=(0, 1)), "a metadata key is 4611686018427387904 bytes"),
    "huge string": (_file([_s("general.name") + struct.pack("<IQ", 8, 2**33)], []), "value of general.name is 8589934592"),
    "huge array": (_file([_s("x") + struct.pack("<IIQ", 9, 5, 2**40)], []), "length of x is 1099511627776"),
    "array longer than the file": (_file([_s("x") + struct.pack("<IIQ", 9, 5, 1000)], []), "more than the file can hold"),
    "nested array": (_file([_s("x") + struct.pack("<IIQ", 9, 9, 1)], []), "x: an array of arrays"),
    "unknown value type": (_file([_s("x") + struct.pack("<I", 13)], []), "value type 13 is not a GGUF type"),
    "duplicate key": (_file([ARCH, ARCH], []), "metadata key 'general.architecture' appears twice"),
    "not UTF-8": (_file([_s(b"\xff\xfe") + struct.pack("<II", 4, 1)], []), "a metadata key is not UTF-8"),
    "bad alignment": (_file([ARCH, _kv_u32("general.alignment", 3)], []), "general.alignment 3 is not a power of two"),
    "no dims": (_file([ARCH], [_tensor("t", [])]), "tensor t: 0 dimensions"),
    "five dims": (_file([ARCH], [_tensor("t", [1] * 5)]), "tensor t: 5 dimensions"),
    "zero dim": (_file([ARCH], [_tensor("t", [8, 0])]), "tensor t: dims [8, 0] are not sizes"),
    "overflowing dims": (_file([ARCH], [_tensor("t", [2**32, 2**32, 2**32])]), "tensor t: dims [4294967296"),
    "unknown type": (_file([ARCH], [_tensor("t", [8], type_id=99)]), "tensor t: type 99 is not a GGML type"),
    "unsupported type": (_file([ARCH], [_tensor("t", [256], type_id=16)]), "tensor t: type IQ2_XXS is not supported"),
    "partial block": (_file([ARCH], [_tensor("t", [33, 2], type_id=2)]), "rows of 33 are not whole Q4_0 blocks"),
    "unaligned offset": (_file([ARCH], [_tensor("t", [8], offset=4)], b"\0" * 64), "offset 4 is not a multiple"),
    "past the end": (_file([ARCH], [_tensor("t", [8, 4])], b"\0" * 64), "run past the end of the file"),
    "overlap": (_file([ARCH], [_tensor("a", [16]), _tensor("b", [16], offset=32)], b"\0" * 96), "tensors a and b overlap"),
    "duplicate tensor": (_file([ARCH], [_tensor("a", [8]), _tensor("a", [8], offset=32)], b"\0" * 64),
                         "tensor a appears twice"),
}


def _u8_array(key: str, length: int) -> bytes:
    return _s(key) + struct.pack("<IIQ", 9, 0, length) + b"\0" * length


@pytest.mark.parametrize("lengths, expected", [
    # one array over its own bound, though the file holds its items and the total has room
    ([MAX_ARRAY_ITEMS + 1], f"length of x0 is {MAX_ARRAY_ITEMS + 1}, more than {MAX_ARRAY_ITEMS}"),
    # arrays each within their bound, together over the header's: ~0.4 GB of objects otherwise
    ([MAX_ARRAY_ITEMS, MAX_ARRAY_ITEMS, 1], f"length of x2 is 1, more than the 0 items left of the "
                                            f"{MAX_TOTAL_ITEMS} all of the header's arrays may hold"),
    ([MAX_ARRAY_ITEMS, MAX_ARRAY_ITEMS // 2, MAX_ARRAY_ITEMS // 2 + 7],
     f"length of x2 is {MAX_ARRAY_ITEMS // 2 + 7}, more than the {MAX_ARRAY_ITEMS // 2} items left"),
])
def test_each_array_bound_refuses_on_its_own(tmp_path, lengths, expected):
    assert MAX_ARRAY_ITEMS < MAX_TOTAL_ITEMS
    path = tmp_path / "arrays.gguf"
    path.write_bytes(_file([_u8_array(f"x{i}", n) for i, n in enumerate(lengths)], []))
    with pytest.raises(CheckpointError) as error:
        read_gguf(path)
    assert str(error.value).startswith(f"{path}: {expected}") and "\n" not in str(error.value)


def test_arrays_up_to_both_bounds_are_read(tmp_path):
    path = tmp_path / "arrays.gguf"
    path.write_bytes(_file([_u8_array("x0", MAX_ARRAY_ITEMS), _u8_array("x1", MAX_TOTAL_ITEMS - MAX_ARRAY_ITEMS)], []))
    metadata = read_gguf(path).metadata
    assert (metadata["x0"].size, metadata["x1"].size) == (MAX_ARRAY_ITEMS, MAX_TOTAL_ITEMS - MAX_ARRAY_ITEMS)


@pytest.mark.parametrize("case", HOSTILE, ids=list(HOSTILE))
def test_a_hostile_header_is_refused_in_one_line(tmp_path, case):
    data, expected = HOSTILE[case]
    path = tmp_path / "hostile.gguf"
    path.write_bytes(data)
    with pytest.raises(CheckpointError) as error:
        read_gguf(path)
    message = str(error.value)
    assert message.startswith(f"{path}: ") and expected in message and "\n" not in message


@pytest.mark.parametrize("kvs, tensors, expected", [
    ([ARCH, *SIZES], [_tensor("blk.0.attn_sinks.weight", [8])], "tensor blk.0.attn_sinks.weight has no place"),
    ([ARCH, *SIZES], [_tensor("blk.0.attn_q.weight", [8, 3])], "attn_q.weight: 3 rows are not whole rotary heads"),
    ([_s("general.architecture") + struct.pack("<I", 8) + _s("gpt2")], [], "general.architecture 'gpt2' is not"),
    ([_s("general.architecture") + struct.pack("<IIQ", 9, 8, 1) + _s("llama")], [],
     r"general.architecture \['llama'\] is not"),
    ([ARCH, *SIZES], [_tensor("blk.\u00b2.attn_norm.weight", [8])], "tensor blk.\u00b2.attn_norm.weight has no place"),
    ([ARCH, *(_kv_u32(k, 1 if k == "llama.embedding_length" else v) for k, v in LLAMA.items())], [],
     "head dim 0 .* must be a positive even number"),
    ([ARCH, *SIZES, _s("llama.attention.layer_norm_rms_epsilon") + struct.pack("<If", 6, float("inf"))], [],
     "layer_norm_rms_epsilon must be a positive number, got inf"),
    ([ARCH, *SIZES[:2], _s("llama.embedding_length") + struct.pack("<I", 8) + _s("576")], [],
     "metadata llama.embedding_length must be a positive integer, got '576'"),
])
def test_metadata_or_tensors_outside_the_llama_family_are_refused(tmp_path, kvs, tensors, expected):
    path = tmp_path / "odd.gguf"
    path.write_bytes(_file(kvs, tensors, b"\0" * 128))
    with pytest.raises(CheckpointError, match=expected):
        GGUFWeightMap.from_gguf(path)


def test_a_spec_naming_a_hostile_gguf_is_refused_at_model_checkpoint(tmp_path):
    from trtbuild.builder.errors import SpecError
    from trtbuild.builder.spec.resolve import spec_from_dict

    path = tmp_path / "hostile.gguf"
    path.write_bytes(HOSTILE["huge array"][0])
    with pytest.raises(SpecError) as error:
        spec_from_dict({"model": {"checkpoint": str(path), "dtype": "float32"}})
    assert str(error.value) == f"model.checkpoint: {path}: length of x is 1099511627776, more than {MAX_ARRAY_ITEMS}"


@pytest.mark.parametrize("case", ["huge array", "past the end"])
def test_build_refuses_a_hostile_gguf_with_exit_2_and_writes_nothing(tmp_path, case):
    import subprocess
    import sys

    path = tmp_path / "hostile.gguf"
    path.write_bytes(HOSTILE[case][0])
    spec = tmp_path / "spec.yaml"
    spec.write_text(f"model: {{checkpoint: {path}, dtype: float32}}\n")
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "trtbuild.cli", "build", str(spec), "-o", str(out)],
                          capture_output=True, text=True)
    assert proc.returncode == 2, proc.stderr[-800:]
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert f"{path}: " in proc.stderr and HOSTILE[case][1] in proc.stderr
    assert not out.exists()

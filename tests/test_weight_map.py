"""The weight map: safetensors headers read without loading, tensors and row slices read
exactly, hostile headers refused in one line, and the meta skeleton with real weights
computing what transformers computes."""
from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from trtbuild.builder.frontend.skeleton import meta_model, truncated_model
from trtbuild.checkpoint.weight_map import WeightMap
from trtbuild.checkpoint.errors import CheckpointError

from conftest import TINY_CODE, make_checkpoint


def test_every_tensor_reads_exactly_as_safetensors_loads_it():
    weights = WeightMap.from_checkpoint(TINY_CODE)
    loaded = load_file(str(TINY_CODE / "model.safetensors"))
    assert sorted(weights.names) == sorted(loaded)
    assert weights.total_bytes == sum(t.numel() * t.element_size() for t in loaded.values())
    for name, tensor in loaded.items():
        assert torch.equal(weights.tensor(name), tensor), name
    name = "model.layers.1.mlp.down_proj.weight"
    assert torch.equal(weights.rows(name, 5, 17), loaded[name][5:17])


def test_bf16_tensors_convert_to_the_asked_dtype(tmp_path):
    table = torch.randn(6, 4).to(torch.bfloat16)
    save_file({"a": table, "b": torch.arange(3, dtype=torch.int64)}, str(tmp_path / "model.safetensors"))
    weights = WeightMap.from_checkpoint(tmp_path)
    assert weights.tensor("a").dtype == torch.bfloat16 and torch.equal(weights.tensor("a"), table)
    assert torch.equal(weights.tensor("a", torch.float16), table.to(torch.float16))
    assert torch.equal(weights.rows("a", 2, 4, torch.float32), table[2:4].float())
    assert weights.tensor("b").tolist() == [0, 1, 2]


def _write_raw(path, header: dict, data: bytes = b"") -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


@pytest.mark.parametrize("header, data, message", [
    ({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8, "run past the end"),
    ({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}}, b"\0" * 16, "do not hold"),
    ({"w": {"dtype": "Q4", "shape": [4], "data_offsets": [0, 4]}}, b"\0" * 4, "dtype 'Q4'"),
    ({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4, "shape"),
    ({"w": [1, 2]}, b"", "not an object"),
])
def test_hostile_headers_are_refused_naming_file_and_tensor(tmp_path, header, data, message):
    _write_raw(tmp_path / "model.safetensors", header, data)
    with pytest.raises(CheckpointError, match=message) as info:
        WeightMap.from_checkpoint(tmp_path)
    assert "model.safetensors" in str(info.value) and "\n" not in str(info.value)


def test_a_header_longer_than_the_file_is_refused(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", 10**6) + b"{}")
    with pytest.raises(CheckpointError, match="does not fit the file"):
        WeightMap.from_checkpoint(tmp_path)


def test_a_tensor_in_two_files_and_a_link_out_of_the_dir_are_refused(tmp_path):
    save_file({"w": torch.zeros(2)}, str(tmp_path / "a.safetensors"))
    save_file({"w": torch.ones(2)}, str(tmp_path / "b.safetensors"))
    with pytest.raises(CheckpointError, match="each tensor must be in one file"):
        WeightMap.from_checkpoint(tmp_path)
    inside, outside = tmp_path / "ckpt", tmp_path / "elsewhere"
    inside.mkdir(), outside.mkdir()
    save_file({"w": torch.zeros(2)}, str(outside / "x.safetensors"))
    (inside / "model.safetensors").symlink_to(outside / "x.safetensors")
    with pytest.raises(CheckpointError, match="model.safetensors: leads outside the dir"):
        WeightMap.from_checkpoint(inside)


def test_a_missing_tensor_names_itself_and_the_files():
    with pytest.raises(CheckpointError, match=r"tensor model.layers.99.mlp.up_proj.weight is not .*model.safetensors"):
        WeightMap.from_checkpoint(TINY_CODE).tensor("model.layers.99.mlp.up_proj.weight")


def test_the_meta_model_holds_no_weight_bytes_but_a_real_rotary_table():
    model = meta_model(TINY_CODE, torch.float32)
    assert all(p.is_meta for p in model.parameters())
    assert not model.model.rotary_emb.inv_freq.is_meta


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_the_truncated_model_computes_what_transformers_computes(tmp_path, family):
    """All layers assigned from the map: logits equal transformers' own load (tied and untied
    embeddings, q/k/v biases, q/k norms); a truncation keeps the first k layers' weights."""
    checkpoint = make_checkpoint(tmp_path / family, family, layers=3)
    weights = WeightMap.from_checkpoint(checkpoint)
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, local_files_only=True).eval()
    ids = torch.randint(0, 4096, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(truncated_model(checkpoint, weights, torch.float32, 3)(input_ids=ids).logits,
                           reference(input_ids=ids).logits)
        reference.model.layers = reference.model.layers[:1]
        reference.config.num_hidden_layers = 1
        truncated = truncated_model(checkpoint, weights, torch.float32, 1)
        assert torch.allclose(truncated(input_ids=ids).logits, reference(input_ids=ids).logits, atol=1e-6)

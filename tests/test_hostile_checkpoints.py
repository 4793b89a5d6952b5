"""The checkpoint trust boundary: a fuzz corpus of hostile safetensors headers and indexes, each
refused in one line naming the file and what is wrong, by every reader of weights (the build's
weight map, Medusa heads, eval's checkpoint model), and by ``trtbuild build`` with exit code 2
and nothing written."""
from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
import tracemalloc

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from trtbuild.builder.errors import UserError
from trtbuild.builder.medusa.heads import MedusaHeads, load_heads, read_heads_config, save_heads
from trtbuild.checkpoint.errors import CheckpointError
from trtbuild.checkpoint.model import load_checkpoint_model
from trtbuild.checkpoint.weight_map import WeightMap

from conftest import TINY_CODE

F32 = '"dtype": "F32"'


def write_raw(path, header: str, data: bytes = b"") -> None:
    """A safetensors file with ``header`` as its exact JSON text (duplicates and depth kept)."""
    raw = header.encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


# (header JSON text, data bytes, what the one-line error must say)
CORPUS = {
    "int64 wrap, inverted": (f'{{"w": {{{F32}, "shape": [3, 4611686018427387904], '
                             '"data_offsets": [18446744073709551616, 0]}}', b"", "are inverted (begin after end)"),
    "int64 wrap to zero bytes": (f'{{"w": {{{F32}, "shape": [4, 4611686018427387904], "data_offsets": [0, 0]}}}}',
                                 b"", "span 0 bytes; shape [4, 4611686018427387904] of F32 is 73786976294838206464"),
    "inverted": (f'{{"w": {{{F32}, "shape": [], "data_offsets": [8, 4]}}}}', b"\0" * 8, "are inverted"),
    "overlap": (f'{{"a": {{{F32}, "shape": [2], "data_offsets": [0, 8]}}, '
                f'"b": {{{F32}, "shape": [2], "data_offsets": [4, 12]}}}}', b"\0" * 12,
                "tensor b: data_offsets [4, 12] overlap tensor a's (which ends at 8)"),
    "same span twice": (f'{{"a": {{{F32}, "shape": [2], "data_offsets": [0, 8]}}, '
                        f'"b": {{{F32}, "shape": [2], "data_offsets": [0, 8]}}}}', b"\0" * 8, "overlap tensor a's"),
    "gap": (f'{{"a": {{{F32}, "shape": [1], "data_offsets": [0, 4]}}, '
            f'"b": {{{F32}, "shape": [1], "data_offsets": [8, 12]}}}}', b"\0" * 12,
            "leave bytes [4, 8) of the data belonging to no tensor"),
    "trailing bytes": (f'{{"a": {{{F32}, "shape": [1], "data_offsets": [0, 4]}}}}', b"\0" * 8,
                       "bytes [4, 8) of the data belong to no tensor"),
    "out of file": (f'{{"a": {{{F32}, "shape": [4], "data_offsets": [0, 16]}}}}', b"\0" * 8,
                    "run past the end of the file's data (8 bytes)"),
    "deep nesting": ('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}", b"", "JSON nested 100001 levels deep (at most 3)"),
    "nesting in metadata": ('{"__metadata__": {"a": {"b": {"c": 1}}}}', b"", "nested 4 levels deep"),
    "duplicate name": (f'{{"w": {{{F32}, "shape": [1], "data_offsets": [0, 4]}}, '
                       f'"w": {{{F32}, "shape": [1], "data_offsets": [4, 8]}}}}', b"\0" * 8,
                       "key 'w' appears twice in one object"),
    "boolean offsets": ('{"w": {"dtype": "U8", "shape": [1], "data_offsets": [false, true]}}', b"\0",
                        "data_offsets [False, True] is not [begin, end]"),
    "dim beyond int64": (f'{{"w": {{{F32}, "shape": [0, 18446744073709551616], "data_offsets": [0, 0]}}}}', b"",
                         "is not a list of sizes (integers 0 to 2**63 - 1)"),
    "5000-digit integer": (f'{{"w": {{{F32}, "shape": [{"9" * 5000}], "data_offsets": [0, 4]}}}}', b"\0" * 4,
                           "safetensors header: not valid JSON (Exceeds the limit"),
    "metadata not strings": ('{"__metadata__": {"format": 1}}', b"", "__metadata__ is not an object of strings"),
    "not an object": ("[1, 2]", b"", "safetensors header is not a JSON object"),
}


def _one_line(exc: BaseException) -> str:
    message = str(exc)
    assert "\n" not in message, message
    return message


@pytest.mark.parametrize("case", list(CORPUS))
def test_every_hostile_header_is_refused_in_one_line_naming_the_file(tmp_path, case):
    header, data, message = CORPUS[case]
    path = tmp_path / "model.safetensors"
    write_raw(path, header, data)
    with pytest.raises(CheckpointError) as info:
        WeightMap.from_checkpoint(tmp_path)
    line = _one_line(info.value)
    assert line.startswith(f"{path}: ") and message in line, line


def test_a_valid_file_with_zero_sized_tensors_reads(tmp_path):
    save_file({"empty": torch.zeros(0, 3), "w": torch.arange(4.0), "also_empty": torch.zeros(0)},
              str(tmp_path / "model.safetensors"))
    weights = WeightMap.from_checkpoint(tmp_path)
    assert weights.tensor("empty").shape == (0, 3) and weights.tensor("w").tolist() == [0.0, 1.0, 2.0, 3.0]
    assert weights.total_bytes == 16


def test_eval_and_medusa_read_through_the_same_checks(tmp_path):
    header, data, message = CORPUS["int64 wrap, inverted"]
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    shutil.copy(TINY_CODE / "config.json", checkpoint / "config.json")
    write_raw(checkpoint / "model.safetensors", header, data)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint_model(checkpoint, torch.float32)  # eval's (and --reference's) loader
    assert _one_line(info.value).startswith(f"{checkpoint / 'model.safetensors'}: ") and message in str(info.value)
    heads = tmp_path / "heads"
    heads.mkdir()
    (heads / "config.json").write_text('{"medusa_num_heads": 1, "medusa_num_layers": 0}')
    write_raw(heads / "medusa_lm_head.safetensors", *CORPUS["overlap"][:2])
    with pytest.raises(UserError) as info:
        read_heads_config(heads)
    assert _one_line(info.value).startswith(f"{heads / 'medusa_lm_head.safetensors'}: ")
    assert CORPUS["overlap"][2] in str(info.value)
    (heads / "config.json").write_text('{"medusa_num_heads": ' + "[" * 5000 + "]" * 5000 + "}")
    with pytest.raises(UserError, match=r"config.json: JSON nested 5001 levels deep \(at most 64\)"):
        read_heads_config(heads)


def _sharded(tmp_path, index: dict | None = None):
    """A two-file checkpoint with its index: a, b in one file, c in the other."""
    save_file({"a": torch.zeros(2), "b": torch.ones(2)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"c": torch.full((3,), 2.0)}, str(tmp_path / "model-00002-of-00002.safetensors"))
    weight_map = {"a": "model-00001-of-00002.safetensors", "b": "model-00001-of-00002.safetensors",
                  "c": "model-00002-of-00002.safetensors"}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index or {"weight_map": weight_map}))
    return weight_map


def test_a_dir_with_an_index_reads_only_the_files_it_names(tmp_path):
    _sharded(tmp_path)
    write_raw(tmp_path / "stray.safetensors", *CORPUS["overlap"][:2])  # not named: never opened
    save_file({"a": torch.ones(1)}, str(tmp_path / "consolidated.safetensors"))
    weights = WeightMap.from_checkpoint(tmp_path)
    assert sorted(weights.names) == ["a", "b", "c"] and weights.tensor("c").tolist() == [2.0, 2.0, 2.0]


@pytest.mark.parametrize("change, message", [
    (lambda m: {**m, "d": "model-00002-of-00002.safetensors"},
     "weight_map puts tensor d in model-00002-of-00002.safetensors, but model-00002-of-00002.safetensors does not hold it"),
    (lambda m: {**m, "b": "model-00002-of-00002.safetensors"},
     "weight_map puts tensor b in model-00002-of-00002.safetensors, but it is in model-00001-of-00002.safetensors"),
    (lambda m: {k: v for k, v in m.items() if k != "b"},
     "weight_map does not name tensor b, which model-00001-of-00002.safetensors holds"),
    (lambda m: {**m, "c": "../model-00002-of-00002.safetensors"},
     "each file must be a *.safetensors file name directly in the checkpoint dir"),
    (lambda m: {**m, "c": "missing.safetensors"}, "missing.safetensors: not a file"),
    (lambda m: {"metadata": {}, "weight_map": "model.safetensors"}, "weight_map must be a non-empty object"),
])
def test_an_index_that_disagrees_with_its_files_is_refused(tmp_path, change, message):
    weight_map = _sharded(tmp_path)
    changed = change(weight_map)
    _sharded(tmp_path, changed if "weight_map" in changed else {"weight_map": changed})
    with pytest.raises(CheckpointError) as info:
        WeightMap.from_checkpoint(tmp_path)
    assert message in _one_line(info.value)


def test_an_index_file_leading_out_of_the_dir_is_refused(tmp_path):
    inside, outside = tmp_path / "ckpt", tmp_path / "elsewhere"
    inside.mkdir(), outside.mkdir()
    _sharded(inside)
    (inside / "model-00002-of-00002.safetensors").unlink()
    save_file({"c": torch.zeros(3)}, str(outside / "x.safetensors"))
    (inside / "model-00002-of-00002.safetensors").symlink_to(outside / "x.safetensors")
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors: leads outside the dir"):
        WeightMap.from_checkpoint(inside)
    (inside / "model.safetensors.index.json").write_text('{"weight_map": ' + "[" * 5000 + "]" * 5000 + "}")
    with pytest.raises(CheckpointError, match=r"index.json: JSON nested 5001 levels deep"):
        WeightMap.from_checkpoint(inside)


def test_medusa_heads_load_no_tensor_until_it_is_used(tmp_path):
    """Four heads of [20000, 64] float32 (20 MB): loading them reads the header only, and the
    logits come out as the arrays' own."""
    rng = np.random.default_rng(0)
    heads = MedusaHeads.from_arrays(blocks=tuple(((rng.standard_normal((64, 64)), rng.standard_normal(64)),)
                                                 for _ in range(4)),
                                    out=tuple(rng.standard_normal((20_000, 64)) for _ in range(4)))
    save_heads(heads, tmp_path / "heads")
    del heads
    tracemalloc.start()
    try:
        loaded = load_heads(tmp_path / "heads")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1_000_000, peak  # one head's projection alone is 5.12 MB
    stored = {name: torch.from_numpy(loaded.source.tensor(name)) for name in ("0.0.linear.weight", "3.1.weight")}
    assert stored["3.1.weight"].shape == (20_000, 64) and loaded.params == 4 * (64 * 64 + 64 + 20_000 * 64)
    assert np.array_equal(loaded.out(3, 5, 9), loaded.out(3)[5:9])


@pytest.mark.parametrize("case", ["int64 wrap, inverted", "overlap"])
def test_build_refuses_a_hostile_checkpoint_with_exit_2_and_writes_nothing(tmp_path, case):
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY_CODE / name, checkpoint / name)
    write_raw(checkpoint / "model.safetensors", *CORPUS[case][:2])
    last = _refused_build(tmp_path, checkpoint)
    assert f"{checkpoint / 'model.safetensors'}: " in last and CORPUS[case][2] in last
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "spec.yaml"]


def _refused_build(tmp_path, checkpoint) -> str:
    """`trtbuild build` of ``checkpoint`` into tmp_path/out: exit 2, no traceback, no out dir; its
    last line of stderr."""
    spec = tmp_path / "spec.yaml"
    spec.write_text(f"model: {{checkpoint: {checkpoint}, dtype: float32}}\nbuild: {{max_seq_len: 1024}}\n")
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "trtbuild.cli", "build", str(spec), "-o", str(out)],
                          capture_output=True, text=True)
    assert proc.returncode == 2, proc.stderr[-800:]
    assert "Traceback" not in proc.stderr and not out.exists()
    return proc.stderr.strip().splitlines()[-1]


# --- the layers the tensors hold against the config's count ----------------------------------------

def _tiny_code_saying(tmp_path, num_hidden_layers: int):
    """tiny-code's six layers of tensors under a config.json counting ``num_hidden_layers``."""
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "model.safetensors"):
        shutil.copy(TINY_CODE / name, checkpoint / name)
    config = json.loads((TINY_CODE / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**config, "num_hidden_layers": num_hidden_layers}))
    return checkpoint


@pytest.mark.parametrize("layers, expected", [(5, "0-4"), (7, "0-6")])
def test_safetensors_layers_other_than_num_hidden_layers_are_refused(tmp_path, layers, expected):
    """Five: a model cut to five layers without a word otherwise; seven: refused when opened, not
    when the missing layer is read."""
    from trtbuild.checkpoint.source import open_weights

    checkpoint = _tiny_code_saying(tmp_path, layers)
    message = (f"{checkpoint / 'config.json'}: num_hidden_layers is {layers}, so the tensors should be of layers "
               f"{expected}; those in model.safetensors are of layers 0-5")
    with pytest.raises(CheckpointError) as info:
        open_weights(checkpoint)
    assert _one_line(info.value) == message
    with pytest.raises(CheckpointError) as info:
        load_checkpoint_model(checkpoint, torch.float32)  # eval's (and --reference's) loader
    assert str(info.value) == message


def test_build_refuses_more_layers_than_the_config_counts_with_exit_2(tmp_path):
    checkpoint = _tiny_code_saying(tmp_path, 5)
    assert _refused_build(tmp_path, checkpoint) == (f"error: {checkpoint / 'config.json'}: num_hidden_layers is 5, so "
                                                    "the tensors should be of layers 0-4; those in model.safetensors "
                                                    "are of layers 0-5")


def test_a_gguf_replaced_while_the_export_reads_it_is_the_users_one_line_error(tmp_path, monkeypatch):
    """The export stage opens the file, then reads its tensors: a file moved over it in between is
    refused as the checkpoint error it is (the CLI's exit 2), not numpy's mmap error."""
    from trtbuild.builder import export_stage as export_module
    from trtbuild.builder.spec.resolve import spec_from_dict

    sys.path.insert(0, str(TINY_CODE.parents[1] / "benchmarks"))
    from gguf_export import export

    path = export(TINY_CODE, tmp_path / "tiny.gguf", "f32")
    spec = spec_from_dict({"model": {"checkpoint": str(path), "dtype": "float32"},
                           "build": {"max_seq_len": 256, "max_input_len": 32, "targets": ["sm89"]}})
    export_step = export_module.export_step

    def replaced_then_exported(*args):
        shutil.copy(path, tmp_path / "new.gguf")  # the same bytes, but another file
        (tmp_path / "new.gguf").replace(path)
        return export_step(*args)

    monkeypatch.setattr(export_module, "export_step", replaced_then_exported)
    (tmp_path / "work").mkdir()
    with pytest.raises(UserError) as info:
        export_module.export_stage(spec, tmp_path / "work", None)
    assert _one_line(info.value) == (f"{path}: replaced by another file since its header was read; "
                                     "leave the file unchanged during a build")

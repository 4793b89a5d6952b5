"""Quantization streamed from the weight map: layer-by-layer calibration gives the statistics of
whole-model hooks, the codes equal the quantizers run on the whole transformers model, the store
holds one file per layer and reads lazily, the pass writes its codes to an external-data file."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
import torch

from trtbuild.builder.frontend.skeleton import assign_weights, meta_model
from trtbuild.checkpoint.weight_map import WeightMap
from trtbuild.builder.numerics import run_onnx
from trtbuild.builder.passes import PassContext
from trtbuild.builder.passes.quantize_weights import DATA_FILE, quantize_weights
from trtbuild.builder.quant.algorithms import awq, awq_shared, fp8_per_tensor, gptq, nvfp4, rtn, smoothquant
from trtbuild.builder.quant.calibrate import InputStats, calibration_batches, layer_by_layer
from trtbuild.builder.quant.quantize import apply_dequantized, load_quantized, quantize_checkpoint, selected_layers
from trtbuild.builder.spec.resolve import spec_from_dict
from trtbuild.builder.spec.model import Spec
from trtbuild.checkpoint.errors import CheckpointError
from trtbuild.checkpoint.model import load_checkpoint_model

from conftest import REPO
from test_quantization import matmul_graph

CALIB = REPO / "tools" / "train_tiny_model.py"


def small_spec(checkpoint, **quantization) -> Spec:
    targets = ["sm120"] if quantization.get("mode") == "nvfp4" else ["sm89"]
    return spec_from_dict({"model": {"checkpoint": str(checkpoint), "dtype": "float32"},
                           "build": {"max_seq_len": 256, "max_input_len": 32, "targets": targets},
                           "quantization": {"exclude": [], **quantization}})


def calibrated(checkpoint, **quantization) -> Spec:
    return small_spec(checkpoint, **quantization, calibration={"data": str(CALIB), "samples": 2, "seq_len": 40})


def whole_model_stats(checkpoint, names: list[str], batches: torch.Tensor):
    """The old path, as the oracle: the whole transformers model run with hooks on every linear."""
    model = load_checkpoint_model(checkpoint, torch.float32)
    stats: dict[str, InputStats] = {}

    def hook(name):
        return lambda module, inputs, output: stats.setdefault(name, InputStats.empty(inputs[0].shape[-1], True)).add(inputs[0])

    for name in names:
        model.get_submodule(name if name == "lm_head" else f"model.{name}").register_forward_hook(hook(name))
    with torch.no_grad():
        for batch in batches:
            model(input_ids=batch[None])
    return model, stats


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: q/k/v biases, tied embeddings
def test_layer_by_layer_statistics_equal_whole_model_hooks(checkpoints, family):
    checkpoint = checkpoints[family]
    spec = calibrated(checkpoint, mode="int4_weight_only", algorithm="gptq", group_size=32)
    names = selected_layers(spec)
    batches = calibration_batches(checkpoint, spec.quantization.calibration.data, 2, 40)
    _, expected = whole_model_stats(checkpoint, names, batches)
    streamed, blocks = {}, []
    for block, stats in layer_by_layer(checkpoint, WeightMap.from_checkpoint(checkpoint), torch.float32, names,
                                       batches, progress=lambda message: None, hessian=True):
        blocks.append(block)
        streamed.update(stats)
    assert blocks == ["layers.0", "layers.1", "lm_head"] and sorted(streamed) == sorted(names)
    for name in names:
        for field in ("hessian", "abs_sum", "abs_max", "sample_rows"):
            torch.testing.assert_close(getattr(streamed[name], field), getattr(expected[name], field),
                                       rtol=1e-6, atol=1e-6, msg=f"{name}.{field}")
        assert streamed[name].rows == expected[name].rows == 2 * 40


def test_layer_by_layer_stops_after_the_last_layer_it_needs(checkpoints):
    checkpoint = checkpoints["llama"]
    batches = calibration_batches(checkpoint, (CALIB,), 2, 16)
    seen = []
    blocks = [block for block, _ in layer_by_layer(checkpoint, WeightMap.from_checkpoint(checkpoint), torch.float32,
                                                   ["layers.0.mlp.up_proj"], batches, progress=seen.append)]
    assert blocks == ["layers.0"] and seen == ["  calibration: layer 1/2"]


def expected_layer(name, weight, stats, spec, model) -> object:
    """What the whole-model quantizer computed for one layer (the oracle's dispatch)."""
    q = spec.quantization
    group = q.group_size if q.bits == 4 else None
    if q.mode == "w8a8" or q.algorithm == "awq":  # one input scale per group of linears reading one input
        parent, leaf = name.rsplit(".", 1) if "." in name else ("", name)
        attention, mlp = ("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")
        siblings = attention if leaf in attention else mlp if leaf in mlp else (leaf,)
        members = [f"{parent}.{s}" if parent else s for s in siblings]
        weights = [model.get_submodule(m if m == "lm_head" else f"model.{m}").weight.detach().float() for m in members]
        x = stats[members[0]]
        layers = smoothquant(weights, x.abs_max, q.smoothquant_alpha)[0] if q.mode == "w8a8" else \
            awq_shared(weights, x.abs_mean, x.sample_rows, q.bits, group)
        return layers[members.index(name)]
    if q.mode == "nvfp4":
        return nvfp4(weight)
    if q.mode == "fp8":
        return fp8_per_tensor(weight, float(stats[name].abs_max.max()))
    if q.algorithm == "gptq":
        return gptq(weight, stats[name].hessian, q.bits, group)
    return rtn(weight, q.bits, group)


@pytest.mark.parametrize("family, quantization", [
    ("llama", {"mode": "int4_weight_only", "group_size": 32}),
    ("llama", {"mode": "int8_weight_only", "quantize_embeddings": True}),
    ("qwen2", {"mode": "int4_weight_only", "group_size": 32}),  # tied lm_head: the embedding's rows
    ("llama", {"mode": "int4_weight_only", "algorithm": "gptq", "group_size": 32, "calibrate": True}),
    ("qwen2", {"mode": "int4_weight_only", "algorithm": "awq", "group_size": 32, "calibrate": True}),
    ("llama", {"mode": "w8a8", "calibrate": True}),
    ("llama", {"mode": "fp8", "calibrate": True}),
    ("llama", {"mode": "nvfp4"}),
], ids=["int4-rtn", "int8-rtn-embeddings", "int4-rtn-tied", "int4-gptq", "int4-awq-qwen2", "w8a8", "fp8", "nvfp4"])
def test_streamed_codes_equal_the_whole_model_quantizers(checkpoints, tmp_path, family, quantization):
    checkpoint = checkpoints[family]
    fields = {k: v for k, v in quantization.items() if k != "calibrate"}
    spec = calibrated(checkpoint, **fields) if quantization.get("calibrate") else small_spec(checkpoint, **fields)
    report = quantize_checkpoint(WeightMap.from_checkpoint(checkpoint), spec, tmp_path / "q", progress=lambda m: None)
    layers, saved_report = load_quantized(tmp_path / "q")
    names = selected_layers(spec)
    q = spec.quantization
    if q.calibration is not None:
        batches = calibration_batches(checkpoint, q.calibration.data, q.calibration.samples, q.calibration.seq_len)
        model, stats = whole_model_stats(checkpoint, names, batches)
    else:
        model, stats = load_checkpoint_model(checkpoint, torch.float32), {}
    assert sorted(layers) == sorted(names + (["embed_tokens"] if q.quantize_embeddings else [])) and saved_report == report
    for name in names:
        weight = model.get_submodule(name if name == "lm_head" else f"model.{name}").weight.detach().float()
        expected, got = expected_layer(name, weight, stats, spec, model), layers[name]
        assert torch.equal(got.codes, expected.codes) and torch.equal(got.scales, expected.scales), name
        assert (got.input_scale is None) == (expected.input_scale is None), name
        if expected.input_scale is not None:
            assert torch.equal(got.input_scale, expected.input_scale), name
        stored_activation_scale = None if expected.activation_scale is None else \
            float(torch.tensor(expected.activation_scale, dtype=torch.float32))  # stored as float32, as before
        assert (got.activation_scale, got.global_scale, got.bits, got.group) == \
            (stored_activation_scale, expected.global_scale, expected.bits, expected.group), name
        old_error = float((expected.dequantize() - weight).norm() / weight.norm())
        assert report[name]["weight_rel_error"] == pytest.approx(old_error, abs=2e-6), name
        assert ("output_rel_error" in report[name]) == (q.calibration is not None), name
    if q.quantize_embeddings:
        table = model.model.embed_tokens.weight.detach().float()
        assert torch.equal(layers["embed_tokens"].codes, rtn(table, 8, None).codes)


def mapped_from(address: int) -> Path | None:
    """The file whose memory mapping holds ``address`` in this process (Linux)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, *rest = line.split(maxsplit=5)
        low, high = (int(a, 16) for a in span.split("-"))
        if low <= address < high and len(rest) == 5:
            return Path(rest[4])
    return None


def test_store_is_one_file_per_layer_read_lazily_and_applies_to_a_truncated_model(checkpoints, tmp_path):
    checkpoint = checkpoints["llama"]
    spec = small_spec(checkpoint, mode="int8_weight_only")
    quantize_checkpoint(WeightMap.from_checkpoint(checkpoint), spec, tmp_path / "q", progress=lambda m: None)
    files = sorted(p.name for p in (tmp_path / "q").iterdir())
    assert files == ["index.json", "layers.0.safetensors", "layers.1.safetensors", "lm_head.safetensors"]
    stored = WeightMap.from_checkpoint(tmp_path / "q")
    assert sorted({entry.file.name for name, entry in stored.entries.items() if name.startswith("layers.1.")}) == \
        ["layers.1.safetensors"]
    layers, _ = load_quantized(tmp_path / "q")
    codes = layers["layers.1.mlp.down_proj"].codes
    assert mapped_from(codes.data_ptr()) == tmp_path / "q" / "layers.1.safetensors"  # memory-mapped, not read
    model = meta_model(checkpoint, torch.float32, num_layers=1)    # layers.1 and nothing of it: skipped
    assign_weights(model, WeightMap.from_checkpoint(checkpoint), "", torch.float32)
    apply_dequantized(model, layers)
    assert torch.equal(model.model.layers[0].mlp.down_proj.weight, layers["layers.0.mlp.down_proj"].dequantize())
    assert torch.equal(model.lm_head.weight, layers["lm_head"].dequantize())
    (tmp_path / "q" / "index.json").unlink()
    with pytest.raises(CheckpointError, match="no index.json; the quantization did not finish"):
        load_quantized(tmp_path / "q")


@pytest.mark.parametrize("make", [lambda w, x: rtn(w, 4, 32), lambda w, x: awq(w, x.abs().mean(0), x, 4, 32),
                                  lambda w, x: fp8_per_tensor(w, float(x.abs().max()))], ids=["int4", "awq", "fp8"])
def test_pass_writes_codes_to_an_external_data_file_with_the_same_numerics(tmp_path, make):
    torch.manual_seed(5)
    w, x = torch.randn(48, 64), torch.randn(4, 64)
    layer = make(w, x)
    quantized = {"layers.0.mlp.up_proj": layer}
    in_memory = gs.export_onnx(quantize_weights(matmul_graph(w.T.contiguous().numpy()),
                                                PassContext(spec=None, quantized=quantized)).graph)
    external = gs.export_onnx(quantize_weights(matmul_graph(w.T.contiguous().numpy()),
                                               PassContext(spec=None, quantized=quantized, weights_dir=tmp_path)).graph)
    codes = next(t for t in external.graph.initializer if t.name.endswith("weight_q"))
    assert codes.data_location == onnx.TensorProto.EXTERNAL
    assert {e.key: e.value for e in codes.external_data}["location"] == DATA_FILE
    assert [(t.name, t.data_type, list(t.dims)) for t in external.graph.initializer] == \
        [(t.name, t.data_type, list(t.dims)) for t in in_memory.graph.initializer]
    onnx.save_model(external, tmp_path / "model.onnx")
    np.testing.assert_array_equal(run_onnx(tmp_path / "model.onnx", {"x": x.numpy()})["y"],
                                  run_onnx(in_memory, {"x": x.numpy()})["y"])


def test_apply_dequantized_leaves_a_tied_embedding_float(checkpoints, tmp_path):
    """The engine dequantizes lm_head's MatMul and gathers from the float table: the reference must too."""
    checkpoint = checkpoints["qwen2"]
    quantize_checkpoint(WeightMap.from_checkpoint(checkpoint), small_spec(checkpoint, mode="int8_weight_only"),
                        tmp_path / "q", progress=lambda m: None)
    layers, _ = load_quantized(tmp_path / "q")
    model = load_checkpoint_model(checkpoint, torch.float32)
    table = model.model.embed_tokens.weight.detach().clone()
    apply_dequantized(model, layers)
    assert torch.equal(model.lm_head.weight, layers["lm_head"].dequantize())
    assert torch.equal(model.model.embed_tokens.weight, table)


def test_external_int4_codes_read_back_for_sharding(tmp_path):
    """shard_tensor_parallel slices the pass's codes from its data file: 4-bit codes lie two to a byte there."""
    import ml_dtypes

    from trtbuild.builder.passes.weights import WeightWriter, read

    writer = WeightWriter(tmp_path / DATA_FILE)
    writer.constant("before", np.ones(600, np.float32))  # a non-zero offset
    codes = np.random.default_rng(0).integers(-7, 8, (64, 48)).astype(ml_dtypes.int4)
    constant = writer.constant("codes", codes)
    assert (tmp_path / DATA_FILE).stat().st_size == 2400 + 64 * 48 // 2
    np.testing.assert_array_equal(read(constant, tmp_path).astype(np.int8), codes.astype(np.int8))


@pytest.mark.parametrize("algorithm", ["awq", "gptq"])
def test_calibration_keeps_an_input_hessian_only_for_gptq(checkpoints, algorithm):
    """Σ xᵀx is [in, in] float32 per linear (822 MB for a Llama-3-8B down_proj): only GPTQ reads it."""
    from trtbuild.builder.quant.quantize import _blocks

    checkpoint = checkpoints["llama"]
    spec = calibrated(checkpoint, mode="int4_weight_only", algorithm=algorithm, group_size=32)
    names = selected_layers(spec)
    seen = {}
    for _, stats in _blocks(WeightMap.from_checkpoint(checkpoint), spec, names, progress=lambda m: None):
        seen.update({name: s.hessian for name, s in stats.items()})
    assert sorted(seen) == sorted(names)
    if algorithm == "gptq":
        assert {name: tuple(h.shape) for name, h in seen.items() if "down_proj" in name} == \
            {"layers.0.mlp.down_proj": (256, 256), "layers.1.mlp.down_proj": (256, 256)}
    else:
        assert all(h is None for h in seen.values())

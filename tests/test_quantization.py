"""Quantization: spec refusals, the quantize_weights pass on hand-built graphs, an int4 build end to end."""
from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from trtbuild.builder.errors import SpecError
from trtbuild.builder.numerics import run_onnx
from trtbuild.builder.passes import PassContext, PassError
from trtbuild.builder.passes.quantize_weights import quantize_weights
from trtbuild.builder.quant.algorithms import awq, fp8_per_tensor, rtn
from trtbuild.builder.spec.resolve import spec_from_dict

from conftest import REPO, TINY_CODE

CALIB = REPO / "models" / "tiny-code" / "heldout.txt"  # any text will do for validation tests


def spec_with(**quantization) -> dict:
    return {"model": {"checkpoint": str(TINY_CODE), "dtype": "float32"},
            "build": {"max_input_len": 64, "max_seq_len": 512, "targets": ["sm80", "sm89"]},
            "quantization": quantization}


@pytest.mark.parametrize("quantization, message", [
    ({"mode": "fp8"}, "quantization.mode: fp8 needs every build target to be sm89 or newer"),
    ({"mode": "nvfp4"}, "quantization.mode: nvfp4 needs sm120/sm121 targets only"),
    ({"mode": "w8a8"}, "quantization.calibration: required for mode w8a8"),
    ({"mode": "fp8", "calibration": {"data": str(CALIB)}}, "quantization.mode: fp8 needs every build target"),
    ({"mode": "int8_weight_only", "kv_cache": "int8"}, "quantization.kv_cache: int8 caches do not build: TensorRT-RTX's KV-cache update"),
    ({"mode": "int8_weight_only", "algorithm": "awq"}, "quantization.algorithm: awq applies to int4_weight_only"),
    ({"mode": "none", "quantize_embeddings": True}, "quantization.quantize_embeddings: applies to int8_weight_only"),
    ({"mode": "int4_weight_only", "group_size": 96}, "quantization.group_size: 96 does not divide hidden_size=256"),
    ({"mode": "int4_weight_only", "algorithm": "gptq"}, "quantization.calibration: required for algorithm gptq"),
    ({"mode": "int4_weight_only", "algorithm": "awq", "calibration": {"data": "/nonexistent.txt"}},
     "quantization.calibration.data: /nonexistent.txt is not a file"),
    ({"mode": "int4_weight_only", "exclude": ["lm_haed"]}, "quantization.exclude: 'lm_haed' matches no linear layer"),
    ({"mode": "none", "cpu_activations": "int8"},
     "quantization.cpu_activations: int8 applies to int4_weight_only and int8_weight_only"),
])
def test_quantization_refusals_name_the_field(quantization, message):
    with pytest.raises(SpecError) as info:
        spec_from_dict(spec_with(**quantization))
    assert str(info.value).startswith(message), str(info.value)


def test_valid_int4_spec_resolves_calibration_path(tmp_path):
    (tmp_path / "calib.txt").write_text("x = 1\n" * 100)
    spec = spec_from_dict(spec_with(mode="int4_weight_only", algorithm="gptq", group_size=64,
                                    calibration={"data": "calib.txt"}), base_dir=tmp_path)
    assert spec.quantization.bits == 4 and spec.quantization.calibration.data == (tmp_path / "calib.txt",)
    (tmp_path / "more.txt").write_text("y = 2\n" * 100)
    several = spec_from_dict(spec_with(mode="int4_weight_only", algorithm="gptq", group_size=64,
                                       calibration={"data": ["calib.txt", "more.txt"]}), base_dir=tmp_path)
    assert several.quantization.calibration.data == (tmp_path / "calib.txt", tmp_path / "more.txt")
    with pytest.raises(SpecError, match="quantization.calibration.data: .*missing.txt is not a file"):
        spec_from_dict(spec_with(mode="int4_weight_only", algorithm="gptq", group_size=64,
                                 calibration={"data": ["calib.txt", "missing.txt"]}), base_dir=tmp_path)


def matmul_graph(w: np.ndarray) -> gs.Graph:
    """x [4, in] @ W [in, out], the way the exporter writes a Linear, named like one."""
    node = helper.make_node("MatMul", ["x", "w"], ["y"], name="/model/layers.0/mlp/up_proj/MatMul")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, w.shape[0]])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, w.shape[1]])],
                              [numpy_helper.from_array(w, "w")])
    return gs.import_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 24)]))


@pytest.mark.parametrize("make", [lambda w, x: rtn(w, 8, None), lambda w, x: rtn(w, 4, 32),
                                  lambda w, x: awq(w, x.abs().mean(0), x, 4, 32),
                                  lambda w, x: fp8_per_tensor(w, None)])
def test_quantize_weights_computes_what_the_quantizer_simulates(make):
    torch.manual_seed(0)
    w = torch.randn(16, 64)                        # [out, in] as in torch
    x = torch.randn(4, 64)
    layer = make(w, x)
    ctx = PassContext(spec=None, quantized={"layers.0.mlp.up_proj": layer})
    result = quantize_weights(matmul_graph(w.T.contiguous().numpy()), ctx)
    assert result.stats["matches"] == 1
    model = gs.export_onnx(result.graph)
    ops = sorted(n.op_type for n in model.graph.node)
    assert ops == (["DequantizeLinear", "MatMul", "Mul"] if layer.input_scale is not None else ["DequantizeLinear", "MatMul"])
    y = run_onnx(model, {"x": x.numpy()})["y"]
    np.testing.assert_allclose(y, (x @ layer.dequantize().T).numpy(), atol=1e-4)


def test_quantize_weights_takes_an_lm_head_exported_as_a_transposed_table():
    """A GGUF checkpoint's LM head exports as MatMul(x, Transpose(lm_head.weight [V, H])): with the
    head quantized (exclude: []) its codes replace the transpose, and the table goes with it."""
    torch.manual_seed(2)
    w, x = torch.randn(96, 64), torch.randn(4, 64)  # [V, H]
    transpose = helper.make_node("Transpose", ["lm_head.weight"], ["w_t"], name="/model/lm_head/Transpose", perm=[1, 0])
    matmul = helper.make_node("MatMul", ["x", "w_t"], ["y"], name="/model/lm_head/MatMul")
    graph = helper.make_graph([transpose, matmul], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 96])],
                              [numpy_helper.from_array(w.numpy(), "lm_head.weight")])
    layer = rtn(w, 4, 32)
    result = quantize_weights(gs.import_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 24)])),
                              PassContext(spec=None, quantized={"lm_head": layer}))
    assert result.stats["matches"] == 1
    model = gs.export_onnx(result.graph)
    assert sorted(n.op_type for n in model.graph.node) == ["DequantizeLinear", "MatMul"]
    assert "lm_head.weight" not in {t.name for t in model.graph.initializer}
    np.testing.assert_allclose(run_onnx(model, {"x": x.numpy()})["y"], (x @ layer.dequantize().T).numpy(), atol=1e-4)


def test_fp8_quantizes_weights_and_activations_per_tensor():
    torch.manual_seed(1)
    w, x = torch.randn(16, 64), torch.randn(4, 64) * 3
    layer = fp8_per_tensor(w, float(x.abs().max()))
    assert layer.fp8 and layer.scales.shape == (1,) and layer.codes.dtype == torch.float8_e4m3fn
    assert layer.scales[0] == pytest.approx(float(w.abs().max()) / 448)
    # E4M3 has 3 mantissa bits: relative rounding error at most 2^-4 per element
    assert float(((layer.dequantize() - w).abs() / w.abs()).max()) <= 2 ** -4 + 1e-6
    ctx = PassContext(spec=None, quantized={"layers.0.mlp.up_proj": layer})
    model = gs.export_onnx(quantize_weights(matmul_graph(w.T.contiguous().numpy()), ctx).graph)
    assert sorted(n.op_type for n in model.graph.node) == ["DequantizeLinear", "DequantizeLinear", "MatMul",
                                                            "QuantizeLinear"]
    weight = next(t for t in model.graph.initializer if t.name.endswith("weight_q"))
    assert weight.data_type == TensorProto.FLOAT8E4M3FN and list(weight.dims) == [64, 16]
    y = run_onnx(model, {"x": x.numpy()})["y"]
    np.testing.assert_allclose(y, (layer.fake_quantize_input(x) @ layer.dequantize().T).numpy(), atol=1e-4)


def test_nvfp4_blocks_of_16_with_fp8_scales_and_a_simulated_cpu_path():
    import ml_dtypes

    from trtbuild.builder.quant.algorithms import nvfp4
    from trtbuild.plugins.onnxruntime import fp4

    torch.manual_seed(2)
    w, x = torch.randn(16, 64), torch.randn(4, 64)
    layer = nvfp4(w)
    assert layer.nvfp4 and layer.group == 16 and layer.scales.shape == (16, 4)
    grid = {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0}
    assert set(layer.codes.abs().unique().tolist()) <= grid                     # E2M1 values
    scales = layer.scales.numpy()
    assert np.array_equal(scales.astype(ml_dtypes.float8_e4m3fn).astype(np.float32), scales)  # E4M3 values
    assert float((layer.dequantize() - w).norm() / w.norm()) < 0.12            # ~4-bit error
    ctx = PassContext(spec=None, quantized={"layers.0.mlp.up_proj": layer})
    model = gs.export_onnx(quantize_weights(matmul_graph(w.T.contiguous().numpy()), ctx).graph)
    assert sorted(n.op_type for n in model.graph.node) == ["DequantizeLinear", "DequantizeLinear", "MatMul"]
    assert fp4.has_fp4(model)
    simulated = fp4.simulate(model)
    assert not fp4.has_fp4(simulated) and [n.op_type for n in simulated.graph.node] == ["MatMul"]
    y = run_onnx(simulated, {"x": x.numpy()})["y"]
    np.testing.assert_allclose(y, (x @ layer.dequantize().T).numpy(), atol=1e-4)


def test_embedding_table_becomes_int8_rows_dequantized_then_gathered():
    torch.manual_seed(4)
    table = torch.randn(32, 8)                                           # [V, D]
    layer = rtn(table, 8, None)
    node = helper.make_node("Gather", ["embed_tokens.weight", "ids"], ["h"], name="/model/embed_tokens/Gather")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("ids", TensorProto.INT32, [2, 3])],
                              [helper.make_tensor_value_info("h", TensorProto.FLOAT, [2, 3, 8])],
                              [numpy_helper.from_array(table.numpy(), "embed_tokens.weight")])
    ctx = PassContext(spec=None, quantized={"embed_tokens": layer})
    result = quantize_weights(gs.import_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 24)])), ctx)
    assert result.stats["matches"] == 1
    model = gs.export_onnx(result.graph)
    assert [n.op_type for n in model.graph.node] == ["DequantizeLinear", "Gather"]  # TensorRT's accepted order
    ids = np.array([[0, 5, 31], [7, 7, 1]], np.int32)
    h = run_onnx(model, {"ids": ids})["h"]
    np.testing.assert_allclose(h, layer.dequantize().numpy()[ids], atol=1e-6)


def test_tied_embeddings_are_not_quantized_twice(checkpoints):
    message = str(pytest.raises(SpecError, spec_from_dict, {
        "model": {"checkpoint": str(checkpoints["qwen2"]), "dtype": "float32"}, "build": {"max_seq_len": 512},
        "quantization": {"mode": "int8_weight_only", "quantize_embeddings": True}}).value)
    assert message.startswith("quantization.quantize_embeddings: the checkpoint ties its embeddings")


def test_quantize_weights_fails_when_a_layer_is_missing():
    w = torch.randn(16, 64)
    ctx = PassContext(spec=None,
                      quantized={"layers.0.mlp.up_proj": rtn(w, 8, None), "layers.0.mlp.down_proj": rtn(w, 8, None)})
    with pytest.raises(PassError, match=r"quantize_weights matched 1 of the 2 layers to quantize; not found: \['layers.0.mlp.down_proj'\]"):
        quantize_weights(matmul_graph(w.T.contiguous().numpy()), ctx)


def prompt_ids(text: str) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(TINY_CODE / "tokenizer.json")).encode(text).ids


def dequantized_greedy(spec: Spec, prompt: list[int], steps: int, workdir) -> list[int]:
    """transformers' greedy tokens with the weights the spec's quantization gives (the same
    deterministic quantize_checkpoint the build ran) and, for W8A8/FP8, fake-quantized inputs."""
    from trtbuild.checkpoint.weight_map import WeightMap
    from trtbuild.builder.quant.quantize import apply_dequantized, load_quantized, quantize_checkpoint
    from trtbuild.checkpoint.model import load_checkpoint_model

    quantize_checkpoint(WeightMap.from_checkpoint(TINY_CODE), spec, workdir, progress=lambda message: None)
    model = load_checkpoint_model(TINY_CODE, torch.float32)
    apply_dequantized(model, load_quantized(workdir)[0])
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.mark.slow
@pytest.mark.parametrize("quantization", [
    {"mode": "int4_weight_only", "algorithm": "gptq", "group_size": 64},
    {"mode": "w8a8", "smoothquant_alpha": 0.5},
    {"mode": "fp8"},  # E4M3 weights and activations: builds for sm89 with TensorRT-RTX, runs in ORT
    {"mode": "nvfp4"},  # FP4 weights: builds for sm120; ORT runs it simulated (plugins/onnxruntime/fp4.py)
], ids=["int4-gptq-g64", "w8a8", "fp8", "nvfp4"])
def test_quantized_build_keeps_most_greedy_tokens(tmp_path, quantization):
    from trtbuild.builder.build import BuildOptions, build
    from trtbuild.builder.progress import Progress, Verbosity
    from trtbuild.runtime.evaluate import evaluate

    calib = tmp_path / "calib.txt"
    calib.write_text((REPO / "tools" / "train_tiny_model.py").read_text() * 20)  # code, and not held-out text
    spec = spec_from_dict({**spec_with(**quantization, calibration={"data": str(calib), "samples": 8, "seq_len": 256}),
                           "build": {"max_input_len": 256, "max_seq_len": 1024,
                                     "targets": ["sm120"] if quantization["mode"] == "nvfp4" else ["sm89"]}})
    summary = build(spec, BuildOptions(out=tmp_path / "out"), Progress(Verbosity.error))
    record = next(r for r in summary.pass_records if r["pass"] == "quantize_weights")
    assert record["matches"] == 42 and record["numerics"]["ok"]
    assert all("output_rel_error" in v for v in record["layers"].values())
    result = evaluate(tmp_path / "out", CALIB, 512, 4096, reference=TINY_CODE)
    base = evaluate(TINY_CODE, CALIB, 512, 4096)
    assert result.agreement >= 0.9, result           # top-1 agreement with the float model
    assert result.perplexity <= base.perplexity * 1.05, (result, base)
    from trtbuild.runtime.llm import LLM               # the CPU runtime serves it too (NVFP4: simulated)
    from trtbuild.runtime.core.sampling import SamplingParams
    prompt = prompt_ids("def f(x):\n    return")
    (completion,) = LLM(tmp_path / "out", backend="onnxruntime").generate([prompt], SamplingParams(max_tokens=8))
    assert completion.token_ids == dequantized_greedy(spec, prompt, 8, tmp_path / "quantized")


@pytest.mark.slow
def test_int8_cpu_activations_reach_every_onnx_runtime_session(tmp_path):
    """quantization.cpu_activations: int8 is what the numerics check, eval and the runtime run."""
    import dataclasses

    from trtbuild.builder.build import BuildOptions, build
    from trtbuild.builder.progress import Progress, Verbosity
    from trtbuild.plugins.onnxruntime.session import CpuActivations
    from trtbuild.runtime.engine_dir import load
    from trtbuild.runtime.evaluate import evaluate, score_engine, windows
    from trtbuild.runtime.llm import LLM
    from trtbuild.runtime.core.sampling import SamplingParams

    spec = spec_from_dict({**spec_with(mode="int4_weight_only", cpu_activations="int8"),
                           "build": {"max_input_len": 64, "max_seq_len": 256, "targets": ["sm89"]}})
    summary = build(spec, BuildOptions(out=tmp_path / "out"), Progress(Verbosity.error))
    record = next(r for r in summary.pass_records if r["pass"] == "quantize_weights")["numerics"]
    # Against torch with the same dequantized weights: float activations agree to ~1e-5; int8
    # activations add their own rounding, which the check measures (and bounds).
    assert record["ok"] and record["vs_torch"]["max_abs"] > 1e-3, record
    engine_dir = load(tmp_path / "out")
    assert engine_dir.cpu_activations == CpuActivations.int8
    result = evaluate(tmp_path / "out", CALIB, 256, 1024)
    assert result.cpu_activations == "int8"
    as_float = dataclasses.replace(engine_dir, manifest={**engine_dir.manifest, "spec": {
        **engine_dir.manifest["spec"], "quantization": {**engine_dir.manifest["spec"]["quantization"],
                                                        "cpu_activations": "float"}}})
    from tokenizers import Tokenizer
    ids = Tokenizer.from_file(str(TINY_CODE / "tokenizer.json")).encode(CALIB.read_text()).ids
    float_perplexity = score_engine(as_float, windows(ids, 256, 1024)).perplexity
    assert float_perplexity != result.perplexity and abs(result.perplexity / float_perplexity - 1) < 0.05
    llm = LLM(tmp_path / "out", backend="onnxruntime")
    assert llm.backend_label == "onnxruntime, int8 activations"  # what `trtbuild run` and `serve` print
    options = llm.engine.session.get_session_options()
    assert options.get_session_config_entry("session.qdq_matmulnbits_accuracy_level") == "4"
    prompt = prompt_ids("def f(x):\n    return")
    (completion,) = llm.generate([prompt], SamplingParams(max_tokens=8))
    # int8 activations perturb the logits by ~1e-3: the greedy tokens stay torch's with the same weights
    assert completion.token_ids == dequantized_greedy(spec, prompt, 8, tmp_path / "quantized")


def norm_then_two_matmuls(w1: np.ndarray, w2: np.ndarray, norm_weight: np.ndarray) -> gs.Graph:
    """RMSNormalization → q_proj and k_proj MatMuls, as after fuse_rmsnorm."""
    nodes = [helper.make_node("RMSNormalization", ["x", "g"], ["h"], axis=-1, epsilon=1e-5,
                              name="/model/layers.0/input_layernorm/RMSNormalization"),
             helper.make_node("MatMul", ["h", "w1"], ["y1"], name="/model/layers.0/self_attn/q_proj/MatMul"),
             helper.make_node("MatMul", ["h", "w2"], ["y2"], name="/model/layers.0/self_attn/k_proj/MatMul")]
    f = TensorProto.FLOAT
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", f, [4, w1.shape[0]])],
                              [helper.make_tensor_value_info("y1", f, [4, w1.shape[1]]),
                               helper.make_tensor_value_info("y2", f, [4, w2.shape[1]])],
                              [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2"),
                               numpy_helper.from_array(norm_weight, "g")])
    return gs.import_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 24)]))


def test_smoothquant_folds_into_the_norm_and_quantizes_activations():
    from trtbuild.builder.quant.algorithms import smoothquant

    torch.manual_seed(3)
    w1, w2, g = torch.randn(8, 32), torch.randn(16, 32), torch.rand(32) + 0.5
    x = torch.randn(4, 32)
    x[:, 3] *= 20  # an outlier channel
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * g
    (l1, l2), s = smoothquant([w1, w2], h.abs().amax(0), alpha=0.5)
    ctx = PassContext(spec=None,
                      quantized={"layers.0.self_attn.q_proj": l1, "layers.0.self_attn.k_proj": l2})
    result = quantize_weights(norm_then_two_matmuls(w1.T.contiguous().numpy(), w2.T.contiguous().numpy(), g.numpy()), ctx)
    model = gs.export_onnx(result.graph)
    ops = sorted(n.op_type for n in model.graph.node)
    # no Mul: 1/s went into the norm's weight; one activation Q/DQ pair shared by both MatMuls
    assert ops == ["DequantizeLinear", "DequantizeLinear", "DequantizeLinear", "MatMul", "MatMul",
                   "QuantizeLinear", "RMSNormalization"]
    out = run_onnx(model, {"x": x.numpy()})
    for name, layer in (("y1", l1), ("y2", l2)):
        expected = layer.fake_quantize_input(h) @ layer.dequantize().T
        np.testing.assert_allclose(out[name], expected.numpy(), atol=2e-3, rtol=1e-3)


def test_activations_past_the_calibrated_range_saturate_as_quantize_linear_does():
    """Inputs outside calibration's range (the build's numerics check feeds random cached K/V)
    saturate: int8 QuantizeLinear clamps to [-128, 127], and the simulation must clamp the same
    (at -127 it drifted 10 % from the graph on SmolLM2 and failed the w8a8 build)."""
    from trtbuild.builder.quant.algorithms import smoothquant

    torch.manual_seed(4)
    w1, w2, g = torch.randn(8, 32), torch.randn(16, 32), torch.rand(32) + 0.5
    x = torch.randn(4, 32)
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * g
    (l1, l2), _ = smoothquant([w1, w2], h.abs().amax(0) / 4, alpha=0.5)  # calibrated on a quarter of the range
    codes = torch.round(h / l1.input_scale / l1.activation_scale)
    assert (codes < -128).any() and (codes > 127).any()
    ctx = PassContext(spec=None, quantized={"layers.0.self_attn.q_proj": l1, "layers.0.self_attn.k_proj": l2})
    model = gs.export_onnx(quantize_weights(norm_then_two_matmuls(w1.T.contiguous().numpy(), w2.T.contiguous().numpy(),
                                                                   g.numpy()), ctx).graph)
    out = run_onnx(model, {"x": x.numpy()})
    for name, layer in (("y1", l1), ("y2", l2)):
        expected = layer.fake_quantize_input(h) @ layer.dequantize().T
        np.testing.assert_allclose(out[name], expected.numpy(), atol=2e-3, rtol=1e-3)


def test_group_size_refusal_names_the_group_sizes_that_divide_every_width(tmp_path):
    """A SmolLM-135M-shaped config: hidden 576 = 4.5 × 128, intermediate 1536, 9 heads × 64."""
    import json

    config = json.loads((TINY_CODE / "config.json").read_text())
    config.update(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                  vocab_size=49152)
    (tmp_path / "config.json").write_text(json.dumps(config))
    spec = spec_with(mode="int4_weight_only", group_size=128)
    spec["model"]["checkpoint"] = str(tmp_path)
    with pytest.raises(SpecError) as info:
        spec_from_dict(spec)
    assert str(info.value) == ("quantization.group_size: 128 does not divide hidden_size=576; "
                               "valid: 8, 12, 16, 24, 32, 48, 64, 96, 192")
    spec["parallel"] = {"tensor": 3}  # per rank: intermediate 512, heads 3 × 64 = 192
    with pytest.raises(SpecError) as info:
        spec_from_dict(spec)
    assert str(info.value) == ("quantization.group_size: 128 does not divide hidden_size=576; "
                               "valid: 8, 16, 32, 64")

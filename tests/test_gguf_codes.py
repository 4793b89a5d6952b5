"""Quantized in, quantized out: a GGUF file's Q4_0 blocks under int4 group 32 keep their codes
and scales bit for bit (the engine computes the file's weights), Q4_1's too with one offset per
block (to float32 rounding), Q8_0 under int8 per channel where a row has one scale, else with its
block scales, and everything else (other groups, keep_gguf_codes: false, Q4_1 across tensor ranks)
is re-quantized with the reason
in the pass log. The oracle for the codes is the `gguf` package
quantizing the Hugging Face-order weights: quantization is per row, so it equals the file's
blocks with llama.cpp's q/k row permutation undone."""
from __future__ import annotations

import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from trtbuild.builder.quant.gguf_codes import kept_codes, kept_source
from trtbuild.builder.quant.quantize import load_quantized, quantize_checkpoint
from trtbuild.builder.spec.resolve import spec_from_dict
from trtbuild.builder.spec.document import QuantizationSection
from trtbuild.checkpoint.gguf_blocks import block_codes, offset_block_codes
from trtbuild.checkpoint.gguf_weights import GGUFWeightMap

from conftest import REPO, TINY_CODE
from test_gguf_file import write_llama

sys.path.insert(0, str(REPO / "benchmarks"))
from gguf_export import export  # noqa: E402

LINEARS = 42  # 6 decoder layers × 7 linears (lm_head excluded by default)
KEPT_Q4_0, KEPT_Q4_1 = "kept GGUF Q4_0 codes as int4 group 32", "kept GGUF Q4_1 codes as int4 group 32 with block offsets"


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf")
    return {kind: export(TINY_CODE, root / f"tiny-{kind}.gguf", kind) for kind in ("q4_0", "q4_1", "q8_0")}


def file_codes(name: str, type_name: str = "Q4_0") -> tuple[np.ndarray, np.ndarray]:
    """The codes [out, in] and scales [out, in/32] the file holds for a tiny-code linear, in
    Hugging Face row order, from the gguf package alone: d from each block's first two bytes,
    codes = its dequantized values / d."""
    kind = gguf.GGMLQuantizationType[type_name]
    raw = gguf.quants.quantize(load_file(str(TINY_CODE / "model.safetensors"))[f"model.{name}.weight"].astype(np.float32), kind)
    rows, size = raw.shape[0], gguf.GGML_QUANT_SIZES[kind][1]
    scales = np.ascontiguousarray(raw.reshape(rows, -1, size)[:, :, :2]).view(np.float16)[:, :, 0].astype(np.float32)
    assert (scales != 0).all()
    values = gguf.quants.dequantize(raw, kind).reshape(rows, -1, 32)
    return np.rint(values / scales[:, :, None]).reshape(rows, -1).astype(np.int8), scales


def quantize(path: Path, tmp_path: Path, tensor: int = 1, **quantization) -> tuple[dict, dict]:
    spec = spec_from_dict({"model": {"checkpoint": str(path), "dtype": "float32"},
                           "build": {"max_seq_len": 256, "max_input_len": 32, "targets": ["sm89"]},
                           "parallel": {"tensor": tensor}, "quantization": quantization})
    report = quantize_checkpoint(GGUFWeightMap.from_gguf(path), spec, tmp_path / "quantized", progress=lambda m: None)
    return load_quantized(tmp_path / "quantized")[0], report


@pytest.mark.parametrize("type_name", ["Q4_0", "Q8_0"])
def test_block_codes_times_scales_are_the_dequantized_tensor(tmp_path, type_name):
    """Also for a q projection, whose rows the file holds permuted: whole blocks move with their rows."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((256, 256)).astype(np.float32)
    path = write_llama(tmp_path / "m.gguf", {"blk.0.attn_q.weight": (q, type_name), "blk.0.ffn_up.weight": (q, type_name)})
    weights = GGUFWeightMap.from_gguf(path)
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.up_proj.weight"):
        kind, raw = weights.blocks(name)
        codes, scales = block_codes(kind, raw)
        assert kind == type_name and codes.shape == (256, 256) and scales.shape == (256, 8)
        assert (codes.min(), codes.max()) == ((-8, 7) if type_name == "Q4_0" else (-127, 127))
        dequantized = (codes.astype(np.float32).reshape(256, 8, 32) * scales[:, :, None]).reshape(256, 256)
        assert np.array_equal(dequantized, weights.tensor(name).numpy()), name


def test_q4_0_codes_are_kept_bit_for_bit(gguf_files, tmp_path):
    layers, report = quantize(gguf_files["q4_0"], tmp_path, mode="int4_weight_only", group_size=32)
    assert len(report) == LINEARS
    assert {entry["source"] for entry in report.values()} == {KEPT_Q4_0}
    assert {entry["weight_rel_error"] for entry in report.values()} == {0.0}
    for name in ("layers.0.self_attn.q_proj", "layers.2.self_attn.k_proj", "layers.5.mlp.down_proj"):
        codes, scales = file_codes(name)
        assert np.array_equal(layers[name].codes.numpy(), codes), name
        assert np.array_equal(layers[name].scales.numpy(), scales), name
        assert layers[name].codes.min() == -8 and (layers[name].scales < 0).any()  # Q4_0's range and signs, as stored


@pytest.mark.parametrize("kind, quantization, source", [
    ("q4_0", {"group_size": 32, "keep_gguf_codes": False}, "re-quantized GGUF Q4_0: quantization.keep_gguf_codes is false"),
    ("q4_0", {"group_size": 64}, "re-quantized GGUF Q4_0: group_size 64 is not Q4_0's block of 32"),
    ("q4_1", {"group_size": 64}, "re-quantized GGUF Q4_1: group_size 64 is not Q4_1's block of 32"),
    ("q4_1", {"group_size": 32, "keep_gguf_codes": False}, "re-quantized GGUF Q4_1: quantization.keep_gguf_codes is false"),
], ids=["keep-off", "group-64", "q4_1-group-64", "q4_1-keep-off"])
def test_a_block_tensor_the_mode_cannot_hold_is_requantized_with_the_reason(gguf_files, tmp_path, kind, quantization,
                                                                          source):
    layers, report = quantize(gguf_files[kind], tmp_path, mode="int4_weight_only", **quantization)
    assert {entry["source"] for entry in report.values()} == {source}
    codes = layers["layers.0.mlp.up_proj"].codes
    assert codes.abs().max() == 7  # our RTN's symmetric range, not Q4_0's −8
    if kind == "q4_0" and quantization["group_size"] == 32:  # re-rounding the file's values moves codes
        assert not np.array_equal(codes.numpy(), file_codes("layers.0.mlp.up_proj")[0])


def test_q4_1_blocks_are_q4_0_codes_plus_one_offset_each(tmp_path):
    """d·(q − 8) + (m + 8d) against the gguf package's d·q + m: within one float32 rounding of
    the offset; rows the file holds permuted (a q projection) move with their offsets."""
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((256, 256)) + 0.5).astype(np.float32)  # off-centre: the minimums matter
    path = write_llama(tmp_path / "m.gguf", {"blk.0.attn_q.weight": (w, "Q4_1"), "blk.0.ffn_up.weight": (w, "Q4_1")})
    weights = GGUFWeightMap.from_gguf(path)
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.up_proj.weight"):
        kind, raw = weights.blocks(name)
        codes, scales, offsets = offset_block_codes(raw)
        assert kind == "Q4_1" and codes.shape == (256, 256) and scales.shape == offsets.shape == (256, 8)
        assert (codes.min(), codes.max()) == (-8, 7)
        kept = (codes.astype(np.float32).reshape(256, 8, 32) * scales[:, :, None] + offsets[:, :, None]).reshape(256, 256)
        reference = weights.tensor(name).numpy()
        assert np.abs(kept - reference).max() <= 2 * np.finfo(np.float32).eps * np.abs(reference).max(), name


def test_q4_1_codes_and_offsets_are_kept_under_int4_group_32(gguf_files, tmp_path):
    """The engine's weights are the file's: the report's weight error is float32 rounding, not
    the ~10 % of re-rounding Q4_1's asymmetric grid onto a symmetric one."""
    layers, report = quantize(gguf_files["q4_1"], tmp_path, mode="int4_weight_only", group_size=32)
    assert len(report) == LINEARS and {entry["source"] for entry in report.values()} == {KEPT_Q4_1}
    assert max(entry["weight_rel_error"] for entry in report.values()) < 1e-6
    weights = GGUFWeightMap.from_gguf(gguf_files["q4_1"])
    for name in ("layers.0.self_attn.k_proj", "layers.5.mlp.down_proj"):
        layer = layers[name]
        assert layer.offsets is not None and layer.offsets.shape == layer.scales.shape
        reference = weights.tensor(f"model.{name}.weight")
        assert torch.allclose(layer.dequantize(), reference, rtol=0, atol=1e-6 * reference.abs().max().item()), name
    _, requantized = quantize(gguf_files["q4_1"], tmp_path / "rtn", mode="int4_weight_only", group_size=32,
                              keep_gguf_codes=False)
    assert min(entry["weight_rel_error"] for entry in requantized.values()) > 0.01


def test_q4_1_is_requantized_where_its_offsets_cannot_go(gguf_files, tmp_path):
    _, report = quantize(gguf_files["q4_1"], tmp_path, tensor=2, mode="int4_weight_only", group_size=32)
    assert {entry["source"] for entry in report.values()} == {
        "re-quantized GGUF Q4_1: its block offsets' correction is not sharded across ranks (parallel.tensor 2; "
        "keeping them needs 1)"}
    weights = GGUFWeightMap.from_gguf(gguf_files["q4_1"])
    key = "model.layers.0.mlp.up_proj.weight"
    layer, source = kept_codes(weights, key, QuantizationSection(mode="int8_weight_only"), 8, None, tensor_parallel=2)
    assert layer is None and source.startswith("re-quantized GGUF Q4_1: its block offsets' correction is not sharded")


def test_q8_0_is_kept_per_channel_where_a_row_has_one_scale_else_with_its_block_scales(tmp_path):
    rng = np.random.default_rng(0)
    one_scale = rng.uniform(-1, 1, (16, 256)).astype(np.float32)
    one_scale[:, ::32] = 2.0  # every block's absmax is 2: one d per row
    path = write_llama(tmp_path / "m.gguf", {"blk.0.ffn_up.weight": (one_scale, "Q8_0"),
                                             "blk.0.ffn_gate.weight": (rng.standard_normal((16, 256)).astype(np.float32), "Q8_0")})
    weights, q = GGUFWeightMap.from_gguf(path), QuantizationSection(mode="int8_weight_only")
    layer, source = kept_codes(weights, "model.layers.0.mlp.up_proj.weight", q, 8, None)
    assert source == "kept GGUF Q8_0 codes as int8 per output channel" and layer.group is None
    assert layer.scales.shape == (16,)
    assert torch.equal(layer.dequantize(), weights.tensor("model.layers.0.mlp.up_proj.weight"))
    layer, source = kept_codes(weights, "model.layers.0.mlp.gate_proj.weight", q, 8, None)
    assert source == "kept GGUF Q8_0 codes as int8 group 32" and (layer.bits, layer.group) == (8, 32)
    assert layer.scales.shape == (16, 8) and layer.offsets is None
    assert torch.equal(layer.dequantize(), weights.tensor("model.layers.0.mlp.gate_proj.weight"))
    table, source = kept_codes(weights, "model.layers.0.mlp.gate_proj.weight", q, 8, None, embedding=True)
    assert table is None and source == ("re-quantized GGUF Q8_0: Q8_0's scales are per 32 inputs and the int8 table "
                                        "has one scale per row; this tensor's rows have more than one")


def built(checkpoint: Path, out: Path, **quantization):
    """The build summary of ``checkpoint`` (a tiny GGUF file) at float32, quantized as given."""
    from trtbuild.builder.build import BuildOptions, build
    from trtbuild.builder.progress import Progress, Verbosity

    spec = spec_from_dict({"model": {"checkpoint": str(checkpoint), "dtype": "float32"},
                           "build": {"max_batch_size": 2, "max_input_len": 32, "max_seq_len": 128, "targets": ["sm89"]},
                           "quantization": quantization})
    return build(spec, BuildOptions(out=out), Progress(Verbosity.error))


def same_greedy_tokens(one: Path, other: Path) -> bool:
    """Whether two engine dirs decode two code prompts to the same 16 greedy tokens."""
    from trtbuild.runtime.core.sampling import SamplingParams
    from trtbuild.runtime.llm import LLM

    from test_quantization import prompt_ids

    prompts = [prompt_ids("def f(x):\n    return"), prompt_ids("class Node:\n")]
    params = SamplingParams(max_tokens=16)
    tokens = [[c.token_ids for c in LLM(d, backend="onnxruntime").generate(prompts, params)] for d in (one, other)]
    return tokens[0] == tokens[1] and all(len(t) == 16 for t in tokens[0])


@pytest.mark.slow
def test_a_q4_0_engine_holds_the_files_codes_and_decodes_as_its_float_build(gguf_files, tmp_path):
    """The rank graph's int4 DequantizeLinear holds the file's codes and scales; the pass log and
    `trtbuild inspect` say kept; greedy tokens equal the float32 build of the same (dequantized) file."""
    import onnx
    from click.testing import CliRunner
    from onnx import numpy_helper

    from trtbuild.cli.main import main
    from trtbuild.builder.passes.quantize_weights import module_of

    summary = built(gguf_files["q4_0"], tmp_path / "kept", mode="int4_weight_only", group_size=32)
    record = next(r for r in summary.pass_records if r["pass"] == "quantize_weights")
    assert record["matches"] == LINEARS and record["numerics"]["ok"]
    assert {entry["source"] for entry in record["layers"].values()} == {KEPT_Q4_0}
    shown = CliRunner().invoke(main, ["inspect", str(tmp_path / "kept")])
    assert shown.exit_code == 0 and f"gguf codes   {KEPT_Q4_0}: 42 layers (self_attn.q_proj in layers 0-5;" in shown.output

    graph = onnx.load(tmp_path / "kept" / "rank0.onnx")
    arrays = {t.name: t for t in graph.graph.initializer}
    for name in ("layers.0.self_attn.q_proj", "layers.3.mlp.gate_proj"):
        node = next(n for n in graph.graph.node if n.op_type == "DequantizeLinear" and module_of(n.name) == name)
        codes, scales = (numpy_helper.to_array(arrays[i]) for i in node.input[:2])  # [in, out], [in/32, out]
        expected_codes, expected_scales = file_codes(name)
        assert arrays[node.input[0]].data_type == onnx.TensorProto.INT4
        assert np.array_equal(codes.astype(np.int8).T, expected_codes), name
        assert np.array_equal(scales.T, expected_scales), name

    built(gguf_files["q4_0"], tmp_path / "float")  # the same file, dequantized, no quantization
    assert same_greedy_tokens(tmp_path / "kept", tmp_path / "float")


@pytest.mark.slow
def test_a_q4_1_engine_adds_its_offsets_and_decodes_as_its_float_build(gguf_files, tmp_path):
    """Each linear of the rank graph is MatMul(x, DQ(codes)) + MatMul(block sums of x, offsets),
    one block sum per input tensor (q/k/v share theirs), and the CPU graph packs q/k/v with their
    offsets; the build's numerics check finds its logits within 1e-4 (max relative) of the float
    model of the same file, and greedy tokens are the float32 build's."""
    import onnx

    summary = built(gguf_files["q4_1"], tmp_path / "kept", mode="int4_weight_only", group_size=32)
    record = next(r for r in summary.pass_records if r["pass"] == "quantize_weights")
    assert record["matches"] == LINEARS and record["numerics"]["ok"]
    assert record["numerics"]["vs_torch_float"]["max_rel"] < 1e-4   # the float model of the same file
    graph = onnx.load(tmp_path / "kept" / "rank0.onnx", load_external_data=False).graph
    ops = [n.op_type for n in graph.node]
    assert sum(n.name.endswith("/OffsetMatMul") for n in graph.node) == LINEARS
    assert ops.count("ReduceSum") == 6 * 4   # per layer: the attention input, o_proj's, the MLP input, down_proj's
    packed = next(r for r in summary.pass_records if r["pass"] == "cpu_pack_qkv")   # offsets packed with q/k/v
    assert packed["matches"] == 6 and packed["numerics"]["ok"]

    built(gguf_files["q4_1"], tmp_path / "float")
    assert same_greedy_tokens(tmp_path / "kept", tmp_path / "float")


def test_keep_gguf_codes_is_a_strict_boolean(gguf_files):
    from trtbuild.builder.errors import SpecError

    with pytest.raises(SpecError, match=r"^quantization\.keep_gguf_codes: Input should be a valid boolean"):
        spec_from_dict({"model": {"checkpoint": str(gguf_files["q4_0"])},
                        "quantization": {"mode": "int4_weight_only", "keep_gguf_codes": "yes"}})

"""W8A8 graphs on the CPU give the graph's numbers whatever the CPU's int8 instructions
(plugins/onnxruntime/int8_gemm.py): exact where the integer GEMM is, float GEMMs where it saturates."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from trtbuild.plugins.onnxruntime import int8_gemm
from trtbuild.plugins.onnxruntime.session import run, session

K, N = 576, 256


def w8a8_matmul(rng: np.random.Generator, zero_point_type: int = TensorProto.INT8) -> tuple[onnx.ModelProto, dict]:
    """x [4, K] → QuantizeLinear/DequantizeLinear (a static per-tensor scale, as W8A8 has) →
    MatMul with int8 weight codes over their full range, one scale per output channel."""
    codes = rng.integers(-127, 128, (K, N), dtype=np.int8)
    weight_scale = (rng.random(N) * 0.01 + 0.001).astype(np.float32)
    x_scale = np.float32(0.02)
    zero = np.array(0, np.int8 if zero_point_type == TensorProto.INT8 else np.uint8)
    if zero_point_type == TensorProto.FLOAT8E4M3FN:
        zero = helper.make_tensor("x_zero", TensorProto.FLOAT8E4M3FN, [], [0.0])
    else:
        zero = numpy_helper.from_array(zero, "x_zero")
    nodes = [helper.make_node("QuantizeLinear", ["x", "x_scale", "x_zero"], ["x_q"]),
             helper.make_node("DequantizeLinear", ["x_q", "x_scale", "x_zero"], ["x_dq"]),
             helper.make_node("DequantizeLinear", ["w_q", "w_scale"], ["w"], axis=1),
             helper.make_node("MatMul", ["x_dq", "w"], ["y"])]
    graph = helper.make_graph(nodes, "w8a8", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, K])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, N])],
                              [numpy_helper.from_array(codes, "w_q"), numpy_helper.from_array(weight_scale, "w_scale"),
                               numpy_helper.from_array(x_scale, "x_scale"), zero])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    # Activations spread over the whole int8 range: the worst case for a saturating pair sum.
    x = (rng.standard_normal((4, K)) * 1.2).astype(np.float32)
    x_dq = np.clip(np.round(x / x_scale), -128, 127) * x_scale
    reference = x_dq.astype(np.float64) @ (codes.astype(np.float64) * weight_scale)
    return model, {"x": x, "reference": reference}


def test_a_w8a8_matmul_gives_its_fake_quantized_math_on_this_cpu():
    """Max relative error against float64 math on the same codes: ~5e-7 where the GEMM is exact
    or runs in float; without the float GEMMs an AVX2-only CPU gave 19 % here."""
    model, data = w8a8_matmul(np.random.default_rng(0))
    y = run(session(model, threads=1), {"x": data["x"]})["y"]
    reference = data["reference"]
    max_rel = float(np.abs(y - reference).max() / np.abs(reference).max())
    assert max_rel < 1e-5, (max_rel, int8_gemm.saturates())


def test_graphs_that_quantize_activations_to_int8_are_told_apart_from_weight_only_and_fp8():
    rng = np.random.default_rng(1)
    w8a8, _ = w8a8_matmul(rng)
    assert int8_gemm.quantizes_activations(w8a8)
    assert int8_gemm.quantizes_activations(w8a8_matmul(rng, TensorProto.UINT8)[0])
    assert not int8_gemm.quantizes_activations(w8a8_matmul(rng, TensorProto.FLOAT8E4M3FN)[0])

    weight_only = onnx.ModelProto()
    weight_only.CopyFrom(w8a8)
    nodes = [n for n in weight_only.graph.node if n.output[0] not in ("x_q", "x_dq")]
    nodes[-1].input[0] = "x"
    del weight_only.graph.node[:]
    weight_only.graph.node.extend(nodes)
    assert not int8_gemm.quantizes_activations(weight_only)

    # Inside an If's branch, as the CPU step model holds its decode graph.
    branch = helper.make_graph(list(w8a8.graph.node), "then", [], list(w8a8.graph.output),
                               list(w8a8.graph.initializer))
    other = helper.make_graph([helper.make_node("Identity", ["x"], ["y_else"])], "else", [],
                              [helper.make_tensor_value_info("y_else", TensorProto.FLOAT, [4, K])])
    step = helper.make_graph([helper.make_node("If", ["cond"], ["y"], then_branch=branch, else_branch=other)], "step",
                             [helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
                              helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, K])],
                             [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    assert int8_gemm.quantizes_activations(helper.make_model(step, opset_imports=[helper.make_opsetid("", 21)]))


@pytest.mark.parametrize("saturating", [True, False])
def test_only_graphs_that_quantize_activations_lose_the_integer_kernels(monkeypatch, tmp_path, caplog, saturating):
    """The switch also turns off int4 DequantizeLinear → MatMulNBits: a weight-only graph keeps it.
    Where it applies, one warning a process says W8A8 runs at float speed."""
    monkeypatch.setattr(int8_gemm, "saturates", lambda: saturating)
    int8_gemm._say_once.cache_clear()
    w8a8, _ = w8a8_matmul(np.random.default_rng(2))
    path = tmp_path / "w8a8.onnx"
    onnx.save(w8a8, path)
    assert int8_gemm.needs_float_gemms(path) is saturating
    assert int8_gemm.needs_float_gemms(str(path)) is saturating
    assert int8_gemm.needs_float_gemms(w8a8.SerializeToString()) is saturating
    warnings = [r for r in caplog.records if r.name == int8_gemm.__name__ and "float32 speed" in r.getMessage()]
    assert len(warnings) == (1 if saturating else 0)
    weight_only = onnx.ModelProto()
    weight_only.CopyFrom(w8a8)
    del weight_only.graph.node[:2]
    weight_only.graph.node[-1].input[0] = "x"
    weight_only.graph.node[0].name = "QuantizeLinear"  # a name is not an op type
    onnx.save(weight_only, tmp_path / "weight_only.onnx")
    monkeypatch.setattr(onnx, "load", lambda *a, **k: pytest.fail("parsed a weight-only file"))
    monkeypatch.setattr(onnx, "load_from_string", lambda *a, **k: pytest.fail("parsed weight-only bytes"))
    for source in (weight_only, tmp_path / "weight_only.onnx", weight_only.SerializeToString()):
        assert not int8_gemm.needs_float_gemms(source)


def test_the_probe_calls_saturation_as_the_fused_kernel_computes_another_matmul():
    """The once-per-process probe (its own matrix) and this test's 576-wide MatMul, run with the
    fusion on, agree on whether this CPU's int8 GEMM is exact; with the fusion off both are."""
    import onnxruntime as ort

    from trtbuild.plugins.onnxruntime.session import session_options

    model, data = w8a8_matmul(np.random.default_rng(3))
    errors = {}
    for float_gemms in (False, True):
        options = session_options(1, float_gemms=float_gemms)
        fused = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        y = fused.run(None, {"x": data["x"]})[0]
        errors[float_gemms] = float(np.abs(y - data["reference"]).max() / np.abs(data["reference"]).max())
    assert errors[True] < 1e-5, errors
    assert int8_gemm.saturates() is (errors[False] > int8_gemm.PROBE_TOLERANCE), errors

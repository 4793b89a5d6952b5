"""Where ONNX Runtime's int8 GEMM is not exact, and what a session does about it.

A W8A8 graph quantizes activations at run time (``QuantizeLinear`` to int8 in front of each
MatMul whose weights are int8 codes). ONNX Runtime fuses each such pair into an integer GEMM
(u8 activations × s8 weights). On x86 CPUs with VNNI or AMX int8 that GEMM accumulates in int32
and is exact. With AVX2 (or AVX-512 without VNNI) alone, MLAS multiplies with ``vpmaddubsw``,
which adds two u8 × s8 products into a saturating int16: with int8 weights over their full range
576-wide MatMuls came out 15–19 % off (max relative error) on an AMD EPYC, against ~5e-7 with the
fusion off. On such a CPU a session of a graph that quantizes activations turns the fusion off
(``session.disable_quant_qdq``): the activations' Q/DQ still round as the engine's do, and the
MatMuls run in float on the dequantized weights, so the numbers are the graph's, at float speed.
That switch also turns off the int4 ``DequantizeLinear → MatMulNBits`` rewrite, which is why it
is limited to graphs that quantize activations: weight-only graphs never need it.

Whether the GEMM saturates is measured, not read from CPU flags: one small W8A8 MatMul whose
pair sums overflow int16 runs once per process, the first time a graph that quantizes
activations is loaded, and its error decides (so an ONNX Runtime that stops saturating, or a
CPU whose flags say nothing, is judged by what it computes).
"""
from __future__ import annotations

import functools
import logging
import mmap
import os

import numpy as np
import onnx

log = logging.getLogger(__name__)

_INT8 = {2, 3}  # onnx.TensorProto.UINT8, INT8
_OP_TYPE = b"\x22\x0eQuantizeLinear"  # NodeProto.op_type (field 4, length-delimited), 14 bytes long
PROBE_TOLERANCE = 1e-3  # max relative error; exact GEMMs give ~5e-7; AVX2 alone gave 0.46


@functools.cache
def saturates() -> bool:
    """Whether ONNX Runtime's fused int8 GEMM is inexact on this CPU: the probe's max relative
    error against float64 math on the same codes exceeds PROBE_TOLERANCE."""
    import onnxruntime as ort

    model, x, reference = probe()
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    (y,) = session.run(None, {"x": x})
    error = float(np.abs(y - reference).max() / np.abs(reference).max())
    log.debug("int8 GEMM probe: max relative error %.2g", error)
    return error > PROBE_TOLERANCE


def probe():
    """(model, x, reference): x [8, 512] → QuantizeLinear/DequantizeLinear (int8, one scale) →
    MatMul with int8 weight codes [512, 64] of ±127 and ±126, one scale per column. Every
    activation code is far from zero, so adjacent u8 × s8 products sum past int16 wherever a
    kernel pairs them in int16; ``reference`` [8, 64] is the same math in float64."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    codes = (rng.choice([-127, -126, 126, 127], (512, 64))).astype(np.int8)
    scales = (rng.random(64) * 0.01 + 0.001).astype(np.float32)
    x_scale = np.float32(0.01)
    x = (rng.choice([-1.0, 1.0], (8, 512)) * rng.uniform(1.0, 1.27, (8, 512))).astype(np.float32)
    nodes = [helper.make_node("QuantizeLinear", ["x", "x_scale", "x_zero"], ["x_q"]),
             helper.make_node("DequantizeLinear", ["x_q", "x_scale", "x_zero"], ["x_dq"]),
             helper.make_node("DequantizeLinear", ["w_q", "w_scale"], ["w"], axis=1),
             helper.make_node("MatMul", ["x_dq", "w"], ["y"])]
    graph = helper.make_graph(nodes, "int8_gemm_probe", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 512])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8, 64])],
                              [numpy_helper.from_array(codes, "w_q"), numpy_helper.from_array(scales, "w_scale"),
                               numpy_helper.from_array(x_scale, "x_scale"),
                               numpy_helper.from_array(np.array(0, np.int8), "x_zero")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    onnx.checker.check_model(model)
    x_dq = np.clip(np.round(x / x_scale), -128, 127).astype(np.float64) * x_scale
    return model, x, x_dq @ (codes.astype(np.float64) * scales)


def quantizes_activations(model) -> bool:
    """Whether ``model`` (an onnx.ModelProto) quantizes tensors to 8-bit integers at run time:
    a ``QuantizeLinear`` to int8/uint8 anywhere, If branches included (our graphs store weights
    as codes, so every such node quantizes activations: W8A8)."""
    graphs = [*_graphs(model.graph), *(g for function in model.functions for g in _graphs(function))]
    return any(_quantizes_to_int8(node, graph) for graph in graphs for node in graph.node
               if node.op_type == "QuantizeLinear")


def _quantizes_to_int8(node, graph) -> bool:
    """A QuantizeLinear's output type: its ``output_dtype``, else its zero point's, else uint8."""
    for attribute in node.attribute:
        if attribute.name == "output_dtype" and attribute.i:
            return attribute.i in _INT8
    if len(node.input) < 3 or not node.input[2]:
        return True  # no zero point: uint8
    zero_point = node.input[2]
    for tensor in graph.initializer if isinstance(graph, onnx.GraphProto) else ():  # a FunctionProto has none
        if tensor.name == zero_point:
            return tensor.data_type in _INT8
    for constant in graph.node:
        if constant.op_type == "Constant" and zero_point in constant.output:
            return any(a.t.data_type in _INT8 for a in constant.attribute if a.HasField("t"))
    return True  # a zero point we cannot see: assume the common int8 case, the safe side


def _mentions_quantize(source) -> bool:
    """Whether a serialized model (bytes, or a file read through a memory map) may hold a
    QuantizeLinear node: its op_type field as protobuf writes it (NodeProto field 4, then the
    name's length, 14), which DequantizeLinear's (length 16) and names do not match."""
    if isinstance(source, (bytes, bytearray)):
        return _OP_TYPE in source
    with open(source, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return False  # ONNX Runtime says what is wrong with it
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            return mapped.find(_OP_TYPE) >= 0


def _graphs(graph):
    """``graph`` (a GraphProto or FunctionProto) and every subgraph its nodes hold."""
    yield graph
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.HasField("g"):
                yield from _graphs(attribute.g)
            for sub in attribute.graphs:
                yield from _graphs(sub)


def needs_float_gemms(source) -> bool:
    """Whether a session of ``source`` (a model path, serialized bytes or an onnx.ModelProto) must
    run its int8 GEMMs in float: it quantizes activations and this CPU's int8 GEMM saturates
    (probed the first time such a graph comes)."""
    if isinstance(source, onnx.ModelProto):
        model = source
    elif not _mentions_quantize(source):  # most graphs: no parse (a serialized one may hold its weights)
        return False
    else:
        model = onnx.load_from_string(bytes(source)) if isinstance(source, (bytes, bytearray)) else \
            onnx.load(str(source), load_external_data=False)
    if not quantizes_activations(model) or not saturates():
        return False
    _say_once()
    return True


@functools.cache
def _say_once() -> None:
    """A warning (once a process): the numbers are right, but W8A8 runs at float speed here."""
    log.warning("W8A8 on this CPU: ONNX Runtime's int8 GEMM saturates without VNNI or AMX int8, so the graph's "
                "activation Q/DQ run as written and its MatMuls in float on the dequantized weights (the "
                "graph's results, at float32 speed and weight memory)")

"""Where ONNX Runtime's int8 GEMM is not exact, and what a session does about it.

A W8A8 graph quantizes activations at run time (``QuantizeLinear`` to int8 in front of each
MatMul whose weights are int8 codes). ONNX Runtime fuses each such pair into an integer GEMM
(u8 activations × s8 weights). On x86 CPUs with VNNI or AMX int8 that GEMM accumulates in int32
and is exact. With AVX2 (or AVX-512 without VNNI) alone, MLAS multiplies with ``vpmaddubsw``,
which adds two u8 × s8 products into a saturating int16: with int8 weights over their full range
a 576-wide MatMul came out 15.5 % off (max relative error) on an AMD EPYC, against 3e-7 with the
fusion off. On such a CPU a session of a graph that quantizes activations turns the fusion off
(``session.disable_quant_qdq``): the activations' Q/DQ still round as the engine's do, and the
MatMuls run in float on the dequantized weights, so the numbers are the graph's, at float speed.
That switch also turns off the int4 ``DequantizeLinear → MatMulNBits`` rewrite, which is why it
is limited to graphs that quantize activations: weight-only graphs never need it.
"""
from __future__ import annotations

import functools
import logging
import mmap
import os
import platform
from pathlib import Path

log = logging.getLogger(__name__)

# CPU flags (Linux's /proc/cpuinfo names) under which MLAS's u8 × s8 GEMM accumulates in int32.
INT8_DOT_PRODUCT_FLAGS = frozenset({"avx512_vnni", "avx_vnni", "amx_int8"})
_INT8 = {2, 3}  # onnx.TensorProto.UINT8, INT8
_OP_TYPE = b"\x22\x0eQuantizeLinear"  # NodeProto.op_type (field 4, length-delimited), 14 bytes long


@functools.cache
def saturates() -> bool:
    """Whether this CPU's int8 GEMM in ONNX Runtime can saturate: an x86 CPU whose flags show
    neither VNNI nor AMX int8. False elsewhere (other architectures widen their products; a CPU
    whose flags cannot be read is taken at its word)."""
    if platform.machine().lower() not in ("x86_64", "amd64", "i686", "x86"):
        return False
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), None)
    return flags is not None and not INT8_DOT_PRODUCT_FLAGS & set(flags)


def quantizes_activations(model) -> bool:
    """Whether ``model`` (an onnx.ModelProto) quantizes tensors to 8-bit integers at run time:
    a ``QuantizeLinear`` to int8/uint8 anywhere, If branches included (our graphs store weights
    as codes, so every such node quantizes activations: W8A8)."""
    return any(_quantizes_to_int8(node, graph) for graph in _graphs(model.graph) for node in graph.node
               if node.op_type == "QuantizeLinear")


def _quantizes_to_int8(node, graph) -> bool:
    """A QuantizeLinear's output type: its ``output_dtype``, else its zero point's, else uint8."""
    for attribute in node.attribute:
        if attribute.name == "output_dtype" and attribute.i:
            return attribute.i in _INT8
    if len(node.input) < 3 or not node.input[2]:
        return True  # no zero point: uint8
    zero_point = node.input[2]
    for tensor in graph.initializer:
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
    if isinstance(source, bytes):
        return _OP_TYPE in source
    with open(source, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return False  # ONNX Runtime says what is wrong with it
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            return mapped.find(_OP_TYPE) >= 0


def _graphs(graph):
    """``graph`` and every subgraph its nodes hold."""
    yield graph
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.HasField("g"):
                yield from _graphs(attribute.g)
            for sub in attribute.graphs:
                yield from _graphs(sub)


def needs_float_gemms(source) -> bool:
    """Whether a session of ``source`` (a model path, serialized bytes or an onnx.ModelProto) must
    run its int8 GEMMs in float on this CPU; read only where the CPU saturates."""
    if not saturates():
        return False
    import onnx

    if isinstance(source, onnx.ModelProto):
        model = source
    elif not _mentions_quantize(source):  # most graphs: no parse (a serialized one may hold its weights)
        return False
    else:
        model = onnx.load_from_string(source) if isinstance(source, bytes) else \
            onnx.load(str(source), load_external_data=False)
    if not quantizes_activations(model):
        return False
    log.info("this CPU has no int8 dot products (VNNI/AMX), where ONNX Runtime's int8 GEMM saturates: the "
             "graph's activation Q/DQ run as written and its MatMuls in float (exact, at float speed)")
    return True

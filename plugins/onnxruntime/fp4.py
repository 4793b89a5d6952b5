"""NVFP4 weights on CPU: ONNX Runtime has no FLOAT4E2M1 ``DequantizeLinear`` kernel.

The graph keeps the standard form TensorRT compiles on sm120 (``DequantizeLinear(codes
FLOAT4E2M1, block scales)`` with the block scales themselves ``DequantizeLinear(FLOAT8E4M3FN,
global scale)``). For ONNX Runtime, ``simulate`` replaces each such chain by the float weights
it computes (numpy, ml_dtypes): the same scales, so running it is simulated NVFP4 quantization
of exactly what the engine holds.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

FP4 = onnx.TensorProto.FLOAT4E2M1


def has_fp4(model: onnx.ModelProto) -> bool:
    return any(t.data_type == FP4 for t in model.graph.initializer)


def simulate(model: onnx.ModelProto, base_dir: Path | str = "") -> onnx.ModelProto:
    """``model`` with every FP4 ``DequantizeLinear`` chain folded into a float initializer; external
    codes and scales are read relative to ``base_dir`` (the dir the model's data files lie in)."""
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    producers = {out: node for node in graph.node for out in node.output}
    drop, new = set(), []
    for node in graph.node:
        codes_init = inits.get(node.input[0]) if node.op_type == "DequantizeLinear" else None
        if codes_init is None or codes_init.data_type != FP4:
            continue
        codes = numpy_helper.to_array(codes_init, str(base_dir)).astype(np.float32)              # [in, out]
        scale_node = producers[node.input[1]]                                      # DQ(block scales, global)
        blocks = numpy_helper.to_array(inits[scale_node.input[0]], str(base_dir)).astype(np.float32)
        global_scale = numpy_helper.to_array(inits[scale_node.input[1]], str(base_dir))  # in the model's float type
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        scales = np.repeat(blocks * global_scale.astype(np.float32), attrs["block_size"], axis=attrs.get("axis", 1))
        weight = (codes * scales).astype(global_scale.dtype)
        new.append(numpy_helper.from_array(weight, node.output[0]))
        drop.update({id(node), id(scale_node)})
    if not new:
        return model
    kept = [n for n in graph.node if id(n) not in drop]
    del graph.node[:]
    graph.node.extend(kept)
    used = {name for n in kept for name in n.input}
    initializers = [t for t in graph.initializer if t.name in used] + new
    del graph.initializer[:]
    graph.initializer.extend(initializers)
    return model


def cpu_model(path: Path) -> onnx.ModelProto:
    """A rank ONNX as ONNX Runtime can run it: its structure (weights stay external, beside it),
    or for an NVFP4 graph the simulated model with its weights loaded (fine for CPU-sized models)."""
    structure = onnx.load(path, load_external_data=False)
    return simulate(onnx.load(path)) if has_fp4(structure) else structure


def ort_source(path: Path) -> str | bytes:
    """What to hand ``onnxruntime.InferenceSession`` for a whole rank ONNX: its path (ONNX Runtime
    reads the weights itself), or the simulated NVFP4 model in memory."""
    if not has_fp4(onnx.load(path, load_external_data=False)):
        return str(path)
    return cpu_model(path).SerializeToString()

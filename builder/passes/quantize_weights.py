"""quantize_weights: MatMul(x, W) → MatMul(x [/ s], DequantizeLinear(W_q, scale)) for each layer
the spec quantizes (codes and scales come from trtbuild.builder.quant, computed on the
checkpoint). INT8: per output channel (axis 1); INT4: blocks of ``group`` input rows
(axis 0, block_size). AWQ's per-input-channel scale ``s`` becomes a Mul on the activations.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx_graphsurgeon as gs
from onnx import numpy_helper
from onnx_graphsurgeon.ir.tensor import LazyValues

from .base import PassContext, PassError, PassResult
from .fusion import new_node


def module_of(node_name: str) -> str:
    """``/model/layers.0/self_attn/q_proj/MatMul`` → ``layers.0.self_attn.q_proj``."""
    return node_name.removeprefix("/model/").rsplit("/", 1)[0].replace("/", ".")


def _constant(name: str, values: np.ndarray) -> gs.Constant:
    """A constant whose TensorProto is made by onnx itself: it packs int4 two to a byte
    (onnx-graphsurgeon's own export would write one byte per element)."""
    return gs.Constant(name, LazyValues(numpy_helper.from_array(values, name)))


def quantize_weights(graph: gs.Graph, ctx: PassContext) -> PassResult:
    layers = ctx.quantized or {}
    if not layers:
        return PassResult(graph=graph, modified=False, stats={"matches": 0, "mode": "none"})
    done, skipped = {}, {}
    for node in list(graph.nodes):
        if node.op != "MatMul":
            continue
        name = module_of(node.name)
        layer = layers.get(name)
        if layer is None:
            continue
        weight = node.inputs[1]
        if not isinstance(weight, gs.Constant) or tuple(weight.shape) != tuple(layer.codes.shape[::-1]):
            skipped[node.name] = f"weight is not a constant of shape {tuple(layer.codes.shape[::-1])}"
            continue
        dtype = np.dtype(weight.dtype)
        codes = layer.codes.T.contiguous().numpy()              # [in, out]
        scales = layer.scales.numpy().astype(dtype)
        if layer.bits == 4:
            codes, scales = codes.astype(ml_dtypes.int4), np.ascontiguousarray(scales.T)  # scales [in/g, out]
            attrs = {"axis": 0, "block_size": layer.group}
        else:
            attrs = {"axis": 1}                                  # scales [out]
        scope = node.name.rsplit("/", 1)[0]
        dequantized = gs.Variable(f"{name}.weight_dq", dtype=dtype, shape=list(weight.shape))
        graph.nodes.append(new_node("DequantizeLinear", f"{scope}/DequantizeLinear",
                                    [_constant(f"{name}.weight_q", codes), gs.Constant(f"{name}.weight_scale", scales)],
                                    attrs, [dequantized]))
        node.inputs[1] = dequantized
        if layer.input_scale is not None:  # AWQ: x / s feeds the scaled weights
            scaled = gs.Variable(f"{name}.input_scaled", dtype=dtype)
            inverse = gs.Constant(f"{name}.input_scale_inv", (1.0 / layer.input_scale.numpy()).astype(dtype))
            graph.nodes.append(new_node("Mul", f"{scope}/ActivationScale", [node.inputs[0], inverse], outputs=[scaled]))
            node.inputs[0] = scaled
        done[name] = (ctx.quant_report or {}).get(name, {})
    graph.cleanup(remove_unused_graph_inputs=False).toposort()
    if len(done) != len(layers):
        missing = sorted(set(layers) - set(done))[:4]
        raise PassError(f"quantize_weights matched {len(done)} of the {len(layers)} layers to quantize; "
                        f"not found: {missing}{'; skipped: ' + str(skipped) if skipped else ''}")
    return PassResult(graph=graph, modified=True, stats={"matches": len(done), "expected": len(layers),
                                                         "layers": done})

"""CPU stage: a GroupQueryAttention's three projections of one input become one MatMul over the
weights concatenated, fed to GroupQueryAttention as its packed QKV input: float weights by a
Concat of initializers, which ONNX Runtime folds once; quantized ones (DequantizeLinear →
MatMul) by one DequantizeLinear over codes and scales concatenated here (ONNX has no Concat of
int4), which ONNX Runtime turns into one n-bit GEMM; int4 kept from a GGUF Q4_1 file (each
projection MatMul + MatMul(block sums, offsets), builder/passes/quantize_weights.py) packs its
three offset tables as well, one MatMul and one Add. The packed tensors are new: the engine dir
holds them in rankN.cpu.onnx's own data file, every other weight in the rank's
(builder/emit/cpu_step_model.py).

    fusion: pattern (three MatMuls of one input, read only by the attention) + replacement + check
    (the numerics gate: a decode step against the rank graph)
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import external_data_helper, helper, numpy_helper

from .base import PassContext
from .onnx_rewrite import Rewritten, attribute, replace_nodes

# Quantization modes whose q/k/v projections have the one form pack_qkv packs (float, or weight-only
# DequantizeLinear → MatMul); with activations quantized too the count is reported, not required.
PACKED_MODES = ("none", "int8_weight_only", "int4_weight_only")


def pack_qkv(model: onnx.ModelProto, weights_dir: Path | None = None) -> Rewritten:
    """The model with each GroupQueryAttention's q/k/v MatMuls packed into one.
    ``weights_dir``: where the model's external weights are (quantized projections are packed
    from their bytes)."""
    graph = model.graph
    weights = {i.name: i for i in graph.initializer}
    producer = {o: n for n in graph.node for o in n.output}
    readers: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1
    replacement: dict[int, list[onnx.NodeProto]] = {}
    unmatched: dict[str, str] = {}
    packed_weights: list[onnx.TensorProto] = []
    for attention in graph.node:
        if attention.op_type != "GroupQueryAttention" or not all(attention.input[:3]):
            continue
        projections = [producer.get(name) for name in attention.input[:3]]
        offsets = _offset_form(projections, producer, weights, readers)
        if offsets is not None:  # int4 kept from a GGUF Q4_1 file: each projection is MatMul + offsets
            adds, projections, corrections = offsets
        if any(p is None or p.op_type != "MatMul" or readers[p.output[0]] != 1 for p in projections) \
                or len({p.input[0] for p in projections}) != 1:
            unmatched[attention.name] = "q/k/v are not three MatMuls of one input, each read by the attention only"
            continue
        weight, packed = f"{attention.name}/qkv_weight", f"{attention.name}/qkv"  # [K, N_q + N_k + N_v]
        if all(p.input[1] in weights for p in projections):
            # Float weights: a Concat of initializers, which ONNX Runtime folds once.
            nodes = [helper.make_node("Concat", [p.input[1] for p in projections], [weight], axis=1, name=weight)]
        else:
            dequantize = _packed_dequantize([producer.get(p.input[1]) for p in projections], weights, readers,
                                            weight, weights_dir)
            if dequantize is None:
                unmatched[attention.name] = "the q/k/v weights' DequantizeLinear forms differ"
                continue
            node, tensors = dequantize
            nodes = [node]
            packed_weights += tensors
            replacement.update({id(producer[p.input[1]]): [] for p in projections})
        fused = onnx.NodeProto()
        fused.CopyFrom(attention)
        fused.input[0], fused.input[1], fused.input[2] = packed, "", ""
        for p in projections:
            replacement[id(p)] = []
        matmul = packed if offsets is None else f"{packed}/dq_matmul"
        nodes.append(helper.make_node("MatMul", [projections[0].input[0], weight], [matmul], name=matmul))
        if offsets is not None:
            # One MatMul of the shared block sums by the three offset tables side by side, then one Add.
            table = _concat([weights[c.input[1]] for c in corrections], 1, f"{attention.name}/qkv_offsets",
                            weights_dir)
            packed_weights.append(table)
            nodes += [helper.make_node("MatMul", [corrections[0].input[0], table.name], [f"{packed}/offsets"],
                                       name=f"{packed}/offsets"),
                      helper.make_node("Add", [matmul, f"{packed}/offsets"], [packed], name=f"{packed}/add_offsets")]
            replacement.update({id(n): [] for n in (*adds, *corrections)})
        replacement[id(attention)] = [*nodes, fused]
    out = replace_nodes(model, replacement)
    out.graph.initializer.extend(packed_weights)
    return Rewritten(out, sum(1 for nodes in replacement.values() if nodes), unmatched)


def _offset_form(projections: list, producer: dict, weights: dict, readers: dict) -> tuple[list, list, list] | None:
    """(the three Adds, their MatMuls of x, their offset MatMuls) where each projection is
    Add(MatMul(x, W), MatMul(block sums of x, offsets)) with the sums shared and the offsets
    initializers, each intermediate read once (quantize_weights' form of kept Q4_1 codes); else None."""
    if any(p is None or p.op_type != "Add" or readers[p.output[0]] != 1 for p in projections):
        return None
    mains = [producer.get(p.input[0]) for p in projections]
    corrections = [producer.get(p.input[1]) for p in projections]
    if any(n is None or n.op_type != "MatMul" or readers[n.output[0]] != 1 for n in (*mains, *corrections)) \
            or len({c.input[0] for c in corrections}) != 1 or any(c.input[1] not in weights for c in corrections):
        return None
    return projections, mains, corrections


def _packed_dequantize(nodes: list[onnx.NodeProto | None], weights: dict[str, onnx.TensorProto],
                       readers: dict[str, int], output: str, weights_dir: Path | None
                       ) -> tuple[onnx.NodeProto, list[onnx.TensorProto]] | None:
    """One DequantizeLinear over the q/k/v weights, scales and zero points concatenated along
    the output channels (new in-memory initializers), or None if the three do not have one form:
    weight [K, N] and scale/zero point [K / block, N] or per-channel [N], same attributes and
    types, each read by its DequantizeLinear only. ONNX Runtime then makes one n-bit GEMM of the
    packed weights, as for the unpacked ones (its rewrite of DequantizeLinear → MatMul)."""
    if any(n is None or n.op_type != "DequantizeLinear" or len(n.input) != len(nodes[0].input)
           or n.attribute != nodes[0].attribute for n in nodes):
        return None
    columns = []  # per input slot: the three tensors and the axis their output channels run along
    for slot in range(len(nodes[0].input)):
        tensors = [weights.get(n.input[slot]) for n in nodes]
        if any(t is None or readers[n.input[slot]] != 1 or t.data_type != tensors[0].data_type
               for t, n in zip(tensors, nodes)):
            return None
        dims = [list(t.dims) for t in tensors]
        if len(dims[0]) == 2 and all(len(d) == 2 and d[0] == dims[0][0] for d in dims):
            axis = 1
        elif slot > 0 and all(len(d) == 1 for d in dims) and attribute(nodes[0], "axis", 1) == 1:
            axis = 0  # per output channel
        else:
            return None
        columns.append((tensors, axis))
    names = [output + suffix for suffix in ("_q", "_scale", "_zero_point")[:len(columns)]]
    packed = [_concat(tensors, axis, name, weights_dir) for (tensors, axis), name in zip(columns, names)]
    node = onnx.NodeProto()
    node.CopyFrom(nodes[0])
    node.name = output
    del node.input[:]
    node.input.extend(names)
    node.output[0] = output
    return node, packed


_FOUR_BIT = (onnx.TensorProto.INT4, onnx.TensorProto.UINT4)


def _concat(tensors: list[onnx.TensorProto], axis: int, name: str, weights_dir: Path | None) -> onnx.TensorProto:
    """``tensors`` concatenated along ``axis``, as an in-memory initializer."""
    loaded = []
    for tensor in tensors:
        if external_data_helper.uses_external_data(tensor):
            if weights_dir is None:
                raise ValueError(f"{tensor.name}: external weights, and no weights_dir to read them from")
            copy = onnx.TensorProto()
            copy.CopyFrom(tensor)
            external_data_helper.load_external_data_for_tensor(copy, str(weights_dir))
            tensor = copy
        loaded.append(tensor)
    values = np.concatenate([numpy_helper.to_array(t) for t in loaded], axis=axis)
    if loaded[0].data_type in _FOUR_BIT:  # numpy has no 4-bit type: pack two codes a byte, low first
        flat = np.append(values.ravel(), 0) if values.size % 2 else values.ravel()
        out = onnx.TensorProto(name=name, data_type=loaded[0].data_type, dims=values.shape)
        out.raw_data = ((flat[0::2] & 0xF) | ((flat[1::2] & 0xF) << 4)).astype(np.uint8).tobytes()
        return out
    return numpy_helper.from_array(values, name)


def rewrite(model: onnx.ModelProto, ctx: PassContext) -> Rewritten:
    return pack_qkv(model, ctx.weights_dir)


def expected(ctx: PassContext) -> int | None:
    if ctx.spec is not None and ctx.spec.quantization.mode not in PACKED_MODES:
        return None
    if _mixed_forms(ctx):
        return None
    # Biased projections (Qwen2's MatMul → Add) are not this pattern: they stay three MatMuls.
    return 0 if ctx.arch.attention_bias else ctx.arch.num_layers


def _mixed_forms(ctx: PassContext) -> bool:
    """Whether some layer's q/k/v weights are quantized in different forms (GGUF codes kept per
    tensor: a Q4_K_M file's v projection in Q6_K beside Q4_K q/k): those stay three MatMuls."""
    layers = ctx.quantized or {}
    for i in range(ctx.arch.num_layers):
        found = [layers[n] for n in (f"layers.{i}.self_attn.{p}_proj" for p in "qkv") if n in layers]
        if len({(q.bits, q.group, q.offsets is None) for q in found}) > 1:
            return True
    return False

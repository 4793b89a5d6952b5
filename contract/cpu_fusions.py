"""CPU fusions for the decode graph (contract/cpu_decode_graph.py), each pattern +
replacement, reporting its match count (the check is the decode graph's: the build's numerics
gate runs it against the rank graph).

- ``skip_norm``: ``Add(a, b) → RMSNormalization`` becomes com.microsoft
  SkipSimplifiedLayerNormalization, which returns the sum too (the residual stream): two ops
  and a temporary per norm become one.
- ``drop_row_gather``: the step's ``GatherElements`` of the rows at ``logits_index`` is the
  identity in a plain decode step (one token a row, so S = R = 1 and every index is 0): its
  readers take the hidden state itself, and the last residual Add → final norm becomes a
  ``skip_norm`` match like every other layer's.
- ``pack_qkv``: a GroupQueryAttention's three projections of one input become one MatMul over
  the weights concatenated, fed to GroupQueryAttention as its packed QKV input: float weights by
  a Concat of initializers, which ONNX Runtime folds once; quantized ones (DequantizeLinear →
  MatMul) by one DequantizeLinear over codes and scales concatenated here, in memory (ONNX has
  no Concat of int4), which ONNX Runtime turns into one n-bit GEMM.

Measured in benchmarks/cpu_decode.py (the "step, rank graph" column is the same runtime without
the decode graph).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import external_data_helper, helper, numpy_helper


def attribute(node: onnx.NodeProto, name: str, default=None):
    return next((helper.get_attribute_value(a) for a in node.attribute if a.name == name), default)


def _replace(model: onnx.ModelProto, replacement: dict[int, list[onnx.NodeProto]]) -> onnx.ModelProto:
    """``model`` with each node whose id is a key replaced by the listed nodes (none: removed)."""
    nodes: list[onnx.NodeProto] = []
    for node in model.graph.node:
        nodes.extend(replacement.get(id(node), [node]))
    out = onnx.ModelProto()
    out.CopyFrom(model)
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    return out


def skip_norm(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """(the model with Add → RMSNormalization pairs fused, pairs fused)."""
    producer = {o: n for n in model.graph.node for o in n.output}
    replacement: dict[int, list[onnx.NodeProto]] = {}
    for norm in model.graph.node:
        add = producer.get(norm.input[0]) if norm.op_type == "RMSNormalization" else None
        # The fused op normalizes the last axis with float accumulation: only that form matches.
        if (add is None or add.op_type != "Add" or id(add) in replacement or attribute(norm, "axis", -1) != -1
                or attribute(norm, "stash_type", 1) != 1):
            continue
        replacement[id(add)] = []
        replacement[id(norm)] = [helper.make_node(
            "SkipSimplifiedLayerNormalization", [add.input[0], add.input[1], norm.input[1]],
            [norm.output[0], "", "", add.output[0]], name=f"{norm.name}/skip", domain="com.microsoft",
            epsilon=float(attribute(norm, "epsilon", 1e-5)))]
    return _replace(model, replacement), len(replacement) // 2


def drop_row_gather(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """(the model with the logits-row gather bypassed, gathers bypassed: 0 or 1). Valid only for
    steps of one token a row: the decode graph's."""
    graph = model.graph
    producer = {o: n for n in graph.node for o in n.output}
    outputs = {o.name for o in graph.output}
    for gather in graph.node:
        expand = producer.get(gather.input[1]) if gather.op_type == "GatherElements" else None
        unsqueeze = producer.get(expand.input[0]) if expand is not None and expand.op_type == "Expand" else None
        if (unsqueeze is None or unsqueeze.op_type != "Unsqueeze" or unsqueeze.input[0] != "logits_index"
                or gather.output[0] in outputs or attribute(gather, "axis", 0) != 1):
            continue
        hidden, picked = gather.input[0], gather.output[0]  # [B, S, D] → [B, R, D]
        out = _replace(model, {id(gather): []})
        for node in out.graph.node:
            for i, name in enumerate(node.input):
                if name == picked:
                    node.input[i] = hidden
        return out, 1
    return model, 0


def pack_qkv(model: onnx.ModelProto, weights_dir: Path | None = None) -> tuple[onnx.ModelProto, int]:
    """(the model with each GroupQueryAttention's q/k/v MatMuls packed into one, attentions packed).
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
    packed_weights: list[onnx.TensorProto] = []
    for attention in graph.node:
        if attention.op_type != "GroupQueryAttention" or not all(attention.input[:3]):
            continue
        projections = [producer.get(name) for name in attention.input[:3]]
        if any(p is None or p.op_type != "MatMul" or readers[p.output[0]] != 1 for p in projections) \
                or len({p.input[0] for p in projections}) != 1:
            continue
        weight, packed = f"{attention.name}/qkv_weight", f"{attention.name}/qkv"  # [K, N_q + N_k + N_v]
        if all(p.input[1] in weights for p in projections):
            # Float weights: a Concat of initializers, which ONNX Runtime folds once.
            nodes = [helper.make_node("Concat", [p.input[1] for p in projections], [weight], axis=1, name=weight)]
        else:
            dequantize = _packed_dequantize([producer.get(p.input[1]) for p in projections], weights, readers,
                                            weight, weights_dir)
            if dequantize is None:
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
        replacement[id(attention)] = [*nodes, helper.make_node("MatMul", [projections[0].input[0], weight], [packed],
                                                               name=packed), fused]
    out = _replace(model, replacement)
    out.graph.initializer.extend(packed_weights)
    return out, sum(1 for nodes in replacement.values() if nodes)


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

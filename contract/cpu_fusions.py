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
- ``pack_qkv``: a GroupQueryAttention's three projections of one input (plain MatMuls with
  weight initializers) become one MatMul over the weights concatenated at session load
  (a Concat of initializers, which ONNX Runtime folds once), fed to GroupQueryAttention as its
  packed QKV input.

Measured in benchmarks/cpu_decode.py (the "step, rank graph" column is the same runtime without
the decode graph).
"""
from __future__ import annotations

import onnx
from onnx import helper


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


def pack_qkv(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """(the model with each GroupQueryAttention's q/k/v MatMuls packed into one, attentions packed)."""
    graph = model.graph
    weights = {i.name for i in graph.initializer}
    producer = {o: n for n in graph.node for o in n.output}
    readers: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1
    replacement: dict[int, list[onnx.NodeProto]] = {}
    for attention in graph.node:
        if attention.op_type != "GroupQueryAttention" or not all(attention.input[:3]):
            continue
        projections = [producer.get(name) for name in attention.input[:3]]
        if any(p is None or p.op_type != "MatMul" or p.input[1] not in weights or readers[p.output[0]] != 1
               for p in projections) or len({p.input[0] for p in projections}) != 1:
            continue
        weight, packed = f"{attention.name}/qkv_weight", f"{attention.name}/qkv"  # [K, N_q + N_k + N_v]
        fused = onnx.NodeProto()
        fused.CopyFrom(attention)
        fused.input[0], fused.input[1], fused.input[2] = packed, "", ""
        for p in projections:
            replacement[id(p)] = []
        replacement[id(attention)] = [
            helper.make_node("Concat", [p.input[1] for p in projections], [weight], axis=1, name=weight),
            helper.make_node("MatMul", [projections[0].input[0], weight], [packed], name=packed), fused]
    return _replace(model, replacement), sum(1 for nodes in replacement.values() if nodes)

"""CPU stage: ``Add(a, b) → RMSNormalization`` becomes com.microsoft
SkipSimplifiedLayerNormalization, which returns the sum too (the residual stream): two ops and a
temporary per norm become one. Every residual norm matches: each layer's two, less the first
layer's input norm (it reads the embedding), plus the final norm (an Add's once
cpu_drop_row_gather has bypassed the logits-row gather).

    fusion: pattern (Add → RMSNormalization over the last axis, float accumulation) + replacement
    + check (the numerics gate: a decode step against the rank graph)
"""
from __future__ import annotations

import onnx
from onnx import helper

from .base import PassContext
from .onnx_rewrite import Rewritten, attribute, replace_nodes


def skip_norm(model: onnx.ModelProto) -> Rewritten:
    """The model with Add → RMSNormalization pairs fused."""
    producer = {o: n for n in model.graph.node for o in n.output}
    position = {id(n): i for i, n in enumerate(model.graph.node)}
    replacement: dict[int, list[onnx.NodeProto]] = {}
    for norm in model.graph.node:
        add = producer.get(norm.input[0]) if norm.op_type == "RMSNormalization" else None
        # The fused op normalizes the last axis with float accumulation: only that form matches.
        if (add is None or add.op_type != "Add" or id(add) in replacement or attribute(norm, "axis", -1) != -1
                or attribute(norm, "stash_type", 1) != 1):
            continue
        fused = helper.make_node(
            "SkipSimplifiedLayerNormalization", [add.input[0], add.input[1], norm.input[1]],
            [norm.output[0], "", "", add.output[0]], name=f"{norm.name}/skip", domain="com.microsoft",
            epsilon=float(attribute(norm, "epsilon", 1e-5)))
        # The fused node takes the Add's place where the norm's weight is there by then (a graph
        # input or constant): the sum may have readers between the Add and the norm (the draft
        # head's tapped layers), which must still come after what produces it.
        weight = producer.get(norm.input[1])
        early = weight is None or position[id(weight)] < position[id(add)]
        replacement[id(add)], replacement[id(norm)] = ([fused], []) if early else ([], [fused])
    return Rewritten(replace_nodes(model, replacement), len(replacement) // 2)


def rewrite(model: onnx.ModelProto, ctx: PassContext) -> Rewritten:
    return skip_norm(model)


def expected(ctx: PassContext) -> int:
    return 2 * ctx.arch.num_layers

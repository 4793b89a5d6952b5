"""CPU stage: the step's ``GatherElements`` of the rows at ``logits_index`` is the identity in a
plain decode step (one token a row, so S = R = 1 and every index is 0) and in a Medusa
verification (logits at every node: logits_index is 0..S-1): its readers take the hidden state
itself, and the last residual Add → final norm becomes a cpu_skip_norm match like every other
layer's. Valid only for those steps: the decode and verification graphs'.

    fusion: pattern (GatherElements(x, Expand(Unsqueeze(logits_index))) on axis 1) + replacement
    (its readers read x) + check (the numerics gate: a step of the graph's kind against the rank graph)
"""
from __future__ import annotations

import onnx

from .base import PassContext
from .onnx_rewrite import Rewritten, attribute, replace_nodes


def drop_row_gather(model: onnx.ModelProto) -> Rewritten:
    """The model with the logits-row gather bypassed (0 or 1 matches)."""
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
        out = replace_nodes(model, {id(gather): []})
        for node in out.graph.node:
            for i, name in enumerate(node.input):
                if name == picked:
                    node.input[i] = hidden
        return Rewritten(out, 1)
    return Rewritten(model, 0)


def rewrite(model: onnx.ModelProto, ctx: PassContext) -> Rewritten:
    return drop_row_gather(model)


def expected(ctx: PassContext) -> int:
    return 1  # the step has one logits-row gather, before the final norm

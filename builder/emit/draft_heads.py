"""The Medusa heads of a CPU decode graph behind an ``If`` on ``draft_heads``.

A plain decode step of an engine dir with heads computes the heads' logits for the next tree.
When the runtime decodes without drafting (a multi-step greedy run: speculation stepped aside
or is off) nobody reads them, yet on the bundled model the heads' four vocabulary projections
cost as much as the rest of a decode step (ONNX Runtime's profile: 0.58 of ~1.3 ms). Here the
nodes that only ``medusa_logits`` needs move into the If's then-branch with the weights only they
read (ONNX Runtime prepacks a weight in the graph that holds it); the else-branch writes zeros of
the same shape [B, R, K, V], so a binding made for either branch fits both.
"""
from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from ...contract.step import DRAFT_HEADS, MEDUSA_LOGITS


def heads_on_demand(decode: onnx.ModelProto) -> onnx.ModelProto:
    """``decode`` with its heads-only nodes behind ``If(draft_heads)`` and ``draft_heads`` a new
    bool input; ``decode`` itself unchanged. A graph without ``medusa_logits`` comes back as is."""
    graph = decode.graph
    outputs = [o.name for o in graph.output]
    if MEDUSA_LOGITS not in outputs:
        return decode
    heads = _ancestors(graph, [MEDUSA_LOGITS]) - _ancestors(graph, [o for o in outputs if o != MEDUSA_LOGITS])
    head_nodes = [n for i, n in enumerate(graph.node) if i in heads]
    rest = [n for i, n in enumerate(graph.node) if i not in heads]
    read_by_rest = {name for node in rest for name in node.input}
    # The heads may read a step output (heads_at_path_end's acceptance reads the logits): the
    # branch reads it from the outer scope, like every other value the rest computes.
    read_by_heads = {name for node in head_nodes for name in node.input}
    value = next(o for o in graph.output if o.name == MEDUSA_LOGITS)
    dims = [d.dim_value for d in value.type.tensor_type.shape.dim]
    if len(dims) != 4 or not dims[2] or not dims[3]:
        raise ValueError(f"{MEDUSA_LOGITS} needs a static [B, R, K, V] shape to write its zeros; it has {dims}")

    drafted = f"draft/{MEDUSA_LOGITS}"
    then = onnx.GraphProto(name="draft_heads")
    then.node.extend(head_nodes)
    for node in then.node:
        node.output[:] = [drafted if name == MEDUSA_LOGITS else name for name in node.output]
    then.initializer.extend(t for t in graph.initializer if t.name in read_by_heads and t.name not in read_by_rest)
    then.output.append(_renamed(value, drafted))

    skipped = f"skip/{MEDUSA_LOGITS}"
    otherwise = onnx.GraphProto(name="skip_heads")
    otherwise.initializer.append(helper.make_tensor("skip/heads_vocab", TensorProto.INT64, [2], dims[2:]))
    otherwise.node.extend([
        # A plain decode step's rows: R = S = 1, so [B, S] of its input_ids is [B, R].
        helper.make_node("Shape", ["input_ids"], ["skip/rows"], name="skip/rows"),
        helper.make_node("Concat", ["skip/rows", "skip/heads_vocab"], ["skip/shape"], axis=0, name="skip/shape"),
        helper.make_node("ConstantOfShape", ["skip/shape"], [skipped], name="skip/zeros",
                         value=helper.make_tensor("zero", value.type.tensor_type.elem_type, [1], [0])),
    ])
    otherwise.output.append(_renamed(value, skipped))

    out = onnx.ModelProto()
    out.CopyFrom(decode)
    del out.graph.node[:]
    out.graph.node.extend(rest)
    out.graph.node.append(helper.make_node("If", [DRAFT_HEADS], [MEDUSA_LOGITS], name="draft_heads",
                                           then_branch=then, else_branch=otherwise))
    moved = {t.name for t in then.initializer}
    kept = [t for t in out.graph.initializer if t.name not in moved]
    del out.graph.initializer[:]
    out.graph.initializer.extend(kept)
    out.graph.input.append(helper.make_tensor_value_info(DRAFT_HEADS, TensorProto.BOOL, []))
    return out


def _ancestors(graph: onnx.GraphProto, names: list[str]) -> set[int]:
    """Indices of the nodes the values ``names`` depend on."""
    producer = {out: i for i, node in enumerate(graph.node) for out in node.output}
    seen: set[int] = set()
    todo = [producer[name] for name in names if name in producer]
    while todo:
        index = todo.pop()
        if index in seen:
            continue
        seen.add(index)
        todo += [producer[name] for name in graph.node[index].input if name in producer]
    return seen


def _renamed(value: onnx.ValueInfoProto, name: str) -> onnx.ValueInfoProto:
    copy = onnx.ValueInfoProto()
    copy.CopyFrom(value)
    copy.name = name
    return copy

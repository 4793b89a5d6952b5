"""CPU stage, verification graph: the Medusa heads run on one row of the tree, the end of the path
greedy acceptance keeps, instead of on every node.

A verification scores a tree of S nodes, but the runtime drafts the next tree from the heads at
one node only: the last it accepts. The heads cost about as much per row as the base model's LM
head and more (4 heads of a residual block and a vocabulary projection each on the bundled
model: at S = 5 they were half the verification step). So the graph accepts greedily itself,
from the step's own inputs, and gathers that node's hidden state for the heads:

    target[i]   = argmax(logits[i])                      the base model's next token after node i
    parent[i]   = the latest of i's strict ancestors      (the tree mask, attention_mask at the
                                                           row's write_index; ancestors come first)
    correct[i]  = input_ids[i] == target[parent[i]]       (the root always)
    accepted[i] = every ancestor of i (i included) is correct
    end         = the deepest accepted node               (depth = position - the root's position)

which is runtime/medusa.py ``accept_greedy`` (a node's children hold distinct tokens, so the
accepted nodes form one path). ``medusa_logits`` becomes [B, 1, K, V]: the heads at ``end``.
The runtime reads them for a row whose accepted path ends there (every greedy row; a sampled
row whose typical acceptance ends elsewhere gets no draft for one step).

    fusion: pattern (the heads' readers of the LM head's input) + replacement (they read the
    hidden state at ``end``) + check (the numerics gate: the verification graph's heads against
    the rank graph's at the end of the greedy path, on a tree whose path is accepted two deep)
"""
from __future__ import annotations

import heapq

import onnx
from onnx import TensorProto, helper

from .base import PassContext
from .onnx_rewrite import Rewritten

LM_HEAD = "/model/lm_head/MatMul"
HEADS = "/medusa_head."
END = "cpu_verify/path_end"  # int64 [B, 1]: each row's deepest greedily accepted node


def heads_at_path_end(model: onnx.ModelProto) -> Rewritten:
    """The model with every Medusa head reading the hidden state at the greedy path's end (0 or 1 match)."""
    graph = model.graph
    lm_head = next((n for n in graph.node if n.name == LM_HEAD), None)
    if lm_head is None:
        return Rewritten(model, 0, {LM_HEAD: "no LM head MatMul"})
    hidden = lm_head.input[0]  # [B, S, D]
    readers = [n for n in graph.node if n.name.startswith(HEADS) and hidden in n.input]
    if not readers:
        return Rewritten(model, 0, {LM_HEAD: "no Medusa head reads the LM head's input"})
    picked = "cpu_verify/hidden_at_end"  # [B, 1, D]
    for node in readers:
        for i, name in enumerate(node.input):
            if name == hidden:
                node.input[i] = picked
    nodes = [*_path_end(), *_gather_row(hidden, picked)]
    out = onnx.ModelProto()
    out.CopyFrom(model)
    out.graph.node.extend(nodes)  # sorted below: the path end reads the logits
    for value in out.graph.output:
        if value.name == "medusa_logits":  # [B, 1, K, V]
            value.type.tensor_type.shape.dim[1].ClearField("dim_param")
            value.type.tensor_type.shape.dim[1].dim_value = 1
    return Rewritten(_sorted(out), 1)


def _path_end() -> list[onnx.NodeProto]:
    """END from logits [B, S, V], input_ids, position_ids, write_index and attention_mask."""
    p = "cpu_verify/accept"
    const = lambda name, kind, dims, values: helper.make_node(  # noqa: E731
        "Constant", [], [f"{p}/{name}"], name=f"{p}/{name}", value=helper.make_tensor(name, kind, dims, values))
    return [
        const("zero", TensorProto.INT64, [], [0]), const("one", TensorProto.INT64, [], [1]),
        const("minus_one", TensorProto.INT64, [], [-1]), const("axis_1", TensorProto.INT64, [1], [1]),
        const("axis_2", TensorProto.INT64, [1], [2]), const("first", TensorProto.INT64, [1], [0]),
        helper.make_node("ArgMax", ["logits"], [f"{p}/target"], axis=-1, keepdims=0, name=f"{p}/target"),  # [B, S]
        helper.make_node("Shape", ["input_ids"], [f"{p}/S"], start=1, end=2, name=f"{p}/S"),  # [1]
        helper.make_node("Squeeze", [f"{p}/S"], [f"{p}/S_scalar"], name=f"{p}/S_scalar"),
        helper.make_node("Range", [f"{p}/zero", f"{p}/S_scalar", f"{p}/one"], [f"{p}/nodes"], name=f"{p}/nodes"),  # [S]
        # The tree window of each row's mask: A[b, i, j] = node i sees node j.
        helper.make_node("Unsqueeze", ["write_index", f"{p}/axis_1"], [f"{p}/start"], name=f"{p}/start"),  # [B, 1]
        helper.make_node("Add", [f"{p}/start", f"{p}/nodes"], [f"{p}/columns"], name=f"{p}/columns"),  # [B, S]
        helper.make_node("Squeeze", ["attention_mask", f"{p}/axis_1"], [f"{p}/mask"], name=f"{p}/mask"),  # [B, S, S_max]
        helper.make_node("Unsqueeze", [f"{p}/columns", f"{p}/axis_1"], [f"{p}/columns3"], name=f"{p}/columns3"),
        helper.make_node("Shape", [f"{p}/mask"], [f"{p}/mask_shape"], start=0, end=2, name=f"{p}/mask_shape"),
        helper.make_node("Concat", [f"{p}/mask_shape", f"{p}/S"], [f"{p}/window_shape"], axis=0,
                         name=f"{p}/window_shape"),
        helper.make_node("Expand", [f"{p}/columns3", f"{p}/window_shape"], [f"{p}/window"], name=f"{p}/window"),
        helper.make_node("GatherElements", [f"{p}/mask", f"{p}/window"], [f"{p}/sees"], axis=2,
                         name=f"{p}/sees"),  # [B, S, S]
        # parent[i]: the latest strict ancestor (-1 → 0 for the root, which is correct anyway).
        helper.make_node("Unsqueeze", [f"{p}/nodes", f"{p}/axis_1"], [f"{p}/rows"], name=f"{p}/rows"),  # [S, 1]
        helper.make_node("Less", [f"{p}/nodes", f"{p}/rows"], [f"{p}/earlier"], name=f"{p}/earlier"),  # [S, S]: j < i
        helper.make_node("And", [f"{p}/sees", f"{p}/earlier"], [f"{p}/ancestor"], name=f"{p}/ancestor"),
        helper.make_node("Where", [f"{p}/ancestor", f"{p}/nodes", f"{p}/minus_one"], [f"{p}/ancestor_index"],
                         name=f"{p}/ancestor_index"),
        helper.make_node("ReduceMax", [f"{p}/ancestor_index", f"{p}/axis_2"], [f"{p}/parent_or_none"], keepdims=0,
                         name=f"{p}/parent_or_none"),  # [B, S]
        helper.make_node("Max", [f"{p}/parent_or_none", f"{p}/zero"], [f"{p}/parent"], name=f"{p}/parent"),
        helper.make_node("GatherElements", [f"{p}/target", f"{p}/parent"], [f"{p}/expected"], axis=1,
                         name=f"{p}/expected"),  # [B, S]
        helper.make_node("Cast", ["input_ids"], [f"{p}/tokens"], to=TensorProto.INT64, name=f"{p}/tokens"),
        helper.make_node("Equal", [f"{p}/tokens", f"{p}/expected"], [f"{p}/matches"], name=f"{p}/matches"),
        helper.make_node("Equal", [f"{p}/nodes", f"{p}/zero"], [f"{p}/root"], name=f"{p}/root"),  # [S]
        helper.make_node("Or", [f"{p}/matches", f"{p}/root"], [f"{p}/correct"], name=f"{p}/correct"),  # [B, S]
        # accepted[i]: no node i sees is incorrect.
        helper.make_node("Not", [f"{p}/correct"], [f"{p}/wrong"], name=f"{p}/wrong"),
        helper.make_node("Unsqueeze", [f"{p}/wrong", f"{p}/axis_1"], [f"{p}/wrong_seen"], name=f"{p}/wrong_seen"),
        helper.make_node("And", [f"{p}/sees", f"{p}/wrong_seen"], [f"{p}/sees_wrong"], name=f"{p}/sees_wrong"),
        helper.make_node("Cast", [f"{p}/sees_wrong"], [f"{p}/sees_wrong_int"], to=TensorProto.INT32,
                         name=f"{p}/sees_wrong_int"),
        helper.make_node("ReduceMax", [f"{p}/sees_wrong_int", f"{p}/axis_2"], [f"{p}/rejected"], keepdims=0,
                         name=f"{p}/rejected"),  # [B, S] 1: not on the accepted path
        # end: the deepest accepted node (depth + 1 where accepted, 0 where not).
        helper.make_node("Gather", ["position_ids", f"{p}/first"], [f"{p}/root_position"], axis=1,
                         name=f"{p}/root_position"),  # [B, 1]
        helper.make_node("Sub", ["position_ids", f"{p}/root_position"], [f"{p}/depth"], name=f"{p}/depth"),
        helper.make_node("Cast", [f"{p}/depth"], [f"{p}/depth64"], to=TensorProto.INT64, name=f"{p}/depth64"),
        helper.make_node("Add", [f"{p}/depth64", f"{p}/one"], [f"{p}/height"], name=f"{p}/height"),
        helper.make_node("Cast", [f"{p}/rejected"], [f"{p}/rejected_bool"], to=TensorProto.BOOL,
                         name=f"{p}/rejected_bool"),
        helper.make_node("Where", [f"{p}/rejected_bool", f"{p}/zero", f"{p}/height"], [f"{p}/score"],
                         name=f"{p}/score"),
        helper.make_node("ArgMax", [f"{p}/score"], [END], axis=1, keepdims=1, name=END),  # [B, 1]
    ]


def _gather_row(hidden: str, picked: str) -> list[onnx.NodeProto]:
    """hidden [B, S, D] at each row's END → [B, 1, D]."""
    return [helper.make_node("GatherND", [hidden, END], ["cpu_verify/hidden_row"], batch_dims=1,
                             name="cpu_verify/hidden_row"),  # [B, D]
            helper.make_node("Unsqueeze", ["cpu_verify/hidden_row", "cpu_verify/accept/axis_1"], [picked],
                             name="cpu_verify/hidden_at_end")]


def _sorted(model: onnx.ModelProto) -> onnx.ModelProto:
    """Nodes in an order where each comes after what it reads (the inserted ones read the logits):
    Kahn's algorithm, the original order kept among nodes ready together."""
    nodes = list(model.graph.node)
    producer = {name: i for i, node in enumerate(nodes) for name in node.output if name}  # "": no output
    waiting = [len({producer[name] for name in node.input if name in producer}) for node in nodes]
    readers: dict[int, list[int]] = {}
    for i, node in enumerate(nodes):
        for j in {producer[name] for name in node.input if name in producer}:
            readers.setdefault(j, []).append(i)
    ready = [i for i, count in enumerate(waiting) if count == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        i = heapq.heappop(ready)
        order.append(nodes[i])
        for k in readers.get(i, ()):
            waiting[k] -= 1
            if waiting[k] == 0:
                heapq.heappush(ready, k)
    if len(order) != len(nodes):
        raise ValueError("the graph has a cycle")
    del model.graph.node[:]
    model.graph.node.extend(order)
    return model


def rewrite(model: onnx.ModelProto, ctx: PassContext) -> Rewritten:
    return heads_at_path_end(model)


def expected(ctx: PassContext) -> int:
    return 1  # the verification graph is made only where there are heads

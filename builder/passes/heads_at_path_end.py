"""heads_at_path_end: the Medusa heads run on one logits row a step, the end of the path greedy
acceptance keeps, instead of on every row.

A verification scores a tree of S nodes, but the runtime drafts the next tree from the heads at
one node only: the last it accepts. The heads cost about as much per row as the base model's LM
head and more (4 heads of a residual block and a vocabulary projection each on the bundled
model: at S = 5 they were half the verification step), and their logits are K·V floats a row
(at B = 8, R = 64, K = 4, V = 128k a step's B·R·K·V output is 1 GB, all of it copied to the host
on a GPU). So the rank graph accepts greedily itself, from the step's own inputs, over its R
logits rows (row r is token ``logits_index[r]``), and gathers that row's hidden state for the
heads:

    target[r]   = argmax(logits[r])                      the base model's next token after row r
    parent[r]   = the latest row before r that r sees     (the tree mask, attention_mask at the
                                                           row's write_index; ancestors come first)
    correct[r]  = a real token (before kv_length) and, but for row 0, token[r] == target[parent[r]]
    accepted[r] = no row r sees (r included) is incorrect
    end         = the deepest accepted row               (depth = position - row 0's position)

which is runtime/speculation/medusa.py ``accept_greedy`` on a tree row (a node's children hold distinct
tokens, so the accepted rows form one path). A row of one logits row (prefill, plain decode, a
plain row's padding in a verification step is not real) ends at row 0: its heads are where they
were. ``medusa_logits`` becomes [B, 1, K, V]: the heads at ``end``. The runtime reads them for a
row whose accepted path ends there (every greedy row; a sampled row whose typical acceptance
ends elsewhere gets no draft for one step). The CPU stage's graphs are copies of this rank graph
and keep it (their row gather dropped, R = S there).

    fusion: pattern (the heads' readers of the LM head's input) + replacement (they read the
    hidden state at ``end``) + check (the numerics gate: the heads against torch's at each row's
    greedy path end, and at a verification step whose tree path is accepted two deep)
"""
from __future__ import annotations

import heapq

import onnx
from onnx import TensorProto, helper

from .base import PassContext
from .onnx_rewrite import Rewritten

LM_HEAD = "/model/lm_head/MatMul"
HEADS = "/medusa_head."
P = "/medusa/path_end"
END = f"{P}/end"  # int64 [B, 1]: each row's deepest greedily accepted logits row


def heads_at_path_end(model: onnx.ModelProto) -> Rewritten:
    """The model with every Medusa head reading the hidden state at the greedy path's end (0 or 1 match)."""
    graph = model.graph
    lm_head = next((n for n in graph.node if n.name == LM_HEAD), None)
    if lm_head is None:
        return Rewritten(model, 0, {LM_HEAD: "no LM head MatMul"})
    hidden = lm_head.input[0]  # [B, R, D]
    readers = [n for n in graph.node if n.name.startswith(HEADS) and hidden in n.input]
    if not readers:
        return Rewritten(model, 0, {LM_HEAD: "no Medusa head reads the LM head's input"})
    picked = f"{P}/hidden_at_end"  # [B, 1, D]
    for node in readers:
        for i, name in enumerate(node.input):
            if name == hidden:
                node.input[i] = picked
    nodes = [*_path_end(), *_gather_row(hidden, picked)]
    out = onnx.ModelProto()
    out.CopyFrom(model)
    out.graph.node.extend(nodes)  # sorted below: the path end reads the logits
    names = {value.name for value in out.graph.input}
    if "input_ids" not in names:  # a later pipeline stage reads hidden states: the tokens join them
        tokens = next(value for value in out.graph.input if value.name == "position_ids")  # int32 [B, S] too
        value = out.graph.input.add()
        value.CopyFrom(tokens)
        value.name = "input_ids"
    for value in out.graph.output:
        if value.name == "medusa_logits":  # [B, 1, K, V]
            value.type.tensor_type.shape.dim[1].ClearField("dim_param")
            value.type.tensor_type.shape.dim[1].dim_value = 1
    return Rewritten(_sorted(out), 1)


def _path_end() -> list[onnx.NodeProto]:
    """END from logits [B, R, V], logits_index, input_ids, position_ids, write_index, kv_length and
    attention_mask. Reductions run on float32 (TensorRT reduces and takes top-k of floats)."""
    def const(name, kind, dims, values):
        return helper.make_node("Constant", [], [f"{P}/{name}"], name=f"{P}/{name}",
                                value=helper.make_tensor(name, kind, dims, values))

    def node(op, inputs, output, **attributes):
        return helper.make_node(op, [i if i in _GRAPH_INPUTS else f"{P}/{i}" for i in inputs], [f"{P}/{output}"],
                                name=f"{P}/{output}", **attributes)

    return [
        const("zero", TensorProto.INT64, [], [0]), const("one", TensorProto.INT64, [], [1]),
        const("axis_1", TensorProto.INT64, [1], [1]), const("axis_2", TensorProto.INT64, [1], [2]),
        const("first", TensorProto.INT64, [1], [0]), const("none", TensorProto.FLOAT, [], [-1.0]),
        const("zero_f", TensorProto.FLOAT, [], [0.0]), const("one_f", TensorProto.FLOAT, [], [1.0]),
        node("ArgMax", ["logits"], "target", axis=-1, keepdims=0),  # [B, R]
        node("Shape", ["logits_index"], "batch_rows"),  # [2]: B, R
        node("Shape", ["logits_index"], "R", start=1, end=2),
        node("Squeeze", ["R"], "R_scalar"),
        node("Range", ["zero", "R_scalar", "one"], "rows"),  # [R]
        # Each row's token, position and mask row (row r is token logits_index[r]).
        node("Cast", ["input_ids"], "ids", to=TensorProto.INT64),
        node("GatherElements", ["ids", "logits_index"], "tokens", axis=1),  # [B, R]
        node("Cast", ["position_ids"], "positions_f", to=TensorProto.FLOAT),
        node("GatherElements", ["positions_f", "logits_index"], "positions", axis=1),  # [B, R]
        node("Squeeze", ["attention_mask", "axis_1"], "mask"),  # [B, S, S_max]
        node("Shape", ["mask"], "S_max", start=2, end=3),
        node("Concat", ["batch_rows", "S_max"], "rows_shape", axis=0),
        node("Unsqueeze", ["logits_index", "axis_2"], "index3"),  # [B, R, 1]
        node("Expand", ["index3", "rows_shape"], "row_index"),  # [B, R, S_max]
        node("GatherElements", ["mask", "row_index"], "mask_rows", axis=1),  # [B, R, S_max]
        # The rows' window of it: sees[b, i, j] = row i sees row j.
        node("Unsqueeze", ["write_index", "axis_1"], "start"),  # [B, 1]
        node("Add", ["start", "logits_index"], "columns"),  # [B, R]
        node("Unsqueeze", ["columns", "axis_1"], "columns3"),  # [B, 1, R]
        node("Concat", ["batch_rows", "R"], "window_shape", axis=0),
        node("Expand", ["columns3", "window_shape"], "window"),  # [B, R, R]
        node("GatherElements", ["mask_rows", "window"], "sees", axis=2),  # [B, R, R]
        # parent[i]: the latest row before i that i sees (none → 0 for row 0, which needs none).
        node("Unsqueeze", ["rows", "axis_1"], "rows_column"),  # [R, 1]
        node("Less", ["rows", "rows_column"], "earlier"),  # [R, R]: j < i
        node("And", ["sees", "earlier"], "ancestor"),
        node("Cast", ["rows"], "rows_f", to=TensorProto.FLOAT),
        node("Where", ["ancestor", "rows_f", "none"], "ancestor_index"),
        node("ReduceMax", ["ancestor_index", "axis_2"], "parent_or_none", keepdims=0),  # [B, R]
        node("Max", ["parent_or_none", "zero_f"], "parent_f"),
        node("Cast", ["parent_f"], "parent", to=TensorProto.INT64),
        node("GatherElements", ["target", "parent"], "expected", axis=1),  # [B, R]
        node("Equal", ["tokens", "expected"], "matches"),
        node("Equal", ["rows", "zero"], "root"),  # [R]
        node("Or", ["matches", "root"], "follows"),  # [B, R]
        # A real token: before kv_length (a plain row's padding in a verification step is not).
        node("Sub", ["kv_length", "write_index"], "count"),  # [B]
        node("Unsqueeze", ["count", "axis_1"], "count_column"),  # [B, 1]
        node("Less", ["logits_index", "count_column"], "real"),
        node("And", ["follows", "real"], "correct"),
        # accepted[i]: no row i sees is incorrect.
        node("Not", ["correct"], "wrong"),
        node("Unsqueeze", ["wrong", "axis_1"], "wrong_seen"),  # [B, 1, R]
        node("And", ["sees", "wrong_seen"], "sees_wrong"),
        node("Cast", ["sees_wrong"], "sees_wrong_f", to=TensorProto.FLOAT),
        node("ReduceMax", ["sees_wrong_f", "axis_2"], "rejected", keepdims=0),  # [B, R]: 1 off the path
        # end: the deepest accepted row (depth + 1 where accepted, 0 where not).
        node("Gather", ["positions", "first"], "root_position", axis=1),  # [B, 1]
        node("Sub", ["positions", "root_position"], "depth"),
        node("Add", ["depth", "one_f"], "height"),
        node("Sub", ["one_f", "rejected"], "kept"),
        node("Mul", ["height", "kept"], "score"),
        node("ArgMax", ["score"], "end", axis=1, keepdims=1),  # [B, 1]: END
    ]


_GRAPH_INPUTS = frozenset({"logits", "logits_index", "input_ids", "position_ids", "write_index", "kv_length",
                           "attention_mask"})


def _gather_row(hidden: str, picked: str) -> list[onnx.NodeProto]:
    """hidden [B, R, D] at each row's END → [B, 1, D]."""
    return [helper.make_node("GatherND", [hidden, END], [f"{P}/hidden_row"], batch_dims=1,
                             name=f"{P}/hidden_row"),  # [B, D]
            helper.make_node("Unsqueeze", [f"{P}/hidden_row", f"{P}/axis_1"], [picked], name=picked)]


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
    """One where attach_medusa put the heads (the last pipeline stage of a Medusa spec)."""
    return int(ctx.spec is not None and ctx.spec.medusa is not None and ctx.last_stage)

"""CPU stage: each layer's attention chain becomes one com.microsoft GroupQueryAttention.

The chain (q/k/v Reshape → Transpose → RotaryEmbedding, TensorScatter into the caches, Slice to
the filled length, Attention, Transpose → Reshape) becomes one GroupQueryAttention over the same
pools, which writes each row's new K/V in place at its own position (past and present share the
buffer) and attends over that row's filled length. Two wirings, one per CPU graph:

* decode (``cpu_group_query_attention``, the decode graph's first pass): one new token a row,
  written at ``write_index``; the step's positions and mask are not read (a plain decode step
  does not fill them, runtime/backends/onnxruntime/step_graph.py).
* verify (``cpu_verify_attention``, the verification graph's first pass): S new tokens of each of
  B rows, rotated at the step's ``position_ids`` by the rank graph's own RotaryEmbedding (a tree
  node's position is its depth past the root, not its index) and masked by ``attention_mask`` as
  an additive bias (each node sees its row's cache and its ancestors). ONNX Runtime 1.32's CPU
  kernel refuses S > 1 tokens after a cached past for more than one row ("batch_size must be 1
  when sequence_length > 1 and past context is given"), so the rows are folded into heads: one
  row of B·H heads, q/k/v [1, S, B·H·D], the caches bound by the runtime as [1, B·H_kv, S_max, D]
  views of the pool rows (no copy; a Reshape inside the graph made ONNX Runtime copy every
  cache, 3 ms a layer at B = 8). Heads are an attribute, so each layer holds one
  GroupQueryAttention per row count up to ``verify_rows`` (the model's VERIFY_ROWS metadata) behind a chain of If on B (in place
  through the Ifs: measured, the time does not grow with S_max). One row of heads has one
  filled length: every row writes at the step's largest ``write_index`` (the runtime shifts each
  row's mask to match and moves its K/V back after the step,
  runtime/backends/onnxruntime/engine.py). More rows than ``verify_rows``: the rank graph.

The runtime runs every other step on the rank graph (builder/emit/cpu_step_model.py).

    fusion: pattern (``_match``) + replacement (``group_query_attention``) + check (the numerics
    gate runs each graph against the rank graph at a step of its kind)
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper

from ...contract.step import VERIFY_ROWS
from .base import CpuGraph, PassContext
from .onnx_rewrite import Rewritten, attribute, prune, with_microsoft_domain

SEQLENS, TOTAL = "cpu_decode/seqlens_k", "cpu_decode/total_sequence_length"
BIAS, ROWS = "cpu_verify/attention_bias", "cpu_verify/rows"
# The most rows a verification graph verifies at once (each row count is one GroupQueryAttention
# a layer behind an If); more rows run on the rank graph. The runtime reads it from the model.
VERIFY_ROWS_MAX = 16


@dataclass(frozen=True)
class _Chain:
    """One layer's attention chain, from the projections to the output projection's input."""
    attention: onnx.NodeProto
    query: str                    # [B, S, Hq·D] (the q projection)
    key: str                      # [B, S, Hkv·D]
    value: str
    past_key: str                 # graph inputs [B, Hkv, S_max, D]
    past_value: str
    present_key: str              # graph outputs
    present_value: str
    rotated_query: str            # [B, Hq, S, D]: the rank graph's RotaryEmbedding outputs
    rotated_key: str              # [B, Hkv, S, D]
    value_heads: str              # [B, Hkv, S, D]
    cos: str                      # rotary caches [positions, D / 2]
    sin: str
    interleaved: int
    scale: float
    output: str                   # [B, S, Hq·D]
    replaced: tuple               # nodes whose outputs the GroupQueryAttention node takes over


class _Index:
    def __init__(self, graph: onnx.GraphProto):
        self.producer = {o: n for n in graph.node for o in n.output}
        self.consumers: dict[str, list[onnx.NodeProto]] = {}
        for node in graph.node:
            for name in node.input:
                self.consumers.setdefault(name, []).append(node)

    def made_by(self, name: str, op: str) -> onnx.NodeProto | None:
        node = self.producer.get(name)
        return node if node is not None and node.op_type == op else None

    def only_consumer(self, name: str, op: str) -> onnx.NodeProto | None:
        users = self.consumers.get(name, [])
        return users[0] if len(users) == 1 and users[0].op_type == op else None


def _head_input(index: _Index, name: str) -> str | None:
    """The [B, S, H·D] projection behind Transpose(Reshape(x)), if that is what ``name`` is."""
    transpose = index.made_by(name, "Transpose")
    reshape = index.made_by(transpose.input[0], "Reshape") if transpose is not None else None
    if reshape is None or list(attribute(transpose, "perm", [])) != [0, 2, 1, 3]:
        return None
    return reshape.input[0]


def _match(index: _Index, attention: onnx.NodeProto, inputs: set[str], outputs: set[str]) -> _Chain | str:
    """The chain around ``attention``, or why it is not the pattern."""
    if len(attention.input) < 7 or any(attention.input[i] for i in (4, 5)) or attribute(attention, "softcap", 0.0):
        return "past caches inside Attention, or a softcap"
    q_rotary = index.made_by(attention.input[0], "RotaryEmbedding")
    if q_rotary is None or attribute(q_rotary, "rotary_embedding_dim", 0):
        return "the query is not a whole-head RotaryEmbedding's output"
    slices = [index.made_by(attention.input[i], "Slice") for i in (1, 2)]
    scatters = [index.made_by(s.input[0], "TensorScatter") if s is not None else None for s in slices]
    if None in scatters:
        return "key/value are not a Slice of a TensorScatter into the cache"
    k_scatter, v_scatter = scatters
    k_rotary = index.made_by(k_scatter.input[1], "RotaryEmbedding")
    if k_rotary is None or k_rotary.input[1:3] != q_rotary.input[1:3]:
        return "the cached key is not rotated like the query"
    query, key, value = (_head_input(index, q_rotary.input[0]), _head_input(index, k_rotary.input[0]),
                         _head_input(index, v_scatter.input[1]))
    if None in (query, key, value):
        return "q/k/v are not Transpose(Reshape(projection)) (e.g. per-head norms between)"
    transpose = index.only_consumer(attention.output[0], "Transpose")
    reshape = index.only_consumer(transpose.output[0], "Reshape") if transpose is not None else None
    if reshape is None or list(attribute(transpose, "perm", [])) != [0, 2, 1, 3]:
        return "the output is not Transpose → Reshape back to [B, S, H·D]"
    if not ({k_scatter.input[0], v_scatter.input[0]} <= inputs and {k_scatter.output[0], v_scatter.output[0]} <= outputs):
        return "the caches are not the step's past_*/present_* tensors"
    return _Chain(attention=attention, query=query, key=key, value=value, past_key=k_scatter.input[0],
                  past_value=v_scatter.input[0], present_key=k_scatter.output[0], present_value=v_scatter.output[0],
                  rotated_query=attention.input[0], rotated_key=k_scatter.input[1], value_heads=v_scatter.input[1],
                  cos=q_rotary.input[1], sin=q_rotary.input[2], interleaved=int(attribute(q_rotary, "interleaved", 0)),
                  scale=float(attribute(attention, "scale")), output=reshape.output[0],
                  replaced=(attention, transpose, reshape, k_scatter, v_scatter))


def group_query_attention(model: onnx.ModelProto, num_heads: int, num_kv_heads: int,
                          cpu_graph: CpuGraph = CpuGraph.decode, verify_rows: int = 1) -> Rewritten:
    """Every matching chain rewritten (heads are this rank's) for the steps of ``cpu_graph``; a
    chain that is not the pattern is left and reported. ``verify_rows``: the most rows the
    verification graph verifies at once."""
    graph = model.graph
    index = _Index(graph)
    inputs, outputs = {i.name for i in graph.input}, {o.name for o in graph.output}
    if not {"write_index", "kv_length"} <= inputs:
        return Rewritten(model, 0, {"(graph)": "no write_index/kv_length inputs"})
    found = {a.name: _match(index, a, inputs, outputs) for a in graph.node if a.op_type == "Attention"}
    chains = [chain for chain in found.values() if isinstance(chain, _Chain)]
    unmatched = {name: reason for name, reason in found.items() if isinstance(reason, str)}
    if not chains:
        return Rewritten(model, 0, unmatched)
    verify = cpu_graph is CpuGraph.verify
    cache_type = next(i.type.tensor_type.elem_type for i in graph.input if i.name == chains[0].past_key)
    replacement: dict[int, list[onnx.NodeProto]] = {}
    for chain in chains:
        for node in chain.replaced:
            replacement[id(node)] = []
        if verify:
            replacement[id(chain.attention)] = _folded_attention(chain, num_heads, num_kv_heads, verify_rows, cache_type)
        else:
            inputs = [chain.query, chain.key, chain.value, chain.past_key, chain.past_value, SEQLENS, TOTAL, chain.cos,
                      chain.sin]
            replacement[id(chain.attention)] = [helper.make_node(
                "GroupQueryAttention", inputs, [chain.output, chain.present_key, chain.present_value],
                name=f"{chain.attention.name}/cpu_decode", domain="com.microsoft", num_heads=num_heads,
                kv_num_heads=num_kv_heads, scale=chain.scale, do_rotary=1, rotary_interleaved=chain.interleaved)]
    nodes = _verify_inputs(cache_type, num_heads, verify_rows) if verify else _decode_inputs()
    for node in graph.node:
        nodes.extend(replacement.get(id(node), [node]))
    out = onnx.ModelProto()
    out.CopyFrom(model)
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    if verify:
        caches = {n for c in chains for n in (c.past_key, c.past_value, c.present_key, c.present_value)}
        wrong = _batch_from_write_index(out.graph, caches)
        if wrong is not None:
            return Rewritten(model, 0, {wrong: "reads the caches' shape beyond the batch dim (the verification "
                                               "graph takes them with the rows folded into heads)"})
        _cache_rows_in_heads(out.graph, caches)
    # The rotary, reshapes and slices nothing reads any more go.
    return Rewritten(with_microsoft_domain(prune(out)), len(chains), unmatched,
                     {VERIFY_ROWS: verify_rows} if verify else {})


def _folded_attention(chain: _Chain, num_heads: int, num_kv_heads: int, rows: int,
                      dtype: int) -> list[onnx.NodeProto]:
    """One layer's verification attention: the rotated q/k and v of B rows folded into one row of
    B·H heads, the GroupQueryAttention for B chosen by Ifs, its output unfolded to [B, S, Hq·D]."""
    prefix = f"{chain.attention.name}/cpu_verify"
    nodes, folded = [], []
    for tag, heads in (("q", chain.rotated_query), ("k", chain.rotated_key), ("v", chain.value_heads)):
        name = f"{prefix}/{tag}"
        nodes += [helper.make_node("Transpose", [heads], [f"{name}_by_token"], perm=[2, 0, 1, 3],
                                   name=f"{name}_by_token"),  # [S, B, H, D]
                  helper.make_node("Reshape", [f"{name}_by_token", "cpu_verify/flat"], [f"{name}_flat"],
                                   name=f"{name}_flat"),  # [S, B·H·D]
                  helper.make_node("Unsqueeze", [f"{name}_flat", "cpu_verify/axis_0"], [f"{name}_folded"],
                                   name=f"{name}_folded")]  # [1, S, B·H·D]
        folded.append(f"{name}_folded")
    attended = f"{prefix}/attended"  # [1, S, B·Hq·D]
    nodes += _rows_chain(chain, folded, (num_heads, num_kv_heads), (1, rows),
                         [attended, chain.present_key, chain.present_value], prefix, dtype)
    nodes += [helper.make_node("Squeeze", [attended, "cpu_verify/axis_0"], [f"{attended}_flat"],
                               name=f"{attended}_flat"),  # [S, B·Hq·D]
              helper.make_node("Reshape", [f"{attended}_flat", "cpu_verify/unfold"], [f"{attended}_by_token"],
                               name=f"{attended}_by_token"),  # [S, B, Hq·D]
              helper.make_node("Transpose", [f"{attended}_by_token"], [chain.output], perm=[1, 0, 2],
                               name=f"{prefix}/output")]  # [B, S, Hq·D]
    return nodes


def _rows_chain(chain: _Chain, folded: list[str], heads: tuple[int, int], rows_of: tuple[int, int],
                outputs: list[str], prefix: str, dtype: int) -> list[onnx.NodeProto]:
    """GroupQueryAttention over ``rows`` rows' heads (``heads``: a row's query and KV heads;
    ``rows_of``: (rows, most)) if the step has that many rows, else the chain for one row more
    (the last, ``most``, without a test). ``dtype``: the caches' (and the attention output's)
    element type."""
    (num_heads, num_kv_heads), (rows, most) = heads, rows_of

    def attention(outs: list[str]) -> onnx.NodeProto:
        return helper.make_node(
            "GroupQueryAttention", [*folded, chain.past_key, chain.past_value, SEQLENS, TOTAL, "", "", "", BIAS], outs,
            name=f"{prefix}/rows_{rows}", domain="com.microsoft", num_heads=rows * num_heads,
            kv_num_heads=rows * num_kv_heads, scale=chain.scale, do_rotary=0)

    def branch(nodes: list[onnx.NodeProto], outs: list[str], tag: str) -> onnx.GraphProto:
        return helper.make_graph(nodes, f"{prefix}/{tag}", [],
                                 [helper.make_tensor_value_info(o, dtype, None) for o in outs])

    if rows == most:
        return [attention(outputs)]
    mine, more = [f"{prefix}/rows_{rows}/{i}" for i in range(3)], [f"{prefix}/rows_{rows + 1}+/{i}" for i in range(3)]
    test = f"{prefix}/rows_is_{rows}"
    return [helper.make_node("Equal", [ROWS, f"cpu_verify/rows_{rows}"], [test], name=test),
            helper.make_node("If", [test], outputs, name=f"{prefix}/rows_{rows}?",
                             then_branch=branch([attention(mine)], mine, f"rows_{rows}"),
                             else_branch=branch(_rows_chain(chain, folded, heads, (rows + 1, most), more, prefix,
                                                            dtype), more, f"rows_{rows + 1}+"))]


def _batch_from_write_index(graph: onnx.GraphProto, caches: set[str]) -> str | None:
    """The exporter takes the step's batch size from a cache's shape (``Shape(past_value_1)[0:1]``);
    folded, that is 1: such a node reads write_index's shape instead ([B] either way). Returns the
    name of a node that reads more of a cache's shape than that (not rewritten), or None."""
    for node in graph.node:
        if node.op_type == "Shape" and node.input[0] in caches:
            if (attribute(node, "start", 0), attribute(node, "end")) != (0, 1):
                return node.name
            node.input[0] = "write_index"
    return None


def _cache_rows_in_heads(graph: onnx.GraphProto, caches: set[str]) -> None:
    """The caches' batch and head dims made symbolic: the runtime binds them [1, B·H_kv, S_max, D]."""
    for value in (*graph.input, *graph.output):
        dims = value.type.tensor_type.shape.dim
        if value.name in caches and len(dims) == 4:  # (a hand-built graph may declare no shape)
            dims[0].dim_param, dims[1].dim_param = "cache_rows", "cache_heads"


def _decode_inputs() -> list[onnx.NodeProto]:
    """One new token per row: it is written at write_index, and the row's filled length is kv_length."""
    return [helper.make_node("Cast", ["write_index"], [SEQLENS], to=TensorProto.INT32, name="cpu_decode/seqlens"),
            helper.make_node("ReduceMax", ["kv_length"], [f"{TOTAL}_int64"], keepdims=0, name="cpu_decode/total"),
            helper.make_node("Cast", [f"{TOTAL}_int64"], [TOTAL], to=TensorProto.INT32, name="cpu_decode/total_int32")]


def _verify_inputs(cache_type: int, num_heads: int, rows: int) -> list[onnx.NodeProto]:
    """S new tokens of every row written from the step's largest write_index P (one row of heads
    has one filled length, P + S); the mask up to P + S as an additive bias of the caches' type (0
    where seen, the type's lowest value where not), one per folded head [1, B·Hq, S, P + S]; the
    row count B; the shape that unfolds the rows."""
    lowest = float(np.finfo(helper.tensor_dtype_to_np_dtype(cache_type)).min)
    ints = lambda name, values: helper.make_tensor(name, TensorProto.INT64, [len(values)], values)  # noqa: E731
    constant = {"cpu_verify/one": ints("one", [1]), "cpu_verify/zero": ints("zero", [0]),
                "cpu_verify/last_axis": ints("axis", [3]), "cpu_verify/axis_0": ints("axis_0", [0]),
                "cpu_verify/flat": ints("flat", [0, -1]), "cpu_verify/minus_one": ints("minus_one", [-1]),
                "cpu_verify/heads": ints("heads", [1, num_heads, 1, 1]),
                "cpu_verify/rows_in_heads": ints("rows_in_heads", [1, -1, 0, 0]),
                "cpu_verify/seen": helper.make_tensor("seen", cache_type, [], [0.0]),
                "cpu_verify/unseen": helper.make_tensor("unseen", cache_type, [], [lowest]),
                **{f"cpu_verify/rows_{b}": helper.make_tensor(f"rows_{b}", TensorProto.INT64, [], [b])
                   for b in range(1, rows)}}
    node = helper.make_node
    return [*(node("Constant", [], [name], name=name, value=value) for name, value in constant.items()),
            node("Shape", ["input_ids"], ["cpu_verify/tokens"], start=1, end=2, name="cpu_verify/tokens"),  # [1]: S
            node("Shape", ["write_index"], ["cpu_verify/rows_1d"], name="cpu_verify/rows_1d"),  # [1]: B
            node("Squeeze", ["cpu_verify/rows_1d"], [ROWS], name="cpu_verify/rows"),
            node("Concat", ["cpu_verify/zero", "cpu_verify/rows_1d", "cpu_verify/minus_one"], ["cpu_verify/unfold"],
                 axis=0, name="cpu_verify/unfold"),  # [0, B, -1]: [S, B·H·D] → [S, B, H·D]
            node("ReduceMax", ["write_index"], ["cpu_verify/start"], keepdims=1, name="cpu_verify/start"),  # [1]: P
            node("Add", ["cpu_verify/start", "cpu_verify/tokens"], ["cpu_verify/filled"], name="cpu_verify/filled"),
            node("Sub", ["cpu_verify/filled", "cpu_verify/one"], ["cpu_verify/last"], name="cpu_verify/last"),
            node("Cast", ["cpu_verify/last"], [SEQLENS], to=TensorProto.INT32, name="cpu_verify/seqlens"),  # [1]
            node("Squeeze", ["cpu_verify/filled"], [f"{TOTAL}_int64"], name="cpu_verify/total"),
            node("Cast", [f"{TOTAL}_int64"], [TOTAL], to=TensorProto.INT32, name="cpu_verify/total_int32"),
            node("Slice", ["attention_mask", "cpu_verify/zero", "cpu_verify/filled", "cpu_verify/last_axis"],
                 ["cpu_verify/mask"], name="cpu_verify/mask"),  # [B, 1, S, P + S]
            node("Where", ["cpu_verify/mask", "cpu_verify/seen", "cpu_verify/unseen"], ["cpu_verify/row_bias"],
                 name="cpu_verify/row_bias"),
            node("Expand", ["cpu_verify/row_bias", "cpu_verify/heads"], ["cpu_verify/head_bias"],
                 name="cpu_verify/head_bias"),  # [B, Hq, S, P + S]
            node("Reshape", ["cpu_verify/head_bias", "cpu_verify/rows_in_heads"], [BIAS], name="cpu_verify/bias")]


def rewrite(model: onnx.ModelProto, ctx: PassContext) -> Rewritten:
    # The CPU stage runs on single-rank graphs only (base.cpu_stage_skipped): the model's heads.
    return group_query_attention(model, ctx.arch.num_heads, ctx.arch.num_kv_heads, CpuGraph.decode)


def rewrite_verify(model: onnx.ModelProto, ctx: PassContext) -> Rewritten:
    rows = min(ctx.spec.build.max_batch_size, VERIFY_ROWS_MAX) if ctx.spec is not None else 1
    return group_query_attention(model, ctx.arch.num_heads, ctx.arch.num_kv_heads, CpuGraph.verify, rows)


def expected(ctx: PassContext) -> int:
    return ctx.arch.num_layers  # every layer's chain, or the decode graph would be half rewritten

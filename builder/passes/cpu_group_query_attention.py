"""CPU stage: each layer's attention chain becomes one com.microsoft GroupQueryAttention.

The chain (q/k/v Reshape → Transpose → RotaryEmbedding, TensorScatter into the caches, Slice to
the filled length, Attention, Transpose → Reshape) becomes one GroupQueryAttention over the same
pools, which writes each row's new K/V in place at its own position (past and present share the
buffer) and attends over that row's filled length. Two wirings, one per CPU graph:

* decode (``cpu_group_query_attention``, the decode graph's first pass): one new token a row,
  written at ``write_index``; the step's positions and mask are not read (a plain decode step
  does not fill them, runtime/backends/onnxruntime/step_graph.py).
* verify (``cpu_verify_attention``, the verification graph's first pass): S new tokens of one
  row written from ``write_index``, rotated at the step's ``position_ids`` (a tree node's is its
  depth past the root, not its index) and masked by ``attention_mask`` as an additive bias (each
  node sees the cache and its ancestors). ONNX Runtime 1.32's CPU kernel takes S > 1 tokens after
  a cached past for one row only, so the runtime runs this graph at verifications of batch 1.

The runtime runs every other step on the rank graph (builder/emit/cpu_step_model.py).

    fusion: pattern (``_match``) + replacement (``group_query_attention``) + check (the numerics
    gate runs each graph against the rank graph at a step of its kind)
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper

from .base import CpuGraph, PassContext
from .onnx_rewrite import Rewritten, attribute, prune, with_microsoft_domain

SEQLENS, TOTAL = "cpu_decode/seqlens_k", "cpu_decode/total_sequence_length"
POSITIONS, BIAS = "cpu_verify/position_ids", "cpu_verify/attention_bias"


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
                  cos=q_rotary.input[1], sin=q_rotary.input[2], interleaved=int(attribute(q_rotary, "interleaved", 0)),
                  scale=float(attribute(attention, "scale")), output=reshape.output[0],
                  replaced=(attention, transpose, reshape, k_scatter, v_scatter))


def group_query_attention(model: onnx.ModelProto, num_heads: int, num_kv_heads: int,
                          cpu_graph: CpuGraph = CpuGraph.decode) -> Rewritten:
    """Every matching chain rewritten (heads are this rank's) for the steps of ``cpu_graph``; a
    chain that is not the pattern is left and reported."""
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
    replacement: dict[int, onnx.NodeProto | None] = {}
    for chain in chains:
        for node in chain.replaced:
            replacement[id(node)] = None
        inputs = [chain.query, chain.key, chain.value, chain.past_key, chain.past_value, SEQLENS, TOTAL, chain.cos,
                  chain.sin, *((POSITIONS, BIAS) if verify else ())]
        replacement[id(chain.attention)] = helper.make_node(
            "GroupQueryAttention", inputs, [chain.output, chain.present_key, chain.present_value],
            name=f"{chain.attention.name}/cpu_{cpu_graph.value}", domain="com.microsoft", num_heads=num_heads,
            kv_num_heads=num_kv_heads, scale=chain.scale, do_rotary=1, rotary_interleaved=chain.interleaved)
    cache_type = next(i.type.tensor_type.elem_type for i in graph.input if i.name == chains[0].past_key)
    nodes = _verify_inputs(cache_type) if verify else _decode_inputs()
    for node in graph.node:
        if id(node) not in replacement:
            nodes.append(node)
        elif replacement[id(node)] is not None:
            nodes.append(replacement[id(node)])
    out = onnx.ModelProto()
    out.CopyFrom(model)
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    # The rotary, reshapes and slices nothing reads any more go.
    return Rewritten(with_microsoft_domain(prune(out)), len(chains), unmatched)


def _decode_inputs() -> list[onnx.NodeProto]:
    """One new token per row: it is written at write_index, and the row's filled length is kv_length."""
    return [helper.make_node("Cast", ["write_index"], [SEQLENS], to=TensorProto.INT32, name="cpu_decode/seqlens"),
            helper.make_node("ReduceMax", ["kv_length"], [f"{TOTAL}_int64"], keepdims=0, name="cpu_decode/total"),
            helper.make_node("Cast", [f"{TOTAL}_int64"], [TOTAL], to=TensorProto.INT32, name="cpu_decode/total_int32")]


def _verify_inputs(cache_type: int) -> list[onnx.NodeProto]:
    """S new tokens of a row written from write_index (as the rank graph's TensorScatter writes
    them), so its filled length is write_index + S; the mask up to the longest such length as an
    additive bias of the caches' type (0 where seen, the type's lowest value where not)."""
    lowest = float(np.finfo(helper.tensor_dtype_to_np_dtype(cache_type)).min)
    constant = {"cpu_verify/one": helper.make_tensor("one", TensorProto.INT64, [1], [1]),
                "cpu_verify/zero": helper.make_tensor("zero", TensorProto.INT64, [1], [0]),
                "cpu_verify/last_axis": helper.make_tensor("axis", TensorProto.INT64, [1], [3]),
                "cpu_verify/seen": helper.make_tensor("seen", cache_type, [], [0.0]),
                "cpu_verify/unseen": helper.make_tensor("unseen", cache_type, [], [lowest])}
    return [*(helper.make_node("Constant", [], [name], name=name, value=value) for name, value in constant.items()),
            helper.make_node("Shape", ["input_ids"], ["cpu_verify/tokens"], start=1, end=2, name="cpu_verify/tokens"),
            helper.make_node("Add", ["write_index", "cpu_verify/tokens"], ["cpu_verify/filled"],
                             name="cpu_verify/filled"),  # [B]
            helper.make_node("Sub", ["cpu_verify/filled", "cpu_verify/one"], ["cpu_verify/last"], name="cpu_verify/last"),
            helper.make_node("Cast", ["cpu_verify/last"], [SEQLENS], to=TensorProto.INT32, name="cpu_verify/seqlens"),
            helper.make_node("ReduceMax", ["cpu_verify/filled"], ["cpu_verify/longest"], keepdims=1,
                             name="cpu_verify/longest"),  # [1]
            helper.make_node("Squeeze", ["cpu_verify/longest"], [f"{TOTAL}_int64"], name="cpu_verify/total"),
            helper.make_node("Cast", [f"{TOTAL}_int64"], [TOTAL], to=TensorProto.INT32, name="cpu_verify/total_int32"),
            helper.make_node("Cast", ["position_ids"], [POSITIONS], to=TensorProto.INT64, name="cpu_verify/positions"),
            helper.make_node("Slice", ["attention_mask", "cpu_verify/zero", "cpu_verify/longest", "cpu_verify/last_axis"],
                             ["cpu_verify/mask"], name="cpu_verify/mask"),  # [B, 1, S, longest]
            helper.make_node("Where", ["cpu_verify/mask", "cpu_verify/seen", "cpu_verify/unseen"], [BIAS],
                             name="cpu_verify/bias")]


def rewrite(model: onnx.ModelProto, ctx: PassContext) -> Rewritten:
    # The CPU stage runs on single-rank graphs only (base.cpu_stage_skipped): the model's heads.
    return group_query_attention(model, ctx.arch.num_heads, ctx.arch.num_kv_heads, CpuGraph.decode)


def rewrite_verify(model: onnx.ModelProto, ctx: PassContext) -> Rewritten:
    return group_query_attention(model, ctx.arch.num_heads, ctx.arch.num_kv_heads, CpuGraph.verify)


def expected(ctx: PassContext) -> int:
    return ctx.arch.num_layers  # every layer's chain, or the decode graph would be half rewritten

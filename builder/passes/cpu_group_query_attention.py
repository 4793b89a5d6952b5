"""CPU stage: each layer's attention chain becomes one com.microsoft GroupQueryAttention.

The chain (q/k/v Reshape → Transpose → RotaryEmbedding, TensorScatter into the caches, Slice to
the filled length, Attention, Transpose → Reshape) becomes one GroupQueryAttention over the same
pools, which writes each row's new K/V in place at its own position (past and present share the
buffer) and attends over that row's filled length. Valid for plain decode steps (one new token a
row): it is the decode graph's first pass, and the graph it leaves runs only those steps; the
runtime runs every other step on the rank graph (builder/emit/cpu_step_model.py).

    fusion: pattern (``_match``) + replacement (``group_query_attention``) + check (the numerics
    gate runs the decode graph against the rank graph at a decode step)
"""
from __future__ import annotations

from dataclasses import dataclass

import onnx
from onnx import TensorProto, helper

from .base import PassContext
from .onnx_rewrite import Rewritten, attribute, prune, with_microsoft_domain

SEQLENS, TOTAL = "cpu_decode/seqlens_k", "cpu_decode/total_sequence_length"


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


def group_query_attention(model: onnx.ModelProto, num_heads: int, num_kv_heads: int) -> Rewritten:
    """Every matching chain rewritten (heads are this rank's); a chain that is not the pattern is
    left and reported."""
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
    replacement: dict[int, onnx.NodeProto | None] = {}
    for chain in chains:
        for node in chain.replaced:
            replacement[id(node)] = None
        replacement[id(chain.attention)] = helper.make_node(
            "GroupQueryAttention",
            [chain.query, chain.key, chain.value, chain.past_key, chain.past_value, SEQLENS, TOTAL, chain.cos, chain.sin],
            [chain.output, chain.present_key, chain.present_value], name=f"{chain.attention.name}/cpu_decode",
            domain="com.microsoft", num_heads=num_heads, kv_num_heads=num_kv_heads, scale=chain.scale,
            do_rotary=1, rotary_interleaved=chain.interleaved)
    # One new token per row: it is written at write_index, and the row's filled length is kv_length.
    nodes = [helper.make_node("Cast", ["write_index"], [SEQLENS], to=TensorProto.INT32, name="cpu_decode/seqlens"),
             helper.make_node("ReduceMax", ["kv_length"], [f"{TOTAL}_int64"], keepdims=0, name="cpu_decode/total"),
             helper.make_node("Cast", [f"{TOTAL}_int64"], [TOTAL], to=TensorProto.INT32, name="cpu_decode/total_int32")]
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


def rewrite(model: onnx.ModelProto, ctx: PassContext) -> Rewritten:
    # The CPU stage runs on single-rank graphs only (base.cpu_stage_skipped): the model's heads.
    return group_query_attention(model, ctx.arch.num_heads, ctx.arch.num_kv_heads)


def expected(ctx: PassContext) -> int:
    return ctx.arch.num_layers  # every layer's chain, or the decode graph would be half rewritten

"""The rank graph for ONNX Runtime's plain decode steps (one new token per row): each layer's
attention chain (q/k/v Reshape → Transpose → RotaryEmbedding, TensorScatter into the caches,
Slice to the filled length, Attention, Transpose → Reshape) becomes one com.microsoft
GroupQueryAttention over the same pools, which writes each row's new K/V in place at its own
position (past and present share the buffer) and attends over that row's filled length.

Then the CPU fusions of contract/cpu_fusions.py: the three q/k/v projections packed into one
MatMul feeding GroupQueryAttention, the logits-row gather (the identity at one token a row)
bypassed, and each residual Add → RMSNormalization as one SkipSimplifiedLayerNormalization.
Together this is the structure of onnxruntime-genai's CPU graph.

A decode step of the rank graph is ~190 ops on the bundled model; the decode graph's is 78, and
runs a step in the time onnxruntime-genai's graph does (benchmarks/cpu_decode.py). It is CPU-only
and in memory: the rank ONNX TensorRT compiles is untouched, and steps GroupQueryAttention cannot
express (prefill chunks of several rows, Medusa tree verification) run the rank graph itself, in
the same session (contract/cpu_step_graph.py). The build's numerics check runs this graph at a
decode step against the rank graph (pass log ``numerics.cpu_decode``).

    fusion: pattern (``_match``) + replacement (``decode_graph``) + check (builder/passes/numerics_gate.py)
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper

from .cpu_fusions import attribute as _attr, drop_row_gather, pack_qkv, skip_norm

SEQLENS, TOTAL = "cpu_decode/seqlens_k", "cpu_decode/total_sequence_length"
# The step inputs the decode graph reads besides the caches: a decode step fills only these.
READS = ("input_ids", "write_index", "kv_length")


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
    if reshape is None or list(_attr(transpose, "perm", [])) != [0, 2, 1, 3]:
        return None
    return reshape.input[0]


def _match(index: _Index, attention: onnx.NodeProto, inputs: set[str], outputs: set[str]) -> _Chain | None:
    if len(attention.input) < 7 or any(attention.input[i] for i in (4, 5)) or _attr(attention, "softcap", 0.0):
        return None  # past caches inside Attention, or a softcap: forms this rewrite does not know
    q_rotary = index.made_by(attention.input[0], "RotaryEmbedding")
    chains = [index.made_by(attention.input[i], "Slice") for i in (1, 2)]
    if q_rotary is None or None in chains or _attr(q_rotary, "rotary_embedding_dim", 0):
        return None
    scatters = [index.made_by(s.input[0], "TensorScatter") for s in chains]
    if None in scatters:
        return None
    k_scatter, v_scatter = scatters
    k_rotary = index.made_by(k_scatter.input[1], "RotaryEmbedding")
    if k_rotary is None or k_rotary.input[1:3] != q_rotary.input[1:3]:
        return None
    query, key, value = (_head_input(index, q_rotary.input[0]), _head_input(index, k_rotary.input[0]),
                         _head_input(index, v_scatter.input[1]))
    transpose = index.only_consumer(attention.output[0], "Transpose")
    reshape = index.only_consumer(transpose.output[0], "Reshape") if transpose is not None else None
    if None in (query, key, value, reshape) or list(_attr(transpose, "perm", [])) != [0, 2, 1, 3]:
        return None
    if not ({k_scatter.input[0], v_scatter.input[0]} <= inputs and {k_scatter.output[0], v_scatter.output[0]} <= outputs):
        return None
    return _Chain(attention=attention, query=query, key=key, value=value, past_key=k_scatter.input[0],
                  past_value=v_scatter.input[0], present_key=k_scatter.output[0], present_value=v_scatter.output[0],
                  cos=q_rotary.input[1], sin=q_rotary.input[2], interleaved=int(_attr(q_rotary, "interleaved", 0)),
                  scale=float(_attr(attention, "scale")), output=reshape.output[0],
                  replaced=(attention, transpose, reshape, k_scatter, v_scatter))


def _prune(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` without the nodes whose outputs nothing reads (in place)."""
    nodes, outputs = list(model.graph.node), {o.name for o in model.graph.output}
    while True:
        used = {name for node in nodes for name in node.input} | outputs
        live = [node for node in nodes if any(o in used for o in node.output)]
        if len(live) == len(nodes):
            break
        nodes = live
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return model


@dataclass(frozen=True)
class DecodeGraph:
    model: onnx.ModelProto
    layers: int        # attention chains → GroupQueryAttention (every layer's, or no decode graph)
    packed_qkv: int    # of those, with q/k/v projections packed into one MatMul
    skip_norms: int    # Add → RMSNormalization pairs fused
    row_gathers: int   # logits-row gathers bypassed (0 or 1)

    @property
    def counts(self) -> dict[str, int]:
        return {"layers": self.layers, "packed_qkv": self.packed_qkv, "skip_norms": self.skip_norms,
                "row_gathers": self.row_gathers}


def decode_graph(model: onnx.ModelProto, num_heads: int, num_kv_heads: int, weights_dir: Path | None = None
                 ) -> DecodeGraph | None:
    """The decode graph, or None when some layer's chain is not the pattern (then decode runs
    the rank graph, as every other step does). Heads are this rank's; ``weights_dir`` holds the
    model's external weights (quantized q/k/v projections are packed from their bytes)."""
    graph = model.graph
    index = _Index(graph)
    attentions = [n for n in graph.node if n.op_type == "Attention"]
    inputs, outputs = {i.name for i in graph.input}, {o.name for o in graph.output}
    if not attentions or not {"write_index", "kv_length"} <= inputs:
        return None
    chains = [_match(index, a, inputs, outputs) for a in attentions]
    if None in chains:
        return None
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
    out = _prune(out)  # the rotary, reshapes and slices nothing reads any more
    if not any(o.domain == "com.microsoft" for o in out.opset_import):
        out.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    packed, packed_count = pack_qkv(out, weights_dir)
    ungathered, gather_count = drop_row_gather(packed)
    fused, norm_count = skip_norm(ungathered)
    return DecodeGraph(_prune(fused), len(chains), packed_count, norm_count, gather_count)


def fill_decode_inputs(input_ids: np.ndarray, write_index: np.ndarray, kv_length: np.ndarray,
                       tokens: Sequence[Sequence[int]], starts: Sequence[int]) -> None:
    """The READS of a plain decode step (one token a row), written in place: the positions and
    the [B, 1, 1, S_max] mask the rank graph would need are not computed at all."""
    input_ids[:] = tokens                     # [B, 1]
    write_index[:] = starts                   # [B]
    np.add(write_index, 1, out=kv_length)     # [B]

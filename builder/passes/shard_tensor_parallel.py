"""shard_tensor_parallel: the whole model's step graph → rank ``ctx.rank``'s graph (Megatron-style).

Per layer: q/k/v column-parallel by heads (KV heads split, or replicated when N exceeds
them: contract.tensor_parallel), o_proj row-parallel then an all-reduce (sum); gate/up
column-parallel, down row-parallel then an all-reduce. lm_head vocab-parallel, its logits
rows (logits_index) all-gathered. Norms and embeddings stay replicated: a vocab-parallel
embedding would add an all-reduce of [B, S, D] per step to save V·D/N weights per rank.
Quantized weights (DequantizeLinear chains) shard with their scales; AWQ/SmoothQuant input
scales in front of a row-parallel MatMul are sliced with its rows. Reshapes that name head
counts or widths get the rank's, and the cache inputs/outputs its KV heads.

It runs after split_pipeline_stages, on the layers of the rank's stage (and lm_head on the last
stage): ``ctx.tensor_rank`` of ``ctx.tensor_size`` ranks; with one tensor rank it changes nothing.
"""
from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from ..sharding import kv_heads, query_heads, vocab_range
from ...plugins.collectives import all_gather_last_axis, all_reduce
from . import weights
from .base import PassContext, PassError, PassResult

_PROJ = "/model/layers.{i}/{part}/MatMul"


def _node(graph: gs.Graph, name: str) -> gs.Node:
    node = next((n for n in graph.nodes if n.name == name), None)
    if node is None:
        raise PassError(f"shard_tensor_parallel: no node {name} (the fused step graph names its MatMuls by module)")
    return node


class _Sharder:
    def __init__(self, graph: gs.Graph, ctx: PassContext):
        self.graph, self.ctx = graph, ctx
        self.writer = weights.WeightWriter(ctx.weights_dir / f"rank{ctx.rank}.shard.data")
        self.stats = {"column_parallel": 0, "row_parallel": 0, "all_reduce": 0, "all_gather": 0,
                      "sharded_weight_bytes": 0}

    def slice_constant(self, constant: gs.Constant, axis: int, start: int, stop: int) -> gs.Constant:
        values = weights.read(constant, self.ctx.weights_dir)
        part = np.take(values, np.arange(start, stop), axis=axis)
        self.stats["sharded_weight_bytes"] += part.nbytes
        return self.writer.constant(f"{constant.name}.rank{self.ctx.rank}", part)

    def slice_transposed(self, constant: gs.Constant, axis: int, start: int, stop: int) -> gs.Constant:
        """Rows (or columns) of a table that feeds a MatMul through a Transpose (a tied lm_head reads
        the embedding [V, D]), written as the transposed slice: the rank's own [D, V/N] weight."""
        values = weights.read(constant, self.ctx.weights_dir)
        part = np.ascontiguousarray(np.take(values, np.arange(start, stop), axis=axis).T)
        self.stats["sharded_weight_bytes"] += part.nbytes
        return self.writer.constant(f"{constant.name}.T.rank{self.ctx.rank}", part)

    def slice_weight(self, tensor, axis: int, start: int, stop: int, full: int, where: str):
        """The weight [in, out] feeding a MatMul, sliced on ``axis``; follows DequantizeLinear
        chains and slices codes and scales alike (per-channel scales on the output axis,
        block scales [in/g, out] by blocks)."""
        if isinstance(tensor, gs.Constant):
            return self.slice_constant(tensor, axis, start, stop)
        producer = tensor.inputs[0] if len(tensor.inputs) == 1 else None
        if producer is not None and producer.op == "Transpose" and isinstance(producer.inputs[0], gs.Constant) \
                and list(producer.attrs.get("perm", [1, 0])) == [1, 0]:
            return self.slice_transposed(producer.inputs[0], 1 - axis, start, stop)
        dq = producer
        if dq is None or dq.op != "DequantizeLinear":
            raise PassError(f"shard_tensor_parallel: the weight of {where} is neither a constant nor dequantized")
        dq.inputs[0] = self.slice_weight(dq.inputs[0], axis, start, stop, full, where)
        scale = dq.inputs[1]
        block = dq.attrs.get("block_size", 0)
        if block:  # blocks run along the input axis (0): rows must be whole blocks; columns slice freely
            if axis == 0 and (start % block or stop % block):
                raise PassError(f"shard_tensor_parallel: {where} rows [{start}, {stop}) straddle "
                                f"quantization blocks of {block}")
            s_start, s_stop = (start // block, stop // block) if axis == 0 else (start, stop)
            dq.inputs[1] = self.slice_weight(scale, axis, s_start, s_stop, full // block if axis == 0 else full, where)
        elif tuple(getattr(scale, "shape", ()) or ()) == (full,) and dq.attrs.get("axis", 1) in (1, -1) and axis == 1:
            dq.inputs[1] = self.slice_weight(scale, 0, start, stop, full, where)  # per output channel
        tensor.shape = None
        return tensor

    def column(self, name: str, start: int, stop: int) -> gs.Node:
        node = _node(self.graph, name)
        full = node.inputs[1].shape[1] if node.inputs[1].shape else None
        node.inputs[1] = self.slice_weight(node.inputs[1], 1, start, stop, full, name)
        out = node.outputs[0]
        bias = next((c for c in out.outputs if c.op == "Add" and any(
            isinstance(t, gs.Constant) and tuple(t.shape) == (full,) for t in c.inputs)), None)
        if bias is not None:  # q/k/v biases (Qwen2) follow their columns
            index = next(k for k, t in enumerate(bias.inputs) if isinstance(t, gs.Constant) and tuple(t.shape) == (full,))
            bias.inputs[index] = self.slice_constant(bias.inputs[index], 0, start, stop)
        self.stats["column_parallel"] += 1
        return node

    def row(self, name: str, start: int, stop: int) -> None:
        node = _node(self.graph, name)
        full = node.inputs[1].shape[0] if node.inputs[1].shape else None
        node.inputs[1] = self.slice_weight(node.inputs[1], 0, start, stop, full, name)
        self._slice_input_scales(node, full, start, stop)
        out = node.outputs[0]
        partial = gs.Variable(f"{out.name}_partial", dtype=out.dtype)
        node.outputs[0] = partial
        reduced = all_reduce(self.graph, partial, self.ctx.tensor_size, f"{name.rsplit('/', 1)[0]}/AllReduce")
        for consumer in list(out.outputs):
            consumer.inputs[consumer.inputs.index(out)] = reduced
        for k, graph_out in enumerate(self.graph.outputs):
            if graph_out is out:
                self.graph.outputs[k] = reduced
        self.stats["row_parallel"] += 1
        self.stats["all_reduce"] += 1

    def _slice_input_scales(self, node: gs.Node, full: int, start: int, stop: int) -> None:
        """AWQ's x / s (a Mul by a [in] constant) in front of a row-parallel MatMul, through a W8A8 Q/DQ pair."""
        for producer in _input_scaling(node):
            for k, t in enumerate(producer.inputs):
                if isinstance(t, gs.Constant) and tuple(t.shape or ()) == (full,):
                    producer.inputs[k] = self.slice_constant(t, 0, start, stop)

    def set_width(self, reshape: gs.Node, full: int, new: int, where: str) -> None:
        """The Reshape's target shape names ``full`` at axis 2 (heads, or heads × head_dim): make it ``new``."""
        shape = reshape.inputs[1]
        suffix = f".rank{self.ctx.rank}"
        if isinstance(shape, gs.Constant):
            values = np.array(shape.values)
            if shape.name.endswith(suffix) and values[2] == new:  # shared with k's reshape, done already
                return
            if values.shape[0] > 2 and values[2] == full:
                values[2] = new
                reshape.inputs[1] = gs.Constant(f"{shape.name}.rank{self.ctx.rank}", values)
                return
        concat = shape.inputs[0] if len(shape.inputs) == 1 else None
        if concat is not None and concat.op == "Concat" and len(concat.inputs) > 2:
            piece = concat.inputs[2]
            if isinstance(piece, gs.Constant) and piece.name.endswith(suffix):  # shared with k's reshape
                return
            if isinstance(piece, gs.Constant) and np.asarray(piece.values).reshape(-1).tolist() == [full]:
                concat.inputs[2] = gs.Constant(f"{concat.name}/width.rank{self.ctx.rank}",
                                               np.array([new], np.asarray(piece.values).dtype))
                return
        raise PassError(f"shard_tensor_parallel: the reshape after {where} does not name {full} at axis 2")


def _reshape_after(node: gs.Node) -> gs.Node:
    tensor = node.outputs[0]
    for _ in range(2):  # through a bias Add
        consumer = tensor.outputs[0]
        if consumer.op == "Reshape":
            return consumer
        tensor = consumer.outputs[0]
    raise PassError(f"shard_tensor_parallel: no reshape to heads after {node.name}")


def _shard_lm_head(graph: gs.Graph, sharder: _Sharder, rank: int, world: int, vocab_size: int) -> None:
    """lm_head vocab-parallel, its logits rows all-gathered."""
    vocab = vocab_range(rank, world, vocab_size)
    lm_head = sharder.column("/model/lm_head/MatMul", vocab.start, vocab.stop)
    out = lm_head.outputs[0]
    shard = gs.Variable(f"{out.name}_shard", dtype=out.dtype)
    lm_head.outputs[0] = shard
    gathered = all_gather_last_axis(graph, shard, world, "/model/lm_head/AllGather", dims=3)  # [B, R, V/N]
    for consumer in list(out.outputs):
        consumer.inputs[consumer.inputs.index(out)] = gathered
    for k, graph_out in enumerate(graph.outputs):
        if graph_out is out:  # logits straight from the MatMul (float32): the gather now makes them
            graph.outputs[k] = gathered
            gathered.name, out.name = out.name, f"{out.name}_unsharded"
            gathered.shape, gathered.dtype = out.shape, out.dtype
    sharder.stats["all_gather"] += 1


def _input_scaling(node: gs.Node) -> list[gs.Node]:
    """The quantization's elementwise nodes in front of a MatMul's input, nearest first: AWQ's
    Mul by 1/s and a W8A8/FP8 QuantizeLinear → DequantizeLinear pair (at most four)."""
    chain, x = [], node.inputs[0]
    while len(chain) < 4 and len(x.inputs) == 1 and x.inputs[0].op in ("Mul", "QuantizeLinear", "DequantizeLinear"):
        chain.append(x.inputs[0])
        x = chain[-1].inputs[0]
    return chain


def shard_tensor_parallel(graph: gs.Graph, ctx: PassContext) -> PassResult:
    if ctx.tensor_size == 1 or ctx.arch is None:
        return PassResult(graph=graph, modified=False, stats={"world_size": ctx.tensor_size})
    arch, rank, world = ctx.arch, ctx.tensor_rank, ctx.tensor_size
    if not any(node.op == "Attention" for node in graph.nodes):
        raise PassError("shard_tensor_parallel splits fused Attention by heads: enable fuse_attention")
    d = arch.head_dim
    q, kv = query_heads(rank, world, arch.num_heads), kv_heads(rank, world, arch.num_kv_heads)
    inter = arch.intermediate_size // world
    sharder = _Sharder(graph, ctx)
    for i in ctx.layers:
        proj = lambda part: _PROJ.format(i=i, part=part)  # noqa: E731
        q_node = sharder.column(proj("self_attn/q_proj"), q.start * d, q.stop * d)
        sharder.set_width(_reshape_after(q_node), arch.num_heads, len(q), q_node.name)
        for part in ("k_proj", "v_proj"):
            node = sharder.column(proj(f"self_attn/{part}"), kv.start * d, kv.stop * d)
            sharder.set_width(_reshape_after(node), arch.num_kv_heads, len(kv), node.name)
        o_proj = _node(graph, proj("self_attn/o_proj"))
        scaling = _input_scaling(o_proj)  # AWQ's x / s, W8A8/FP8's Q/DQ: the reshape is before them
        flatten = (scaling[-1] if scaling else o_proj).inputs[0].inputs[0]
        if flatten.op != "Reshape":
            raise PassError(f"shard_tensor_parallel: {o_proj.name} does not read a reshape of the attention output")
        sharder.set_width(flatten, arch.num_heads * d, len(q) * d, "the attention output")
        sharder.row(o_proj.name, q.start * d, q.stop * d)
        for part in ("gate_proj", "up_proj"):
            sharder.column(proj(f"mlp/{part}"), rank * inter, (rank + 1) * inter)
        sharder.row(proj("mlp/down_proj"), rank * inter, (rank + 1) * inter)
    if ctx.last_stage:
        _shard_lm_head(graph, sharder, rank, world, arch.vocab_size)
    for tensor in (*graph.inputs, *graph.outputs):
        if tensor.name.startswith(("past_", "present_")) and tensor.shape:
            tensor.shape = [tensor.shape[0], len(kv), *tensor.shape[2:]]
    io = {t.name for t in (*graph.inputs, *graph.outputs)}
    for tensor in graph.tensors().values():  # declared shapes of intermediates are the whole model's
        if isinstance(tensor, gs.Variable) and tensor.name not in io:
            tensor.shape = None
    graph.cleanup(remove_unused_graph_inputs=False).toposort()
    expected = 7 * len(ctx.layers) + (1 if ctx.last_stage else 0)
    found = sharder.stats["column_parallel"] + sharder.stats["row_parallel"]
    if found != expected:
        raise PassError(f"shard_tensor_parallel sharded {found} linear layers; the model has {expected}")
    return PassResult(graph=graph, modified=True, stats={
        "world_size": world, "matches": found, "expected": expected, "query_heads": [q.start, q.stop],
        "kv_heads": [kv.start, kv.stop], **sharder.stats})

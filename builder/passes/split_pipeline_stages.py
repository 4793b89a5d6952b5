"""split_pipeline_stages: the whole model's step graph → the graph of rank ``ctx.rank``'s pipeline stage.

A stage keeps its decoder layers (contract.pipeline) and cuts the residual stream where they
start and end. The residual stream entering layer i is what its attention residual Add
(``/model/layers.{i}/Add``) reads from outside the layer; the one leaving it is the output of
its MLP residual Add (``/model/layers.{i}/Add_1``).

- every stage but the first: that stream becomes the input ``hidden_states`` [B, S, D] (model
  dtype) instead of the token ids; the embedding and earlier layers go;
- every stage but the last: the stream after its last layer becomes the output
  ``hidden_states_out`` [B, S, D], all S rows; logits, logits_index, the final norm and lm_head go;
- each stage keeps only its layers' ``past_*``/``present_*`` caches, under their global names.

Shape arithmetic the exporter computes once for every layer (named by its first use, e.g.
the batch size read off ``past_value_1``) stays where a kept layer needs it; a read of another
stage's cache for its shape reads the stage's own (every layer's cache has one shape).

The first per-rank pass: with one stage it changes nothing; shard_tensor_parallel then splits
each stage over its tensor ranks.
"""
from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from ...contract.pipeline import HIDDEN_STATES, HIDDEN_STATES_OUT, cache_layer
from .base import PassContext, PassError, PassResult



def _node(graph: gs.Graph, name: str) -> gs.Node:
    node = next((n for n in graph.nodes if n.name == name), None)
    if node is None:
        raise PassError(f"split_pipeline_stages: no node {name} (the step graph names each layer's residual Adds)")
    return node


def _residual_in(graph: gs.Graph, layer: int) -> gs.Variable:
    """The residual stream entering ``layer``."""
    add = _node(graph, f"/model/layers.{layer}/Add")
    scope = f"/model/layers.{layer}/"
    outside = [t for t in add.inputs if not (t.inputs and t.inputs[0].name.startswith(scope))]
    if len(outside) != 1:
        raise PassError(f"split_pipeline_stages: {add.name} does not read exactly one tensor from outside the layer")
    return outside[0]


def _residual_out(graph: gs.Graph, layer: int) -> gs.Variable:
    """The residual stream leaving ``layer``."""
    return _node(graph, f"/model/layers.{layer}/Add_1").outputs[0]


def _kept_layers(graph: gs.Graph, num_layers: int) -> list[int]:
    """Layers whose residual Add the graph holds."""
    names = {node.name for node in graph.nodes}
    return [i for i in range(num_layers) if f"/model/layers.{i}/Add" in names]


def _boundary(tensor: gs.Variable, name: str, dtype, hidden_size: int) -> gs.Variable:
    tensor.name, tensor.dtype, tensor.shape = name, dtype, ["batch", "seq", hidden_size]
    return tensor


def _read_own_caches(graph: gs.Graph, layers: range, stage: int) -> int:
    """Nodes left reading another stage's cache (shape arithmetic) read the stage's own, same-shaped
    cache instead; any other dangling read is an error. Returns how many reads moved."""
    inputs = {t.name: t for t in graph.inputs}
    moved = 0
    for node in graph.nodes:
        for k, tensor in enumerate(node.inputs):
            if not isinstance(tensor, gs.Variable) or tensor.inputs or tensor.name in inputs or not tensor.name:
                continue
            layer = cache_layer(tensor.name)
            own = f"{tensor.name.rsplit('_', 1)[0]}_{layers.start}"
            if layer is None or own not in inputs:
                raise PassError(f"split_pipeline_stages: {node.name} reads {tensor.name}, which stage {stage} "
                                f"(layers {layers.start}..{layers.stop - 1}) does not have")
            node.inputs[k] = inputs[own]
            moved += 1
    return moved


def split_pipeline_stages(graph: gs.Graph, ctx: PassContext) -> PassResult:
    if ctx.pipeline == 1 or ctx.arch is None:
        return PassResult(graph=graph, modified=False, stats={"pipeline": ctx.pipeline})
    arch, layers, stage = ctx.arch, ctx.layers, ctx.stage
    dtype = ctx.spec.model.dtype.numpy
    cuts = 0
    if not ctx.first_stage:
        stream = _residual_in(graph, layers.start)
        if stream is not _residual_out(graph, layers.start - 1):
            raise PassError(f"split_pipeline_stages: layer {layers.start} does not read layer {layers.start - 1}'s "
                            "residual stream")
        stream.inputs.clear()  # detached from the layers before: the stage's input
        hidden = _boundary(stream, HIDDEN_STATES, dtype, arch.hidden_size)
        graph.inputs = [hidden if t.name == "input_ids" else t for t in graph.inputs]
        cuts += 1
    kept = [t for t in graph.inputs if cache_layer(t.name) is None or cache_layer(t.name) in layers]
    graph.inputs = [t for t in kept if not (t.name == "logits_index" and not ctx.last_stage)]
    caches = [t for t in graph.outputs if cache_layer(t.name) in layers]
    if ctx.last_stage:
        graph.outputs = [t for t in graph.outputs if cache_layer(t.name) is None] + caches
    else:
        out = _boundary(_residual_out(graph, layers.stop - 1), HIDDEN_STATES_OUT, dtype, arch.hidden_size)
        graph.outputs = [out, *caches]
        cuts += 1
    graph.cleanup(remove_unused_graph_inputs=False)
    moved = _read_own_caches(graph, layers, stage)
    graph.cleanup(remove_unused_graph_inputs=False).toposort()
    found = _kept_layers(graph, arch.num_layers)
    if found != list(layers):
        raise PassError(f"split_pipeline_stages: stage {stage} kept layers {found}; it holds {list(layers)}")
    has = {node.name for node in graph.nodes}
    return PassResult(graph=graph, modified=True, stats={
        "pipeline": ctx.pipeline, "stage": stage, "layers": [layers.start, layers.stop],
        "matches": len(found), "expected": len(layers), "boundary_cuts": cuts, "cache_reads_moved": moved,
        "embedding": "/model/embed_tokens/Gather" in has, "lm_head": "/model/lm_head/MatMul" in has})

"""Rewrites over the ONNX protobuf itself, and the adapter that makes one a pass.

The CPU stage's rewrites (GroupQueryAttention, q/k/v packing, the row-gather bypass, the
skip-norm fusion) produce com.microsoft ops and read quantized weights byte for byte, which is
plainer on ``onnx.ModelProto`` than through onnx-graphsurgeon. ``model_pass`` runs one on a
pass's graph and enforces its expected match count like every fusion (builder/passes/fusion.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import onnx
import onnx_graphsurgeon as gs
from onnx import helper

from .base import PassContext, PassError, PassResult, copy_metadata, record_metadata


@dataclass
class Rewritten:
    """A rewrite's result: the model, its match count and why other candidate sites did not match."""

    model: onnx.ModelProto
    matches: int
    unmatched: dict[str, str] = field(default_factory=dict)  # node name → reason
    metadata: dict[str, object] = field(default_factory=dict)  # recorded in the model's metadata_props


def model_pass(name: str, rewrite: Callable[[onnx.ModelProto, PassContext], Rewritten],
               expected: Callable[[PassContext], int | None]) -> Callable[[gs.Graph, PassContext], PassResult]:
    """A pass running ``rewrite`` on the graph as a model. ``expected(ctx)``: the matches a
    model of ctx's architecture must give (None: not known for this form, only reported)."""

    def run(graph: gs.Graph, ctx: PassContext) -> PassResult:
        done = rewrite(gs.export_onnx(graph), ctx)
        stats: dict = {"matches": done.matches}
        if done.unmatched:
            stats["skipped"] = done.unmatched
        want = expected(ctx) if ctx.arch is not None else None
        if want is not None:
            stats["expected"] = want
            if done.matches != want:
                detail = f"; not matched: {done.unmatched}" if done.unmatched else ""
                raise PassError(f"{name} matched {done.matches} of the {want} sites a {ctx.arch.architecture} with "
                                f"{ctx.arch.num_layers} layers has{detail}")
        if not done.matches:
            return PassResult(graph=graph, modified=False, stats=stats)
        rewritten = copy_metadata(graph, gs.import_onnx(done.model).cleanup(remove_unused_graph_inputs=False))
        for key, value in done.metadata.items():
            record_metadata(rewritten, key, value)
        return PassResult(graph=rewritten, modified=True, stats=stats)

    run.__name__ = name
    return run


def attribute(node: onnx.NodeProto, name: str, default=None):
    return next((helper.get_attribute_value(a) for a in node.attribute if a.name == name), default)


def replace_nodes(model: onnx.ModelProto, replacement: dict[int, list[onnx.NodeProto]]) -> onnx.ModelProto:
    """``model`` with each node whose id is a key replaced by the listed nodes (none: removed)."""
    nodes: list[onnx.NodeProto] = []
    for node in model.graph.node:
        nodes.extend(replacement.get(id(node), [node]))
    out = onnx.ModelProto()
    out.CopyFrom(model)
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    return out


def reads(node: onnx.NodeProto) -> set[str]:
    """The names ``node`` reads: its inputs and what its subgraphs (an If's branches) read from
    outside themselves."""
    names = set(node.input)
    for attr in node.attribute:
        for graph in [attr.g] if attr.HasField("g") else list(attr.graphs):
            own = {name for n in graph.node for name in n.output} | {i.name for i in graph.initializer}
            names |= {name for n in graph.node for name in reads(n)} - own
            names |= {o.name for o in graph.output} - own
    return names - {""}


def prune(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` without the nodes whose outputs nothing reads (in place)."""
    nodes, outputs = list(model.graph.node), {o.name for o in model.graph.output}
    read = {id(node): reads(node) for node in nodes}  # once: an If chain's branches are deep
    while True:
        used = set().union(*(read[id(node)] for node in nodes)) | outputs
        live = [node for node in nodes if any(o in used for o in node.output)]
        if len(live) == len(nodes):
            break
        nodes = live
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return model


def with_microsoft_domain(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` importing the com.microsoft domain (ONNX Runtime's contrib ops), in place."""
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return model

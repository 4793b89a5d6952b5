"""canonicalize: fold constants, drop dead nodes, sort, and name any unnamed node by its op."""
from __future__ import annotations

import contextlib
import io
from collections import Counter

import onnx_graphsurgeon as gs

from .base import PassContext, PassResult


# Larger folded results (e.g. the transpose of a tied embedding) would duplicate weights, and the
# big weights stay on disk (external data) while passes run: those nodes are left to the engine.
FOLD_LIMIT_BYTES = 1 << 20


def canonicalize(graph: gs.Graph, ctx: PassContext) -> PassResult:
    before = len(graph.nodes)
    with contextlib.redirect_stdout(io.StringIO()):
        graph.fold_constants(error_ok=False, size_threshold=FOLD_LIMIT_BYTES)
        graph.cleanup(remove_unused_graph_inputs=False).toposort()
    unnamed = 0
    used = Counter(node.name for node in graph.nodes if node.name)
    for node in graph.nodes:
        if not node.name:
            base = f"/model/{node.op}"
            node.name = f"{base}_{used[base]}" if used[base] else base
            used[base] += 1
            unnamed += 1
    return PassResult(graph=graph, modified=len(graph.nodes) != before or unnamed > 0,
                      stats={"folded_or_removed": before - len(graph.nodes), "named": unnamed})

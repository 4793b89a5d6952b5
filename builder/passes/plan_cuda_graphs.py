"""plan_cuda_graphs: choose the decode batch sizes the runtime captures as CUDA graphs.

The graph is not changed. Each bucket must lie inside the decode optimization profile
(S = 1, B in [1, max_batch_size]); the plan goes to the manifest through the pass stats.
"""
from __future__ import annotations

import onnx_graphsurgeon as gs

from .base import PassContext, PassError, PassResult


def plan_cuda_graphs(graph: gs.Graph, ctx: PassContext) -> PassResult:
    spec = ctx.spec
    if spec is None:
        return PassResult(graph=graph, modified=False, stats={"cuda_graph_batch_sizes": []})
    buckets = list(spec.cuda_graph_batch_sizes)
    limit = spec.build.max_batch_size
    outside = [b for b in buckets if not 1 <= b <= limit]
    if outside:
        raise PassError(f"plan_cuda_graphs: buckets {outside} fall outside the decode profile B in [1, {limit}]")
    return PassResult(graph=graph, modified=False,
                      stats={"cuda_graph_batch_sizes": buckets, "decode_profile": {"batch": [1, limit], "seq": 1}})

"""plan_cuda_graphs: choose the decode batch sizes the runtime captures as CUDA graphs.

The graph is not changed. Each bucket must lie inside the decode optimization profile
(S = 1, B in [1, max_batch_size]). The plan is recorded in the graph (model metadata
``cuda_graph_batch_sizes``), from where the emitter copies it into the manifest.
"""
from __future__ import annotations

import onnx_graphsurgeon as gs

from .base import PassContext, PassError, PassResult, record_metadata


def plan_cuda_graphs(graph: gs.Graph, ctx: PassContext) -> PassResult:
    spec = ctx.spec
    if spec is None:
        record_metadata(graph, "cuda_graph_batch_sizes", [])
        return PassResult(graph=graph, modified=False, stats={"cuda_graph_batch_sizes": []})
    buckets = list(spec.cuda_graph_batch_sizes)
    limit = spec.build.max_batch_size
    outside = [b for b in buckets if not 1 <= b <= limit]
    if outside:
        raise PassError(f"plan_cuda_graphs: buckets {outside} fall outside the decode profile B in [1, {limit}]")
    record_metadata(graph, "cuda_graph_batch_sizes", buckets)
    return PassResult(graph=graph, modified=False,
                      stats={"cuda_graph_batch_sizes": buckets, "decode_profile": {"batch": [1, limit], "seq": 1}})

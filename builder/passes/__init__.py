"""Graph passes over the ONNX step graph, in pipeline order."""
from onnx_graphsurgeon.logger import G_LOGGER

# onnx-graphsurgeon logs to stdout; warnings there would corrupt `trtbuild build --json`.
G_LOGGER.severity = G_LOGGER.ERROR
from .attach_medusa import attach_medusa
from .base import Pass, PassContext, PassError, PassResult
from .canonicalize import canonicalize
from .fuse_attention import fuse_attention
from .fuse_rmsnorm import fuse_rmsnorm
from .fuse_rotary import fuse_rotary
from .plan_cuda_graphs import plan_cuda_graphs
from .quantize_weights import quantize_weights
from .shard_tensor_parallel import shard_tensor_parallel

PIPELINE: tuple[Pass, ...] = (
    # The whole model, once:
    Pass("canonicalize", canonicalize),
    Pass("fuse_rmsnorm", fuse_rmsnorm, requires=("canonicalize",)),
    Pass("fuse_rotary", fuse_rotary, requires=("canonicalize",)),
    Pass("fuse_attention", fuse_attention, requires=("canonicalize",)),
    Pass("quantize_weights", quantize_weights, requires=("canonicalize",)),
    # 1 → N: each rank's graph from here on.
    Pass("shard_tensor_parallel", shard_tensor_parallel, per_rank=True),
    Pass("attach_medusa", attach_medusa, requires=("canonicalize",), per_rank=True),
    Pass("plan_cuda_graphs", plan_cuda_graphs, per_rank=True),
)

__all__ = ["PIPELINE", "Pass", "PassContext", "PassError", "PassResult"]

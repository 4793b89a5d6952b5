"""Graph passes over the ONNX step graph, in pipeline order."""
from onnx_graphsurgeon.logger import G_LOGGER

# onnx-graphsurgeon logs to stdout; warnings there would corrupt `trtbuild build --json`.
G_LOGGER.severity = G_LOGGER.ERROR
from .attach_medusa import attach_medusa
from .base import Pass, PassContext, PassError, PassResult
from . import cpu_drop_row_gather, cpu_group_query_attention, cpu_pack_qkv, cpu_skip_norm
from .canonicalize import canonicalize
from .fuse_attention import fuse_attention
from .fuse_rmsnorm import fuse_rmsnorm
from .fuse_rotary import fuse_rotary
from .onnx_rewrite import model_pass
from .plan_cuda_graphs import plan_cuda_graphs
from .quantize_weights import quantize_weights
from .shard_tensor_parallel import shard_tensor_parallel
from .split_pipeline_stages import split_pipeline_stages

PIPELINE: tuple[Pass, ...] = (
    # The whole model, once:
    Pass("canonicalize", canonicalize),
    Pass("fuse_rmsnorm", fuse_rmsnorm, requires=("canonicalize",)),
    Pass("fuse_rotary", fuse_rotary, requires=("canonicalize",)),
    Pass("fuse_attention", fuse_attention, requires=("canonicalize",)),
    Pass("quantize_weights", quantize_weights, requires=("canonicalize",)),
    # 1 → N: each rank's graph from here on (N = pipeline stages × tensor ranks).
    Pass("split_pipeline_stages", split_pipeline_stages, per_rank=True),
    Pass("shard_tensor_parallel", shard_tensor_parallel, per_rank=True),
    Pass("attach_medusa", attach_medusa, requires=("canonicalize",), per_rank=True),
    Pass("plan_cuda_graphs", plan_cuda_graphs, per_rank=True),
    # The CPU stage, per rank: a copy of the finished rank graph becomes the decode graph ONNX
    # Runtime runs at plain decode steps (rankN.cpu.onnx; base.cpu_stage_skipped says when not).
    *(Pass(name, model_pass(name, module.rewrite, module.expected), requires=requires, per_rank=True, cpu=True)
      for name, module, requires in (
          ("cpu_group_query_attention", cpu_group_query_attention, ("fuse_attention", "fuse_rotary")),
          ("cpu_pack_qkv", cpu_pack_qkv, ("cpu_group_query_attention",)),
          ("cpu_drop_row_gather", cpu_drop_row_gather, ("cpu_group_query_attention",)),
          ("cpu_skip_norm", cpu_skip_norm, ("cpu_group_query_attention", "fuse_rmsnorm", "cpu_drop_row_gather")))),
)

__all__ = ["PIPELINE", "Pass", "PassContext", "PassError", "PassResult"]

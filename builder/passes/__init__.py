"""Graph passes over the ONNX step graph, in pipeline order."""
from onnx_graphsurgeon.logger import G_LOGGER

# onnx-graphsurgeon logs to stdout; warnings there would corrupt `trtbuild build --json`.
G_LOGGER.severity = G_LOGGER.ERROR
from .attach_medusa import attach_medusa
from .base import CpuGraph, Pass, PassContext, PassError, PassResult
from . import cpu_drop_row_gather, cpu_group_query_attention, cpu_pack_qkv, cpu_skip_norm, heads_at_path_end
from .canonicalize import canonicalize
from .fuse_attention import fuse_attention
from .fuse_rmsnorm import fuse_rmsnorm
from .fuse_rotary import fuse_rotary
from .onnx_rewrite import model_pass
from .plan_cuda_graphs import plan_cuda_graphs
from .quantize_weights import quantize_weights
from .shard_tensor_parallel import shard_tensor_parallel
from .split_pipeline_stages import split_pipeline_stages


def _cpu_passes(graph: CpuGraph, attention: str, rewrite_attention, prefix: str) -> tuple[Pass, ...]:
    """One CPU graph's passes: its GroupQueryAttention wiring, then the fusions every CPU graph
    shares, named ``prefix`` + what they do. The verification graph's q/k/v stay three MatMuls:
    each is rotated per row before the rows are folded into heads, so there is no packed input
    to feed (builder/passes/cpu_group_query_attention.py)."""
    gather = f"{prefix}drop_row_gather"
    packs = (((f"{prefix}pack_qkv", cpu_pack_qkv, cpu_pack_qkv.rewrite, (attention,)),)
             if graph is CpuGraph.decode else ())
    return tuple(Pass(name, model_pass(name, rewrite, module.expected), requires=requires, per_rank=True, cpu=graph)
                 for name, module, rewrite, requires in (
                     (attention, cpu_group_query_attention, rewrite_attention, ("fuse_attention", "fuse_rotary")),
                     *packs,
                     (gather, cpu_drop_row_gather, cpu_drop_row_gather.rewrite, (attention,)),
                     (f"{prefix}skip_norm", cpu_skip_norm, cpu_skip_norm.rewrite, (attention, "fuse_rmsnorm", gather))))


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
    Pass("heads_at_path_end", model_pass("heads_at_path_end", heads_at_path_end.rewrite, heads_at_path_end.expected),
         requires=("attach_medusa",), per_rank=True, runs_with="attach_medusa"),
    Pass("plan_cuda_graphs", plan_cuda_graphs, per_rank=True),
    # The CPU stage, per rank: copies of the finished rank graph become the graphs ONNX Runtime
    # runs at plain decode steps and, with any draft source, at verifications of up to 16 rows
    # (rankN.cpu.onnx; base.cpu_graphs_made says which a build makes).
    *_cpu_passes(CpuGraph.decode, "cpu_group_query_attention", cpu_group_query_attention.rewrite, "cpu_"),
    *_cpu_passes(CpuGraph.verify, "cpu_verify_attention", cpu_group_query_attention.rewrite_verify, "cpu_verify_"),
)

__all__ = ["CpuGraph", "PIPELINE", "Pass", "PassContext", "PassError", "PassResult"]

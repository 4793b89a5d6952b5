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

PIPELINE: tuple[Pass, ...] = (
    Pass("canonicalize", canonicalize, description="constant folding, dead nodes, names"),
    Pass("fuse_rmsnorm", fuse_rmsnorm, requires=("canonicalize",), description="→ RMSNormalization"),
    Pass("fuse_rotary", fuse_rotary, requires=("canonicalize",), description="→ RotaryEmbedding"),
    Pass("fuse_attention", fuse_attention, requires=("canonicalize",),
         description="→ TensorScatter + Attention (GQA, bool mask, nonpad_kv_seqlen)"),
    Pass("quantize_weights", quantize_weights, requires=("canonicalize",), quantizes=True,
         description="→ DequantizeLinear (int8 per channel, int4 block-wise) feeding each MatMul"),
    Pass("attach_medusa", attach_medusa, requires=("canonicalize",),
         description="Medusa heads on the final hidden state → medusa_logits [B, R, K, V]"),
    Pass("plan_cuda_graphs", plan_cuda_graphs, description="decode batch buckets for CUDA graphs"),
)

__all__ = ["PIPELINE", "Pass", "PassContext", "PassError", "PassResult"]

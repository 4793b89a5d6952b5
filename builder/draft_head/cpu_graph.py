"""``draft.cpu.onnx``: the draft's step in the form the target's CPU stage gives its verification
graph, made by the same passes (builder/passes), so ONNX Runtime runs the draft as it runs the
target.

``draft.onnx`` (builder/draft_head/export.py) decomposes attention over the whole [B, H_kv, S_max,
D] cache: the caches repeated to every query head, the scores and softmax over all S_max
positions, the new K/V scattered into a new present tensor. Through canonicalize, the RMSNorm,
rotary and attention fusions, then ``cpu_verify_attention`` and ``cpu_verify_skip_norm``, the
layer's attention becomes one com.microsoft GroupQueryAttention over the filled length only,
writing each row's new K/V into the cache it was given (past and present are one buffer under IO
binding: no copy of the cache per run). The verification wiring is the one that fits every run
the drafter makes: S new tokens of each of B rows (B·1 for a chain step, 1 + accepted or a
prompt's chunk for an observe), masked by ``attention_mask`` (the drafter masks positions the
draft never saw), the rows folded into heads and written from the run's largest ``write_index``
(runtime/backends/onnxruntime/one_write_start.py shifts and moves them back). The decode wiring
(``cpu_group_query_attention``) reads no mask and takes one token a row; the logits-row gather
stays (an observe reads the logits of one row of S).

Weights: every tensor the passes kept is read from ``draft.onnx.data`` (same bytes, same offsets);
nothing large is written twice.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import onnx
import onnx_graphsurgeon as gs

from ...contract.draft_head import DRAFT_CPU_GRAPH, NUM_HEADS, NUM_KV_HEADS, DraftLayerShape
from ..frontend.export import load_graph
from ..passes import PassContext
from ..passes import cpu_group_query_attention, cpu_skip_norm
from ..errors import UserError
from ..passes.base import CpuGraph, Pass, graph_metadata
from ..passes.canonicalize import canonicalize
from ..passes.fuse_attention import fuse_attention
from ..passes.fuse_rmsnorm import fuse_rmsnorm
from ..passes.fuse_rotary import fuse_rotary
from ..passes.manager import PassManager, RunResult
from ..passes.onnx_rewrite import model_pass
from ..passes.cpu_group_query_attention import VERIFY_ROWS_MAX
from .model import layer_arch

# Only the head counts of the layer matter to the passes (read from the graph's metadata).
_ANY_SHAPE = DraftLayerShape(hidden_size=1, intermediate_size=1, num_heads=1, num_kv_heads=1, head_dim=1,
                             rms_norm_eps=1.0, rope_theta=1.0)

# The draft's sites for each pass: RMSNorm of the embedding, the feature, the layer's two and the
# final one; q and k rotated; one attention; one residual Add → norm (the post-attention one:
# the input norm reads the combination, the final norm the logits-row gather).
EXPECTED = {"fuse_rmsnorm": 5, "fuse_rotary": 2, "fuse_attention": 1, "draft_cpu_attention": 1,
            "draft_cpu_skip_norm": 1}


def draft_passes(rows: int) -> tuple[Pass, ...]:
    """The target's passes with the draft's match counts; ``rows``: the most rows one run folds."""
    fused = lambda fusion: replace(fusion, expected=lambda arch: EXPECTED[fusion.name])  # noqa: E731
    attention = lambda model, ctx: cpu_group_query_attention.group_query_attention(  # noqa: E731
        model, ctx.arch.num_heads, ctx.arch.num_kv_heads, CpuGraph.verify, rows)
    count = lambda name: (lambda ctx: EXPECTED[name])  # noqa: E731
    return (Pass("canonicalize", canonicalize),
            Pass("fuse_rmsnorm", fused(fuse_rmsnorm), requires=("canonicalize",)),
            Pass("fuse_rotary", fused(fuse_rotary), requires=("canonicalize",)),
            Pass("fuse_attention", fused(fuse_attention), requires=("canonicalize",)),
            Pass("draft_cpu_attention", model_pass("draft_cpu_attention", attention, count("draft_cpu_attention")),
                 requires=("fuse_attention", "fuse_rotary"), per_rank=True, cpu=CpuGraph.verify),
            Pass("draft_cpu_skip_norm", model_pass("draft_cpu_skip_norm", cpu_skip_norm.rewrite,
                                                   count("draft_cpu_skip_norm")),
                 requires=("draft_cpu_attention", "fuse_rmsnorm"), per_rank=True, cpu=CpuGraph.verify))


def run_draft_passes(draft_onnx_path: Path, rows: int = VERIFY_ROWS_MAX) -> RunResult:
    """The passes over ``draft.onnx`` (its large weights left in its data file)."""
    path = Path(draft_onnx_path)
    heads = {p.key: p.value for p in onnx.load(path, load_external_data=False).metadata_props}
    if not {NUM_HEADS, NUM_KV_HEADS} <= set(heads):
        raise UserError(f"{path}: no {NUM_HEADS}/{NUM_KV_HEADS} metadata; export it again "
                        "(builder/draft_head/export.py)")
    graph = load_graph(path)
    arch = layer_arch(_ANY_SHAPE, 1).model_copy(update={"num_heads": int(heads[NUM_HEADS]),
                                                       "num_kv_heads": int(heads[NUM_KV_HEADS])})
    ctx = PassContext(spec=None, arch=arch, cpu_graphs=frozenset({CpuGraph.verify}))
    return PassManager(draft_passes(rows)).run(graph, ctx)


def draft_cpu_graph(draft_onnx_path: Path, rows: int = VERIFY_ROWS_MAX) -> Path:
    """Writes ``draft.cpu.onnx`` beside ``draft_onnx_path`` (its weights read from the draft's own
    data file) and returns its path. ``rows``: the most rows one run takes (the drafter splits
    more), each row count one GroupQueryAttention behind an If."""
    draft_onnx_path = Path(draft_onnx_path)
    result = run_draft_passes(draft_onnx_path, rows)
    (graph,) = result.cpu_graphs[CpuGraph.verify]
    model = gs.export_onnx(graph)
    # Intermediate shapes as the exporter and the fusions declared them name S and R alike (one
    # observe run has S new tokens and 1 logits row): ONNX Runtime plans buffers by them and
    # refuses; it infers what it needs.
    del model.graph.value_info[:]
    source = onnx.load(draft_onnx_path, load_external_data=False)
    model.metadata_props.extend(source.metadata_props)
    model.metadata_props.extend(onnx.StringStringEntryProto(key=k, value=v) for k, v in graph_metadata(graph).items())
    path = draft_onnx_path.with_name(DRAFT_CPU_GRAPH)
    onnx.save_model(model, path)
    return path

"""What the engine dir's manifest says about a build: each rank's entry (its place in the grid,
files, KV heads, I/O table), the CPU step model's files, and the build-wide body."""
from __future__ import annotations

from pathlib import Path

from ..contract.draft_head import DRAFT_GRAPH, DraftHeadEntry
from .emit.cpu_step_model import save_cpu_step_model
from .emit.manifest import io_table, tool_versions
from .emit.tensorrt import optimization_profiles
from .passes import CpuGraph
from .sharding import kv_heads
from .emit.paged_onnx import paged_name
from .spec.document import KVCacheLayout
from .spec.model import Spec


def rank_entry(spec: Spec, rank: int, model, out: Path, paged=None) -> dict:
    """What the runtime needs per rank: where it sits in the stage × tensor-rank grid, the decoder
    layers (and so the KV-cache layers) it holds, its files, KV heads, I/O table and weight bytes.
    ``paged``: the paged graph the engine is compiled from (rankN.paged.onnx), whose I/O the
    engine has; None: the engine is compiled from ``model``."""
    data = out / f"rank{rank}.onnx.data"
    position = spec.ranks[rank]
    heads = kv_heads(position.tensor_rank, spec.parallel.tensor, spec.arch.num_kv_heads)
    return {"rank": rank, "stage": position.stage, "tensor_rank": position.tensor_rank,
            "layers": [position.layers.start, position.layers.stop],
            "engine": f"rank{rank}.engine", "onnx": f"rank{rank}.onnx",
            "onnx_data": data.name if data.is_file() else None, "num_kv_heads": len(heads),
            "kv_heads": [heads.start, heads.stop],
            "paged_onnx": paged_name(rank) if paged is not None else None,
            "weight_bytes": data.stat().st_size if data.is_file() else 0,
            "io": io_table(paged if paged is not None else model)}


def cpu_entry(rank: int, cpu: dict, model, out: Path) -> dict:
    """Writes rankN.cpu.onnx (the CPU step model: the rank graph and the CPU stage's graphs ``cpu``,
    builder/emit/cpu_step_model.py) beside the rank graph ``model`` (as saved); its manifest keys."""
    data = save_cpu_step_model(cpu[CpuGraph.decode], cpu.get(CpuGraph.verify), model, out / f"rank{rank}.cpu.onnx")
    return {"cpu_onnx": f"rank{rank}.cpu.onnx", "cpu_onnx_data": data.name if data is not None else None}


def manifest_body(spec: Spec, flavor, ranks: list[dict], records: list[dict], cuda_graph_plan: list[int]) -> dict:
    return {
        "spec": spec.model_dump(mode="json"),
        "spec_sha256": spec.sha256(),
        "model": spec.arch.model_dump(),
        "tensorrt": flavor.built_for(spec.build.targets),
        "tools": tool_versions(),
        "tensor_parallel": spec.parallel.tensor,
        "pipeline_parallel": spec.parallel.pipeline,
        "cpu_graphs": spec.build.cpu_graphs,
        "ranks": ranks,
        "limits": {"max_batch_size": spec.build.max_batch_size, "max_input_len": spec.build.max_input_len,
                   "max_seq_len": spec.build.max_seq_len},
        "profiles": [{"name": name, "shapes": {k: [list(s) for s in v] for k, v in shapes.items()
                                               if k in ("input_ids", "logits_index")}}
                     for name, shapes in zip(("decode", "prefill"), optimization_profiles(spec))],
        "cuda_graph_batch_sizes": cuda_graph_plan,
        "kv_cache": kv_cache_entry(spec),
        "medusa": _medusa_manifest(spec),
        "draft_head": _draft_head_manifest(spec),
        # The draft sources a request gets by default and the verification S built for (null: none).
        "speculation": spec.speculation.to_manifest() if spec.speculation is not None else None,
        "passes": list(dict.fromkeys(r["pass"] for r in records)),
        "tokenizer": "tokenizer.json",
    }


def kv_cache_entry(spec: Spec) -> dict:
    """The engines' KV layout (contract/step.py): paged, each rank's pools [N, block_size, H_kv, D]
    (``pool``: all but N, per rank), or slots [B, H_kv, max_seq_len, D] (``pool`` null); block_size is
    the runtime's block either way."""
    paged = spec.kv_cache_layout == KVCacheLayout.paged
    heads = [len(kv_heads(p.tensor_rank, spec.parallel.tensor, spec.arch.num_kv_heads)) for p in spec.ranks]
    return {"layout": spec.kv_cache_layout.value, "block_size": spec.runtime.kv_block_size,
            "pool": [[spec.runtime.kv_block_size, h, spec.arch.head_dim] for h in heads] if paged else None}


def _medusa_manifest(spec: Spec) -> dict | None:
    """What the runtime needs to speculate: head count, the tree (likeliest path first, so
    every prefix is a tree) and the heads' measured accuracy (the runtime's prior)."""
    medusa = spec.medusa
    if medusa is None:
        return None
    accuracy = medusa.topk_accuracy
    return {"num_heads": medusa.num_heads, "num_layers": medusa.num_layers,
            "tree": [list(path) for path in medusa.choices], "tree_size": medusa.tree_size,
            "topk_accuracy": [list(row) for row in accuracy] if accuracy else None,
            # P(rank r of head k is right): the runtime's prior for choosing a tree size.
            "rank_accuracy": [[round(p, 5) for p in row] for row in medusa.rank_accuracy],
            "output": "medusa_logits"}


def _draft_head_manifest(spec: Spec) -> dict | None:
    """What the runtime needs to draft with the head: its graph (draft.onnx: one layer's cache,
    FEATURES in), the target layers it reads (the step's DRAFT_FEATURES fuses them), its
    vocabulary and held-out accuracy (the runtime's prior), the longest chain it drafts."""
    draft = spec.draft_head
    if draft is None:
        return None
    return DraftHeadEntry(graph=DRAFT_GRAPH, taps=draft.config.taps, draft_vocab_size=draft.config.draft_vocab_size,
                          hidden=draft.config.layer.hidden_size, accuracy=draft.config.accuracy,
                          num_tokens=draft.num_tokens).to_manifest()

"""rankN.paged.onnx: the graph a paged TensorRT engine is compiled from (builder/passes/page_kv_cache.py
on the saved rank graph). Its weights are rankN.onnx's: the initializers reference the same data
file, so no weight byte is written twice. rankN.onnx and rankN.cpu.onnx keep the slot form (the CPU
runtime runs those)."""
from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import onnx

from ..passes.base import PassError
from ..passes.page_kv_cache import page_kv_cache, step_bytes_per_layer
from ..spec.model import Spec

PASS_NAME = "page_kv_cache"


def paged_name(rank: int) -> str:
    return f"rank{rank}.paged.onnx"


def save_paged_graph(model: onnx.ModelProto, spec: Spec, rank: int, out: Path) -> tuple[onnx.ModelProto, dict]:
    """Writes rank ``rank``'s paged graph beside ``model`` (rankN.onnx as saved: its initializers
    already point into rankN.onnx.data) in ``out``; the paged model and its pass-log record."""
    position = spec.ranks[rank]
    start = time.perf_counter()
    block_size = spec.runtime.kv_block_size
    done = page_kv_cache(model, block_size)
    want = 2 * len(position.layers)  # a K and a V cache per decoder layer of the rank's stage
    if done.matches != want:
        detail = f"; not matched: {done.unmatched}" if done.unmatched else ""
        raise PassError(f"{PASS_NAME} matched {done.matches} of the {want} caches rank {rank} "
                        f"(layers {position.layers.start}–{position.layers.stop - 1}) has{detail}")
    paged = done.model
    for key, value in done.metadata.items():
        entry = paged.metadata_props.add()
        entry.key, entry.value = key, str(value)
    onnx.save_model(paged, out / paged_name(rank))
    before, after = _ops(model), _ops(paged)
    record = {"pass": PASS_NAME, "rank": rank, "stage": position.stage, "tensor_rank": position.tensor_rank,
              "modified": True, "ops_before": before, "ops_after": after,
              "nodes_before": sum(before.values()), "nodes_after": sum(after.values()),
              "ms": round((time.perf_counter() - start) * 1000, 2), "matches": done.matches, "expected": want,
              "kv_bytes_per_layer": _decode_step_bytes(spec)}
    if done.unmatched:
        record["skipped"] = done.unmatched
    return paged, record


def _ops(model: onnx.ModelProto) -> dict[str, int]:
    return dict(sorted(Counter(node.op_type for node in model.graph.node).items()))


def _decode_step_bytes(spec: Spec) -> dict:
    """The bytes one decode step moves per layer (K and V together) in each form, at the largest
    batch with every row's table full (M = max_seq_len / block_size): the worst case of both."""
    b, s_max, bs = spec.build.max_batch_size, spec.build.max_seq_len, spec.runtime.kv_block_size
    moved = step_bytes_per_layer(batch=b, seq=1, max_seq_len=s_max, table_blocks=s_max // bs, block_size=bs,
                                 heads=spec.kv_heads_per_rank, head_dim=spec.arch.head_dim,
                                 itemsize=spec.model.dtype.numpy.itemsize)
    return {"step": {"batch": b, "seq": 1, "table_blocks": s_max // bs, "block_size": bs},
            **{key: 2 * value for key, value in moved.items()},
            "tensorrt_scatter": "TensorRT documents its Scatter layer as copying the input before updating: "
                                "it may copy the pool each step (not measurable without a GPU)"}

"""Which graph a single-rank CPU engine's session runs, and a plain decode step's inputs.

An engine dir built with the CPU stage lists ``rankN.cpu.onnx`` (builder/emit/cpu_step_model.py:
one model holding the rank graph and the CPU decode graph behind an If on ``plain_decode``),
built, checked by the numerics gate and hashed at build time: the runtime loads it as it is.
An engine dir without it (TP ranks, bf16, FP4, Qwen3's per-head norms, or built before the
stage existed) runs the rank graph for every step, as such dirs always have.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ....contract.step import DECODE_READS  # noqa: F401  (what fill_decode_inputs fills: API)
from ....plugins.onnxruntime import fp4
from ...engine_dir import EngineDir

# The decode graph's kernels prepack the weights again (a second copy in memory): worth it for
# CPU-sized models only.
DECODE_GRAPH_MAX_WEIGHT_BYTES = 2 << 30


def cpu_graph(engine_dir: EngineDir, rank: int = 0, use_decode_graph: bool = True) -> tuple[str | bytes, str | None]:
    """What a single-rank engine's session loads (a model path, or bytes for a simulated FP4
    rank graph) and the CPU step model's file name in it (None: the rank graph alone)."""
    entry = engine_dir.manifest["ranks"][rank]
    cpu_onnx = entry.get("cpu_onnx")
    if use_decode_graph and cpu_onnx is not None and entry["weight_bytes"] <= DECODE_GRAPH_MAX_WEIGHT_BYTES:
        return str(engine_dir.rank_file(rank, "cpu_onnx")), cpu_onnx
    return fp4.ort_source(engine_dir.rank_file(rank, "onnx")), None


def fill_decode_inputs(input_ids: np.ndarray, write_index: np.ndarray, kv_length: np.ndarray,
                       tokens: Sequence[Sequence[int]], starts: Sequence[int]) -> None:
    """The DECODE_READS of a plain decode step (one token a row), written in place: the positions
    and the [B, 1, 1, S_max] mask the rank graph would need are not computed at all."""
    input_ids[:] = tokens                     # [B, 1]
    write_index[:] = starts                   # [B]
    np.add(write_index, 1, out=kv_length)     # [B]

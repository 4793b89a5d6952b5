"""Whether an engine dir's ranks fit in this machine's RAM on ONNX Runtime, asked before any
rank loads: a dir too large is refused in one line instead of the kernel killing the ranks
mid-load (a Llama-3-8B fp16 TP=2 dir, measured here: killed, exit -9).

ONNX Runtime has no float16 GEMM on x86 CPUs: it inserts Casts around each float16 MatMul and
folds the weight's Cast at session creation, so a float16 weight is held as float32 (measured on
a [4096, 14336] MatMul: +225 MiB anonymous for a 112 MiB weight; a float32 weight is mapped from
its file instead). int4/int8 codes run in its n-bit GEMM as they are.
"""
from __future__ import annotations

import os

from ....contract.processes import meminfo
from ...engine_dir import EngineDir

GIB = 1 << 30
PROCESS_BYTES = GIB // 2  # a rank process before its weights: Python, torch, ONNX Runtime, KV cache of a small dir


def bytes_per_weight_byte(engine_dir: EngineDir) -> int:
    """RAM per byte of a rank's weight file once its session is created."""
    return 2 if engine_dir.dtype == "float16" and not engine_dir.quantized else 1


def local_ranks(engine_dir: EngineDir) -> list[int]:
    """The ranks whose processes run on this machine: all of them, unless torchrun spread them
    over machines (then its LOCAL_WORLD_SIZE ranks of this node, which hold about the same bytes)."""
    count = int(os.environ.get("LOCAL_WORLD_SIZE", engine_dir.world_size))
    return list(range(min(count, engine_dir.world_size)))


def needed_bytes(engine_dir: EngineDir, ranks: list[int]) -> int:
    per_byte = bytes_per_weight_byte(engine_dir)
    return sum(PROCESS_BYTES + per_byte * engine_dir.manifest["ranks"][r]["weight_bytes"] for r in ranks)


def machine_bytes() -> int:
    """RAM plus swap: what the ranks can hold before the kernel kills one."""
    fields = meminfo()
    return fields["MemTotal"] + fields.get("SwapTotal", 0)


def memory_refusal(engine_dir: EngineDir, available: int, ranks: list[int]) -> str | None:
    """One line saying the ranks cannot load in ``available`` bytes and what would run, or None."""
    need = needed_bytes(engine_dir, ranks)
    if need <= available:
        return None
    why = (" (ONNX Runtime computes float16 MatMuls in float32 on CPU: 2 × the weights)"
           if bytes_per_weight_byte(engine_dir) == 2 else "")
    where = f"its {len(ranks)} rank processes" if len(ranks) > 1 else "it"
    return (f"{engine_dir.path}: on ONNX Runtime (CPU) {where} would need ≈ {need / GIB:.1f} GiB of RAM{why} and "
            f"this machine has {available / GIB:.1f} GiB; run it on a GPU with TensorRT, build it with "
            "quantization.mode: int4_weight_only, or use a machine with more RAM")

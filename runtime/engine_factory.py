"""Which Engine serves an engine dir here: TensorRT on a GPU, ONNX Runtime on CPU, one process
per rank for tensor- and pipeline-parallel dirs."""
from __future__ import annotations

from ..plugins.onnxruntime.session import Spinning
from .core.engine import Engine
from .engine_dir import EngineDir, EngineDirError


def resolve_backend(engine_dir: EngineDir, backend: str) -> str:
    """``tensorrt`` or ``onnxruntime``: ``auto`` takes TensorRT where it can run here."""
    if backend not in ("auto", "tensorrt", "onnxruntime"):
        raise ValueError(f"backend {backend!r}: valid: auto, tensorrt, onnxruntime")
    if backend == "onnxruntime":
        return _cpu_runnable(engine_dir, backend)
    from .backends.tensorrt.library import tensorrt_available

    reason = tensorrt_available(engine_dir)
    if reason is not None and backend == "tensorrt":
        raise EngineDirError(f"--backend tensorrt: {reason}")
    return "tensorrt" if reason is None else _cpu_runnable(engine_dir, "onnxruntime", reason)


def _cpu_runnable(engine_dir: EngineDir, backend: str, no_gpu: str | None = None) -> str:
    from .backends.onnxruntime.memory import local_ranks, machine_bytes, memory_refusal

    engine_dir.require_cpu_graphs(f" ({no_gpu})" if no_gpu else "")
    refusal = memory_refusal(engine_dir, machine_bytes(), local_ranks(engine_dir))
    if refusal is not None:
        raise EngineDirError(refusal)
    return backend


def make_engine(engine_dir: EngineDir, backend: str, threads: int, prefix_blocks: int, block_size: int,
                verify: bool = True, spinning: Spinning = Spinning.always) -> Engine:
    """``auto`` runs the TensorRT engine on a GPU machine with TensorRT, else the rank ONNX on CPU.
    A tensor- or pipeline-parallel engine dir runs one process per rank (runtime/parallel/tensor_parallel.py)."""
    backend = resolve_backend(engine_dir, backend)
    if engine_dir.world_size > 1:
        from .parallel.tensor_parallel import TensorParallelEngine

        # Pipeline stages: as many micro-batches as stages fills the pipeline.
        return TensorParallelEngine(engine_dir, threads=threads, prefix_blocks=prefix_blocks, block_size=block_size,
                                    verify=verify, backend=backend, micro_batches=engine_dir.pipeline_parallel)
    if backend == "tensorrt":
        from .backends.tensorrt.engine import TensorRTEngine

        return TensorRTEngine(engine_dir, prefix_blocks=prefix_blocks, block_size=block_size)
    from .backends.onnxruntime.engine import OnnxRuntimeEngine

    return OnnxRuntimeEngine(engine_dir, threads=threads, prefix_blocks=prefix_blocks, block_size=block_size,
                             spinning=spinning)

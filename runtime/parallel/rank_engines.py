"""What each rank of a tensor- or pipeline-parallel engine runs, once its process group is up:
its own engine (ONNX Runtime over gloo collectives, or TensorRT over an NCCL communicator), as a
pipeline stage where there are stages, and the loop a non-zero rank serves rank 0's messages in
(runtime/parallel/protocol.py). runtime/parallel/tensor_parallel.py starts the ranks and is rank 0's Engine.
"""
from __future__ import annotations

import os
import time

import numpy as np

from ...plugins.collectives import ALL_GATHER, ALL_REDUCE, Collective
from ..engine_dir import EngineDir
from .pipeline_parallel import StageRunner, stage_groups
from .protocol import PagedLimits, Stop, receive
from ..core.step import CopySlot, Discard, KeepPath, KeepPathInBlocks, LoadBlock, SaveBlock, Step
from .transport import HostTransport


class TorchCollectives:
    """The rank graphs' DistCollective over torch.distributed (gloo on CPU), among the ranks of
    ``group`` (a pipeline stage's; None: every rank). Counts what it does: ``calls``, ``bytes``
    sent by this rank and ``seconds`` waited (benchmarks/parallel.py)."""

    def __init__(self, group=None):
        self.group = group
        self.calls, self.bytes, self.seconds = 0, 0, 0.0

    def __call__(self, collective: Collective, x: np.ndarray) -> np.ndarray:
        import torch
        import torch.distributed as dist

        start = time.perf_counter()
        tensor = torch.from_numpy(np.ascontiguousarray(x))
        if collective.operation == ALL_REDUCE:
            dist.all_reduce(tensor, group=self.group)
            out = tensor.numpy()
        elif collective.operation == ALL_GATHER:
            parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(self.group))]
            dist.all_gather(parts, tensor, group=self.group)
            out = torch.cat(parts, dim=0).numpy()
        else:
            raise ValueError(f"collective {collective.operation!r} is not implemented")
        self.calls += 1
        self.bytes += x.nbytes
        self.seconds += time.perf_counter() - start
        return out


class RankEngine:
    """This rank's engine and the NCCL communicator its TensorRT contexts use (None on CPU, or
    one tensor rank): ``close`` frees both, the engine first (its contexts hold the communicator).
    ``limits``: what bounds the block ids of rank 0's messages here (protocol.PagedLimits)."""

    def __init__(self, engine, communicator=None, limits: PagedLimits | None = None):
        self.engine, self.communicator, self.limits = engine, communicator, limits

    def close(self) -> None:
        try:
            self.engine.close()  # looked up now: a test may wrap an engine's close
        finally:
            if self.communicator is not None:
                self.communicator.close()
                self.communicator = None


def rank_engine(engine_dir: EngineDir, rank: int, threads: int, prefix_blocks: int, block_size: int,
                backend: str, micro_batches: int) -> RankEngine:
    """This rank's engine once the process group is up: with pipeline stages, run as its stage
    (runtime/parallel/pipeline_parallel.py, a step in up to ``micro_batches``) with its collectives over
    the stage's group and its hand-offs through a transport (runtime/parallel/transport.py)."""
    groups = stage_groups(engine_dir)  # every rank creates every stage's group
    local = _local_engine(engine_dir, rank, threads, prefix_blocks, block_size, backend,
                          groups[rank // engine_dir.tensor_parallel])
    local.limits = rank_limits(engine_dir, block_size, prefix_blocks)
    if engine_dir.pipeline_parallel == 1:
        return local
    if backend == "tensorrt":
        from .tensorrt_stage import TensorRTStage

        runner = StageRunner(TensorRTStage(local.engine), engine_dir, rank, micro_batches,
                             _device_transport(local.engine))
    else:
        runner = StageRunner(local.engine, engine_dir, rank, micro_batches, HostTransport())
    return RankEngine(runner, local.communicator, local.limits)


def rank_limits(engine_dir: EngineDir, block_size: int, num_blocks: int) -> PagedLimits:
    """The block ids a rank takes from rank 0: tables of at most max_seq_len / block_size blocks,
    ids below ``num_blocks`` (the budget's: a paged rank's pool)."""
    return PagedLimits(block_size, engine_dir.max_seq_len // block_size, num_blocks)


def _device_transport(engine):
    """How a TensorRT stage hands device buffers on: over NCCL where torch has CUDA (real GPUs),
    else staged through host memory over gloo (a CPU build of torch; the simulated device).
    Every rank of a job runs the same torch, so all take the same path; each creates the NCCL
    group (every rank, in the same order)."""
    import torch.distributed as dist

    from .transport import HostStagedTransport, NcclTransport, nccl_usable

    if nccl_usable():
        import torch

        torch.cuda.set_device(engine.device)
        return NcclTransport(dist.new_group(backend="nccl"), engine.device, engine.stream)
    return HostStagedTransport(engine.cudart, engine.stream, engine.ok)


def _local_engine(engine_dir: EngineDir, rank: int, threads: int, prefix_blocks: int, block_size: int,
                  backend: str = "onnxruntime", group=None) -> RankEngine:
    """This rank's engine: its rankN.onnx in ONNX Runtime (collectives over gloo among ``group``,
    its stage's ranks or all), or on a GPU its rankN.engine in TensorRT (one GPU per rank:
    LOCAL_RANK under torchrun) with, where the stage has tensor ranks, an NCCL communicator among
    the ranks of ``group``."""
    if backend == "tensorrt":
        from .nccl import NcclCommunicator
        from ..backends.tensorrt.engine import TensorRTEngine
        from ..backends.tensorrt.library import cuda_runtime

        cudart = cuda_runtime()
        count = cudart.cudaGetDeviceCount()[1]
        device = int(os.environ.get("LOCAL_RANK", rank)) % max(1, count)
        cudart.cudaSetDevice(device)
        tensor = engine_dir.tensor_parallel
        communicator = NcclCommunicator.over_group(rank % tensor, tensor, group) if tensor > 1 else None
        try:
            engine = TensorRTEngine(engine_dir, prefix_blocks=prefix_blocks, block_size=block_size, rank=rank,
                                    device=device, communicator=communicator.capsule() if communicator else None)
        except BaseException:
            if communicator is not None:
                communicator.close()
            raise
        return RankEngine(engine, communicator)
    from ..backends.onnxruntime.engine import OnnxRuntimeEngine

    return RankEngine(OnnxRuntimeEngine(engine_dir, threads=threads, prefix_blocks=prefix_blocks,
                                        block_size=block_size, rank=rank, collective=TorchCollectives(group)))


def run_message(engine, message):
    """What a message asks of this rank's engine, and what that returns (a step's StepOutput;
    rank 0 runs each message it broadcasts on its own engine too)."""
    if isinstance(message, Step):
        return engine.step(message)
    if isinstance(message, CopySlot):
        return engine.copy_slot(message.src, message.dst, message.length)
    if isinstance(message, KeepPath):
        return engine.keep_path(message.slot, message.start, message.nodes)
    if isinstance(message, SaveBlock):
        return engine.save_block(message.slot, message.index, message.block)
    if isinstance(message, LoadBlock):
        return engine.load_block(message.block, message.slot, message.index)
    if isinstance(message, KeepPathInBlocks):  # a paged TensorRT rank's (CPU ranks are never sent one)
        return engine.keep_path_in_blocks(message.blocks, message.start, message.nodes)
    if isinstance(message, Discard):
        return engine.discard(message.slots, message.blocks)
    raise TypeError(f"no engine call for {type(message).__name__}")


def serve_rank(rank: int, local: RankEngine) -> None:
    """A non-zero rank: run rank 0's messages on this rank's engine until told to stop, then free
    it (its communicator included)."""
    try:
        while not isinstance(message := receive(rank, limits=local.limits), Stop):
            run_message(local.engine, message)
    finally:
        local.close()

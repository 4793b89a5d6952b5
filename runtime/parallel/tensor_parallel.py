"""Tensor-parallel engines: one process per rank over torch.distributed.

Rank 0 owns everything above the engine protocol (scheduler, sampler, prefix-cache index,
Medusa policy). ``TensorParallelEngine`` is one more Engine: each call (a step, or a cache
operation) is broadcast to the other ranks as a typed message (runtime/parallel/protocol.py: int64
tensors, no pickle), then every rank runs it on its own engine over its own KV shard
(runtime/parallel/rank_engines.py); the rank graphs' collectives (all-reduce after o_proj and
down_proj, all-gather of the logits rows) run over the same process group. Every rank ends
with the whole logits; rank 0 returns them.

Processes: on one machine the engine starts ranks 1..N-1 itself (spawned, gloo on
127.0.0.1); under ``torchrun`` (across machines) the launcher starts them and each non-zero
rank serves messages until rank 0 stops; every rank frees its engine and NCCL communicator. Every rank loads its engine, then all meet at a
barrier, so a rank that cannot load fails the constructor. A rank that dies or fails ends the
group: rank 0 raises ``RankFailure`` naming the rank and the last line of its traceback (a
started rank's stderr goes to a file rank 0 reads back), and stops every rank it started.
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import traceback
from datetime import timedelta
from pathlib import Path

from ...contract.processes import die_with_parent
from ..core.engine import GreedyRun, StepOutput, StepwiseGreedyRun
from ..engine_dir import EngineDir, load
from .rank_engines import RankEngine, rank_engine, rank_limits, run_message, serve_rank
from .protocol import Message, Stop, broadcast
from ..core.step import CopySlot, Discard, KeepPath, KeepPathInBlocks, LoadBlock, SaveBlock

# A collective that waits longer than this means a rank is gone or stuck (a CPU step of the
# bundled model takes milliseconds; a first step of a large one, seconds).
TIMEOUT_S = float(os.environ.get("TRTBUILD_TP_TIMEOUT_S", "60"))


class RankFailure(RuntimeError):
    """Another rank died or failed; the message names it."""


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def _last_line(exc: BaseException) -> str:
    """The last line of the exception's traceback: ``Type: message``."""
    return traceback.format_exception_only(type(exc), exc)[-1].strip().splitlines()[-1]


def _worker(path: str, rank: int, world: int, address: str, threads: int, prefix_blocks: int, block_size: int,
            verify: bool, backend: str, micro_batches: int) -> None:
    """A rank process started by rank 0 on this machine (``python -m trtbuild.runtime.parallel.tensor_parallel``)."""
    import torch.distributed as dist

    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to rank 0, which stops us
    dist.init_process_group("gloo", init_method=address, rank=rank, world_size=world,
                            timeout=timedelta(seconds=TIMEOUT_S))
    try:
        local = rank_engine(load(Path(path), verify_hashes=verify), rank, threads, prefix_blocks, block_size, backend,
                            micro_batches)
        dist.barrier()  # every rank loaded: rank 0's constructor returns
        serve_rank(rank, local)
    except Exception as exc:  # noqa: BLE001  (reported by rank 0 as this rank's failure)
        traceback.print_exc()
        print(f"trtbuild rank {rank}: {_last_line(exc)}", file=sys.stderr, flush=True)
        os._exit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class TensorParallelEngine:
    """Rank 0's view of a tensor-parallel engine dir: one Engine over all ranks."""

    def __init__(self, engine_dir: EngineDir, threads: int = 0, prefix_blocks: int = 0, block_size: int = 16,
                 verify: bool = True, backend: str = "onnxruntime", micro_batches: int = 1):
        """``micro_batches``: with pipeline stages, how many a step's rows split into (at most;
        1: the stages run one after another)."""
        import torch.distributed as dist

        self.world, self.tensor = engine_dir.world_size, engine_dir.tensor_parallel
        pipeline = engine_dir.pipeline_parallel
        self.name = (f"{backend} (tensor parallel {self.world})" if pipeline == 1 else
                     f"{backend} ({pipeline} pipeline stages × {engine_dir.tensor_parallel} tensor ranks)")
        self.local = None  # rank 0's own engine, once loaded
        # A paged TensorRT dir: every rank pools its own KV heads (and stage's layers) under rank
        # 0's block ids, so rank 0 sends each step's block tables and KeepPathInBlocks; CPU ranks
        # keep slots (the LLM schedules paged on a GPU only: runtime/llm.py).
        self.paged = backend == "tensorrt" and engine_dir.kv_cache.paged
        self.limits = rank_limits(engine_dir, block_size, prefix_blocks)
        self.own: RankEngine | None = None  # that engine with its NCCL communicator: closing frees both
        self.processes: dict[int, subprocess.Popen] = {}
        self.stderr: dict[int, object] = {}  # rank → the file its stderr goes to
        self.closed = False
        # Each rank gets its share of this machine's cores unless told otherwise.
        threads = threads or max(1, (os.cpu_count() or 1) // self.world)
        if launched_by_torchrun():
            dist.init_process_group("gloo", timeout=timedelta(seconds=TIMEOUT_S))
            if dist.get_world_size() != self.world:
                raise ValueError(f"{engine_dir.path} has {self.world} ranks; torchrun started "
                                 f"{dist.get_world_size()} processes: use --nproc-per-node/--nnodes for {self.world}")
            rank = dist.get_rank()
            if rank != 0:  # this process serves rank 0's messages, then the program ends
                local = rank_engine(engine_dir, rank, threads, prefix_blocks, block_size, backend, micro_batches)
                dist.barrier()
                serve_rank(rank, local)
                dist.destroy_process_group()
                raise SystemExit(0)
        else:
            address = f"tcp://127.0.0.1:{_free_port()}"
            # Fresh interpreters (not multiprocessing): nothing of the caller's __main__ is re-run.
            for rank in range(1, self.world):
                self.stderr[rank] = tempfile.TemporaryFile("w+")
                self.processes[rank] = subprocess.Popen(
                    [sys.executable, "-m", "trtbuild.runtime.parallel.tensor_parallel", str(engine_dir.path), "--rank", str(rank),
                     "--world", str(self.world), "--address", address, "--threads", str(threads),
                     "--prefix-blocks", str(prefix_blocks), "--block-size", str(block_size), "--backend", backend,
                     "--micro-batches", str(micro_batches),
                     *([] if verify else ["--no-verify"])], stdin=subprocess.DEVNULL, stderr=self.stderr[rank])
        try:
            if not launched_by_torchrun():
                dist.init_process_group("gloo", init_method=address, rank=0, world_size=self.world,
                                        timeout=timedelta(seconds=TIMEOUT_S))
            self.own = rank_engine(engine_dir, 0, threads, prefix_blocks, block_size, backend, micro_batches)
            self.local = self.own.engine
            dist.barrier()  # every rank loaded its engine
        except Exception as exc:  # noqa: BLE001  (no rank may outlive a failed constructor)
            raise self._failure(exc, "the engine was not loaded") from None

    def _everywhere(self, message: Message):
        """``message`` to every rank (runtime/parallel/protocol.py), then run on rank 0's own engine."""
        if self.closed:
            raise RankFailure("the tensor-parallel engine is closed")
        try:
            broadcast(message, limits=self.limits)
            return run_message(self.local, message)
        except RankFailure:
            raise
        except Exception as exc:  # noqa: BLE001  (named by rank, every rank stopped)
            raise self._failure(exc, "the request was not completed") from None

    def _failure(self, exc: Exception, consequence: str) -> RankFailure:
        """Stops every rank, then names the one that failed: a started rank that ended (how, and
        the last line it wrote: its traceback's), else rank 0 itself (its exception)."""
        codes = {}
        for rank, process in self.processes.items():
            try:
                codes[rank] = process.wait(timeout=2)
            except subprocess.TimeoutExpired:
                codes[rank] = None
        said = {rank: self._last_stderr_line(rank) for rank in codes}
        self.close(graceful=False)
        for rank, code in codes.items():
            if code and code > 0 and said[rank]:
                return RankFailure(f"{self._describe(rank)} failed: {said[rank]}; {consequence}")
            if code:
                how = f"killed by signal {-code}" if code < 0 else f"exited with code {code}"
                return RankFailure(f"{self._describe(rank)} {how}; {consequence}")
        return RankFailure(f"{self._describe(0)} failed: {_last_line(exc)}; {consequence}")

    def _describe(self, rank: int) -> str:
        """A rank by name: "tensor-parallel rank 1", or with pipeline stages "rank 2 (pipeline stage 1, tensor rank 0)"."""
        if self.world == self.tensor:
            return f"tensor-parallel rank {rank}"
        stage, tensor_rank = divmod(rank, self.tensor)
        return f"rank {rank} (pipeline stage {stage}, tensor rank {tensor_rank})"

    def _last_stderr_line(self, rank: int) -> str:
        """What a started rank last wrote: ``trtbuild rank N: Type: message`` if it failed."""
        file = self.stderr.get(rank)
        if file is None:
            return ""
        file.seek(0)
        lines = [line.strip() for line in file.read().splitlines() if line.strip()]
        return lines[-1].removeprefix(f"trtbuild rank {rank}: ") if lines else ""

    def step(self, step) -> StepOutput:
        return self._everywhere(step)

    def greedy_run(self, step) -> GreedyRun:
        return StepwiseGreedyRun(self, step)  # every rank takes each step

    def copy_slot(self, src: int, dst: int, length: int) -> None:
        self._everywhere(CopySlot(src, dst, length))

    def keep_path(self, slot: int, start: int, nodes: tuple[int, ...]) -> None:
        self._everywhere(KeepPath(slot, start, tuple(nodes)))

    def save_block(self, slot: int, index: int, block: int) -> None:
        self._everywhere(SaveBlock(slot, index, block))

    def load_block(self, block: int, slot: int, index: int) -> None:
        self._everywhere(LoadBlock(block, slot, index))

    def keep_path_in_blocks(self, blocks: tuple[int, ...], start: int, nodes: tuple[int, ...]) -> None:
        self._everywhere(KeepPathInBlocks(tuple(blocks), start, tuple(nodes)))

    def discard(self, slots: tuple[int, ...], blocks: tuple[int, ...]) -> None:
        """Every rank's demand-paged pools hand those slots' and store blocks' pages back."""
        self._everywhere(Discard(tuple(slots), tuple(blocks)))

    def close(self, graceful: bool = True) -> None:
        import torch.distributed as dist

        if self.closed:
            return
        self.closed = True
        if graceful and dist.is_initialized():
            try:
                broadcast(Stop())
            except Exception:  # noqa: BLE001  (a rank already gone: nothing to stop)
                pass
        for process in self.processes.values():
            try:
                process.wait(timeout=5 if graceful else 0.1)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=5)
        for file in self.stderr.values():
            file.close()
        if self.own is not None:  # rank 0's engine (its device memory on a GPU) and communicator
            self.own.close()
        if dist.is_initialized():
            dist.destroy_process_group()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001  (interpreter shutdown)
            pass


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="one rank of a tensor-parallel engine (started by rank 0)")
    parser.add_argument("engine_dir")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--address", required=True)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prefix-blocks", type=int, default=0)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--no-verify", action="store_true")
    parser.add_argument("--backend", choices=["onnxruntime", "tensorrt"], default="onnxruntime")
    parser.add_argument("--micro-batches", type=int, default=1)
    args = parser.parse_args(argv)
    _worker(args.engine_dir, args.rank, args.world, args.address, args.threads, args.prefix_blocks,
            args.block_size, not args.no_verify, args.backend, args.micro_batches)


if __name__ == "__main__":
    main()

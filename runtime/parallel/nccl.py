"""An NCCL communicator for a tensor-parallel TensorRT engine (``IExecutionContext.set_communicator``).

TensorRT's DistCollective layers run over the NCCL communicator the execution context is given,
as a capsule holding the ``ncclComm_t``. It is made with NCCL's own C API (ctypes on the
libnccl that the CUDA builds of torch ship in the ``nvidia-nccl`` wheel): the group's first rank
draws the unique id, the ranks' torch.distributed group (gloo, on CPU) carries it to the others,
each rank calls ``ncclCommInitRank`` on its own GPU. With pipeline stages the group is the stage's
tensor ranks (runtime/parallel/pipeline_parallel.py stage_groups), so the collectives stay inside the stage.
GPU machines only; nothing here runs on CPU.
"""
from __future__ import annotations

import ctypes
import ctypes.util
from pathlib import Path

NCCL_UNIQUE_ID_BYTES = 128


class _UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * NCCL_UNIQUE_ID_BYTES)]


def _library() -> ctypes.CDLL:
    candidates = []
    try:
        import nvidia.nccl  # the wheel CUDA builds of torch depend on

        candidates += [str(Path(p) / "lib" / "libnccl.so.2") for p in nvidia.nccl.__path__]
    except ImportError:
        pass
    found = ctypes.util.find_library("nccl")
    candidates += [found] if found else []
    for path in candidates:
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    raise RuntimeError("NCCL is not installed (pip install nvidia-nccl-cu12, or a CUDA build of torch)")


def _check(lib: ctypes.CDLL, result: int, what: str) -> None:
    if result != 0:
        lib.ncclGetErrorString.restype = ctypes.c_char_p
        raise RuntimeError(f"NCCL {what} failed: {lib.ncclGetErrorString(result).decode()}")


def draw_unique_id() -> bytes:
    """A new communicator's id (``ncclGetUniqueId``), drawn by its first rank."""
    lib, unique = _library(), _UniqueId()
    _check(lib, lib.ncclGetUniqueId(ctypes.byref(unique)), "ncclGetUniqueId")
    return bytes(unique.internal)


class NcclCommunicator:
    """This rank's communicator among ``size`` ranks, where it is ``rank``, on the current CUDA
    device; ``unique`` is the id the first rank drew (every rank passes the same)."""

    def __init__(self, rank: int, size: int, unique: bytes):
        if len(unique) != NCCL_UNIQUE_ID_BYTES:
            raise ValueError(f"an NCCL unique id is {NCCL_UNIQUE_ID_BYTES} bytes, not {len(unique)}")
        self.lib = lib = _library()
        carried = _UniqueId()
        ctypes.memmove(carried.internal, unique, NCCL_UNIQUE_ID_BYTES)
        self.comm = ctypes.c_void_p()
        _check(lib, lib.ncclCommInitRank(ctypes.byref(self.comm), size, carried, rank), "ncclCommInitRank")

    @classmethod
    def over_group(cls, rank: int, size: int, group) -> "NcclCommunicator":
        """Among the ``size`` ranks of ``group`` (a torch.distributed gloo group; None: every
        rank): its first rank draws the id, the group carries it to the others as a tensor (no
        pickle)."""
        import torch
        import torch.distributed as dist

        carried = torch.frombuffer(bytearray(draw_unique_id() if rank == 0 else NCCL_UNIQUE_ID_BYTES), dtype=torch.uint8)
        dist.broadcast(carried, group=group, group_src=0)
        return cls(rank, size, carried.numpy().tobytes())

    def capsule(self) -> object:
        """What ``IExecutionContext.set_communicator`` takes: a capsule of the ncclComm_t."""
        new = ctypes.pythonapi.PyCapsule_New
        new.restype, new.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
        return new(self.comm, None, None)

    def close(self) -> None:
        """Frees the communicator (every rank, rank 0 included, once its contexts are gone)."""
        if self.comm:
            self.lib.ncclCommDestroy(self.comm)
            self.comm = ctypes.c_void_p()

"""An NCCL stand-in for CI, in one process (ranks are threads): the semantics of NCCL that decide
whether rank code deadlocks or leaks, not its speed.

- Communicators are created collectively: ``ncclCommInitRank`` returns only once every rank of
  the unique id has called it.
- Each rank's operations run in issue order (one stream per rank): an operation starts only
  once every earlier one of that rank is done; the ops of one batch (``batch``, NCCL's group
  calls, torch's batch_isend_irecv) run together.
- Point-to-point messages between a pair match in issue order; a send of at most
  ``buffer_bytes`` completes into the pair's buffer, a larger one waits until the matching
  receive is running (NCCL's rendezvous above NCCL_BUFFSIZE).
- ``ncclCommDestroy`` is required: ``leaks()`` names every communicator never destroyed.
A wait that can never end is ended by ``abort()`` (a test's timeout): the waiter raises Aborted.
"""
from __future__ import annotations

import ctypes
import threading
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

NCCL_BUFFSIZE = 4 << 20  # NCCL's default channel buffer


class Aborted(RuntimeError):
    """The fabric was aborted while this operation waited (a deadlock the test ended)."""


@dataclass(eq=False)
class Op:
    rank: int
    peer: int
    buffer: np.ndarray      # uint8 view of what is sent, or where a receive lands
    send: bool
    group: int = 0          # ops of one batch (ncclGroupStart/End) run together
    done: bool = False
    collective: tuple[int, int] | None = None  # (communicator, its n-th collective): ranks' ops that meet
    size: int = 0                               # ranks of that communicator
    combine: Callable | None = None             # every rank's input (rank order) → every rank's output

    def wait(self, fabric: "NcclFabric") -> None:
        fabric.wait(self)


@dataclass(eq=False)
class Communicator:
    unique: int
    rank: int
    size: int
    destroyed: bool = False
    issued: int = 0  # collectives issued on it by its rank


@dataclass
class _Init:
    size: int
    joined: set = field(default_factory=set)


class NcclFabric:
    def __init__(self, buffer_bytes: int = NCCL_BUFFSIZE):
        self.buffer_bytes = buffer_bytes
        self.cond = threading.Condition()
        self.streams: dict[int, deque[Op]] = defaultdict(deque)          # rank → its ops not yet done
        self.buffered: dict[tuple[int, int], deque] = defaultdict(deque)  # (src, dst) → sent, not received
        self.inits: dict[int, _Init] = {}
        self.communicators: list[Communicator] = []
        self.next_id, self.aborted = 1, False

    # -- point to point ------------------------------------------------------------------------
    def isend(self, rank: int, array: np.ndarray, dst: int) -> Op:
        return self.batch([self.send_op(rank, array, dst)])[0]

    def irecv(self, rank: int, array: np.ndarray, src: int) -> Op:
        return self.batch([self.recv_op(rank, array, src)])[0]

    @staticmethod
    def send_op(rank: int, array: np.ndarray, dst: int) -> Op:
        return Op(rank, dst, np.ascontiguousarray(array).view(np.uint8).reshape(-1).copy(), True)

    @staticmethod
    def recv_op(rank: int, array: np.ndarray, src: int) -> Op:
        """A receive into ``array`` (contiguous; written in place when it completes)."""
        return Op(rank, src, array.view(np.uint8).reshape(-1), False)

    def batch(self, ops: list[Op]) -> list[Op]:
        """Issues ``ops`` (one rank's) as one group: they run together, after the rank's earlier ops."""
        with self.cond:
            group, self.next_id = self.next_id, self.next_id + 1
            for op in ops:
                op.group = group
                self.streams[op.rank].append(op)
            self._progress()
        return ops

    def collective(self, communicator: "Communicator", x: np.ndarray, combine: Callable) -> np.ndarray:
        """This rank's output of a collective over ``communicator`` (``combine``: every rank's
        input in rank order → every rank's output). Issued on the rank's stream after its earlier
        ops; runs once every rank of the communicator has its matching (n-th) collective running.
        A rank's stream is keyed by its rank in the communicator: the stand-in's collectives run
        over one communicator of the world (tensor parallelism without stages)."""
        op = Op(communicator.rank, -1, np.array(x), False, collective=(communicator.unique, communicator.issued),
                size=communicator.size, combine=combine)
        communicator.issued += 1
        self.wait(self.batch([op])[0])
        return op.buffer

    def wait(self, op: Op) -> None:
        with self.cond:
            while not op.done:
                if self.aborted:
                    raise Aborted(f"rank {op.rank}: {'send to' if op.send else 'receive from'} rank {op.peer} "
                                  f"of {op.buffer.nbytes} bytes never completed")
                self.cond.wait()

    def abort(self) -> None:
        with self.cond:
            self.aborted = True
            self.cond.notify_all()

    def _running(self, rank: int) -> list[Op]:
        """The ops of ``rank`` that run now: its earliest group not done (a stream runs in order)."""
        stream = self.streams[rank]
        return [op for op in stream if op.group == stream[0].group] if stream else []

    def _finish(self, op: Op) -> None:
        op.done = True
        self.streams[op.rank].remove(op)

    def _progress(self) -> None:
        moved = True
        while moved:
            moved = False
            for rank in list(self.streams):
                for op in self._running(rank):
                    moved |= self._step(rank, op)
        self.cond.notify_all()

    def _step(self, rank: int, op: Op) -> bool:
        """Whether ``op`` (running) completed now."""
        if op.collective is not None:
            return self._meet(op)
        if op.send and op.buffer.nbytes <= self.buffer_bytes:
            self.buffered[(rank, op.peer)].append(op.buffer)
            self._finish(op)
            return True
        if op.send:
            return False  # over the buffer: its receive completes it (rendezvous)
        if self._earlier_receive(op):
            return False  # receives from one peer match in issue order
        if self.buffered[(op.peer, rank)]:
            self._land(op, self.buffered[(op.peer, rank)].popleft())
            return True
        sender = next((s for s in self._running(op.peer) if s.send and s.peer == rank), None)
        if sender is None:
            return False
        self._land(op, sender.buffer)
        self._finish(sender)
        return True

    def _meet(self, op: Op) -> bool:
        """A collective completes when every rank of its communicator runs its matching op."""
        peers = sorted((o for r in list(self.streams) for o in self._running(r) if o.collective == op.collective),
                       key=lambda o: o.rank)
        if len(peers) < op.size:
            return False
        for peer, out in zip(peers, op.combine([p.buffer for p in peers])):
            peer.buffer = np.asarray(out)
            self._finish(peer)
        return True

    def _earlier_receive(self, op: Op) -> bool:
        stream = self.streams[op.rank]
        return any(o is not op and not o.send and o.peer == op.peer for o in list(stream)[:stream.index(op)])

    def _land(self, op: Op, data: np.ndarray) -> None:
        if data.nbytes != op.buffer.nbytes:
            raise RuntimeError(f"rank {op.rank}: received {data.nbytes} bytes from rank {op.peer} "
                               f"into a buffer of {op.buffer.nbytes}")
        op.buffer[:] = data
        self._finish(op)

    # -- the libnccl calls runtime/parallel/nccl.py makes -------------------------------------------------
    def library(self) -> "FabricLibrary":
        return FabricLibrary(self)

    def init_rank(self, unique: int, size: int, rank: int) -> Communicator:
        """Collective: returns once all ``size`` ranks of ``unique`` joined."""
        with self.cond:
            init = self.inits.setdefault(unique, _Init(size))
            if init.size != size or rank in init.joined or not 0 <= rank < size:
                raise RuntimeError(f"ncclCommInitRank: rank {rank} of {size} for a communicator of {init.size}")
            init.joined.add(rank)
            self.cond.notify_all()
            while len(init.joined) < size:
                if self.aborted:
                    raise Aborted(f"rank {rank}: ncclCommInitRank waited for {size - len(init.joined)} ranks")
                self.cond.wait()
            communicator = Communicator(unique, rank, size)
            self.communicators.append(communicator)
            return communicator

    def leaks(self) -> list[str]:
        """Every communicator created and never destroyed."""
        return [f"communicator {c.unique} rank {c.rank} of {c.size} was never destroyed"
                for c in self.communicators if not c.destroyed]


class FabricLibrary:
    """The ctypes-facing calls of libnccl (runtime/parallel/nccl.py) over a fabric: handles are ints."""

    def __init__(self, fabric: NcclFabric):
        self.fabric = fabric
        self.handles: dict[int, Communicator] = {}
        self.ncclGetErrorString = lambda code: b"simulated NCCL error"

    def ncclGetUniqueId(self, unique_ref) -> int:
        unique = ctypes.cast(ctypes.pointer(unique_ref._obj), ctypes.POINTER(ctypes.c_int64))  # byref(...)._obj
        with self.fabric.cond:
            unique[0], self.fabric.next_id = self.fabric.next_id, self.fabric.next_id + 1
        return 0

    def ncclCommInitRank(self, comm_ref, size: int, unique, rank: int) -> int:
        ident = ctypes.cast(ctypes.byref(unique), ctypes.POINTER(ctypes.c_int64))[0]
        communicator = self.fabric.init_rank(ident, size, rank)
        handle = id(communicator)
        self.handles[handle] = communicator
        comm_ref._obj.value = handle
        return 0

    def communicator(self, capsule) -> Communicator:
        """The communicator a capsule of its handle (``NcclCommunicator.capsule()``) holds."""
        pointer = ctypes.pythonapi.PyCapsule_GetPointer
        pointer.restype, pointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
        return self.handles[pointer(capsule, None)]

    def ncclCommDestroy(self, comm) -> int:
        communicator = self.handles.pop(comm.value if isinstance(comm, ctypes.c_void_p) else int(comm), None)
        if communicator is None or communicator.destroyed:
            return 4  # ncclInvalidArgument
        communicator.destroyed = True
        return 0


class FabricReceiving:
    def __init__(self, fabric: NcclFabric, op: Op, out: np.ndarray):
        self.fabric, self.op, self.out = fabric, op, out

    def wait(self) -> np.ndarray:
        self.fabric.wait(self.op)
        return self.out


class FabricSending:
    def __init__(self, fabric: NcclFabric, op: Op):
        self.fabric, self.op = fabric, op

    def wait(self) -> None:
        self.fabric.wait(self.op)


class FabricTransport:
    """A pipeline stage transport (runtime/parallel/transport.py's interface) of host arrays over the
    fabric, for rank ``rank``: what NcclTransport does, with NCCL's ordering and buffer limit."""

    def __init__(self, fabric: NcclFabric, rank: int):
        self.fabric, self.rank = fabric, rank

    def send(self, array: np.ndarray, dst: int) -> FabricSending:
        return FabricSending(self.fabric, self.fabric.isend(self.rank, array, dst))

    def recv_into(self, array: np.ndarray, src: int) -> None:
        self.fabric.wait(self.fabric.irecv(self.rank, array, src))

    def send_and_receive(self, array: np.ndarray, dst: int, shapes: list[tuple[int, ...]], dtype,
                         src: int) -> tuple[FabricSending, list[FabricReceiving]]:
        outs = [np.empty(shape, dtype) for shape in shapes]
        ops = self.fabric.batch([self.fabric.send_op(self.rank, array, dst)] +
                                [self.fabric.recv_op(self.rank, out, src) for out in outs])
        return FabricSending(self.fabric, ops[0]), [FabricReceiving(self.fabric, op, out)
                                                    for op, out in zip(ops[1:], outs)]

    def irecv_host(self, shape: tuple[int, ...], dtype, src: int) -> FabricReceiving:
        """A receive posted alone (what the old StageRunner did after all its sends)."""
        out = np.empty(shape, dtype)
        return FabricReceiving(self.fabric, self.fabric.irecv(self.rank, out, src), out)

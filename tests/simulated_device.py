"""A simulation of the GPU for CI, not a GPU test.

``SimulatedDevice`` stands in for the ``cuda.bindings.runtime`` calls TensorRTEngine makes
(malloc, memset, memcpy, 2-D memcpy, streams, stream capture into graphs, graph launch) with
host memory, and for the TensorRT module the manifest names with an execution context that runs
the rank's ONNX graph in ONNX Runtime over the tensors at the addresses bound to it. With it the
backend's own code runs here: buffer sizes, addresses, pitches, slot and block offsets, bucket
padding, capture and replay, Medusa buffers.

What it checks like a device would, or more strictly: every device access lies inside one
allocation (allocations sit apart, so an overrun never lands in a neighbour); cudaMalloc'd
memory starts as NaN bytes, so reading what was never written poisons the logits; a 2-D copy's
width fits its pitches; a memcpy's kind matches its pointers; a captured step replays with the
addresses and shapes it was captured with; shapes stay inside the engine's optimization profile.
What it does not simulate: kernels (ONNX Runtime computes on the CPU), TensorRT's numerics,
asynchrony (copies to and from pageable host memory are synchronous on a GPU too), timing.
"""
from __future__ import annotations

import bisect
import ctypes
import enum
import sys
import threading
import types
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from simulated_nccl import FabricLibrary, NcclFabric

DEVICE_BASE = 1 << 50  # far above any host address on x86-64/aarch64 (≤ 2^48)
GUARD = 1 << 20        # gap between allocations


STREAM_WORK = frozenset({"cudaMemcpyAsync", "cudaMemcpy2DAsync", "cudaGraphLaunch", "cudaStreamSynchronize"})


class cudaError_t(enum.IntEnum):  # noqa: N801  (cuda-python's names)
    cudaSuccess = 0
    cudaErrorInvalidValue = 1
    cudaErrorIllegalAddress = 700
    cudaErrorStreamCaptureUnsupported = 900


class cudaMemcpyKind(enum.IntEnum):  # noqa: N801
    cudaMemcpyHostToHost = 0
    cudaMemcpyHostToDevice = 1
    cudaMemcpyDeviceToHost = 2
    cudaMemcpyDeviceToDevice = 3


class cudaStreamCaptureMode(enum.IntEnum):  # noqa: N801
    cudaStreamCaptureModeGlobal = 0
    cudaStreamCaptureModeThreadLocal = 1
    cudaStreamCaptureModeRelaxed = 2


class DeviceFault(Exception):
    """A device access the simulation refuses (reported to the caller as a CUDA error)."""

    def __init__(self, code: cudaError_t, detail: str):
        super().__init__(detail)
        self.code = code


@dataclass
class Stream:
    captured: list | None = None  # ops recorded while capturing


@dataclass
class Graph:
    ops: list


@dataclass
class Props:
    major: int
    minor: int
    name: bytes = b"Simulated GPU"


@dataclass
class SimulatedDevice:
    """Host memory behind device addresses, and the cuda.bindings.runtime functions over it."""

    compute_capability: str = "sm89"
    memory_bytes: int = 24 << 30                             # the card's memory (an L4's 24 GiB)
    starts: list[int] = field(default_factory=list)        # sorted allocation bases
    buffers: dict[int, np.ndarray] = field(default_factory=dict)
    calls: Counter = field(default_factory=Counter)
    copied: Counter = field(default_factory=Counter)  # bytes moved, by cudaMemcpyKind name
    # CUDA's current device is per host thread: with this on, stream work from a thread that never
    # called cudaSetDevice is refused (on a multi-GPU host it would silently run on device 0).
    per_thread_device: bool = False
    device_threads: set = field(default_factory=set)
    last_fault: str = ""
    next_address: int = DEVICE_BASE
    graphs: list = field(default_factory=list)        # captured graphs not yet destroyed
    graph_execs: list = field(default_factory=list)   # instantiated graphs not yet destroyed
    # libnccl's calls (runtime/parallel/nccl.py) over an NCCL stand-in shared by the ranks (threads) here
    nccl: FabricLibrary = field(default_factory=lambda: NcclFabric().library())

    # -- memory ----------------------------------------------------------------------------
    def _span(self, address: int, nbytes: int) -> np.ndarray:
        """The bytes [address, address + nbytes) of one allocation, or a fault."""
        index = bisect.bisect_right(self.starts, address) - 1
        if index < 0:
            raise DeviceFault(cudaError_t.cudaErrorIllegalAddress, f"address {address:#x} is not device memory")
        base = self.starts[index]
        buffer = self.buffers[base]
        offset = address - base
        if offset + nbytes > buffer.nbytes or nbytes < 0:
            raise DeviceFault(cudaError_t.cudaErrorIllegalAddress,
                              f"{nbytes} bytes at offset {offset} overrun an allocation of {buffer.nbytes} bytes")
        return buffer[offset:offset + nbytes]

    def view(self, address: int, shape: tuple[int, ...], dtype) -> np.ndarray:
        """A numpy view of device memory (shares it: writes land on the device)."""
        dtype = np.dtype(dtype)
        return self._span(address, int(np.prod(shape)) * dtype.itemsize).view(dtype).reshape(shape)

    @staticmethod
    def _is_device(address: int) -> bool:
        return address >= DEVICE_BASE

    def _copy(self, dst: int, src: int, nbytes: int, kind: cudaMemcpyKind) -> None:
        want = {cudaMemcpyKind.cudaMemcpyHostToDevice: (True, False),
                cudaMemcpyKind.cudaMemcpyDeviceToHost: (False, True),
                cudaMemcpyKind.cudaMemcpyDeviceToDevice: (True, True)}[cudaMemcpyKind(kind)]
        if (self._is_device(dst), self._is_device(src)) != want:
            raise DeviceFault(cudaError_t.cudaErrorInvalidValue, f"{cudaMemcpyKind(kind).name} with dst {dst:#x}, "
                                                                 f"src {src:#x}")
        self.copied[cudaMemcpyKind(kind).name] += nbytes
        source = self._span(src, nbytes).copy() if self._is_device(src) else \
            np.frombuffer(ctypes.string_at(src, nbytes), np.uint8)
        if self._is_device(dst):
            self._span(dst, nbytes)[:] = source
        else:
            ctypes.memmove(dst, source.ctypes.data, nbytes)

    # -- stream ops: run now, or recorded into the graph a capture builds -----------------
    def _enqueue(self, stream: Stream, op) -> None:
        if stream.captured is not None:
            stream.captured.append(op)
        else:
            op()

    def _call(self, name: str, fn, *results):
        """cuda-python's convention: a tuple (error, *results)."""
        self.calls[name] += 1
        try:
            if name == "cudaSetDevice":
                self.device_threads.add(threading.get_ident())
            elif (self.per_thread_device and name in STREAM_WORK
                  and threading.get_ident() not in self.device_threads):
                raise DeviceFault(cudaError_t.cudaErrorInvalidValue,
                                  f"{name} from thread {threading.current_thread().name!r}, which never called "
                                  "cudaSetDevice (the current device is per host thread)")
            out = fn()
        except DeviceFault as fault:
            self.last_fault = f"{fault.code.name}: {fault}"
            return (fault.code, *([None] * len(results)))
        return (cudaError_t.cudaSuccess, *((out,) if results else ()))

    # -- the cuda.bindings.runtime API TensorRTEngine uses --------------------------------------
    def module(self) -> types.ModuleType:
        m = types.ModuleType("cuda.bindings.runtime")
        m.cudaError_t, m.cudaMemcpyKind, m.cudaStreamCaptureMode = cudaError_t, cudaMemcpyKind, cudaStreamCaptureMode
        major, minor = int(self.compute_capability[2:-1]), int(self.compute_capability[-1])
        m.cudaGetErrorString = lambda err: (cudaError_t.cudaSuccess,
                                            (self.last_fault or cudaError_t(err).name).encode())
        m.cudaGetDeviceCount = lambda: self._call("cudaGetDeviceCount", lambda: 1, 1)
        m.cudaSetDevice = lambda device: self._call("cudaSetDevice", lambda: self._device(device))
        m.cudaGetDeviceProperties = lambda device: self._call(
            "cudaGetDeviceProperties", lambda: (self._device(device), Props(major, minor))[1], 1)
        m.cudaMalloc = lambda nbytes: self._call("cudaMalloc", lambda: self._malloc(nbytes), 1)
        m.cudaFree = lambda ptr: self._call("cudaFree", lambda: self._free(ptr))
        m.cudaMemGetInfo = lambda: self._call("cudaMemGetInfo", lambda: (self.free_bytes, self.memory_bytes), 2)
        m.cudaMemset = lambda ptr, value, nbytes: self._call(
            "cudaMemset", lambda: self._span(int(ptr), nbytes).fill(value))
        m.cudaMemcpy = lambda dst, src, nbytes, kind: self._call(
            "cudaMemcpy", lambda: self._copy(int(dst), int(src), nbytes, kind))
        m.cudaMemcpyAsync = lambda dst, src, nbytes, kind, stream: self._call(
            "cudaMemcpyAsync", lambda: self._enqueue(stream, lambda: self._copy(int(dst), int(src), nbytes, kind)))
        m.cudaMemcpy2DAsync = lambda dst, dpitch, src, spitch, width, height, kind, stream: self._call(
            "cudaMemcpy2DAsync", lambda: self._copy2d(int(dst), dpitch, int(src), spitch, width, height, kind, stream))
        m.cudaStreamCreate = lambda: self._call("cudaStreamCreate", Stream, 1)
        m.cudaStreamSynchronize = lambda stream: self._call("cudaStreamSynchronize", lambda: self._sync(stream))
        m.cudaStreamDestroy = lambda stream: self._call("cudaStreamDestroy", lambda: None)
        m.cudaStreamBeginCapture = lambda stream, mode: self._call("cudaStreamBeginCapture",
                                                                   lambda: setattr(stream, "captured", []))
        m.cudaStreamEndCapture = lambda stream: self._call("cudaStreamEndCapture", lambda: self._end_capture(stream), 1)
        m.cudaGraphInstantiate = lambda graph, flags: self._call("cudaGraphInstantiate",
                                                                 lambda: self._instantiate(graph), 1)
        m.cudaGraphLaunch = lambda graph, stream: self._call(
            "cudaGraphLaunch", lambda: self._enqueue(stream, lambda: [op() for op in graph.ops]))
        m.cudaGraphExecDestroy = lambda graph: self._call("cudaGraphExecDestroy",
                                                          lambda: self._destroy(self.graph_execs, graph))
        m.cudaGraphDestroy = lambda graph: self._call("cudaGraphDestroy", lambda: self._destroy(self.graphs, graph))
        return m

    @staticmethod
    def _device(device: int) -> None:
        if device != 0:
            raise DeviceFault(cudaError_t.cudaErrorInvalidValue, f"device {device}: the simulation has one GPU")

    def _malloc(self, nbytes: int) -> int:
        address = self.next_address
        self.next_address += (nbytes + GUARD + 255) // 256 * 256
        self.starts.append(address)
        self.buffers[address] = np.full(nbytes, 0xFF, np.uint8)  # NaN bytes until written, as garbage would be
        return address

    @property
    def free_bytes(self) -> int:
        return self.memory_bytes - sum(buffer.nbytes for buffer in self.buffers.values())

    def _free(self, address: int) -> None:
        if int(address) not in self.buffers:
            raise DeviceFault(cudaError_t.cudaErrorInvalidValue, f"cudaFree of {int(address):#x}, never allocated")
        del self.buffers[int(address)]
        self.starts.remove(int(address))

    def _copy2d(self, dst, dpitch, src, spitch, width, height, kind, stream) -> None:
        if width > dpitch or width > spitch:
            raise DeviceFault(cudaError_t.cudaErrorInvalidValue, f"2-D copy of width {width} over pitches "
                                                                 f"{dpitch}/{spitch}")

        def rows():
            for row in range(height):
                self._copy(dst + row * dpitch, src + row * spitch, width, kind)

        self._enqueue(stream, rows)

    @staticmethod
    def _sync(stream: Stream) -> None:
        if stream.captured is not None:
            raise DeviceFault(cudaError_t.cudaErrorStreamCaptureUnsupported, "synchronize while capturing")

    def _end_capture(self, stream: Stream) -> Graph:
        graph, stream.captured = Graph(stream.captured or []), None
        self.graphs.append(graph)
        return graph

    def _instantiate(self, graph: Graph) -> Graph:
        if not any(g is graph for g in self.graphs):
            raise DeviceFault(cudaError_t.cudaErrorInvalidValue, "cudaGraphInstantiate of a destroyed graph")
        executable = Graph(list(graph.ops))
        self.graph_execs.append(executable)
        return executable

    @staticmethod
    def _destroy(live: list, graph: Graph) -> None:
        index = next((i for i, g in enumerate(live) if g is graph), None)
        if index is None:
            raise DeviceFault(cudaError_t.cudaErrorInvalidValue, "destroying a graph that is not live")
        del live[index]

    # -- the TensorRT stand-in -------------------------------------------------------------------
    def tensorrt(self, module_name: str, version: str, engine_dirs: list[Path]) -> types.ModuleType:
        """A TensorRT module whose Runtime deserializes the rank engines of ``engine_dirs``
        (found by their bytes) into contexts that run the rank's ONNX graph."""
        from simulated_tensorrt import tensorrt_module

        return tensorrt_module(self, module_name, version, engine_dirs)

    def modules(self, engine_dirs: list[Path], flavors: dict[str, str] | None = None) -> dict:
        """What the runtime imports, simulated: module name → module (None: importing it fails, as
        if absent). ``flavors``: module name → version of each TensorRT flavour to offer (default:
        the one each engine dir names, at its version)."""
        import json

        from trtbuild.contract.gpu_targets import MODULES

        if flavors is None:
            flavors = {}
            for path in engine_dirs:
                built = json.loads((Path(path) / "manifest.json").read_text())["tensorrt"]
                flavors[MODULES[built["flavor"]]] = built["version"]
        out = {"cuda.bindings.runtime": self.module()}
        for name in MODULES.values():
            out[name] = self.tensorrt(name, flavors[name], engine_dirs) if name in flavors else None
        return out

    def install(self, monkeypatch, engine_dirs: list[Path], flavors: dict[str, str] | None = None) -> None:
        """Puts the simulation where this process imports from (``modules``), for the test's span."""
        for name, module in self.modules(engine_dirs, flavors).items():
            monkeypatch.setitem(sys.modules, name, module)


# Rank processes that rank 0 starts (runtime/parallel/tensor_parallel.py) are fresh interpreters: with
# tests/simulated_site on PYTHONPATH and this variable set (a JSON list of engine dirs), its
# sitecustomize.py installs a simulated device of their own in each (``install_in_rank_processes``).
RANK_PROCESSES_ENV = "TRTBUILD_SIMULATED_DEVICE_DIRS"
SITE = Path(__file__).resolve().parent / "simulated_site"


def install_in_rank_processes(monkeypatch, engine_dirs: list[Path]) -> None:
    """Every process this test starts simulates a device too, serving ``engine_dirs``."""
    import json
    import os

    monkeypatch.setenv(RANK_PROCESSES_ENV, json.dumps([str(p) for p in engine_dirs]))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(SITE), os.environ.get("PYTHONPATH")])))

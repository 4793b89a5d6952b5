"""Which TensorRT runs an engine dir here: the flavour its manifest names (``tensorrt`` or
``tensorrt_rtx``, one Python API), on a GPU whose compute capability the engines serve.

Modules are looked up through ``importlib`` at call time, so a test can stand in for them
(tests/simulated_device.py) and the flavour choice can be tested with either module absent.
"""
from __future__ import annotations

import importlib
from types import ModuleType

from ....contract.gpu_targets import MODULES, runtime_refusal, sm
from ...engine_dir import EngineDir, EngineDirError


def _module(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(name)
    except Exception:  # absent, or installed without its CUDA libraries (fails on import)
        return None


def installed_flavors(flavors=tuple(MODULES)) -> dict[str, str | None]:
    """Flavour → the version importable here (None: not installed or not loadable)."""
    return {flavor: getattr(_module(MODULES[flavor]), "__version__", None) for flavor in flavors}


def cuda_runtime() -> ModuleType:
    """cuda-python's runtime API (``cuda.bindings.runtime``)."""
    module = _module("cuda.bindings.runtime")
    if module is None:
        raise EngineDirError("cuda-python is not usable here: pip install cuda-python")
    return module


def cuda_check(cudart: ModuleType):
    """A function unwrapping cuda-python's (error, *results) tuples, raising on an error."""
    def ok(result):
        err, *rest = result if isinstance(result, tuple) else (result,)
        if err != cudart.cudaError_t.cudaSuccess:
            raise RuntimeError(f"CUDA error: {cudart.cudaGetErrorString(err)[1].decode()}")
        return rest[0] if len(rest) == 1 else rest
    return ok


def device_free_bytes() -> int:
    """Bytes free on the current GPU now (cudaMemGetInfo): what a share-of-memory KV budget is a
    share of on the TensorRT backend."""
    cudart = cuda_runtime()
    free, _total = cuda_check(cudart)(cudart.cudaMemGetInfo())
    return int(free)


def gpu_compute_capability(device: int = 0) -> str | None:
    """``sm90`` for the visible GPU ``device``; None when no GPU (or no CUDA driver) is visible."""
    cudart = _module("cuda.bindings.runtime")
    if cudart is None:
        return None
    err, count = cudart.cudaGetDeviceCount()
    if err != cudart.cudaError_t.cudaSuccess or count <= device:
        return None
    err, props = cudart.cudaGetDeviceProperties(device)
    return sm(props.major, props.minor) if err == cudart.cudaError_t.cudaSuccess else None


def tensorrt_available(engine_dir: EngineDir | None = None, device: int = 0) -> str | None:
    """None when this machine can run the engine dir's TensorRT engines (without a dir: any
    TensorRT flavour on a GPU), else the reason, naming what to install or rebuild."""
    compute_capability = gpu_compute_capability(device)  # first: importing TensorRT costs more
    if compute_capability is None:
        return "no CUDA GPU is visible"
    if engine_dir is None:
        if any(installed_flavors().values()):
            return None
        return "no TensorRT flavour is installed (pip install tensorrt, or \"trtbuild[rtx]\" for tensorrt-rtx)"
    built = engine_dir.manifest["tensorrt"]
    return runtime_refusal(built, installed_flavors((built["flavor"],)), compute_capability)


def load_flavor(engine_dir: EngineDir, device: int = 0) -> ModuleType:
    """The TensorRT module that runs this dir's engines on GPU ``device``, after the check."""
    reason = tensorrt_available(engine_dir, device)
    if reason is not None:
        raise EngineDirError(f"{engine_dir.path}: {reason}")
    return _module(MODULES[engine_dir.manifest["tensorrt"]["flavor"]])

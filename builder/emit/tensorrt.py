"""Build one rank's TensorRT engine from its ONNX graph, with TensorRT or TensorRT-RTX.

Both flavours share one Python API. TensorRT needs a GPU to build; TensorRT-RTX builds
ahead of time on a machine without one, for the compute capabilities in ``build.targets``
(none: a portable engine). The serialized engine is streamed to disk, not held in memory.
"""
from __future__ import annotations

import importlib
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from ...contract.gpu_targets import MODULES, RTX_TARGETS, built_for, sm, tensorrt_only_refusal
from ...contract.kv_budget import max_pool_blocks
from ...contract.pipeline import HIDDEN_STATES
from ...contract.step import BLOCK_TABLE, KV_SLOTS
from ..errors import SpecError, UserError
from ..progress import ProcessPeak, sample_peak
from ..spec.document import Backend, KVCacheLayout
from ..spec.dtype import DType
from ..spec.model import Spec


@dataclass(frozen=True)
class Flavor:
    name: str          # "tensorrt" | "tensorrt-rtx"
    module: ModuleType
    gpu: str | None = None  # TensorRT: the compute capability of the GPU it builds on (and for)

    @property
    def version(self) -> str:
        return self.module.__version__

    def built_for(self, targets: tuple[str, ...]) -> dict:
        """The manifest's ``tensorrt`` entry: flavour, version and the GPUs the engines serve."""
        return {"flavor": self.name, "version": self.version, **built_for(self.name, targets, self.gpu)}


def _import(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(name)
    except Exception:  # an install without its CUDA libraries fails on import, not just missing
        return None


def _tensorrt_can_build(module: ModuleType) -> bool:
    try:
        return module.Builder(module.Logger(module.Logger.ERROR)) is not None
    except Exception:  # no GPU / driver: TensorRT's builder cannot be created
        return False


def building_gpu(device: int = 0) -> str:
    """Compute capability of the GPU TensorRT builds on (it builds for that GPU only)."""
    from cuda.bindings import runtime as cudart

    err, props = cudart.cudaGetDeviceProperties(device)
    if err != cudart.cudaError_t.cudaSuccess:
        raise UserError(f"cannot read the properties of GPU {device} ({err.name}) that TensorRT builds on")
    return sm(props.major, props.minor)


def resolve_flavor(backend: Backend) -> Flavor:
    """The TensorRT flavour to build with; ``auto`` takes TensorRT when it can build here."""
    if backend in (Backend.auto, Backend.tensorrt):
        trt = _import(MODULES["tensorrt"])
        if trt is not None and _tensorrt_can_build(trt):
            return Flavor("tensorrt", trt, gpu=building_gpu())
        if backend == Backend.tensorrt:
            raise SpecError("build.backend", "tensorrt cannot build here (needs the tensorrt package "
                                             "and a GPU); use tensorrt-rtx or auto")
    rtx = _import(MODULES["tensorrt-rtx"])
    if rtx is None:
        raise SpecError("build.backend", f"{backend.value}: no TensorRT flavour can build here; "
                                         "pip install tensorrt-rtx (builds without a GPU)")
    return Flavor("tensorrt-rtx", rtx)


def flavor_by_name(name: str) -> Flavor:
    """The flavour a parent process resolved, re-imported in a build subprocess."""
    module = _import(MODULES[name])
    if module is None:
        raise UserError(f"{name} cannot be imported in the engine-build process")
    return Flavor(name, module)


def check_targets(spec: Spec, flavor: Flavor) -> None:
    """Refuses targets the resolved flavour cannot serve, before any work."""
    targets = spec.build.targets
    if flavor.name == "tensorrt":
        if targets and flavor.gpu not in targets:
            raise SpecError("build.targets", f"{', '.join(targets)}, but TensorRT builds for the GPU it runs on, "
                                             f"which is {flavor.gpu}; build on a GPU of the target class, or "
                                             "use backend tensorrt-rtx for ahead-of-time targets")
        return
    refusal = tensorrt_only_refusal(targets)
    if refusal is not None:
        raise SpecError("build.targets", f"{refusal} (backend {spec.build.backend.value} resolved to "
                                         "TensorRT-RTX here)")
    bad = [t for t in targets if t not in RTX_TARGETS]
    if bad:
        raise SpecError("build.targets", f"{', '.join(bad)} cannot be targeted by TensorRT-RTX "
                                         f"(valid: {', '.join(RTX_TARGETS)}); build with backend "
                                         "tensorrt on such a GPU")


@dataclass(frozen=True)
class EngineReport:
    path: Path
    bytes: int
    seconds: float
    peak: ProcessPeak  # of the process that built it

    @property
    def peak_rss_bytes(self) -> int:
        return self.peak.peak


def _file_writer(trt, handle):
    """An IStreamWriter (of this flavour) that appends the engine to a file as it is produced."""

    class FileWriter(trt.IStreamWriter):
        def __init__(self):
            trt.IStreamWriter.__init__(self)
            self.written = 0

        def write(self, data) -> int:
            view = memoryview(data)
            handle.write(view)
            self.written += view.nbytes
            return view.nbytes

    return FileWriter()


def optimization_profiles(spec: Spec) -> list[dict[str, tuple[tuple[int, ...], ...]]]:
    """min/opt/max shapes per input: decode (S = 1, or up to a Medusa tree's size, with logits
    at every position) and prefill (S up to max_input_len, logits at the last token); a paged
    engine's pools, block table, kv_slots and mask by _paged_shapes. They name
    every input some rank may have (a pipeline stage reads input_ids or hidden_states, its own
    layers' caches, logits_index on the last stage only); each engine takes those of its graph."""
    arch, b_max, s_max = spec.arch, spec.build.max_batch_size, spec.build.max_seq_len
    chunk = spec.max_step_tokens
    cache = (spec.kv_heads_per_rank, s_max, arch.head_dim)  # each rank's engine holds its KV heads

    def profile(seq: tuple[int, int, int], batch: tuple[int, int, int], rows: tuple[int, int, int]):
        shapes = {
            "input_ids": tuple((b, s) for b, s in zip(batch, seq)),
            "position_ids": tuple((b, s) for b, s in zip(batch, seq)),
            "write_index": tuple((b,) for b in batch),
            "kv_length": tuple((b,) for b in batch),
            "attention_mask": tuple((b, 1, s, s_max) for b, s in zip(batch, seq)),
            "logits_index": tuple((b, r) for b, r in zip(batch, rows)),
            HIDDEN_STATES: tuple((b, s, arch.hidden_size) for b, s in zip(batch, seq)),
        }
        for layer in range(arch.num_layers):
            for kind in ("key", "value"):
                shapes[f"past_{kind}_{layer}"] = tuple((b, *cache) for b in batch)
        if paged:
            shapes.update(_paged_shapes(spec, seq, batch))
        return shapes

    paged = spec.kv_cache_layout == KVCacheLayout.paged
    decode_opt, verify = spec.cuda_graph_batch_sizes[-1], spec.verify_tokens
    return [
        profile(seq=(1, 1, verify), batch=(1, decode_opt, b_max), rows=(1, 1, verify)),
        profile(seq=(1, max(1, chunk // 2), chunk), batch=(1, 1, b_max), rows=(1, 1, chunk)),
    ]


def pool_blocks_range(spec: Spec) -> tuple[int, int, int]:
    """min/opt/max blocks N of a paged engine's pools [N, bs, H_kv, D]: the scratch block and one,
    every row's whole context plus the scratch (capped), the most a pool holds under TensorRT's
    Scatter volume limit."""
    bs = spec.runtime.kv_block_size
    most = max_pool_blocks(bs, spec.kv_heads_per_rank, spec.arch.head_dim)
    whole = spec.build.max_batch_size * (spec.build.max_seq_len // bs) + 1
    return 2, max(2, min(whole, most)), max(2, most)


def _paged_shapes(spec: Spec, seq: tuple[int, int, int], batch: tuple[int, int, int]) -> dict:
    """A paged engine's inputs (contract/step.py PAGED_INPUTS) over a profile's S and B ranges: the
    block table's width M from one block to max_seq_len's (half of it at opt), the mask over M·bs
    positions, the pools over pool_blocks_range."""
    bs = spec.runtime.kv_block_size
    widest = spec.build.max_seq_len // bs
    width = (1, max(1, widest // 2), widest)
    pool = tuple((n, bs, spec.kv_heads_per_rank, spec.arch.head_dim) for n in pool_blocks_range(spec))
    shapes: dict[str, tuple[tuple[int, ...], ...]] = {
        BLOCK_TABLE: tuple((b, m) for b, m in zip(batch, width)),
        KV_SLOTS: tuple((b, s, 2) for b, s in zip(batch, seq)),
        "attention_mask": tuple((b, 1, s, m * bs) for b, s, m in zip(batch, seq, width)),
    }
    for layer in range(spec.arch.num_layers):
        for kind in ("key", "value"):
            shapes[f"past_{kind}_{layer}"] = pool
    return shapes


def build_engine(onnx_path: Path, engine_path: Path, spec: Spec, flavor: Flavor) -> EngineReport:
    with sample_peak(f"engine {engine_path.stem}") as sampler:
        path, written, seconds = _build(onnx_path, engine_path, spec, flavor)
    return EngineReport(path=path, bytes=written, seconds=seconds, peak=sampler.result())


def _build(onnx_path: Path, engine_path: Path, spec: Spec, flavor: Flavor) -> tuple[Path, int, float]:
    trt = flavor.module
    start = time.perf_counter()
    logger = trt.Logger(trt.Logger.ERROR)
    builder = trt.Builder(logger)
    flags = 0 if flavor.name == "tensorrt-rtx" else 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise UserError(f"{onnx_path}: TensorRT {flavor.version} cannot parse the graph: {errors}")
    if spec.model.dtype == DType.float32:
        _make_attention_decomposable(network, trt)
    config = builder.create_builder_config()
    config.builder_optimization_level = spec.build.builder_optimization_level
    inputs = {network.get_input(i).name for i in range(network.num_inputs)}
    for shapes in optimization_profiles(spec):
        profile = builder.create_optimization_profile()
        for name, (lo, opt, hi) in shapes.items():
            if name in inputs:  # this rank's stage has it
                profile.set_shape(name, lo, opt, hi)
        config.add_optimization_profile(profile)
    if flavor.name == "tensorrt-rtx":
        _set_rtx_targets(config, spec, trt)
    engine_path.parent.mkdir(parents=True, exist_ok=True)
    with open(engine_path, "wb") as handle:
        writer = _file_writer(trt, handle)
        ok = builder.build_serialized_network_to_stream(network, config, writer)
    if not ok or writer.written == 0:
        engine_path.unlink(missing_ok=True)
        raise UserError(f"{onnx_path}: TensorRT {flavor.version} failed to build the engine "
                        f"(targets: {', '.join(spec.build.targets) or 'portable'})")
    return engine_path, writer.written, time.perf_counter() - start


def build_engine_job(job: tuple[Path, Path, Spec, str]) -> EngineReport:
    """``build_engine`` in a build subprocess: this module imports no torch, so the child stays lean."""
    onnx_path, engine_path, spec, flavor_name = job
    return build_engine(onnx_path, engine_path, spec, flavor_by_name(flavor_name))


def _make_attention_decomposable(network, trt) -> None:
    """FP32 attention has no fused kernel: allow TensorRT to decompose it (seen needed with RTX 1.7)."""
    for index in range(network.num_layers):
        layer = network.get_layer(index)
        if layer.type == trt.LayerType.ATTENTION_OUTPUT:
            layer.__class__ = trt.IAttentionOutputLayer
            layer.attention.decomposable = True


def _set_rtx_targets(config, spec: Spec, trt) -> None:
    targets = spec.build.targets
    if not targets:
        return  # portable engine: every compute capability RTX supports
    config.num_compute_capabilities = len(targets)
    for index, target in enumerate(targets):
        config.set_compute_capability(getattr(trt.ComputeCapability, target.upper()), index)

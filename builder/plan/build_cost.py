"""The build side of a plan: the memory each process of a build needs, the engine dir's disk and
the build's time, from the model's weight bytes alone (builder/plan/model_size.py gives those).

The arithmetic is the one the build itself refuses by (build.py: a rank engine that cannot fit
this machine's RAM stops the build before any work):
- stages before the engines (export, passes, rank ONNX): the weights stream one tensor at a
  time, so ≤ 0.25 × the model's weight bytes + 1.5 GiB (issue 26's target; the numerics check
  of a large model holds the embedding, lm_head and two decoder layers);
- each rank's engine build: ≈ 0.2 GB + 2 × that rank's weight bytes (TensorRT-RTX 1.7 measured,
  DESIGN.md "Scale"); the ranks build one process at a time by default;
- the engine dir: each rank's engine (≈ its weights) plus its CPU graph's data file (its
  weights again) unless the spec leaves the CPU graphs out (build.cpu_graphs: false);
- time: seconds per billion parameters per stage, measured by benchmarks/build_scale.py on a
  2-core machine (the Llama-3.2-1B row; see the README's "Scale" section).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from ...contract.draft_head import WEIGHTS_FILE as DRAFT_WEIGHTS_FILE
from ...contract.paths import path_inside
from ...contract.processes import meminfo
from .model_size import QUANTIZATION_PRECISION, param_counts, weight_bytes

GIB = 2**30
STAGE_BASE_BYTES = 1.5 * GIB
STAGE_PER_WEIGHT_BYTE = 0.25
ENGINE_BASE_BYTES = 0.2e9
ENGINE_PER_WEIGHT_BYTE = 2.0
# benchmarks/build_scale.py --only 1b on 2 shared cores (1.24 B parameters: export 219 s, numerics
# check + passes + rank ONNX 45 s, engine 89 s): seconds per 1e9 parameters
SECONDS_PER_GPARAM = {"export": 177.0, "passes": 36.0, "engines": 72.0}


@dataclass(frozen=True)
class BuildPlan:
    parameters: int
    model_bytes: float       # all ranks' weights
    tp: int
    cpu_graphs: bool
    export_bytes: float      # the weights in the build's float dtype: the export's data file on disk
    draft_bytes: float = 0.0  # a draft head's weights (draft.onnx.data), beside the ranks'

    @property
    def rank_bytes(self) -> float:
        return self.model_bytes / self.tp

    @property
    def stages_peak_bytes(self) -> float:
        """Peak of every process before the engine builds."""
        return STAGE_PER_WEIGHT_BYTE * self.model_bytes + STAGE_BASE_BYTES

    @property
    def engine_peak_bytes(self) -> float:
        """Peak of one rank's engine-build process."""
        return engine_build_bytes(self.rank_bytes)

    @property
    def per_process_peak_bytes(self) -> float:
        return max(self.stages_peak_bytes, self.engine_peak_bytes)

    @property
    def dir_bytes(self) -> float:
        return self.model_bytes * (2 if self.cpu_graphs else 1) + self.draft_bytes

    @property
    def disk_peak_bytes(self) -> float:
        """Free disk the build needs at its peak: while the rank graphs are written, the export's
        data file and every rank's data (a quantized one at TP > 1 also holds the codes once more
        before they are sliced), then the engine dir with the engines; plus 1 GiB of slack."""
        quantized_copy = self.model_bytes if self.model_bytes < self.export_bytes and self.tp > 1 else 0
        return max(self.export_bytes + self.model_bytes + quantized_copy, self.dir_bytes) + GIB

    @property
    def seconds(self) -> dict[str, float]:
        scale = self.parameters / 1e9
        return {stage: rate * scale for stage, rate in SECONDS_PER_GPARAM.items()}

    def as_dict(self) -> dict:
        return {**asdict(self), "rank_bytes": round(self.rank_bytes),
                "stages_peak_bytes": round(self.stages_peak_bytes), "engine_peak_bytes": round(self.engine_peak_bytes),
                "per_process_peak_bytes": round(self.per_process_peak_bytes), "dir_bytes": round(self.dir_bytes),
                "disk_peak_bytes": round(self.disk_peak_bytes),
                "seconds": {k: round(v) for k, v in self.seconds.items()}}


def engine_build_bytes(rank_weight_bytes: float) -> float:
    return ENGINE_BASE_BYTES + ENGINE_PER_WEIGHT_BYTE * rank_weight_bytes


def machine_ram_bytes() -> int:
    return meminfo()["MemTotal"]


def memory_refusal(plan: BuildPlan, ram_bytes: int, valid_tps: list[int]) -> str | None:
    """One line saying a rank's engine cannot build in ``ram_bytes`` and what to do (the smallest
    of ``valid_tps`` whose ranks fit), or None."""
    need = plan.engine_peak_bytes
    if need <= ram_bytes:
        return None
    fits = next((tp for tp in valid_tps if tp > plan.tp and engine_build_bytes(plan.model_bytes / tp) <= ram_bytes),
                None)
    larger = f"parallel.tensor: {fits}" if fits else "a larger parallel.tensor"
    return (f"a rank's engine build needs ≈ {need / GIB:.1f} GiB of RAM (0.2 GB + 2 × its {plan.rank_bytes / GIB:.1f} GiB "
            f"of weights) and this machine has {ram_bytes / GIB:.1f} GiB; use {larger}, or parallel.pipeline stages "
            "(≈ 1/P of the weights each), or quantization.mode: int4_weight_only, or build on a larger machine "
            "(--ignore-memory-check to try anyway)")


def disk_refusal(plan: BuildPlan, free_bytes: int, where) -> str | None:
    """One line saying the build would run out of disk in ``where``, or None."""
    if plan.disk_peak_bytes <= free_bytes:
        return None
    return (f"{where}: the build needs ≈ {plan.disk_peak_bytes / GIB:.1f} GiB of free disk at its peak (the export's "
            f"{plan.export_bytes / GIB:.1f} GiB of weights, then each rank's data and engine) and "
            f"{free_bytes / GIB:.1f} GiB is free; free some, or build with -o on a larger disk "
            "(--ignore-memory-check to try anyway)")


def spec_build_plan(spec) -> BuildPlan:
    """The build plan of a validated spec: its precision (quantization, else dtype) and its ranks
    (T × P: a pipeline stage holds ≈ 1/P of the weights, by layer count)."""
    precision = QUANTIZATION_PRECISION.get(spec.quantization.mode) or \
        spec.model.dtype.short
    counts = param_counts(spec.arch)
    dtype = spec.model.dtype.short
    return BuildPlan(parameters=counts.total, model_bytes=weight_bytes(counts, precision), tp=spec.world_size,
                     cpu_graphs=spec.build.cpu_graphs, export_bytes=weight_bytes(counts, dtype),
                     draft_bytes=draft_head_bytes(spec))


def draft_head_bytes(spec) -> int:
    """What the spec's draft head adds to the engine dir: its weights in float32, as the draft dir
    holds them (the embedding is the target's), so the draft dir's weights file bounds them; 0
    without a draft head, or while its file is missing (the build refuses that itself)."""
    if spec is None or spec.draft_head is None:
        return 0
    weights = path_inside(spec.draft_head.path, DRAFT_WEIGHTS_FILE)
    return weights.stat().st_size if weights is not None and weights.is_file() else 0

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
- Medusa heads (builder/passes/attach_medusa.py): constants of the last stage's rank graphs, so
  in those ranks' data files and engines, in the build's float dtype (never quantized);
- time: seconds per billion parameters per stage, measured by benchmarks/build_scale.py on a
  2-core machine (the Llama-3.2-1B row; see the README's "Scale" section).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from ...contract.draft_head import WEIGHTS_FILE as DRAFT_WEIGHTS_FILE
from ...contract.paths import path_inside
from ...contract.json_file import read_json_object
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
    medusa_bytes: float = 0.0  # the Medusa heads' constants, all ranks together (medusa_heads_bytes)
    medusa_ranks: int = 1      # the ranks that hold them: the last pipeline stage's tensor ranks

    @property
    def rank_bytes(self) -> float:
        return self.model_bytes / self.tp

    @property
    def stages_peak_bytes(self) -> float:
        """Peak of every process before the engine builds."""
        return STAGE_PER_WEIGHT_BYTE * self.model_bytes + STAGE_BASE_BYTES

    @property
    def engine_peak_bytes(self) -> float:
        """Peak of one rank's engine-build process: the heaviest rank's, a last-stage one with Medusa."""
        return engine_build_bytes(self.rank_bytes + self.medusa_bytes / self.medusa_ranks)

    @property
    def per_process_peak_bytes(self) -> float:
        return max(self.stages_peak_bytes, self.engine_peak_bytes)

    @property
    def dir_bytes(self) -> float:
        return (self.model_bytes + self.medusa_bytes) * (2 if self.cpu_graphs else 1) + self.draft_bytes

    @property
    def disk_peak_bytes(self) -> float:
        """Free disk the build needs at its peak: while the rank graphs are written, the export's
        data file and every rank's data (a quantized one at TP > 1 also holds the codes once more
        before they are sliced), then the engine dir with the engines; plus 1 GiB of slack."""
        quantized_copy = self.model_bytes if self.model_bytes < self.export_bytes and self.tp > 1 else 0
        ranks = self.model_bytes + self.medusa_bytes
        return max(self.export_bytes + ranks + quantized_copy, self.dir_bytes) + GIB

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
    # At T tensor ranks each holds 1/T of the weights and of every Medusa head (the last stage's).
    heads_share = plan.medusa_bytes / plan.medusa_ranks * plan.tp
    fits = next((tp for tp in valid_tps if tp > plan.tp
                 and engine_build_bytes((plan.model_bytes + heads_share) / tp) <= ram_bytes), None)
    larger = f"parallel.tensor: {fits}" if fits else "a larger parallel.tensor"
    heads = (f" and {plan.medusa_bytes / plan.medusa_ranks / GIB:.1f} GiB of Medusa heads"
             if plan.medusa_bytes else "")
    return (f"a rank's engine build needs ≈ {need / GIB:.1f} GiB of RAM (0.2 GB + 2 × its {plan.rank_bytes / GIB:.1f} GiB "
            f"of weights{heads}) and this machine has {ram_bytes / GIB:.1f} GiB; use {larger}, or parallel.pipeline stages "
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
                     draft_bytes=draft_head_bytes(spec), medusa_bytes=spec_medusa_bytes(spec),
                     medusa_ranks=spec.parallel.tensor)


def draft_head_bytes(spec) -> int:
    """What the spec's draft head adds to the engine dir: its weights in float32, as the draft dir
    holds them (the embedding is the target's), so the draft dir's weights file bounds them; 0
    without a draft head, or while its file is missing (the build refuses that itself)."""
    if spec is None or spec.draft_head is None:
        return 0
    weights = path_inside(spec.draft_head.path, DRAFT_WEIGHTS_FILE)
    return weights.stat().st_size if weights is not None and weights.is_file() else 0


def medusa_heads_bytes(num_heads: int, num_layers: int, hidden: int, vocab: int, tensor_ranks: int,
                       element_bytes: int, shares_lm_head: bool) -> int:
    """The Medusa heads' constants the rank graphs hold, all ranks together: each of the last
    stage's ``tensor_ranks`` holds every head's residual blocks ([D, D] + [D] each) and its
    vocabulary slice of every head's projection [V', D], so the slices add up to one copy; heads
    that share the LM head's weight (attach_medusa's _shared_lm_head) write no projection."""
    blocks = tensor_ranks * num_heads * num_layers * (hidden * hidden + hidden)
    projections = 0 if shares_lm_head else num_heads * vocab * hidden
    return (blocks + projections) * element_bytes


def spec_medusa_bytes(spec) -> int:
    """``medusa_heads_bytes`` of the spec's heads in its float dtype; 0 without Medusa."""
    if spec is None or spec.medusa is None:
        return 0
    return medusa_heads_bytes(spec.medusa.num_heads, spec.medusa.num_layers, spec.arch.hidden_size,
                              spec.arch.vocab_size, spec.parallel.tensor, spec.model.dtype.numpy.itemsize,
                              medusa_shares_lm_head(spec))


def medusa_shares_lm_head(spec) -> bool:
    """Whether the spec's Medusa heads share the LM head's weight: where `trtbuild medusa train
    --freeze-out` left their projections the LM head's own (the heads dir's config.json says
    ``"trtbuild": {"train_out": false}``) and no quantization rewrote the LM head. Heads from
    elsewhere count as not sharing: the estimate then bounds the build from above."""
    from ..medusa.heads import CONFIG_FILE  # the heads' modules (torch) load only for Medusa specs

    config = path_inside(spec.medusa.heads, CONFIG_FILE)
    recorded = read_json_object(config).get("trtbuild", {}) if config is not None and config.is_file() else {}
    return isinstance(recorded, dict) and recorded.get("train_out") is False and not spec.quantization.bits

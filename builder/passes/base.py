"""Pass conventions: a pass is a function ``(graph, ctx) -> PassResult``.

The pipeline splits once, 1 → N: passes before the first ``per_rank`` pass see the whole
model once (``ctx.rank`` None); from there every pass runs on each rank's graph. The ``cpu``
passes come last: each CPU graph's passes run on a copy of each finished rank graph (what
TensorRT compiles, ``rankN.onnx``) and make a graph ONNX Runtime runs (``rankN.cpu.onnx``): the
decode graph, and with Medusa heads the verification graph.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import onnx_graphsurgeon as gs

from ..errors import UserError
from ..frontend.checkpoint import ArchConfig

if TYPE_CHECKING:  # the pass registry reads a Spec, it does not import one (spec.py validates pass names against it)
    from ..spec.model import Spec

METADATA = "trtbuild_metadata"  # gs.Graph attribute: what passes record in the model's metadata_props


class CpuGraph(Enum):
    """The graphs the CPU stage makes, each from a copy of the finished rank graph, for the steps
    ONNX Runtime runs faster on them than on the rank graph (builder/emit/cpu_step_model.py)."""

    decode = "decode"  # plain decode steps: one token a row, any batch
    # Verifications of up to VERIFY_ROWS rows' drafts (chains or trees), the rows folded into
    # GroupQueryAttention's heads (ONNX Runtime 1.32's CPU kernel refuses S > 1 new tokens after a
    # cached past for more than one row): builder/passes/cpu_group_query_attention.py.
    verify = "verify"


@dataclass(frozen=True)
class PassContext:
    """What a pass may read: the read-only spec and which rank's graph it is working on."""

    spec: Spec | None
    rank: int | None = None           # None before the split: the graph of the whole model
    world_size: int = 1               # ranks: tensor_size × pipeline stages
    tensor_size: int = 1              # T: tensor-parallel ranks in each pipeline stage
    stages: tuple[range, ...] = ()    # each pipeline stage's decoder layers; (): one stage of every layer
    arch: ArchConfig | None = None    # None for hand-built graphs: no expected match counts
    quantized: dict | None = None     # layer name → QuantizedLinear, when the spec quantizes
    quant_report: dict | None = None  # layer name → weight/output errors measured on the checkpoint
    weights_dir: Path | None = None   # where external weight files live; per-rank passes write theirs here
    cpu_graphs: frozenset[CpuGraph] = frozenset()  # the CPU graphs made (cpu_graphs_made); hand-built contexts say so

    def __post_init__(self):
        if self.world_size != self.tensor_size * self.pipeline:
            raise ValueError(f"PassContext: world_size {self.world_size} is not tensor_size {self.tensor_size} × "
                             f"{self.pipeline} pipeline stage(s)")

    @classmethod
    def for_spec(cls, spec: Spec, quantized: dict | None = None, quant_report: dict | None = None,
                 weights_dir: Path | None = None) -> "PassContext":
        return cls(spec=spec, world_size=spec.world_size, tensor_size=spec.parallel.tensor, stages=spec.stages,
                   arch=spec.arch, quantized=quantized, quant_report=quant_report, weights_dir=weights_dir,
                   cpu_graphs=cpu_graphs_made(spec))

    def for_rank(self, rank: int) -> "PassContext":
        return replace(self, rank=rank)

    @property
    def pipeline(self) -> int:
        return max(1, len(self.stages))

    @property
    def stage(self) -> int | None:
        """The pipeline stage of this rank (rank = stage · tensor_size + tensor rank); None before the split."""
        return None if self.rank is None else self.rank // self.tensor_size

    @property
    def tensor_rank(self) -> int:
        """This rank's place among its stage's tensor-parallel ranks (0 before the split)."""
        return 0 if self.rank is None else self.rank % self.tensor_size

    @property
    def layers(self) -> range:
        """The decoder layers this graph holds: its stage's, or every layer before the split."""
        if self.stage is not None and self.stages:
            return self.stages[self.stage]
        return range(self.arch.num_layers if self.arch is not None else 0)

    @property
    def first_stage(self) -> bool:
        """Holds the embedding (reads input_ids): stage 0, or the graph before the split."""
        return self.stage in (None, 0)

    @property
    def last_stage(self) -> bool:
        """Holds the final norm and the heads (writes logits)."""
        return self.stage is None or self.stage == self.pipeline - 1


@dataclass
class PassResult:
    graph: gs.Graph
    modified: bool
    stats: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Pass:
    name: str
    run: Callable[[gs.Graph, PassContext], PassResult]
    requires: tuple[str, ...] = ()  # passes that must be enabled and run earlier
    per_rank: bool = False          # runs on each rank's graph (the first such pass is the 1 → N split)
    cpu: CpuGraph | None = None     # the CPU graph it makes (per rank, after every other pass)
    # A pass whose output the engine contract depends on once this other pass runs (heads_at_path_end:
    # medusa_logits [B, 1, K, V] once attach_medusa adds the heads): disabled alone, it is refused.
    runs_with: str | None = None


class PassError(UserError):
    """A pass failed; the message names it and the passes that ran before it."""


def after(ran: list[str]) -> str:
    """The tail of a pass error: which passes ran before the failing one."""
    return f" (after {', '.join(ran)})" if ran else " (it ran first)"


def cpu_stage_skipped(spec: Spec) -> str | None:
    """Why the CPU stage makes no decode graph for this spec, or None when it does. The CPU
    runtime runs float32/float16 rank graphs; tensor-parallel ranks run the rank graph in
    segments between collectives; ONNX Runtime has no FP4 kernels (the runtime simulates the
    rank graph's); GroupQueryAttention has no place for Qwen3's per-head q/k norms."""
    if spec.parallel.tensor > 1:
        return "tensor-parallel ranks run their rank graph in segments"
    if spec.parallel.pipeline > 1:
        return "pipeline stages run their rank graph"
    if spec.model.dtype.value not in ("float32", "float16"):
        return f"ONNX Runtime's CPU kernels do not run {spec.model.dtype.value}"
    if spec.quantization.mode == "nvfp4":
        return "ONNX Runtime has no FP4 kernels"
    if spec.arch.qk_norm:
        return "GroupQueryAttention has no place for per-head q/k norms"
    return None


def cpu_graphs_made(spec: Spec) -> frozenset[CpuGraph]:
    """The CPU graphs a build of ``spec`` makes: none where the stage is skipped, the verification
    graph where any draft source (Medusa heads, prompt lookup, suffix) proposes guesses to verify."""
    if cpu_stage_skipped(spec) is not None:
        return frozenset()
    return frozenset({CpuGraph.decode, *((CpuGraph.verify,) if spec.speculation is not None else ())})


def record_metadata(graph: gs.Graph, key: str, value) -> None:
    """A decision a pass records in the graph itself; it becomes model metadata (JSON) that the
    emitter reads into the manifest."""
    # vars(): gs.Graph resolves unknown attributes as registered functions, with an error log.
    vars(graph).setdefault(METADATA, {})[key] = json.dumps(value)


def graph_metadata(graph: gs.Graph) -> dict[str, str]:
    return dict(vars(graph).get(METADATA, {}))


def copy_metadata(source: gs.Graph, target: gs.Graph) -> gs.Graph:
    """``target`` with ``source``'s recorded metadata (``gs.Graph.copy()`` and re-imports drop it)."""
    vars(target)[METADATA] = graph_metadata(source)
    return target


def copy_graph(graph: gs.Graph) -> gs.Graph:
    """A deep copy of ``graph``, the metadata passes recorded in it included."""
    return copy_metadata(graph, graph.copy())

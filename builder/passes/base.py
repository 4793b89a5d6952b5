"""Pass conventions: a pass is a function ``(graph, ctx) -> PassResult``.

The pipeline splits once, 1 → N: passes before the first ``per_rank`` pass see the whole
model once (``ctx.rank`` None); from there every pass runs on each rank's graph.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import onnx_graphsurgeon as gs

from ..errors import UserError
from ..frontend.checkpoint import ArchConfig
from ..spec import Spec

METADATA = "trtbuild_metadata"  # gs.Graph attribute: what passes record in the model's metadata_props


@dataclass(frozen=True)
class PassContext:
    """What a pass may read: the read-only spec and which rank's graph it is working on."""

    spec: Spec | None
    rank: int | None = None           # None before the split: the graph of the whole model
    world_size: int = 1
    arch: ArchConfig | None = None    # None for hand-built graphs: no expected match counts
    quantized: dict | None = None     # layer name → QuantizedLinear, when the spec quantizes
    quant_report: dict | None = None  # layer name → weight/output errors measured on the checkpoint
    weights_dir: Path | None = None   # where external weight files live; per-rank passes write theirs here

    @classmethod
    def for_spec(cls, spec: Spec, quantized: dict | None = None, quant_report: dict | None = None,
                 weights_dir: Path | None = None) -> "PassContext":
        return cls(spec=spec, world_size=spec.world_size, arch=spec.arch, quantized=quantized,
                   quant_report=quant_report, weights_dir=weights_dir)

    def for_rank(self, rank: int) -> "PassContext":
        return replace(self, rank=rank)


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


class PassError(UserError):
    """A pass failed; the message names it and the passes that ran before it."""


def after(ran: list[str]) -> str:
    """The tail of a pass error: which passes ran before the failing one."""
    return f" (after {', '.join(ran)})" if ran else " (it ran first)"


def record_metadata(graph: gs.Graph, key: str, value) -> None:
    """A decision a pass records in the graph itself; it becomes model metadata (JSON) that the
    emitter reads into the manifest."""
    # vars(): gs.Graph resolves unknown attributes as registered functions, with an error log.
    vars(graph).setdefault(METADATA, {})[key] = json.dumps(value)


def graph_metadata(graph: gs.Graph) -> dict[str, str]:
    return dict(vars(graph).get(METADATA, {}))

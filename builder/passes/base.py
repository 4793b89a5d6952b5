"""Pass conventions: a pass is a function ``(graph, ctx) -> PassResult``."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import onnx_graphsurgeon as gs

from ..errors import UserError
from ..frontend.checkpoint import ArchConfig
from ..spec import Spec


@dataclass(frozen=True)
class PassContext:
    """What a pass may read: the read-only spec, this rank, and a seeded RNG."""

    spec: Spec | None
    rank: int
    rng: np.random.Generator
    arch: ArchConfig | None = None  # None for hand-built graphs: no expected match counts
    quantized: dict | None = None     # layer name → QuantizedLinear, when the spec quantizes
    quant_report: dict | None = None  # layer name → weight/output errors measured on the checkpoint

    @classmethod
    def for_spec(cls, spec: Spec, rank: int, quantized: dict | None = None,
                 quant_report: dict | None = None) -> "PassContext":
        return cls(spec=spec, rank=rank, rng=np.random.default_rng(rank), arch=spec.arch,
                   quantized=quantized, quant_report=quant_report)


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
    description: str = ""
    quantizes: bool = False         # from here on, numerics compare against the quantized torch model


class PassError(UserError):
    """A pass failed; the message names it and the passes that ran before it."""

"""PassManager: runs the pipeline for one rank with instrumentation around every pass.

Instrumentation lives here, not in passes: timing, op histograms, node provenance
(``created_by``), the numerics check, ``--dump-after`` and ``--disable-pass``.
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import onnx
import onnx_graphsurgeon as gs

from .. import numerics
from ...plugins import fp4
from ..emit.rank_onnx import save_graph
from ..errors import UserError
from .base import Pass, PassContext, PassError, PassResult


@dataclass
class RunResult:
    graph: gs.Graph
    results: dict[str, PassResult]
    provenance: dict[str, str]                    # node name → pass that created it
    records: list[dict] = field(default_factory=list)


class NumericsGate:
    """Runs each pass's output and compares with the previous graph and with torch eager."""

    def __init__(self, inputs: dict, torch_reference: dict, atol: float, rtol: float, workdir: Path | None = None,
                 quantized_reference: dict | None = None, quantized_rtol: float | None = None):
        """``workdir`` holds the export's weight file when the graph's weights are external;
        ``quantized_reference`` is torch eager with the dequantized weights, the reference once
        a pass has quantized (quantization error is measured, not a pass's mistake)."""
        self.inputs, self.reference, self.atol, self.rtol = inputs, torch_reference, atol, rtol
        self.workdir, self.quantized_reference = workdir, quantized_reference
        self.quantized_rtol = quantized_rtol or rtol
        self.previous: dict | None = None  # outputs of the graph before the current pass

    def __call__(self, graph: gs.Graph, pass_name: str, ran_before: list[str], quantized: bool = False) -> dict:
        model = gs.export_onnx(graph)
        if fp4.has_fp4(model):  # ONNX Runtime has no FP4 kernels: fold to float weights (simulated)
            model = fp4.simulate(model)
        if self.workdir is not None:  # external weights resolve relative to the model file
            path = self.workdir / "numerics.onnx"
            onnx.save_model(model, path)
            model = path
        outputs = numerics.run_onnx(model, self.inputs)
        reference = self.quantized_reference if quantized and self.quantized_reference else self.reference
        vs_torch = numerics.compare(outputs, reference)
        vs_previous = numerics.compare(outputs, self.previous) if self.previous is not None else None
        self.previous = outputs
        record = {"vs_torch": numerics.worst(vs_torch)}
        if quantized and self.quantized_reference:
            record["vs_torch_float"] = numerics.worst(numerics.compare(outputs, self.reference))
        if vs_previous is not None:
            record["vs_previous"] = numerics.worst(vs_previous)
        rtol = self.quantized_rtol if quantized and self.quantized_reference else self.rtol
        bad = {name: s for name, s in vs_torch.items() if not s.within(self.atol, rtol)}
        record["ok"] = not bad
        if bad:
            name, stat = max(bad.items(), key=lambda kv: kv[1].max_abs)
            raise PassError(f"pass {pass_name} broke numerics: {name} max_abs {stat.max_abs:.3g} "
                            f"(max_rel {stat.max_rel:.3g}) vs torch exceeds atol {self.atol} / rtol "
                            f"{rtol}{_after(ran_before)}")
        return record


class PassManager:
    def __init__(self, passes: tuple[Pass, ...], disabled: frozenset[str] = frozenset(),
                 dump_after: frozenset[str] = frozenset(), dump_dir: Path | None = None,
                 numerics: NumericsGate | None = None, weights: Path | None = None,
                 on_record: Callable[[dict], None] = lambda record: None):
        known = {p.name for p in passes}
        for name in (*disabled, *dump_after):
            if name not in known and name != "all":
                raise UserError(f"unknown pass {name!r}; passes: {', '.join(p.name for p in passes)}")
        self.passes, self.disabled, self.dump_after = passes, disabled, dump_after
        self.dump_dir, self.numerics, self.on_record = dump_dir, numerics, on_record
        self.weights = weights  # the export's external weight file, for dumps
        self.check_order()

    @property
    def enabled(self) -> list[Pass]:
        return [p for p in self.passes if p.name not in self.disabled]

    def check_order(self) -> None:
        """Every pass's requirements must be enabled and come before it; checked before any runs."""
        seen: set[str] = set()
        for p in self.enabled:
            for need in p.requires:
                if need in self.disabled:
                    raise PassError(f"pass {p.name} requires {need}, which is disabled; "
                                    f"also disable {p.name} or enable {need}")
                if need not in seen:
                    raise PassError(f"pass {p.name} requires {need} to run before it")
            seen.add(p.name)

    def run(self, graph: gs.Graph, ctx: PassContext) -> RunResult:
        provenance = {node.name: "export" for node in graph.nodes}
        results: dict[str, PassResult] = {}
        records: list[dict] = []
        ran: list[str] = []
        quantized = False
        for index, p in enumerate(self.enabled, start=1):
            quantized = quantized or p.quantizes
            before = _histogram(graph)
            start = time.perf_counter()
            try:
                result = p.run(graph, ctx)
            except PassError as exc:
                raise PassError(f"{exc}{_after(ran)}") from None
            except UserError:
                raise
            except Exception as exc:  # a bug in a pass: say which, keep the cause chained
                raise PassError(f"pass {p.name} failed on rank {ctx.rank}: {type(exc).__name__}: {exc}"
                                f"{_after(ran)}") from exc
            ms = (time.perf_counter() - start) * 1000
            graph = result.graph
            for node in graph.nodes:
                provenance.setdefault(node.name, p.name)
            record = {"pass": p.name, "rank": ctx.rank, "ms": round(ms, 2), "modified": result.modified,
                      "ops_before": before, "ops_after": _histogram(graph),
                      "nodes_before": sum(before.values()), "nodes_after": len(graph.nodes), **result.stats}
            if self.numerics is not None and (result.modified or index == 1):
                record["numerics"] = self.numerics(graph, p.name, ran, quantized)
            if self.dump_dir is not None and (p.name in self.dump_after or "all" in self.dump_after):
                path = self.dump_dir / f"rank{ctx.rank}" / f"{index:03d}_{p.name}.onnx"
                save_graph(to_onnx(graph, provenance), path, self.weights)
                record["dump"] = str(path.relative_to(self.dump_dir.parent))
            results[p.name] = result
            records.append(record)
            self.on_record(record)
            ran.append(p.name)
        return RunResult(graph=graph, results=results, provenance=provenance, records=records)


def to_onnx(graph: gs.Graph, provenance: dict[str, str]) -> onnx.ModelProto:
    """The graph as a model proto, each node's metadata recording the pass that created it."""
    model = gs.export_onnx(graph)
    for node in model.graph.node:
        entry = node.metadata_props.add()
        entry.key, entry.value = "created_by", provenance.get(node.name, "unknown")
    return model


def _histogram(graph: gs.Graph) -> dict[str, int]:
    return dict(sorted(Counter(node.op for node in graph.nodes).items()))


def _after(ran: list[str]) -> str:
    return f" (after {', '.join(ran)})" if ran else " (it ran first)"

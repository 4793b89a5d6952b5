"""Instruments around every pass (the TVM style): op counts, timing, provenance, dumps.

The manager calls ``before``/``after`` around a pass on one rank's graph and ``after_all``
once every rank has run it; an instrument adds its fields to that rank's pass-log record.
Passes know nothing of them. The numerics check is one more instrument (numerics_gate.py).
"""
from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import onnx
import onnx_graphsurgeon as gs

from ..emit.rank_onnx import save_graph
from .base import CpuGraph, Pass, PassResult, graph_metadata


class Instrument:
    def before(self, p: Pass, rank: int | None, graph: gs.Graph) -> None: ...

    def after(self, p: Pass, rank: int | None, graph: gs.Graph, result: PassResult, record: dict) -> None: ...

    def after_all(self, p: Pass, graphs: list[gs.Graph], results: list[PassResult], records: list[dict],
                  ran: list[str]) -> None: ...

    def split(self, world_size: int) -> None:
        """The pipeline has just turned one graph into ``world_size`` rank graphs."""

    def start_cpu_stage(self, rank_graphs: list[gs.Graph], cpu_graph: CpuGraph) -> None:
        """The rank graphs are final; the passes from here on make ``cpu_graph`` from copies of them."""


class OpCounts(Instrument):
    def before(self, p, rank, graph):
        self._before = histogram(graph)

    def after(self, p, rank, graph, result, record):
        record.update(ops_before=self._before, ops_after=histogram(result.graph),
                      nodes_before=sum(self._before.values()), nodes_after=len(result.graph.nodes))


class Timing(Instrument):
    def before(self, p, rank, graph):
        self._start = time.perf_counter()

    def after(self, p, rank, graph, result, record):
        record["ms"] = round((time.perf_counter() - self._start) * 1000, 2)


class Provenance(Instrument):
    """Which pass created each node (``created_by`` in the node's metadata), per rank."""

    def __init__(self):
        self.by_rank: list[dict[str, str]] = [{}]

    def split(self, world_size):
        self.by_rank = [dict(self.by_rank[0]) for _ in range(world_size)]

    def of(self, rank: int | None) -> dict[str, str]:
        return self.by_rank[rank or 0]

    def before(self, p, rank, graph):
        names = self.of(rank)
        if not names:
            names.update((node.name, "export") for node in graph.nodes)

    def after(self, p, rank, graph, result, record):
        names = self.of(rank)
        for node in result.graph.nodes:
            names.setdefault(node.name, p.name)


class Dump(Instrument):
    """``--dump-after PASS`` (or ``all``): the graph after that pass, per rank, weights beside it."""

    def __init__(self, names: frozenset[str], directory: Path, weights_dir: Path | None, provenance: Provenance):
        self.names, self.directory, self.weights_dir, self.provenance = names, directory, weights_dir, provenance
        self.index = 0

    def after_all(self, p, graphs, results, records, ran):
        self.index += 1
        if p.name not in self.names and "all" not in self.names:
            return
        for rank, (graph, record) in enumerate(zip(graphs, records)):
            label = "all" if record["rank"] is None else f"rank{record['rank']}"
            path = self.directory / label / f"{self.index:03d}_{p.name}.onnx"
            save_graph(to_onnx(graph, self.provenance.of(record["rank"])), path, self.weights_dir)
            record["dump"] = str(path.relative_to(self.directory.parent))


def to_onnx(graph: gs.Graph, provenance: dict[str, str]) -> onnx.ModelProto:
    """The graph as a model proto: each node's metadata records the pass that created it, the
    model's metadata what passes recorded in the graph (e.g. the CUDA-graph plan)."""
    model = gs.export_onnx(graph)
    for node in model.graph.node:
        entry = node.metadata_props.add()
        entry.key, entry.value = "created_by", provenance.get(node.name, "unknown")
    for key, value in sorted(graph_metadata(graph).items()):
        entry = model.metadata_props.add()
        entry.key, entry.value = key, value
    return model


def histogram(graph: gs.Graph) -> dict[str, int]:
    return dict(sorted(Counter(node.op for node in graph.nodes).items()))

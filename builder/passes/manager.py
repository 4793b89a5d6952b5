"""PassManager: runs the pipeline, 1 → N ranks, with instruments around every pass.

Passes before the first ``per_rank`` pass run once on the whole model's graph (pass-log
rank ``None``, shown as "all"); then the graph is copied per rank and each later pass runs on
every rank's graph before the next pass starts, so instruments (the numerics check above
all) can look at all ranks together. Ordering constraints are checked before anything runs;
a failure names the pass, the rank and the passes that ran before it.

The ``cpu`` passes come last, grouped by the CPU graph they make: at the first, each finished
rank graph is kept (``graphs``, what becomes rankN.onnx), and at the first of each CPU graph a
copy of it runs through that graph's passes (``cpu_graphs``, rankN.cpu.onnx), under the same
instruments. The CPU graphs a build does not make (``PassContext.cpu_graphs``) have their passes
skipped and are absent from ``cpu_graphs``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import onnx_graphsurgeon as gs

from ..errors import UserError
from .base import CpuGraph, Pass, PassContext, PassError, PassResult, after, copy_graph
from .instruments import Dump, Instrument, OpCounts, Provenance, Timing, to_onnx  # noqa: F401  (to_onnx: API)


@dataclass
class RunResult:
    graphs: list[gs.Graph]                        # one per rank
    results: dict[str, list[PassResult]]          # pass name → its result per graph it ran on
    provenance: list[dict[str, str]]              # per rank: node name → pass that created it
    records: list[dict] = field(default_factory=list)
    cpu_graphs: dict[CpuGraph, list[gs.Graph]] = field(default_factory=dict)  # each CPU graph made, per rank

    @property
    def graph(self) -> gs.Graph:
        """The only graph of a single-rank run."""
        (graph,) = self.graphs
        return graph


class PassManager:
    def __init__(self, passes: tuple[Pass, ...], disabled: frozenset[str] = frozenset(),
                 dump_after: frozenset[str] = frozenset(), dump_dir: Path | None = None,
                 numerics: Instrument | None = None, weights_dir: Path | None = None,
                 on_record: Callable[[dict], None] = lambda record: None):
        known = {p.name for p in passes}
        for name in (*disabled, *dump_after):
            if name not in known and name != "all":
                raise UserError(f"unknown pass {name!r}; passes: {', '.join(p.name for p in passes)}")
        self.passes, self.disabled, self.dump_after = passes, disabled, dump_after
        self.dump_dir, self.numerics, self.on_record, self.weights_dir = dump_dir, numerics, on_record, weights_dir
        self.check_order()

    @property
    def enabled(self) -> list[Pass]:
        return [p for p in self.passes if p.name not in self.disabled]

    def check_order(self) -> None:
        """Every pass's requirements must be enabled and come before it, and no whole-model pass
        may follow a per-rank one, nor a rank-graph pass a CPU-stage one, and each CPU graph's
        passes come together; checked before any runs."""
        seen: set[str] = set()
        split = cpu = None
        cpu_done: set[CpuGraph] = set()  # CPU graphs whose passes are over
        for p in self.passes:
            if p.runs_with and p.name in self.disabled and p.runs_with not in self.disabled:
                raise PassError(f"pass {p.name} cannot be disabled while {p.runs_with} runs: the engine's outputs "
                                f"depend on it; disable both or neither")
        for p in self.enabled:
            for need in p.requires:
                if need in self.disabled:
                    raise PassError(f"pass {p.name} requires {need}, which is disabled; "
                                    f"also disable {p.name} or enable {need}")
                if need not in seen:
                    raise PassError(f"pass {p.name} requires {need} to run before it")
            if split and not p.per_rank:
                raise PassError(f"pass {p.name} runs on the whole model but comes after the per-rank pass {split}")
            if p.cpu and not p.per_rank:
                raise PassError(f"pass {p.name} is a CPU-stage pass, and those run per rank")
            if cpu and not p.cpu:
                raise PassError(f"pass {p.name} runs on the rank graph but comes after the CPU-stage pass {cpu}")
            if cpu and p.cpu is not previous.cpu:
                cpu_done.add(previous.cpu)
            if p.cpu in cpu_done:
                raise PassError(f"pass {p.name} makes the CPU {p.cpu.value} graph, whose passes ran before "
                                f"{previous.name}'s: each CPU graph's passes come together")
            split = split or (p.name if p.per_rank else None)
            cpu = cpu or (p.name if p.cpu else None)
            previous = p
            seen.add(p.name)

    def run(self, graph: gs.Graph, ctx: PassContext) -> RunResult:
        provenance = Provenance()
        instruments: list[Instrument] = [OpCounts(), provenance, Timing()]
        if self.numerics is not None:
            instruments.append(self.numerics)
        if self.dump_dir is not None and self.dump_after:
            instruments.append(Dump(self.dump_after, self.dump_dir, self.weights_dir, provenance))
        graphs, contexts = [graph], [ctx]
        results: dict[str, list[PassResult]] = {}
        records: list[dict] = []
        ran: list[str] = []
        rank_graphs: list[gs.Graph] | None = None  # once the CPU stage has started
        cpu_graphs: dict[CpuGraph, list[gs.Graph]] = {}
        for p in self.enabled:
            if p.per_rank and contexts[0].rank is None:  # the 1 → N split of what the whole-model passes made
                whole = graphs[0]
                graphs = [whole if ctx.world_size == 1 else copy_graph(whole) for _ in range(ctx.world_size)]
                contexts = [ctx.for_rank(rank) for rank in range(ctx.world_size)]
                for instrument in instruments:
                    instrument.split(ctx.world_size)
            if p.cpu and p.cpu not in ctx.cpu_graphs:
                continue  # a CPU graph this build does not make
            if p.cpu and p.cpu not in cpu_graphs:  # the rank graphs are done; each CPU graph works on copies
                rank_graphs = graphs if rank_graphs is None else rank_graphs
                graphs = cpu_graphs[p.cpu] = [copy_graph(g) for g in rank_graphs]
                for instrument in instruments:
                    instrument.start_cpu_stage(rank_graphs, p.cpu)
            step_results, step_records = [], []
            for index, (rank_graph, rank_ctx) in enumerate(zip(graphs, contexts)):
                for instrument in instruments:
                    instrument.before(p, rank_ctx.rank, rank_graph)
                result = self._call(p, rank_graph, rank_ctx, ran)
                record = {"pass": p.name, "rank": rank_ctx.rank, "modified": result.modified}
                if rank_ctx.rank is not None:
                    record.update(stage=rank_ctx.stage, tensor_rank=rank_ctx.tensor_rank)
                for instrument in instruments:
                    instrument.after(p, rank_ctx.rank, rank_graph, result, record)
                record.update(result.stats)
                graphs[index] = result.graph  # (a CPU graph's list in cpu_graphs too)
                step_results.append(result)
                step_records.append(record)
            for instrument in instruments:
                instrument.after_all(p, graphs, step_results, step_records, ran)
            for record in step_records:
                self.on_record(record)
            results[p.name] = step_results
            records += step_records
            ran.append(p.name)
        return RunResult(graphs=graphs if rank_graphs is None else rank_graphs, results=results,
                         provenance=provenance.by_rank, records=records,
                         cpu_graphs=cpu_graphs)

    @staticmethod
    def _call(p: Pass, graph: gs.Graph, ctx: PassContext, ran: list[str]) -> PassResult:
        where = "" if ctx.rank is None else f" on rank {ctx.rank}"
        try:
            return p.run(graph, ctx)
        except PassError as exc:
            raise PassError(f"{exc}{after(ran)}") from None
        except UserError:
            raise
        except Exception as exc:  # a bug in a pass: say which, keep the cause chained
            raise PassError(f"pass {p.name} failed{where}: {type(exc).__name__}: {exc}{after(ran)}") from exc

"""The numerics check as an instrument: after each pass that changed the graph, run it in
ONNX Runtime on seeded inputs and compare with the graph before it and with torch eager.

After the split the rank graphs run together as one step: the pipeline stages in sequence
(each stage's own caches and the hidden states the stage before wrote), and within a stage
its tensor ranks together (each rank's cache shard as input, the collectives computed in
numpy between their segments). The last stage's logits and every stage's gathered caches are
compared with the whole model's: a split or sharding mistake on any stage fails the pass that
made it.

The CPU stage's passes make graphs for one kind of step each: a decode graph pass is checked at
a decode step (the seeded step cut to one token a row), a verification graph pass at a Medusa
verification step of one row (the seeded row with a cached past, its tokens as a tree), each
against the finished rank graph at that step.

An output the reference has is either not made yet (medusa_logits before attach_medusa: no
graph so far had it) or must be there: a pass that loses one (a ``present_*``) fails.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from ...contract.errors import first_line
from ...plugins.onnxruntime import session as ort_config
from ...plugins.onnxruntime.session import CpuActivations
from ...contract.pipeline import HIDDEN_STATES, HIDDEN_STATES_OUT
from ...contract.step import MEDUSA_LOGITS
from ..sharding import gather_caches, shard_caches
from ...plugins.onnxruntime import fp4
from ...plugins.collectives import OP
from ...plugins.onnxruntime.segments import run_ranks
from .. import numerics
from .base import CpuGraph, PassError, after
from .instruments import Instrument


class NumericsGate(Instrument):
    def __init__(self, inputs: dict, torch_reference: dict, atol: float, rtol: float, workdir: Path | None = None,
                 quantized_reference: dict | None = None, quantized_rtol: float | None = None,
                 num_kv_heads: int | None = None, activations: CpuActivations = CpuActivations.float,
                 label: dict | None = None, tensor_size: int = 1):
        """``workdir`` holds the graphs' external weight files; ``quantized_reference`` is torch
        eager with the dequantized weights, the reference once the graph holds quantized weights
        (quantization error is measured, not a pass's mistake); ``num_kv_heads`` of the whole
        model, to give each rank its cache shard; ``activations`` the spec's, as the runtime will run;
        ``label``: which check this is (numerics.CheckPlan.record), copied into every record;
        ``tensor_size``: tensor ranks per pipeline stage (rank graphs come stage by stage)."""
        self.inputs, self.reference, self.atol, self.rtol = inputs, torch_reference, atol, rtol
        self.workdir, self.quantized_reference = workdir, quantized_reference
        self.quantized_rtol = quantized_rtol or rtol
        self.num_kv_heads, self.activations, self.tensor_size = num_kv_heads, activations, tensor_size
        self.label = dict(label or {})
        self.previous: dict | None = None  # outputs of the graphs before the current pass
        self.produced: set[str] | None = None  # every output some graph so far had
        self.first = True
        self.cpu_inputs: dict | None = None  # the step the current CPU graph is for
        self.cpu_reference: dict | None = None  # the rank graph at that step (the CPU stage's reference)
        self.cpu_previous: dict | None = None
        self.path_end: int | None = None  # at a verification step: the node greedy acceptance ends at

    def before(self, p, rank, graph):
        if self.produced is None:  # the exported graph
            self.produced = {tensor.name for tensor in graph.outputs}

    def start_cpu_stage(self, rank_graphs, cpu_graph):
        if len(rank_graphs) != 1:
            return  # the CPU stage runs on single-rank graphs only (base.cpu_stage_skipped)
        session = ort_config.session(self._runnable(self._model(rank_graphs[0], self.workdir), "numerics.onnx"),
                                     activations=self.activations)
        rank = lambda feeds: ort_config.run(session, feeds)  # noqa: E731
        if cpu_graph is CpuGraph.decode:
            self.cpu_inputs = numerics.decode_inputs(self.inputs)
        else:
            self.cpu_inputs = numerics.verify_inputs(self.inputs, rank)
        self.cpu_reference = rank(self.cpu_inputs)
        self.cpu_previous = self.cpu_reference
        self.path_end = (numerics.greedy_path_end(self.cpu_inputs, self.cpu_reference["logits"])
                         if cpu_graph is CpuGraph.verify else None)

    def after_all(self, p, graphs, results, records, ran):
        if p.cpu:
            if self.cpu_reference is not None and any(r.modified for r in results):
                self._check_cpu_graph(p, graphs[0], records, ran)
            return
        if not (self.first or any(r.modified for r in results)):
            return
        self.first = False
        try:
            models = [self._model(graph, self.workdir) for graph in graphs]  # exported (and saved) once, for both checks
            single = self._runnable(models[0], "numerics.onnx") if len(models) == 1 else None
            outputs = self.run(models, single)
        except Exception as exc:  # noqa: BLE001  (ONNX Runtime refusing the graph is the pass's failure)
            raise PassError(f"pass {p.name} left a graph ONNX Runtime cannot run: {first_line(exc)}{after(ran)}") from exc
        quantized = any(node.op == "DequantizeLinear" for node in graphs[0].nodes)
        use_quantized = quantized and self.quantized_reference is not None
        reference = self.quantized_reference if use_quantized else self.reference
        not_yet = frozenset(name for name in reference if name not in self.produced)
        reference = self._at_rows_of(outputs, reference, self.inputs)
        try:
            vs_torch = numerics.compare(outputs, reference, not_yet)
            vs_previous = (numerics.compare(outputs, self._at_rows_of(outputs, self.previous, self.inputs))
                           if self.previous is not None else None)
        except numerics.DroppedOutput as exc:
            raise PassError(f"pass {p.name}: {exc}{after(ran)}") from None
        self.previous = outputs
        self.produced |= set(outputs)
        # Quantized graphs: int8 activations (CpuActivations.int8) round differently in the two graphs.
        rtol = self.quantized_rtol if use_quantized else self.rtol
        record = {**self.label, "vs_torch": numerics.worst(vs_torch), "atol": self.atol, "rtol": rtol}
        if use_quantized:
            record["vs_torch_float"] = numerics.worst(numerics.compare(
                outputs, self._at_rows_of(outputs, self.reference, self.inputs), not_yet))
        if vs_previous is not None:
            record["vs_previous"] = numerics.worst(vs_previous)
        if len(graphs) > 1:
            record["ranks_together"] = len(graphs)
            record["stages_in_sequence"] = len(graphs) // self.tensor_size
        bad = {name: s for name, s in vs_torch.items() if not s.within(self.atol, rtol)}
        record["ok"] = not bad
        for rank_record in records:
            rank_record["numerics"] = record
        if bad:
            name, stat = max(bad.items(), key=lambda kv: kv[1].max_abs)
            on = (f" on the first {self.label['layers']} of {self.label['of_layers']} decoder layers"
                  if self.label.get("check") == "truncated" else "")
            raise PassError(f"pass {p.name} broke numerics{on}: {name} max_abs {stat.max_abs:.3g} "
                            f"(max_rel {stat.max_rel:.3g}) vs torch exceeds atol {self.atol} / rtol "
                            f"{rtol}{after(ran)}")

    def run(self, models: list[onnx.ModelProto], single: onnx.ModelProto | Path | None) -> dict:
        """The step's outputs: ``single`` (the one rank graph, as ONNX Runtime loads it), or the
        rank graphs together."""
        if single is not None:
            return numerics.run_onnx(single, self.inputs, activations=self.activations)
        result, hidden = {}, None
        for start in range(0, len(models), self.tensor_size):  # stage by stage
            stage = models[start:start + self.tensor_size]
            names = [value.name for value in stage[0].graph.input]
            feeds = {name: self.inputs[name] for name in names if name in self.inputs}
            if HIDDEN_STATES in names:
                feeds[HIDDEN_STATES] = hidden
            # Between split_pipeline_stages and shard_tensor_parallel a stage's tensor ranks are
            # whole copies: each gets the whole caches, and the first one's are the stage's.
            sharded = any(node.op_type == OP for node in stage[0].graph.node)
            outputs = run_ranks(stage, shard_caches(feeds, len(stage), self.num_kv_heads) if sharded
                                else [feeds] * len(stage), self.workdir, self.activations)
            hidden = outputs[0].get(HIDDEN_STATES_OUT)
            result.update({name: value for name, value in outputs[0].items()
                           if not name.startswith("present_") and name != HIDDEN_STATES_OUT})
            result.update(gather_caches(outputs if sharded else outputs[:1], self.num_kv_heads))
        return result

    def _check_cpu_graph(self, p, graph, records, ran) -> None:
        """A CPU-stage pass's graph at its step, against the rank graph and the graph before it."""
        model = self._model(graph, self.workdir)
        kind = p.cpu.value
        try:
            outputs = numerics.run_onnx(self._runnable(model, "numerics_cpu.onnx"), self.cpu_inputs,
                                        activations=self.activations)
        except Exception as exc:  # noqa: BLE001  (ONNX Runtime refusing the graph is the pass's failure)
            raise PassError(f"pass {p.name} left a {kind} graph ONNX Runtime cannot run: {first_line(exc)}{after(ran)}") from exc
        try:
            vs_rank = numerics.compare(outputs, self._at_rows_of(outputs, self.cpu_reference, self.cpu_inputs))
            vs_previous = numerics.compare(outputs, self._at_rows_of(outputs, self.cpu_previous, self.cpu_inputs))
        except numerics.DroppedOutput as exc:
            raise PassError(f"pass {p.name}: {exc}{after(ran)}") from None
        self.cpu_previous = outputs
        rtol = self.quantized_rtol if any(n.op == "DequantizeLinear" for n in graph.nodes) else self.rtol
        bad = {name: s for name, s in vs_rank.items() if not s.within(self.atol, rtol)}
        record = {"step": kind, "vs_rank_graph": numerics.worst(vs_rank), "vs_previous": numerics.worst(vs_previous),
                  "atol": self.atol, "rtol": rtol, "ok": not bad}
        if self.path_end is not None:
            record["greedy_path_end"] = self.path_end
        for rank_record in records:
            rank_record["numerics"] = record
        if bad:
            name, stat = max(bad.items(), key=lambda kv: kv[1].max_abs)
            raise PassError(f"pass {p.name} broke numerics: at a {kind} step {name} max_abs {stat.max_abs:.3g} "
                            f"(max_rel {stat.max_rel:.3g}) vs the rank graph exceeds atol {self.atol} / rtol "
                            f"{rtol}{after(ran)}")

    @staticmethod
    def _at_rows_of(outputs: dict, reference: dict, inputs: dict) -> dict:
        """``reference`` where ``outputs`` has the heads at each row's greedy path end only
        (heads_at_path_end) and it has them at every logits row: its heads at that row, found
        from its own logits on ``inputs``."""
        medusa, heads = outputs.get(MEDUSA_LOGITS), reference.get(MEDUSA_LOGITS)
        if medusa is None or heads is None or medusa.shape[1] == heads.shape[1]:
            return reference
        ends = numerics.greedy_path_ends(inputs, reference["logits"])  # [B]
        return {**reference, MEDUSA_LOGITS: heads[np.arange(len(ends)), ends][:, None]}  # [B, 1, K, V]

    def _runnable(self, model: onnx.ModelProto, name: str) -> onnx.ModelProto | Path:
        """``model``, or saved in the workdir, where its external weights resolve."""
        if self.workdir is None:
            return model
        path = self.workdir / name
        onnx.save_model(model, path)
        return path

    @staticmethod
    def _model(graph: gs.Graph, weights_dir: Path | None) -> onnx.ModelProto:
        """The graph as ONNX Runtime runs it: FP4 weights folded to float (it has no FP4 kernels),
        their codes read from ``weights_dir``, where the graph's external data lies."""
        model = gs.export_onnx(graph)
        return fp4.simulate(model, weights_dir or "") if fp4.has_fp4(model) else model


"""The numerics check as an instrument: after each pass that changed the graph, run it in
ONNX Runtime on seeded inputs and compare with the graph before it and with torch eager.

After the tensor-parallel split the N rank graphs run together as one step (each rank's
cache shard as input, the collectives computed in numpy between their segments) and the
gathered logits are compared with the whole model's: a sharding mistake fails the pass that
made it.
"""
from __future__ import annotations

from pathlib import Path

import onnx
import onnx_graphsurgeon as gs

from ...contract.cpu_decode_graph import decode_graph
from ...contract.onnxruntime import CpuActivations
from ...contract.tensor_parallel import gather_caches, shard_caches
from ...plugins import fp4
from ...plugins.segments import run_ranks
from .. import numerics
from .base import PassError, after
from .instruments import Instrument


class NumericsGate(Instrument):
    def __init__(self, inputs: dict, torch_reference: dict, atol: float, rtol: float, workdir: Path | None = None,
                 quantized_reference: dict | None = None, quantized_rtol: float | None = None,
                 num_kv_heads: int | None = None, heads: tuple[int, int] | None = None,
                 activations: CpuActivations = CpuActivations.float, label: dict | None = None):
        """``workdir`` holds the graphs' external weight files; ``quantized_reference`` is torch
        eager with the dequantized weights, the reference once the graph holds quantized weights
        (quantization error is measured, not a pass's mistake); ``num_kv_heads`` of the whole
        model, to give each rank its cache shard; ``heads`` (query, KV) of a single-rank graph,
        for the CPU decode graph (contract/cpu_decode_graph.py), checked against the rank graph
        at a decode step whenever it applies; ``activations`` the spec's, as the runtime will run;
        ``label``: which check this is (numerics.CheckPlan.record), copied into every record."""
        self.inputs, self.reference, self.atol, self.rtol = inputs, torch_reference, atol, rtol
        self.workdir, self.quantized_reference = workdir, quantized_reference
        self.quantized_rtol = quantized_rtol or rtol
        self.num_kv_heads, self.heads, self.activations = num_kv_heads, heads, activations
        self.label = dict(label or {})
        self.previous: dict | None = None  # outputs of the graphs before the current pass
        self.first = True

    def after_all(self, p, graphs, results, records, ran):
        if not (self.first or any(r.modified for r in results)):
            return
        self.first = False
        try:
            models = [self._model(graph) for graph in graphs]  # exported (and saved) once, for both checks
            single = self._runnable(models[0], "numerics.onnx") if len(models) == 1 else None
            outputs = self.run(models, single)
        except Exception as exc:  # noqa: BLE001  (ONNX Runtime refusing the graph is the pass's failure)
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise PassError(f"pass {p.name} left a graph ONNX Runtime cannot run: {first}{after(ran)}") from exc
        quantized = any(node.op == "DequantizeLinear" for node in graphs[0].nodes)
        use_quantized = quantized and self.quantized_reference is not None
        reference = self.quantized_reference if use_quantized else self.reference
        vs_torch = numerics.compare(outputs, reference)
        vs_previous = numerics.compare(outputs, self.previous) if self.previous is not None else None
        self.previous = outputs
        record = {**self.label, "vs_torch": numerics.worst(vs_torch)}
        if use_quantized:
            record["vs_torch_float"] = numerics.worst(numerics.compare(outputs, self.reference))
        if vs_previous is not None:
            record["vs_previous"] = numerics.worst(vs_previous)
        if len(graphs) > 1:
            record["ranks_together"] = len(graphs)
        # Quantized graphs: int8 activations (CpuActivations.int8) round differently in the two graphs.
        rtol = self.quantized_rtol if use_quantized else self.rtol
        decode = self.check_decode(models[0], single) if single is not None and self.heads is not None else None
        if decode is not None:
            counts, stats = decode
            record["cpu_decode"] = {**counts, **numerics.worst(stats)}
            bad_decode = {name: s for name, s in stats.items() if not s.within(self.atol, rtol)}
            if bad_decode:
                name, stat = max(bad_decode.items(), key=lambda kv: kv[1].max_abs)
                raise PassError(f"after pass {p.name} the CPU decode graph (GroupQueryAttention) differs from the "
                                f"rank graph: {name} max_abs {stat.max_abs:.3g} exceeds atol {self.atol}{after(ran)}")
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
        feeds = shard_caches(self.inputs, len(models), self.num_kv_heads)
        outputs = run_ranks(models, feeds, self.workdir, self.activations)
        logits = {name: value for name, value in outputs[0].items() if not name.startswith("present_")}
        return {**logits, **gather_caches(outputs, self.num_kv_heads)}

    def check_decode(self, model: onnx.ModelProto, runnable: onnx.ModelProto | Path
                     ) -> tuple[dict[str, int], dict] | None:
        """(the decode graph's fusion counts, stats of the decode graph vs the rank graph at a
        decode step), or None when the decode rewrite does not apply to this graph (yet).
        ``runnable``: the rank graph as ONNX Runtime loads it."""
        found = decode_graph(model, *self.heads, self.workdir)
        if found is None:
            return None
        inputs = numerics.decode_inputs(self.inputs)
        reference = numerics.run_onnx(runnable, inputs, activations=self.activations)
        actual = numerics.run_onnx(self._runnable(found.model, "numerics_decode.onnx"), inputs,
                                   activations=self.activations)
        return found.counts, numerics.compare(actual, reference)

    def _runnable(self, model: onnx.ModelProto, name: str) -> onnx.ModelProto | Path:
        """``model``, or saved in the workdir, where its external weights resolve."""
        if self.workdir is None:
            return model
        path = self.workdir / name
        onnx.save_model(model, path)
        return path

    @staticmethod
    def _model(graph: gs.Graph) -> onnx.ModelProto:
        model = gs.export_onnx(graph)
        return fp4.simulate(model) if fp4.has_fp4(model) else model  # ONNX Runtime has no FP4 kernels


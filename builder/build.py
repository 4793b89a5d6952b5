"""``trtbuild build``: spec → export → passes per rank → rank ONNX + engine → engine dir."""
from __future__ import annotations

import json
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path


from . import numerics
from .emit.engine_dir import check_destination, staged
from ..contract.tensor_parallel import kv_heads
from .emit.manifest import graph_metadata, io_table, tool_versions, write_manifest
from ..contract.gpu_targets import describe
from .emit.tensorrt import EngineReport, build_engine_job, check_targets, optimization_profiles, resolve_flavor
from .emit.rank_onnx import save_graph
from .frontend.export import export_step, load_graph
from .frontend.weight_map import WeightMap
from .isolate import map_isolated, run_isolated
from .medusa.heads import MedusaHeads, load_heads
from .quant.quantize import apply_dequantized, load_quantized, quantize_checkpoint
from .passes import PIPELINE, PassContext
from .passes.instruments import to_onnx
from .passes.manager import PassManager
from .passes.numerics_gate import NumericsGate
from .progress import Progress, human_bytes, peak_rss_bytes
from .spec import DType, Spec

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "config.json")


@dataclass(frozen=True)
class BuildOptions:
    """Per-invocation choices that are not part of the deployment spec."""

    out: Path
    dump_after: frozenset[str] = frozenset()
    disable: frozenset[str] = frozenset()
    jobs: int = 1


@dataclass
class BuildSummary:
    out: Path
    stages: list[tuple[str, float]]
    engines: list[EngineReport]
    peak_rss_bytes: int
    pass_records: list[dict] = field(default_factory=list)
    manifest: dict = field(default_factory=dict)


def build(spec: Spec, options: BuildOptions, progress: Progress | None = None) -> BuildSummary:
    progress = progress or Progress()
    check_destination(options.out)  # before any work: never a user's directory
    flavor = resolve_flavor(spec.build.backend)
    check_targets(spec, flavor)
    disabled = frozenset(spec.passes.disable) | options.disable
    progress.say(f"trtbuild: {spec.arch.architecture} from {spec.model.checkpoint} → {options.out} "
                 f"({spec.model.dtype.value}, {flavor.name} {flavor.version}, "
                 f"for {describe(flavor.built_for(spec.build.targets))})")
    with staged(options.out) as tmp:
        manager_for = _manager_factory(disabled, options, tmp, progress)
        workdir = tmp / ".export"
        workdir.mkdir()
        with progress.stage("export (torch.export → ONNX)"):
            exported = run_isolated(_export_stage, spec, workdir)
        child_peaks = [exported.peak_rss_bytes]
        progress.say(f"  export process peak RSS {human_bytes(exported.peak_rss_bytes)}")
        if exported.note:
            progress.say(f"  {exported.note}")
        quantized, quant_report = (load_quantized(exported.quantized_path) if exported.quantized_path
                                   else (None, None))
        gate = (NumericsGate(*exported.reference, spec.passes.atol, spec.passes.rtol, workdir=workdir,
                             quantized_reference=exported.quantized_reference,
                             quantized_rtol=spec.passes.quantized_rtol, num_kv_heads=spec.arch.num_kv_heads,
                             heads=(spec.arch.num_heads, spec.arch.num_kv_heads) if spec.world_size == 1 else None,
                             activations=spec.quantization.activations)
                if exported.reference else None)
        context = PassContext.for_spec(spec, quantized, quant_report, weights_dir=workdir)
        label = "passes" if spec.world_size == 1 else f"passes (whole model, then {spec.world_size} ranks)"
        with progress.stage(label):
            run = manager_for(gate).run(load_graph(exported.path), context)
        records = run.records
        ranks: list[dict] = []
        cuda_graph_plan: list[int] = []
        for rank, (graph, provenance) in enumerate(zip(run.graphs, run.provenance)):
            with progress.stage(f"write rank{rank}.onnx"):
                model = to_onnx(graph, provenance)
                save_graph(model, tmp / f"rank{rank}.onnx", workdir)
            cuda_graph_plan = json.loads(graph_metadata(model).get("cuda_graph_batch_sizes", "[]"))
            ranks.append(_rank_entry(spec, rank, model, tmp))
            del model
        del run
        shutil.rmtree(workdir)
        engines = _build_engines(spec, flavor, tmp, options.jobs, progress)
        child_peaks += [e.peak_rss_bytes for e in engines]
        with progress.stage("manifest"):
            _copy_tokenizer(spec.model.checkpoint, tmp)
            (tmp / "passes.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
            manifest = write_manifest(tmp, _manifest_body(spec, flavor, ranks, records, cuda_graph_plan))
    return BuildSummary(out=options.out, stages=progress.stages, engines=engines,
                        peak_rss_bytes=max([peak_rss_bytes(), *child_peaks]), pass_records=records, manifest=manifest)


def _rank_entry(spec: Spec, rank: int, model, out: Path) -> dict:
    """What the runtime needs per rank: its files, KV heads, I/O table and weight bytes."""
    data = out / f"rank{rank}.onnx.data"
    heads = kv_heads(rank, spec.world_size, spec.arch.num_kv_heads)
    return {"rank": rank, "engine": f"rank{rank}.engine", "onnx": f"rank{rank}.onnx",
            "onnx_data": data.name if data.is_file() else None, "num_kv_heads": len(heads),
            "kv_heads": [heads.start, heads.stop],
            "weight_bytes": data.stat().st_size if data.is_file() else 0, "io": io_table(model)}


def _manifest_body(spec: Spec, flavor, ranks: list[dict], records: list[dict], cuda_graph_plan: list[int]) -> dict:
    return {
        "spec": spec.model_dump(mode="json"),
        "spec_sha256": spec.sha256(),
        "model": spec.arch.model_dump(),
        "tensorrt": flavor.built_for(spec.build.targets),
        "tools": tool_versions(),
        "tensor_parallel": spec.world_size,
        "ranks": ranks,
        "limits": {"max_batch_size": spec.build.max_batch_size, "max_input_len": spec.build.max_input_len,
                   "max_seq_len": spec.build.max_seq_len},
        "profiles": [{"name": name, "shapes": {k: [list(s) for s in v] for k, v in shapes.items()
                                               if k in ("input_ids", "logits_index")}}
                     for name, shapes in zip(("decode", "prefill"), optimization_profiles(spec))],
        "cuda_graph_batch_sizes": cuda_graph_plan,
        "medusa": _medusa_manifest(spec),
        "passes": list(dict.fromkeys(r["pass"] for r in records)),
        "tokenizer": "tokenizer.json",
    }


def _medusa_manifest(spec: Spec) -> dict | None:
    """What the runtime needs to speculate: head count, the tree (likeliest path first, so
    every prefix is a tree) and the heads' measured accuracy (the runtime's prior)."""
    medusa = spec.medusa
    if medusa is None:
        return None
    accuracy = medusa.topk_accuracy
    return {"num_heads": medusa.num_heads, "num_layers": medusa.num_layers,
            "tree": [list(path) for path in medusa.choices], "tree_size": medusa.tree_size,
            "topk_accuracy": [list(row) for row in accuracy] if accuracy else None,
            # P(rank r of head k is right): the runtime's prior for choosing a tree size.
            "rank_accuracy": [[round(p, 5) for p in row] for row in medusa.rank_accuracy],
            "output": "medusa_logits"}


@dataclass(frozen=True)
class _Exported:
    """What the export subprocess hands back: paths, and the numerics reference if any."""

    path: Path
    data_path: Path
    output_names: list[str]
    reference: tuple[dict, dict] | None
    note: str | None
    peak_rss_bytes: int
    quantized_path: Path | None = None       # codes and scales per layer (quant/store.py's directory)
    quantized_reference: dict | None = None  # torch eager outputs with the dequantized weights


def _export_stage(spec: Spec, workdir: Path) -> _Exported:
    """Runs in a subprocess: export, torch eager's outputs on the seeded inputs, and the
    weight quantization the spec asks for (with the outputs of the dequantized model)."""
    exported = export_step(spec, workdir)
    inputs, note = _numerics_inputs(spec, exported)
    heads = load_heads(spec.medusa.heads) if spec.medusa is not None and inputs is not None else None
    reference = (inputs, _torch_outputs(exported, inputs, heads)) if inputs is not None else None
    quantized_path, quantized_reference = None, None
    if spec.quantization.bits:
        quantized_path = workdir / "quantized"
        say = lambda message: print(message, file=sys.stderr, flush=True)  # noqa: E731  (stdout may be JSON)
        quantize_checkpoint(WeightMap.from_checkpoint(spec.model.checkpoint), spec, quantized_path, progress=say)
        if reference is not None:
            apply_dequantized(exported.hf_model, load_quantized(quantized_path)[0])
            quantized_reference = _torch_outputs(exported, inputs, heads)
    return _Exported(path=exported.path, data_path=exported.data_path, output_names=exported.output_names,
                     reference=reference, note=note, peak_rss_bytes=peak_rss_bytes(),
                     quantized_path=quantized_path, quantized_reference=quantized_reference)


def _manager_factory(disabled, options: BuildOptions, tmp: Path, progress: Progress):
    def make(gate: NumericsGate | None) -> PassManager:
        return PassManager(PIPELINE, disabled=disabled, dump_after=options.dump_after, dump_dir=tmp / "dumps",
                           numerics=gate, weights_dir=tmp / ".export", on_record=progress.pass_record)
    make(None)  # check ordering constraints and pass names before the slow export
    return make


def _numerics_inputs(spec: Spec, exported) -> tuple[dict | None, str | None]:
    """The seeded inputs of the numerics check, or None and why the check cannot run."""
    if not spec.passes.numerics:
        return None, None
    if spec.model.dtype == DType.bfloat16:
        return None, "numerics check skipped: ONNX Runtime's CPU kernels do not cover bfloat16"
    if exported.weight_bytes > numerics.MAX_NUMERICS_BYTES:
        return None, (f"numerics check skipped: the weights are over {numerics.MAX_NUMERICS_BYTES >> 20} MiB, where "
                      "running every pass in ONNX Runtime would double the build's memory "
                      "(set passes.numerics: false to silence this)")
    return numerics.seeded_inputs(spec), None


def _torch_outputs(exported, inputs: dict, heads: MedusaHeads | None) -> dict:
    """Torch eager's outputs on ``inputs``; with Medusa, the heads' logits (numpy reference)
    on the final-norm hidden state the step computed, so attach_medusa is checked too."""
    captured = {}
    handle = exported.step.norm.register_forward_hook(lambda module, args, out: captured.update(hidden=out))
    try:
        outputs = numerics.run_torch(exported.step, inputs, exported.output_names)
    finally:
        handle.remove()
    if heads is not None:
        outputs["medusa_logits"] = heads.logits(captured["hidden"].float().numpy())
    return outputs


def _build_engines(spec: Spec, flavor, tmp: Path, jobs: int, progress: Progress) -> list[EngineReport]:
    """Each rank's engine in its own subprocess (up to ``jobs`` at once): builder memory is per process."""
    ranks = list(range(spec.world_size))
    with progress.stage(f"engine {', '.join(f'rank{r}' for r in ranks)} ({flavor.name})"):
        reports = map_isolated(build_engine_job, [(tmp / f"rank{r}.onnx", tmp / f"rank{r}.engine", spec, flavor.name)
                                                  for r in ranks], jobs)
    for rank, report in zip(ranks, reports):
        progress.say(f"  rank{rank}.engine: {human_bytes(report.bytes)}, builder process peak RSS "
                     f"{human_bytes(report.peak_rss_bytes)}")
    return reports


def _copy_tokenizer(checkpoint: Path, out: Path) -> None:
    for name in TOKENIZER_FILES:
        if (checkpoint / name).is_file():
            shutil.copyfile(checkpoint / name, out / name)

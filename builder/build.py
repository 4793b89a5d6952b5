"""``trtbuild build``: spec → export → passes per rank → rank ONNX + engine → engine dir."""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path

from . import numerics
from .emit.draft_graph import share_target_embedding
from .emit.engine_dir import check_destination, staged
from ..contract.pipeline import balanced_layers, stage_layers
from .emit.manifest import graph_metadata, write_manifest
from ..contract.gpu_targets import describe
from .emit.tensorrt import EngineReport, build_engine_job, check_targets, resolve_flavor
from .emit.paged_onnx import paged_name, save_paged_graph
from .emit.rank_onnx import save_graph
from .errors import UserError
from .export_stage import Exported, export_stage, weight_bytes
from .frontend.export import load_graph
from .frontend.side_files import check_side_files, checkpoint_side_files, side_file_record
from .isolate import map_isolated, run_isolated
from .manifest_entries import cpu_entry, manifest_body, rank_entry
from .quant.quantize import load_quantized
from .passes import PIPELINE, PassContext
from .passes.instruments import Instrument, to_onnx
from .passes import weights
from .passes.manager import PassManager
from .passes.numerics_gate import NumericsGate
from .passes.structure_check import StructureCheck, layer_forms
from .plan.build_cost import disk_refusal, machine_ram_bytes, memory_refusal, spec_build_plan
from .spec.checks import tensor_parallel_ok
from .progress import Progress, ProcessPeak, dir_size, human_bytes, peak_rss_bytes
from .spec.document import KVCacheLayout
from .spec.model import Spec


@dataclass(frozen=True)
class BuildOptions:
    """Per-invocation choices that are not part of the deployment spec."""

    out: Path
    dump_after: frozenset[str] = frozenset()
    disable: frozenset[str] = frozenset()
    jobs: int = 1
    ignore_memory_check: bool = False  # build even where a rank's engine would need more RAM than the machine has

    def __post_init__(self):
        # The Python API takes a path as str or Path, as the CLI does.
        object.__setattr__(self, "out", Path(self.out))
        object.__setattr__(self, "dump_after", frozenset(self.dump_after))
        object.__setattr__(self, "disable", frozenset(self.disable))


@dataclass
class BuildSummary:
    out: Path
    stages: list[tuple[str, float]]
    engines: list[EngineReport]
    peak_rss_bytes: int
    pass_records: list[dict] = field(default_factory=list)
    manifest: dict = field(default_factory=dict)
    processes: list[ProcessPeak] = field(default_factory=list)  # export, then each rank's engine build
    dir_bytes: int = 0


def build(spec: Spec, options: BuildOptions, progress: Progress | None = None) -> BuildSummary:
    progress = progress or Progress()
    check_destination(options.out)  # before any work: never a user's directory
    flavor = resolve_flavor(spec.build.backend)
    check_targets(spec, flavor)
    if not options.ignore_memory_check:
        _check_memory(spec)
        _check_disk(spec, options.out)
    side_files = checkpoint_side_files(spec.model.checkpoint)
    check_side_files(side_files, spec.model.checkpoint, spec.arch.vocab_size)
    if spec.draft_head is not None:  # every tensor of the draft dir, before anything is written
        from .draft_head.build import check_draft_dir

        check_draft_dir(spec)
    disabled = frozenset(spec.passes.disable) | options.disable
    progress.say(f"trtbuild: {spec.arch.architecture} from {spec.model.checkpoint} → {options.out} "
                 f"({spec.model.dtype.value}, {flavor.name} {flavor.version}, "
                 f"for {describe(flavor.built_for(spec.build.targets))})")
    with staged(options.out) as tmp:
        manager_for = _manager_factory(disabled, options, tmp)
        workdir = tmp / ".export"
        workdir.mkdir()
        check = numerics.check_plan(spec, weight_bytes(spec))
        with progress.stage("export (torch.export → ONNX)"):
            exported = run_isolated(export_stage, spec, workdir, check)
        child_peaks = [exported.peak]
        progress.say(f"  export process peak RSS {exported.peak.describe()}")
        if exported.draft_graph is not None:
            data = exported.draft_graph.with_name(exported.draft_graph.name + ".data")
            progress.say(f"  draft head: {exported.draft_graph.name} ({human_bytes(data.stat().st_size)} of weights "
                         "with the target's token embedding)")
        progress.say(f"  {check.describe()}" if check is not None else "  numerics check off (passes.numerics: false)")
        quantized, quant_report = (load_quantized(exported.quantized_path) if exported.quantized_path
                                   else (None, None))
        gate = _numerics_gate(spec, check, exported, workdir) if check is not None else None
        context = PassContext.for_spec(spec, quantized, quant_report, weights_dir=workdir)
        checked: dict[tuple, dict] = {}
        if check is not None and not check.whole:
            with progress.stage(f"numerics check (the passes on {check.layers} of {check.of_layers} layers)"):
                checked = _truncated_check(spec, check, exported, gate, context, disabled, workdir)
            gate = StructureCheck(spec.arch.num_layers, workdir, check.record(), spec.stages, spec.parallel.tensor,
                                  layer_forms(context.quantized, spec.arch.num_layers))

        def on_record(record: dict) -> None:
            if (record["pass"], record["rank"]) in checked:
                record["numerics"] = checked[record["pass"], record["rank"]]
            progress.pass_record(record)

        label = "passes" if spec.world_size == 1 else f"passes (whole model, then {_grid(spec)})"
        with progress.stage(label):
            run = manager_for(gate, on_record).run(load_graph(exported.path), context)
        records = run.records
        ranks: list[dict] = []
        cuda_graph_plan: list[int] = []
        adoptable = _single_reader_files(run.graphs)
        for rank, (graph, provenance) in enumerate(zip(run.graphs, run.provenance)):
            with progress.stage(f"write rank{rank}.onnx"):
                model = to_onnx(graph, provenance)
                save_graph(model, tmp / f"rank{rank}.onnx", workdir, adoptable[rank])
            cuda_graph_plan = json.loads(graph_metadata(model).get("cuda_graph_batch_sizes", "[]"))
            engine_graph = None
            if spec.kv_cache_layout == KVCacheLayout.paged:
                with progress.stage(f"write {paged_name(rank)}"):
                    engine_graph, record = save_paged_graph(model, spec, rank, tmp)
                progress.pass_record(record)
                records.append(record)
            ranks.append(rank_entry(spec, rank, model, tmp, engine_graph))
            del engine_graph
            if run.cpu_graphs:
                with progress.stage(f"write rank{rank}.cpu.onnx"):
                    cpu = {kind: to_onnx(graphs[rank], provenance) for kind, graphs in run.cpu_graphs.items()}
                    ranks[-1].update(cpu_entry(rank, cpu, model, tmp))
            del model
        del run
        shutil.rmtree(workdir)
        if exported.draft_graph is not None and spec.build.cpu_graphs:  # else rank0.onnx.data is left out
            saved = share_target_embedding(exported.draft_graph, tmp / "rank0.onnx")
            if saved:
                progress.say(f"  {exported.draft_graph.name}: the token embedding read from rank0.onnx.data "
                             f"({human_bytes(saved)} not written twice)")
        if exported.draft_graph is not None:
            from .draft_head.cpu_graph import draft_cpu_graph
            from .passes.cpu_group_query_attention import VERIFY_ROWS_MAX

            with progress.stage("draft head CPU graph (the CPU stage's fusions)"):
                cpu_draft = draft_cpu_graph(exported.draft_graph, rows=min(spec.build.max_batch_size, VERIFY_ROWS_MAX))
            progress.say(f"  {cpu_draft.name}: GroupQueryAttention over the draft's cache, bound in place at run time")
        engines = _build_engines(spec, flavor, tmp, [rank.get("paged_onnx") or rank["onnx"] for rank in ranks],
                                 options.jobs, progress)
        child_peaks += [e.peak for e in engines]
        if not spec.build.cpu_graphs:
            _leave_out_cpu_graphs(ranks, tmp, progress)
        with progress.stage("manifest"):
            for name, data in side_files.items():
                (tmp / name).write_bytes(data)
            (tmp / "passes.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
            manifest = write_manifest(tmp, {**manifest_body(spec, flavor, ranks, records, cuda_graph_plan),
                                            "side_files": side_file_record(side_files)})
    return BuildSummary(out=options.out, stages=progress.stages, engines=engines,
                        peak_rss_bytes=max([peak_rss_bytes(), *(p.peak for p in child_peaks)]),
                        pass_records=records, manifest=manifest, processes=child_peaks,
                        dir_bytes=dir_size(options.out))


def _grid(spec: Spec) -> str:
    """The rank grid in words: "2 ranks", "2 pipeline stages × 2 tensor ranks"."""
    p = spec.parallel
    if p.pipeline == 1:
        return f"{p.tensor} ranks"
    return f"{p.pipeline} pipeline stages × {p.tensor} tensor rank{'s' if p.tensor > 1 else ''}"


def _leave_out_cpu_graphs(ranks: list[dict], tmp: Path, progress: Progress) -> None:
    """build.cpu_graphs: false — the rank graphs were built, checked and compiled into the
    engines; the dir keeps the engines alone (it ships to GPUs), so the ONNX files go."""
    freed = 0
    for rank in ranks:
        for key in ("onnx", "onnx_data", "paged_onnx", "cpu_onnx", "cpu_onnx_data"):
            if rank.get(key) is not None:
                freed += (tmp / rank[key]).stat().st_size
                (tmp / rank[key]).unlink()
            rank[key] = None
    progress.say(f"  build.cpu_graphs: false — left out the ONNX graphs ({human_bytes(freed)}); "
                 "this dir runs on TensorRT only")


def _single_reader_files(graphs) -> list[frozenset[str]]:
    """Per rank, the weight files that no other rank's graph reads (its shard file; at one rank,
    every file): save_graph may move them into the rank's data file instead of copying."""
    reads = [weights.external_files(graph) for graph in graphs]
    return [frozenset(mine - set().union(*(other for k, other in enumerate(reads) if k != rank)))
            for rank, mine in enumerate(reads)]


def _check_disk(spec: Spec, out: Path) -> None:
    """Refuses, before any work, a build whose files would not fit the free disk where it writes."""
    where = Path(out).absolute().parent
    while not where.exists():
        where = where.parent
    refusal = disk_refusal(spec_build_plan(spec), shutil.disk_usage(where).free, where)
    if refusal is not None:
        raise UserError(refusal)


def _check_memory(spec: Spec) -> None:
    """Refuses, before any work, a rank engine whose build needs more RAM than this machine has."""
    valid = [tp for tp in range(1, 129) if tensor_parallel_ok(spec.arch, tp)]
    refusal = memory_refusal(spec_build_plan(spec), machine_ram_bytes(), valid)
    if refusal is not None:
        raise UserError(refusal)


def _numerics_gate(spec: Spec, check: numerics.CheckPlan, exported: Exported, workdir: Path) -> NumericsGate:
    return NumericsGate(*exported.reference, spec.passes.atol, spec.passes.rtol,
                        workdir=workdir if check.whole else workdir / "check",
                        quantized_reference=exported.quantized_reference,
                        quantized_rtol=spec.passes.quantized_rtol, num_kv_heads=spec.arch.num_kv_heads,
                        activations=spec.quantization.activations, label=check.record(),
                        tensor_size=spec.parallel.tensor)


def _truncated_check(spec: Spec, check: numerics.CheckPlan, exported: Exported, gate: NumericsGate,
                     context: PassContext, disabled: frozenset[str], workdir: Path) -> dict[tuple, dict]:
    """The same passes on the truncated graph, with the numerics gate: {(pass, rank): its numerics record}."""
    arch = spec.arch.model_copy(update={"num_layers": check.layers, "vocab_size": check.vocab_rows})
    # The truncated graph's layers split into the spec's P stages too (check.layers ≥ P), balanced.
    stages = stage_layers(balanced_layers(check.layers, spec.parallel.pipeline))
    check_ctx = replace(context, arch=arch, stages=stages, quantized=_first_layers(context.quantized, check.layers),
                        weights_dir=workdir / "check")
    run = PassManager(PIPELINE, disabled=disabled, numerics=gate).run(load_graph(exported.check_path), check_ctx)
    shutil.rmtree(workdir / "check")
    return {(r["pass"], r["rank"]): r["numerics"] for r in run.records if "numerics" in r}


def _first_layers(layers, count: int) -> dict | None:
    """The quantized layers a model of the first ``count`` decoder layers has (only those are read)."""
    if layers is None:
        return None
    keep = lambda name: not name.startswith("layers.") or int(name.split(".")[1]) < count  # noqa: E731
    return {name: layers[name] for name in layers if keep(name)}


def _manager_factory(disabled, options: BuildOptions, tmp: Path):
    def make(gate: Instrument | None, on_record) -> PassManager:
        return PassManager(PIPELINE, disabled=disabled, dump_after=options.dump_after, dump_dir=tmp / "dumps",
                           numerics=gate, weights_dir=tmp / ".export", on_record=on_record)
    make(None, print)  # check ordering constraints and pass names before the slow export
    return make


def _build_engines(spec: Spec, flavor, tmp: Path, graphs: list[str], jobs: int,
                   progress: Progress) -> list[EngineReport]:
    """Each rank's engine, from ``graphs[rank]`` (rankN.onnx, or rankN.paged.onnx for a paged
    engine), in its own subprocess (up to ``jobs`` at once): builder memory is per process."""
    ranks = list(range(spec.world_size))
    with progress.stage(f"engine {', '.join(f'rank{r}' for r in ranks)} ({flavor.name})"):
        reports = map_isolated(build_engine_job, [(tmp / graphs[r], tmp / f"rank{r}.engine", spec, flavor.name)
                                                  for r in ranks], jobs)
    for rank, report in zip(ranks, reports):
        progress.say(f"  rank{rank}.engine: {human_bytes(report.bytes)}, builder process peak RSS "
                     f"{report.peak.describe()}")
    return reports

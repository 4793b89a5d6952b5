"""``trtbuild build``: spec → export → passes per rank → rank ONNX + engine → engine dir."""
from __future__ import annotations

import gc
import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import onnx
import onnx_graphsurgeon as gs

from . import numerics
from .emit.engine_dir import staged
from .emit.manifest import io_table, tool_versions, write_manifest
from .emit.tensorrt import EngineReport, build_engine, check_targets, optimization_profiles, peak_rss_bytes, resolve_flavor
from .frontend.export import export_step
from .passes import PIPELINE, PassContext
from .passes.manager import NumericsGate, PassManager, to_onnx
from .progress import Progress
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
    flavor = resolve_flavor(spec.build.backend)
    check_targets(spec, flavor)
    disabled = frozenset(spec.passes.disable) | options.disable
    progress.say(f"trtbuild: {spec.arch.architecture} from {spec.model.checkpoint} → {options.out} "
                 f"({spec.model.dtype.value}, {flavor.name} {flavor.version}, "
                 f"targets {', '.join(spec.build.targets) or 'portable'})")
    with staged(options.out) as tmp:
        manager_for = _manager_factory(disabled, options, tmp, progress)
        with progress.stage("export (torch.export → ONNX)"):
            exported = export_step(spec)
        reference = _numerics_reference(spec, exported, progress)
        del exported.step  # the torch reference is computed; free its weights before the next stages
        records: list[dict] = []
        cuda_graph_plan: list[int] = []
        for rank in range(spec.world_size):
            with progress.stage(f"passes (rank {rank})"):
                gate = NumericsGate(*reference, spec.passes.atol, spec.passes.rtol) if reference else None
                run = manager_for(gate).run(gs.import_onnx(exported.model), PassContext.for_spec(spec, rank))
            with progress.stage(f"write rank{rank}.onnx"):
                model = to_onnx(run.graph, run.provenance)
                onnx.save_model(model, tmp / f"rank{rank}.onnx", save_as_external_data=True,
                                all_tensors_to_one_file=True, location=f"rank{rank}.onnx.data",
                                size_threshold=1024)
                io = io_table(onnx.load(tmp / f"rank{rank}.onnx", load_external_data=False))
            records += run.records
            if "plan_cuda_graphs" in run.results:
                cuda_graph_plan = run.results["plan_cuda_graphs"].stats["cuda_graph_batch_sizes"]
            del run, model
        del exported
        gc.collect()
        engines = _build_engines(spec, flavor, tmp, options.jobs, progress)
        with progress.stage("manifest"):
            _copy_tokenizer(spec.model.checkpoint, tmp)
            (tmp / "passes.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
            manifest = write_manifest(tmp, {
                "spec": spec.model_dump(mode="json"),
                "spec_sha256": spec.sha256(),
                "model": spec.arch.model_dump(),
                "tensorrt": {"flavor": flavor.name, "version": flavor.version},
                "targets": list(spec.build.targets) or ["portable"],
                "tools": tool_versions(),
                "ranks": [{"rank": r, "engine": f"rank{r}.engine", "onnx": f"rank{r}.onnx",
                           "onnx_data": f"rank{r}.onnx.data"} for r in range(spec.world_size)],
                "io": io,
                "limits": {"max_batch_size": spec.build.max_batch_size,
                           "max_input_len": spec.build.max_input_len,
                           "max_seq_len": spec.build.max_seq_len},
                "profiles": [{"name": name, "shapes": {k: [list(s) for s in v] for k, v in shapes.items()
                                                       if k in ("input_ids", "logits_index")}}
                             for name, shapes in zip(("decode", "prefill"), optimization_profiles(spec))],
                "cuda_graph_batch_sizes": cuda_graph_plan,
                "passes": [r["pass"] for r in records if r["rank"] == 0],
                "tokenizer": "tokenizer.json",
            })
    return BuildSummary(out=options.out, stages=progress.stages, engines=engines,
                        peak_rss_bytes=peak_rss_bytes(), pass_records=records, manifest=manifest)


def _manager_factory(disabled, options: BuildOptions, tmp: Path, progress: Progress):
    def make(gate: NumericsGate | None) -> PassManager:
        return PassManager(PIPELINE, disabled=disabled, dump_after=options.dump_after,
                           dump_dir=tmp / "dumps", numerics=gate, on_record=progress.pass_record)
    make(None)  # check ordering constraints and pass names before the slow export
    return make


def _numerics_reference(spec: Spec, exported, progress: Progress) -> tuple[dict, dict] | None:
    """Seeded inputs and torch eager's outputs on them, or None where the check cannot run."""
    if not spec.passes.numerics:
        return None
    if spec.model.dtype == DType.bfloat16:
        progress.say("  numerics check skipped: ONNX Runtime's CPU kernels do not cover bfloat16")
        return None
    if exported.model.ByteSize() > numerics.MAX_NUMERICS_BYTES:
        progress.say(f"  numerics check skipped: the graph is over {numerics.MAX_NUMERICS_BYTES >> 20} MiB, where "
                     "running every pass in ONNX Runtime would double the build's memory "
                     "(set passes.numerics: false to silence this)")
        return None
    inputs = numerics.seeded_inputs(spec)
    names = [o.name for o in exported.model.graph.output]
    return inputs, numerics.run_torch(exported.step, inputs, names)


def _build_engines(spec: Spec, flavor, tmp: Path, jobs: int, progress: Progress) -> list[EngineReport]:
    def one(rank: int) -> EngineReport:
        with progress.stage(f"engine rank{rank} ({flavor.name})"):
            return build_engine(tmp / f"rank{rank}.onnx", tmp / f"rank{rank}.engine", spec, flavor)

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        return list(pool.map(one, range(spec.world_size)))


def _copy_tokenizer(checkpoint: Path, out: Path) -> None:
    for name in TOKENIZER_FILES:
        if (checkpoint / name).is_file():
            shutil.copyfile(checkpoint / name, out / name)

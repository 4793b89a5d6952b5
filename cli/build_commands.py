"""The builder's commands of the ``trtbuild`` CLI (``build``, ``inspect``, ``plan``, ``medusa``, ``draft``;
trtbuild.cli.main gathers them with the runtime's)."""
from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import click

from ..builder.errors import UserError


@click.command()
@click.argument("spec", type=click.Path(path_type=Path))
@click.option("-o", "--out", type=click.Path(path_type=Path), default=None,
              help="Engine dir to write (default: build/<spec name>). Replaced atomically if it exists.")
@click.option("--dump-after", multiple=True, metavar="PASS",
              help="Write the graph after PASS to OUT/dumps/rankN/NNN_PASS.onnx ('all' for every pass). Repeatable.")
@click.option("--disable-pass", multiple=True, metavar="PASS",
              help="Skip PASS (added to the spec's passes.disable). Repeatable.")
@click.option("--jobs", type=click.IntRange(min=1), default=1, show_default=True,
              help="Rank engines built at once (each in its own process, with its own builder memory: "
                   "≈ 0.2 GB + 2 × the rank's weights).")
@click.option("--ignore-memory-check", is_flag=True,
              help="Build even where a rank's engine would need more RAM than this machine has.")
@click.option("--log-level", type=click.Choice(["error", "info", "debug"]), default="info", show_default=True,
              help="error: only errors and the summary; debug: skipped fusion sites and tracebacks.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON on stdout.")
@click.pass_context
def build(ctx, spec: Path, out: Path | None, dump_after, disable_pass, jobs: int, ignore_memory_check: bool,
          log_level: str, as_json: bool):
    """Build one TensorRT engine per rank from a deployment SPEC (YAML).

    Exports the step graph with torch.export from a meta-device model, streams the checkpoint's
    weights into it one tensor at a time, runs the pass
    pipeline (canonicalize, fuse_rmsnorm, fuse_rotary, fuse_attention, quantize_weights, attach_medusa,
    plan_cuda_graphs)
    with a numerics check after each pass, and writes OUT/rank{N}.onnx, OUT/rank{N}.engine,
    OUT/passes.jsonl and OUT/manifest.json; a paged engine (build.kv_cache_layout, the default for
    one rank: KV in one pool of blocks read through block tables) is compiled from
    OUT/rank{N}.paged.onnx, which shares rank{N}.onnx's weights. Works without a GPU (TensorRT-RTX).

    \b
    Example:
      trtbuild build specs/tiny-code.yaml -o build/tiny-code --dump-after fuse_attention
    """
    from ..builder.build import BuildOptions, build as run_build
    from ..builder.progress import Progress, Verbosity, human_bytes, table
    from ..builder.spec.resolve import load_spec

    ctx.meta["trtbuild.debug"] = log_level == "debug"
    # SIGTERM unwinds like Ctrl-C: the staged dir is removed and worker processes die with us.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    loaded = load_spec(spec)
    options = BuildOptions(out=out or Path("build") / spec.stem, dump_after=frozenset(dump_after),
                           disable=frozenset(disable_pass), jobs=jobs, ignore_memory_check=ignore_memory_check)
    progress = Progress(Verbosity[log_level])
    summary = run_build(loaded, options, progress)
    if as_json:
        click.echo(json.dumps({
            "out": str(summary.out),
            "stages": [{"stage": name, "seconds": round(sec, 3)} for name, sec in summary.stages],
            "engines": [{"rank": i, "bytes": e.bytes, "seconds": round(e.seconds, 3), "weight_bytes": r["weight_bytes"],
                         "peak_rss_bytes": e.peak_rss_bytes}
                        for i, (e, r) in enumerate(zip(summary.engines, summary.manifest["ranks"]))],
            "processes": [{"process": p.name, "peak_rss_bytes": p.peak, "anon_bytes": p.anon, "file_bytes": p.file}
                          for p in summary.processes],
            "peak_rss_bytes": summary.peak_rss_bytes, "dir_bytes": summary.dir_bytes}, indent=2))
        return
    stages = [[name, f"{sec:.1f}"] for name, sec in summary.stages]
    stages.append(["total", f"{sum(sec for _, sec in summary.stages):.1f}"])
    click.echo(table(stages, ["stage", "seconds"]))
    click.echo()
    weights = [r["weight_bytes"] for r in summary.manifest["ranks"]]
    click.echo(table([[f"rank{i}", human_bytes(e.bytes), f"{e.seconds:.1f}", human_bytes(w)]
                      for i, (e, w) in enumerate(zip(summary.engines, weights))],
                     ["engine", "size", "build s", "weights"]))
    click.echo()
    click.echo(table([[p.name, human_bytes(p.peak), human_bytes(p.anon), human_bytes(p.file)] for p in summary.processes],
                     ["process", "peak RSS", "anon", "file"]))
    click.echo(f"\npeak RSS {human_bytes(summary.peak_rss_bytes)}; engine dir {summary.out} "
               f"({human_bytes(summary.dir_bytes)})")


@click.command()
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--rank", type=int, default=None, help="Only this rank's passes.")
@click.option("--pass", "pass_name", default=None, metavar="NAME", help="Only this pass, with its op-count changes.")
@click.option("--node", default=None, metavar="NAME", help="Which pass created this node of the rank graph.")
@click.option("--json", "as_json", is_flag=True, help="Print the manifest and pass records as JSON.")
def inspect(out: Path, rank: int | None, pass_name: str | None, node: str | None, as_json: bool):
    """Show an engine dir: model, TensorRT flavour and targets, file hashes, and the pass log.

    \b
    Example:
      trtbuild inspect build/tiny-code --pass fuse_attention
      trtbuild inspect build/tiny-code --node /model/layers.0/self_attn/Attention
    """
    from ..builder.inspect import load_engine_dir, node_origin, render, select

    manifest, records = load_engine_dir(out)
    bad = integrity(out, manifest)
    if node is not None:
        click.echo(node_origin(out, rank or 0, node))
    elif as_json:
        click.echo(json.dumps({"manifest": manifest, "passes": select(records, rank, pass_name),
                               "integrity": bad or "ok"}, indent=2))
    else:
        click.echo(render(out, manifest, select(records, rank, pass_name), detail=pass_name is not None, bad=bad))
    if bad:  # shown, and the exit code says so: scripts must not ship a dir that fails its hashes
        click.echo(f"error: {bad}", err=True)
        sys.exit(1)


def integrity(out: Path, manifest: dict) -> str | None:
    """None when every file checks out (listed, inside the dir, hashes), else what is wrong: the same
    check the runtime makes before it loads a dir."""
    from ..contract.manifest import ManifestError
    from ..runtime.engine_dir_check import check_engine_dir

    try:
        check_engine_dir(Path(out), manifest)
    except ManifestError as exc:
        return str(exc)
    return None


@click.command()
@click.argument("source", type=click.Path(path_type=Path))
@click.option("--gpu", default="H100-SXM", show_default=True, help="GPU from the table (trtbuild plan --list-gpus).")
@click.option("--gpus", type=click.IntRange(min=1), default=None, help="GPUs available (default: the tensor parallelism).")
@click.option("--precision", type=click.Choice(["fp32", "fp16", "bf16", "fp8", "int8", "w8a8", "int4", "fp4"]),
              default=None, help="Precision of the roofline figures: int8/int4 weight-only, w8a8 int8 GEMMs, fp4 "
                                 "NVFP4 (default: the spec's quantization or dtype, else fp16).")
@click.option("--tp", type=click.IntRange(min=1), default=None, help="Tensor parallelism (default: the spec's, else 1).")
@click.option("--batch", type=click.IntRange(min=1), default=None, help="Batch size (default: the spec's max_batch_size, else 1).")
@click.option("--seq-len", type=click.IntRange(min=1), default=None,
              help="Tokens per sequence (default: the spec's max_seq_len, else the model's context).")
@click.option("--pp", type=click.IntRange(min=1), default=None,
              help="Pipeline stages (default: the spec's parallel.pipeline, else 1).")
@click.option("--network", type=click.Choice(["infiniband-ndr", "infiniband-hdr", "ethernet-400g", "ethernet-100g"]),
              default="infiniband-ndr", show_default=True, help="The link between nodes (pipeline stages).")
@click.option("--kv-cache-memory", "kv_cache_memory", default=None, metavar="BUDGET",
              help="KV-cache budget per rank: bytes (\"1GiB\") or a share in (0, 1] of the memory free once the "
                   "weights are loaded (default: the spec's runtime.kv_cache_memory; unset: every row's whole context).")
@click.option("--list-gpus", is_flag=True, help="Print the GPU table and exit.")
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON.")
def plan(source: Path, gpu: str, gpus, precision, tp, batch, seq_len, pp, network: str, kv_cache_memory,
         list_gpus: bool, as_json: bool):
    """Diagnose the bottleneck before building: memory per rank and the roofline of prefill and decode.

    SOURCE is a spec (YAML), a checkpoint dir holding at least config.json (no weights needed), a .gguf file,
    or a known model's name (llama-3-8b, llama-3-70b, llama-3.1-405b, mistral-7b, qwen2.5-7b: their published
    config.json ships with trtbuild). A spec whose checkpoint is not here is planned from the
    known model its checkpoint dir names, if any (said on stderr).

    \b
    Example:
      trtbuild plan specs/llama-3-8b.yaml --gpu L40S
      trtbuild plan llama-3-70b --gpu H200 --precision fp8
      trtbuild plan /models/Llama-2-70b-hf --gpu A100-80GB --precision int8
      trtbuild plan llama-3.1-405b --gpu H100-SXM --tp 8 --pp 2 --network infiniband-ndr

    Every plan ends with the layout the model needs on nodes of the GPU (node_gpus in the
    table): the fewest GPUs whose ranks fit, tensor parallelism inside a node and pipeline
    stages across nodes. With --pp > 1 it also prints each stage's memory per rank, the
    activations handed between stages (and over the network), and the pipeline bubble.
    """
    from ..checkpoint.gguf_config import is_gguf
    from ..builder.frontend.checkpoint import arch_config
    from ..builder.gpus import find_gpu, gpu_table, network_table
    from ..builder.known_models import find_known, known_arch, known_names
    from ..builder.plan.build_cost import draft_head_bytes
    from ..builder.plan.estimate import Plan, medusa_plan, speculation_plan, workload_for
    from ..builder.plan.model_size import QUANTIZATION_PRECISION, param_counts
    from ..builder.plan.advice import plan_report
    from ..builder.plan.pipeline import PipelinePlan, recommend_layout
    from ..builder.plan.render import render, render_pipeline
    from ..builder.spec.resolve import load_spec
    from ..builder.spec.checks import tensor_parallel_refusal

    if list_gpus:
        for entry in gpu_table().values():
            click.echo(f"{entry['name']:<10} {entry['sm']:<6} {entry['memory_gb']:>4} GB  {entry['bandwidth_gbps']:>5} GB/s  "
                       f"{entry['tflops']['float16']:>6} TFLOP/s fp16  ({entry['source']})")
        return
    spec = None
    if is_gguf(source):
        arch = arch_config(source)
    elif source.is_file():
        spec = load_spec(source, absent_checkpoint=_stand_in_arch)
        arch = spec.arch
    elif source.is_dir():
        arch = arch_config(source)
    elif (known := find_known(str(source))) is not None:
        arch = known_arch(known)
        click.echo(f"note: planning {known} from its shipped config.json (builder/data/models)", err=True)
    else:
        raise UserError(f"{source}: neither a spec file, a checkpoint dir, a .gguf file nor a known model "
                        f"({', '.join(known_names())})")
    precision = precision or (QUANTIZATION_PRECISION.get(spec.quantization.mode) if spec else None) \
        or (spec.model.dtype.short if spec else "fp16")
    tp = tp or (spec.parallel.tensor if spec else 1)
    refusal = tensor_parallel_refusal(arch, tp)
    if refusal is not None:
        raise UserError(f"--tp: {refusal}")
    pp = pp or (spec.parallel.pipeline if spec else 1)
    if pp > arch.num_layers:
        raise UserError(f"--pp: {pp} stages for {arch.num_layers} layers; at most one stage per layer")
    gpus = gpus or tp * pp
    if tp * pp > gpus:
        raise UserError(f"--tp × --pp: {tp * pp} ranks are more than --gpus {gpus}")
    result = Plan(arch=arch, gpu=find_gpu(gpu), gpus=gpus, tp=tp, precision=precision,
                  workload=workload_for(spec, arch, batch, seq_len, precision, kv_budget(kv_cache_memory)),
                  counts=param_counts(arch),
                  medusa=medusa_plan(spec) if spec is not None and spec.medusa is not None else None,
                  speculation=speculation_plan(spec) if spec is not None and spec.speculation is not None else None,
                  backend=spec.build.backend.value if spec else None, targets=spec.build.targets if spec else (),
                  draft_bytes=draft_head_bytes(spec))
    split = spec.parallel.layers_per_stage if spec is not None and pp == spec.parallel.pipeline else ()
    if spec is not None and spec.parallel.layers_per_stage and not split:
        click.echo(f"note: --pp {pp} is not the spec's pipeline {spec.parallel.pipeline}: its "
                   "parallel.layers_per_stage is left out and the layers are balanced", err=True)
    pipe = PipelinePlan(result, pp, network_table()[network], split)
    layout = recommend_layout(result, pipe.network)
    if as_json:
        click.echo(json.dumps({**plan_report(result), "pipeline": pipe.as_dict(),
                               "layout": None if layout is None else layout.as_dict()}, indent=2))
    else:
        click.echo("\n".join([render(result), "", *render_pipeline(pipe, layout)]))




def kv_budget(value: str | None):
    """--kv-cache-memory as a budget (contract.kv_budget), or a one-line error naming the option."""
    from ..contract.kv_budget import parse_kv_cache_memory

    try:
        return None if value is None else parse_kv_cache_memory(value)
    except ValueError as exc:
        raise UserError(f"--kv-cache-memory: {exc}") from None


def _stand_in_arch(checkpoint: Path):
    """``plan`` needs only the architecture: a spec's absent checkpoint may be a known model."""
    from ..builder.known_models import arch_for_absent_checkpoint

    found = arch_for_absent_checkpoint(checkpoint)
    if found is None:
        return None
    name, arch = found
    click.echo(f"note: model.checkpoint {checkpoint} is not here; planning with the shipped config.json of "
               f"{name} (architecture only)", err=True)
    return arch


@click.group()
def medusa() -> None:
    """Medusa speculative-decoding heads: train them for a checkpoint."""


@medusa.command("train")
@click.argument("checkpoint", type=click.Path(path_type=Path))
@click.option("--data", "data", multiple=True, required=True, type=click.Path(path_type=Path),
              help="Text file to train on (tokenized with the checkpoint's tokenizer). Repeatable.")
@click.option("--heads", type=int, default=4, show_default=True, help="Number of heads K (head k guesses token t+k+2).")
@click.option("--layers", type=int, default=1, show_default=True, help="Residual blocks per head.")
@click.option("-o", "--out", type=click.Path(path_type=Path), required=True, help="Heads dir to write.")
@click.option("--steps", type=click.IntRange(min=1), default=300, show_default=True)
@click.option("--sequences", type=click.IntRange(min=4), default=640, show_default=True,
              help="Sequences of --seq-len tokens taken from the data (5% held out for accuracy).")
@click.option("--seq-len", type=int, default=256, show_default=True)
@click.option("--batch", type=click.IntRange(min=1), default=4, show_default=True, help="Sequences per step.")
@click.option("--lr", type=float, default=1e-3, show_default=True)
@click.option("--self-distill/--no-self-distill", default=True, show_default=True,
              help="Train on the model's own greedy continuations of data prompts (what greedy verification accepts).")
@click.option("--train-out/--freeze-out", default=True, show_default=True,
              help="Train each head's vocabulary projection, or keep it the base LM head's (a third less work "
                   "per step: what a real vocabulary on a CPU needs).")
@click.option("--seed", type=int, default=0, show_default=True)
def medusa_train(checkpoint: Path, data, heads: int, layers: int, out: Path, steps: int, sequences: int,
                 seq_len: int, batch: int, lr: float, self_distill: bool, train_out: bool, seed: int):
    """Train Medusa-1 heads on a frozen CHECKPOINT; writes the public Medusa layout.

    OUT gets medusa_lm_head.safetensors and config.json (medusa_num_heads,
    medusa_num_layers, and each head's held-out top-1..top-10 accuracy, which the
    build uses to shape its default tree).

    \b
    Example:
      trtbuild medusa train models/tiny-code --data train.txt --heads 4 -o models/tiny-code/medusa
    """
    _check_checkpoint(checkpoint)
    _train_medusa(checkpoint, list(data), out, heads=heads, layers=layers, seq_len=seq_len, sequences=sequences,
                  steps=steps, batch=batch, lr=lr, self_distill=self_distill, train_out=train_out, seed=seed)


def _check_checkpoint(checkpoint: Path) -> None:
    from ..checkpoint.gguf_config import is_gguf

    if not (is_gguf(checkpoint) or (checkpoint / "config.json").is_file()):
        raise UserError(f"{checkpoint}: neither a checkpoint dir (no config.json) nor a .gguf file")


def _train_medusa(checkpoint: Path, data: list[Path], out: Path, **settings) -> None:
    from ..builder.medusa.train import TrainOptions, train_heads
    from ..builder.progress import table

    options = TrainOptions(**settings)
    report = train_heads(checkpoint, data, out, options, progress=lambda m: click.echo(m, err=True))
    rows = [[f"head {k} (t+{k + 2})", f"{acc[0]:.3f}", f"{acc[4]:.3f}", f"{acc[9]:.3f}"]
            for k, acc in enumerate(report.heads.topk_accuracy)]
    click.echo(table(rows, ["head", "top-1", "top-5", "top-10"]))
    click.echo(f"\n{report.train_tokens} training tokens, {report.eval_tokens} held-out, final loss "
               f"{report.final_loss:.3f}, {report.seconds:.0f} s; heads written to {out}")




@click.group()
def draft() -> None:
    """Trained drafts for speculative decoding: an EAGLE-3-style draft head, or Medusa heads."""


_HEAD_ONLY = ("draft_vocab", "ttt_depth", "taps", "precision")
_MEDUSA_ONLY = ("heads", "layers", "train_out")


@draft.command("train")
@click.argument("checkpoint", type=click.Path(path_type=Path))
@click.option("--data", "data", multiple=True, required=True, type=click.Path(path_type=Path),
              help="Text file to train on (tokenized with the checkpoint's tokenizer; each file gives an equal "
                   "share of the windows). Repeatable.")
@click.option("-o", "--out", type=click.Path(path_type=Path), required=True, help="Draft dir to write.")
@click.option("--kind", type=click.Choice(["head", "medusa"]), default="head", show_default=True,
              help="head: one decoder layer over three of the target's layers, a reduced vocabulary (EAGLE-3 "
                   "style); medusa: Medusa-1 heads over the last hidden state (as `trtbuild medusa train`).")
@click.option("--draft-vocab", type=int, default=None,
              help="[head] Draft vocabulary K: the target's K most frequent argmaxes (default 8192, at most the "
                   "target's vocabulary).")
@click.option("--ttt-depth", type=int, default=None, help="[head] Draft depths unrolled in training (default 3).")
@click.option("--taps", default=None, metavar="A,B,C",
              help="[head] The three decoder layers (0-based) whose outputs feed the draft (default: low, middle, "
                   "high: layers 2, L/2, L-3).")
@click.option("--precision", type=click.Choice(["auto", "float32", "bfloat16"]), default=None,
              help="[head] The training passes' matmuls: bfloat16 (torch autocast; weights and optimizer stay "
                   "float32) ran 1.6x faster on a CPU with AMX; auto (default) takes it where the CPU has AMX.")
@click.option("--prompt-len", type=int, default=None,
              help="Data tokens each self-distilled window starts from (default 32)." )
@click.option("--heads", type=int, default=None, help="[medusa] Number of heads (default 4).")
@click.option("--layers", type=int, default=None, help="[medusa] Residual blocks per head (default 1).")
@click.option("--train-out/--freeze-out", default=None, help="[medusa] Train each head's vocabulary projection.")
@click.option("--steps", type=int, default=None, help="Optimizer steps (default: head 360, medusa 300).")
@click.option("--sequences", type=int, default=None,
              help="Windows of --seq-len tokens from the data, 5% held out (default: head 240, medusa 640).")
@click.option("--seq-len", type=int, default=None, help="Tokens per window (default: head 160, medusa 256).")
@click.option("--batch", type=int, default=None, help="Windows per step (default 4).")
@click.option("--lr", type=float, default=None, help="Peak learning rate (default: head 2e-3, medusa 1e-3).")
@click.option("--self-distill/--no-self-distill", default=True, show_default=True,
              help="Train on the target's own greedy continuations of data prompts (what greedy verification "
                   "accepts), or on the data as it is.")
@click.option("--seed", type=int, default=0, show_default=True)
def draft_train(checkpoint: Path, data, out: Path, kind: str, **settings):
    """Train a draft for a frozen CHECKPOINT (a checkpoint dir or a .gguf file) by self-distillation.

    With --kind head, OUT gets draft_head.json (shapes, taps, the held-out accuracies against the
    target's argmax, what it was trained on) and draft_head.safetensors; with --kind medusa, the
    public Medusa layout. Progress and an ETA go to stderr; the held-out table to stdout.

    \b
    Example:
      python tools/training_text.py -o text.txt --max-chars 700000
      python benchmarks/chat_instructions.py --gguf model.gguf -o chat.txt
      trtbuild draft train model.gguf --data text.txt --data chat.txt -o model-draft
    """
    _check_checkpoint(checkpoint)
    given = {name: value for name, value in settings.items() if value is not None}
    wrong = _MEDUSA_ONLY if kind == "head" else _HEAD_ONLY
    for name in wrong:
        if name in given:
            raise UserError(f"--{name.replace('_', '-')}: not an option of --kind {kind}")
    if kind == "medusa":
        _train_medusa(checkpoint, list(data), out, **given)
        return
    if "taps" in given:
        given["taps"] = _tap_list(given["taps"])
    if "precision" in given:
        from ..builder.draft_head.train import TrainPrecision

        given["precision"] = TrainPrecision(given["precision"])
    _train_draft_head(checkpoint, list(data), out, given)


def _tap_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise UserError(f"--taps {text!r}: three comma-separated layer indices expected, e.g. 2,15,27") from None


def _train_draft_head(checkpoint: Path, data: list[Path], out: Path, settings: dict) -> None:
    from ..builder.draft_head.train import DraftTrainOptions, train_draft_head
    from ..builder.progress import table

    report = train_draft_head(checkpoint, data, out, DraftTrainOptions(**settings),
                              progress=lambda m: click.echo(m, err=True))
    acc, training = report.config.accuracy, report.config.training
    rows = [["depth 1", f"{acc['top1']:.3f}", f"{acc['top5']:.3f}"]]
    rows += [[f"depth {j + 2}", f"{top1:.3f}", ""] for j, top1 in enumerate(acc["by_depth_top1"][1:])]
    rows += [["best unigram", f"{acc['unigram_top1']:.3f}", ""]]
    click.echo(table(rows, ["held-out vs target argmax", "top-1", "top-5"]))
    click.echo(f"\nvocabulary {report.config.draft_vocab_size} covers {acc['vocab_coverage']:.1%} of held-out "
               f"argmaxes; {training['windows']} windows, {training['steps']} steps, {report.seconds:.0f} s, "
               f"peak RSS {training['peak_rss_mib']} MiB; draft head written to {out}")

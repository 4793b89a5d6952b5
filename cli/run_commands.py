"""Runtime commands of the ``trtbuild`` CLI (gathered by trtbuild.cli.main)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import click

BACKENDS = click.Choice(["auto", "tensorrt", "onnxruntime"])


MEDUSA_TREE_SIZE = click.option(
    "--medusa-tree-size", type=click.IntRange(min=0), default=None,
    help="Engine dirs with Medusa heads: guesses verified per step. Default: chosen per batch from "
         "measured step times and acceptance (off where it does not pay); 0: no speculation.")


def _sources(ctx, param, value: str | None):
    """--speculation's value as sources: None (the engine dir's), () for "none", or the names given."""
    from ..contract.speculation import Source

    if value is None:
        return None
    if value.strip() == "none":
        return ()
    names = [n.strip() for n in value.split(",") if n.strip()]
    valid = ", ".join(s.value for s in Source)
    try:
        return tuple(Source(n) for n in names) or None
    except ValueError:
        raise click.BadParameter(f"{value!r}: a comma-separated list of {valid}, or none") from None


def SPECULATION(command):
    """--speculation, --speculation-mode and --draft-tree-width, for the commands that load an engine dir."""
    command = click.option(
        "--draft-tree-width", type=click.IntRange(min=1), default=None,
        help="Engine dirs with a draft head: tokens its drafts offer at each depth of a greedy or seeded "
             "request's chain (the chain's and the next likeliest), a tree the adaptive policy prunes to "
             "what pays; 1: chains only. Default: 3.")(command)
    command = click.option(
        "--speculation-mode", type=click.Choice(["adaptive", "always"]), default="adaptive", show_default=True,
        help="adaptive: verify drafts only where measured step times and acceptance say it pays (plain "
             "decoding elsewhere); always: verify every draft a source has.")(command)
    return click.option(
        "--speculation", callback=_sources, default=None, metavar="SOURCES",
        help="Draft sources to speculate with: a comma-separated list of medusa, prompt_lookup, suffix, draft_head (those "
             "the engine dir was built for), or none. Default: the engine dir's (its spec's speculative section).")(command)


MULTI_STEP = click.option(
    "--multi-step", type=click.IntRange(min=1), default=None,
    help="Greedy decode steps a batch runs back to back before its tokens are detokenized and "
         "streamed (text comes in pieces of up to N tokens); a stop or eos id, an arrival or an "
         "abort ends a run early. 1: every step. Default: the spec's runtime.multi_step (8).")


def _budget(ctx, param, value: str | None):
    """--kv-cache-memory's value as a budget (contract.kv_budget), or click's exit-2 error naming it."""
    from ..contract.kv_budget import parse_kv_cache_memory

    try:
        return None if value is None else parse_kv_cache_memory(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


KV_CACHE_MEMORY = click.option(
    "--kv-cache-memory", callback=_budget, default=None, metavar="BUDGET",
    help="KV-cache budget: bytes (\"1GiB\", \"512MiB\") or a share in (0, 1] of the memory available at load. "
         "Requests draw blocks from it as they grow; when it runs dry the newest is preempted and recomputed "
         "later. Default: the spec's runtime.kv_cache_memory, else room for every row's max_seq_len.")


def _load(out: Path, backend: str, threads: int, multi_step: int | None, prefix_cache: bool | None = None,
          batching: str = "inflight", medusa_tree_size: int | None = None, speculation=None,
          speculation_mode: str = "adaptive", kv_cache_memory=None, draft_tree_width: int | None = None):
    from ..runtime.engine_dir import EngineDirError
    from ..runtime.llm import LLM
    from ..runtime.core.scheduler import Batching
    from ..runtime.speculation.adaptive import SpeculationMode

    try:
        return LLM(out, backend=backend, threads=threads, prefix_cache=prefix_cache, batching=Batching(batching),
                   medusa_tree_size=medusa_tree_size, multi_step=multi_step, speculation=speculation,
                   speculation_mode=SpeculationMode(speculation_mode), kv_cache_memory=kv_cache_memory,
                   draft_tree_width=draft_tree_width)
    except (EngineDirError, ValueError) as exc:
        _fail(str(exc))


def _fail(message: str):
    """One line on stderr, exit code 2: the user's input is what needs fixing."""
    click.echo(f"error: {message}", err=True)
    sys.exit(2)


@click.command()
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--prompt", required=True, help="Text to continue.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=None, help="New tokens (default: the spec's runtime.max_tokens).")
@click.option("--temperature", type=click.FloatRange(min=0), default=None, help="0 is greedy (default: the spec's).")
@click.option("--top-k", type=click.IntRange(min=0), default=None)
@click.option("--top-p", type=click.FloatRange(min=0, min_open=True, max=1), default=None)
@click.option("--seed", type=int, default=None, help="Seed for sampling.")
@click.option("--stop", multiple=True, help="Stop string (repeatable); the output ends before it.")
@click.option("--stream", is_flag=True, help="Print tokens as they are produced.")
@click.option("--backend", type=BACKENDS, default="auto", show_default=True,
              help="tensorrt runs rankN.engine on a GPU; onnxruntime runs rankN.onnx on CPU.")
@click.option("--threads", type=click.IntRange(min=0), default=0, help="CPU threads for onnxruntime (0: all cores).")
@MEDUSA_TREE_SIZE
@SPECULATION
@MULTI_STEP
@KV_CACHE_MEMORY
@click.option("--json", "as_json", is_flag=True, help="Print {text, token_ids, finish_reason} as JSON.")
def run(out: Path, prompt: str, max_tokens, temperature, top_k, top_p, seed, stop, stream: bool, backend: str,
        threads: int, medusa_tree_size, speculation, speculation_mode: str, draft_tree_width, multi_step, kv_cache_memory,
        as_json: bool):
    """Generate a completion of --prompt with the engines in OUT.

    A tensor-parallel engine dir starts one process per rank on this machine; across machines,
    launch every rank with torchrun (rank 0 prints the result):

    \b
    Example:
      trtbuild run build/tiny-code --prompt "def fibonacci(n):" --max-tokens 48 --stream
      torchrun --standalone --nproc-per-node 2 -m trtbuild.cli run build/tiny-tp2 --prompt "def f(x):"
    """
    from ..runtime.parallel.tensor_parallel import RankFailure

    llm = _load(out, backend, threads, multi_step, medusa_tree_size=medusa_tree_size, speculation=speculation,
                speculation_mode=speculation_mode, kv_cache_memory=kv_cache_memory, draft_tree_width=draft_tree_width)
    try:
        _run(llm, prompt, max_tokens, temperature, top_k, top_p, seed, stop, stream, as_json)
    except RankFailure as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
    finally:
        llm.close()


def _run(llm, prompt: str, max_tokens, temperature, top_k, top_p, seed, stop, stream: bool, as_json: bool) -> None:
    overrides = {k: v for k, v in dict(max_tokens=max_tokens, temperature=temperature, top_k=top_k,
                                       top_p=top_p).items() if v is not None}
    try:
        params = llm.default_params(seed=seed, stop=tuple(stop), **overrides)
        if stream:
            click.echo(prompt, nl=False)
            for delta in llm.stream(prompt, params):
                click.echo(delta.text, nl=False)
            click.echo()
            return
        (completion,) = llm.generate([prompt], params)
    except ValueError as exc:
        _fail(str(exc))
    if as_json:
        click.echo(json.dumps({"text": completion.text, "token_ids": completion.token_ids,
                               "finish_reason": completion.finish_reason}))
        return
    click.echo(prompt + completion.text)
    medusa = (f", {completion.decode_steps} decode steps ({completion.accepted_tokens} draft tokens accepted)"
              if llm.speculation is not None else "")
    click.echo(f"[{len(completion.token_ids)} tokens, {completion.finish_reason}, backend {llm.backend_label}, "
               f"ttft {completion.ttft_s * 1000:.1f} ms{medusa}]", err=True)


@click.command()
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--workload", default="skewed", show_default=True,
              help="A preset (skewed, uniform, shared-prefix) or a JSON-lines file of {prompt, max_tokens}.")
@click.option("--mode", type=click.Choice(["inflight", "static"]), default="inflight", show_default=True,
              help="static admits a new batch only when the whole previous batch has finished.")
@click.option("--prefix-cache", type=click.Choice(["on", "off"]), default="on", show_default=True)
@click.option("--backend", type=BACKENDS, default="auto", show_default=True)
@click.option("--threads", type=click.IntRange(min=0), default=0, help="CPU threads for onnxruntime (0: all cores).")
@MEDUSA_TREE_SIZE
@SPECULATION
@MULTI_STEP
@KV_CACHE_MEMORY
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON.")
def bench(out: Path, workload: str, mode: str, prefix_cache: str, backend: str, threads: int, medusa_tree_size,
          speculation, speculation_mode: str, draft_tree_width, multi_step, kv_cache_memory, as_json: bool):
    """Serve a workload from OUT and report requests/s, output tokens/s, TTFT and inter-token latency.

    \b
    Example:
      trtbuild bench build/tiny-code --workload skewed --mode static
    """
    from ..runtime import bench as benchmark

    llm = _load(out, backend, threads, multi_step, prefix_cache=prefix_cache == "on", batching=mode,
                medusa_tree_size=medusa_tree_size, speculation=speculation, speculation_mode=speculation_mode,
                kv_cache_memory=kv_cache_memory, draft_tree_width=draft_tree_width)
    d = llm.engine_dir
    try:
        load = (benchmark.load_workload(Path(workload), llm.tokenizer) if Path(workload).is_file()
                else benchmark.preset(workload, d.vocab_size, d.max_seq_len))
        result = benchmark.run(llm, load)
    except ValueError as exc:
        _fail(f"--workload: {exc}")
    kv = llm.scheduler.kv
    figures = {"mode": mode, "prefix_cache": prefix_cache, "backend": llm.backend, **result.as_dict(),
               "kv_blocks": kv.num_blocks, "kv_block_size": kv.block_size, "preemptions": kv.stats.preemptions}
    if llm.speculation is not None:
        figures["speculation"] = llm.speculation.stats.as_dict()
    if as_json:
        click.echo(json.dumps(figures, indent=2))
        return
    width = max(map(len, figures))
    for key, value in figures.items():
        click.echo(f"{key.ljust(width)}  {value}")


@click.command(name="eval")
@click.argument("target", type=click.Path(path_type=Path))
@click.option("--data", type=click.Path(path_type=Path), required=True, help="Text file to score.")
@click.option("--context", type=click.IntRange(min=2), default=512, show_default=True, help="Tokens per window.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=None, help="Score only the first N tokens.")
@click.option("--reference", type=click.Path(path_type=Path), default=None,
              help="Checkpoint or engine dir to compare top-1 predictions with (greedy agreement).")
@click.option("--threads", type=click.IntRange(min=0), default=0, help="CPU threads for onnxruntime (0: all cores).")
@click.option("--json", "as_json", is_flag=True)
def evaluate(target: Path, data: Path, context: int, max_tokens, reference, threads: int, as_json: bool):
    """Perplexity of TARGET (an engine dir, run in ONNX Runtime, or a checkpoint dir) on --data.

    \b
    Example:
      trtbuild eval build/tiny-int4 --data models/tiny-code/heldout.txt --reference models/tiny-code
    """
    from ..runtime.evaluate import evaluate as run_eval

    if not data.is_file():
        _fail(f"--data: {data} is not a file")
    try:
        result = run_eval(target, data, context, max_tokens, reference, threads)
    except ValueError as exc:
        _fail(str(exc))
    if as_json:
        click.echo(json.dumps(result.as_dict(), indent=2))
        return
    line = f"{target}: perplexity {result.perplexity:.3f} over {result.tokens} tokens (windows of {result.context})"
    if result.cpu_activations == "int8":
        line += " with int8 activations (quantization.cpu_activations)"
    if result.agreement is not None:
        line += f"; greedy agreement with {reference}: {100 * result.agreement:.1f}%"
    click.echo(line)

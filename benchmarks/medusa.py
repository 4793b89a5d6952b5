#!/usr/bin/env python3
"""Medusa benchmark on the bundled model or the real one (ONNX Runtime backend, CPU, greedy).

    python benchmarks/medusa.py [--model tiny-code|smollm2] [--engine-dir DIR] [--prompts 8] [--tokens 128]
                                [--repeat 3] [--fixed N ...] [--json]

Builds the model's Medusa spec into a temporary dir unless --engine-dir is given. --model
tiny-code (the default): specs/tiny-code-medusa.yaml, prompts are 32-token windows of the
held-out text (models/tiny-code/heldout.txt). --model smollm2: specs/smollm2-135m-medusa.yaml
(SmolLM2-135M-Instruct with self-distilled heads, docs/benchmarks.md), prompts are instructions
made from held-out stdlib modules' docstrings rendered with the engine dir's chat template
(benchmarks/chat_instructions.py). Every request generates --tokens tokens (ignore_eos). Side by
side on the same engine dir:
  * plain decoding (speculation off: multi-step greedy runs, whose steps skip the heads as on an
    engine dir without them), and the same with the heads computed in every step (what plain
    decoding on a Medusa dir cost before the decode graph held them behind draft_heads),
    the full default tree, each --fixed tree prefix, and the adaptive policy, at batch 1 (requests one after another)
    and batch 8 (3 × 8 requests in flight, 8 slots), each run --repeat times (a fresh LLM
    each; calibration at load is not timed), the modes taking turns within each round; the
    median tok/s is reported, and the median over rounds of each mode's ratio to plain's run
    in the same round;
  * mean accepted tokens per engine step with the default tree (target >= 2.0);
  * speed-up over plain: adaptive never below 0.97x at any batch (it steps aside into runs
    where a tree does not pay), >= 1.3x at batch 1 where verification can pay;
  * the step-time-vs-tokens curve (calibrated at load) and a greedy run's step, which explain
    the numbers.
Every mode's tokens are checked to equal plain decoding's. The 1-minute load average at the
start and end is printed: on a shared machine the absolute tok/s move with it, the paired ratios
much less.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
from trtbuild.builder.progress import table as format_table  # noqa: E402


def build_engine(spec: Path, out: Path) -> None:
    subprocess.run([sys.executable, "-m", "trtbuild.cli", "build", str(spec), "-o", str(out),
                    "--log-level", "error"], check=True, capture_output=True)


def heldout_prompts(engine: Path, tokenizer, count: int, length: int = 32) -> list[list[int]]:
    ids = tokenizer.encode((REPO / "models" / "tiny-code" / "heldout.txt").read_text()).ids
    stride = (len(ids) - length) // count
    return [ids[i * stride:i * stride + length] for i in range(count)]


def _heads_in_every_step_engine(*args, **kwargs):
    """The CPU engine as before the decode graph held the Medusa heads behind draft_heads: every
    plain decode step, a greedy run's included, computes them (a comparison, not a runtime mode)."""
    from trtbuild.runtime.backends.onnxruntime.engine import OnnxRuntimeEngine

    class HeadsInEveryStep(OnnxRuntimeEngine):
        def _filled(self, step, draft):
            return super()._filled(step, draft=True)

    return HeadsInEveryStep(*args, **kwargs)


def chat_prompts(engine: Path, tokenizer, count: int) -> list[list[int]]:
    """``count`` held-out instructions, spread over the modules, in the engine dir's chat template."""
    from chat_instructions import instructions, rendered
    from trtbuild.runtime.engine_dir import load
    from trtbuild.runtime.server.chat import chat_template

    texts = instructions("heldout")
    picked = [texts[i * len(texts) // count] for i in range(count)]
    return [tokenizer.encode(p, add_special_tokens=False).ids for p in rendered(chat_template(load(engine)), picked)]


# --model: the spec built when no --engine-dir is given, and the prompts that suit the model.
MODELS = {"tiny-code": (REPO / "specs" / "tiny-code-medusa.yaml", heldout_prompts),
          "smollm2": (REPO / "specs" / "smollm2-135m-medusa.yaml", chat_prompts)}


def run(engine: Path, prompts: list[list[int]], tokens: int, batch: int, size: int | None, threads: int,
        skip_idle_heads: bool = True) -> dict:
    """One mode's timed generation. The LLM is closed before returning: every mode of every round
    kept alive held ~250 MiB and a spinning thread pool each (30 of them with --repeat 5).
    ``skip_idle_heads`` False: a multi-step run's steps compute the heads too (as before the
    decode graph held them behind draft_heads), the engine otherwise the same."""
    from trtbuild.runtime.engine_dir import load
    from trtbuild.runtime.core.kv_budget import RowMemory, kv_manager_for
    from trtbuild.runtime.llm import LLM
    from trtbuild.runtime.core.sampling import SamplingParams

    d = load(engine)
    # LLM's default budget (no kv_cache_memory): its engine's prefix store has one block per budget block.
    blocks = kv_manager_for(d, None, d.kv_block_size, True, RowMemory.pages).num_blocks
    own = None if skip_idle_heads else _heads_in_every_step_engine(d, threads=threads, prefix_blocks=blocks,
                                                                   block_size=d.kv_block_size)
    llm = LLM(engine, backend="onnxruntime", threads=threads, medusa_tree_size=size, engine=own)
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=8, ignore_eos=True))  # warm-up
    llm.stats.__init__()
    spec_stats = llm.speculation.stats if llm.speculation else None
    if spec_stats is not None:
        spec_stats.__init__(head_tried=[0] * len(spec_stats.head_tried),
                            head_accepted=[0] * len(spec_stats.head_accepted))
    start = time.perf_counter()
    if batch == 1:
        outs = [llm.generate([p], params)[0] for p in prompts]
    else:
        outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    generated = sum(len(o.token_ids) for o in outs)
    result = {"seconds": seconds, "tok_per_s": generated / seconds, "tokens": [o.token_ids for o in outs],
              "steps": llm.stats.decode_steps}
    if spec_stats is not None:
        result.update(spec_stats.as_dict())
        times = llm.speculation.times
        result["step_times"] = ({b: dict(row) for b, row in times.table.items()}, dict(times.runs))
    llm.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny-code",
                        help="the Medusa spec built without --engine-dir, and the prompts asked")
    parser.add_argument("--engine-dir", type=Path, default=None)
    parser.add_argument("--prompts", type=int, default=8, help="requests at batch 1 (3x as many at batch 8)")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3, help="rounds (each mode once per round); medians reported")
    parser.add_argument("--fixed", type=int, nargs="*", default=[],
                        help="tree prefixes of N choices to run as modes of their own (what the policy chooses between)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    say = (lambda m: print(m, file=sys.stderr, flush=True)) if args.json else print
    from tokenizers import Tokenizer

    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        spec, make_prompts = MODELS[args.model]
        engine = args.engine_dir
        if engine is None:
            engine = Path(tmp) / spec.stem
            say(f"building specs/{spec.name} ...")
            build_engine(spec, engine)
        tokenizer = Tokenizer.from_file(str(engine / "tokenizer.json"))
        tree_nodes = len(json.loads((engine / "manifest.json").read_text())["medusa"]["tree"])
        rows, results, curve = [], {}, None
        modes = (("plain", 0), ("plain, heads in every step", 0), (f"default tree ({tree_nodes} nodes)", tree_nodes),
                 *((f"tree prefix ({n} nodes)", n) for n in args.fixed), ("adaptive", None))
        for batch, count in ((1, args.prompts), (8, 3 * args.prompts)):
            prompts = make_prompts(engine, tokenizer, count)
            # Rounds: every mode once per round, back to back, so a slow spell of this shared
            # machine hits the modes of a round alike; ratios pair each mode with plain's run of
            # the same round, and the median round ratio is reported.
            rounds = []
            for round_index in range(args.repeat):
                say(f"batch {batch}: round {round_index + 1}/{args.repeat} ...")
                rounds.append({mode: run(engine, prompts, args.tokens, batch, size, args.threads,
                                         skip_idle_heads="heads in every step" not in mode)
                               for mode, size in modes})
            for mode, size in modes:
                by_speed = sorted(rounds, key=lambda r: r[mode]["tok_per_s"])
                result = by_speed[len(by_speed) // 2][mode]
                if size is None:
                    curve = result["step_times"]
                ratio = statistics.median(r[mode]["tok_per_s"] / r["plain"]["tok_per_s"] for r in rounds)
                results[(batch, mode)] = result
                same = all(r[mode]["tokens"] == r["plain"]["tokens"] for r in rounds)
                rows.append([str(batch), mode, f"{result['tok_per_s']:.0f}", f"{ratio:.2f}x",
                             f"{result.get('mean_tokens_per_step', 1.0):.2f}", str(result["steps"]),
                             str(result.get("steps_saved", 0)),
                             " ".join(f"{a:.2f}" for a in result.get("head_acceptance", [])) or "-",
                             ",".join(f"{s}:{c}" for s, c in result.get("tree_sizes", {}).items()) or "-",
                             "yes" if same else "NO"])
        times, runs = curve
        curve = [[str(s), *(f"{1000 * times[b][s]:.2f}" if s in times.get(b, {}) else "-" for b in sorted(times))]
                 for s in sorted({s for row in times.values() for s in row})]
        curve.append(["run step", *(f"{1000 * runs[b]:.2f}" if b in runs else "-" for b in sorted(times))])
    load = {"start": round(load_start, 2), "end": round(os.getloadavg()[0], 2)}
    if args.json:
        print(json.dumps({"rows": [dict(zip(HEADER, r)) for r in rows], "load_average_1min": load,
                          "step_ms": {b: {s: round(1000 * t, 3) for s, t in row.items()} for b, row in times.items()}},
                         indent=2))
        return
    print()
    print(format_table(rows, HEADER))
    print("\nengine step time (ms, calibrated at load, refined while decoding) by tokens per row S and batch B;\n"
          "'run step': a step of a multi-step greedy run (plain decoding), its commit included:")
    print(format_table(curve, ["S", *(f"B={b}" for b in sorted(times))]))
    print(f"\nload average (1 min): {load['start']} at the start, {load['end']} at the end ({os.cpu_count()} cores)")


HEADER = ["batch", "mode", "tok/s", "vs plain", "tokens/step", "decode steps", "steps saved",
          "head acceptance", "tree sizes (S:steps)", "same tokens"]

if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Tensor and pipeline parallelism on the bundled model, side by side in one run:
T×P = 1×1, 2×1, 4×1 (tensor), 1×2, 1×4 (pipeline stages) and 2×2.

    python benchmarks/parallel.py [--json] [--tokens 64] [--grid 1x1,1x2]

Per grid: build wall time and peak RSS, the largest rank's weights, collectives per decode
step and the bytes rank 0 sends per step (its collectives' inputs, or the hidden states it
hands to stage 1), greedy tokens/s at batch 1 and 8 (ONNX Runtime, one process per rank over
gloo), the share of rank 0's step time spent in collectives, and with pipeline stages rank 0's
idle share (waiting for the last stage's logits: the pipeline bubble; a batch of 1 runs the
stages one after another; at batch 8 the step splits into P micro-batches, and the
same batch runs once more without them to show the difference). On a 2-core CPU more ranks cannot be faster
(they share the same cores); the point is the cost of the communication, measured, and that
the tokens stay those of 1×1. A second table gives each rank of each grid: its stage, tensor
rank and layers, its weight bytes, its engine build's seconds and peak RSS (each engine builds in
its own process), and its resident memory while serving (after the batch-8 run; rank 0 is this
process, which also holds the scheduler and the other grids' leftovers).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]

from trtbuild.builder.progress import human_bytes, table  # noqa: E402

PROMPTS = ["def fibonacci(n):", "import os\nimport sys", "class Stack:", "    def __init__(self, items):",
           "for i in range(", "with open(path) as f:", "try:\n    import json", "def parse_args(argv):"]


def build(tp: int, pp: int, root: Path) -> tuple[Path, dict, float]:
    spec = yaml.safe_load((REPO / "specs" / "tiny-code.yaml").read_text())
    spec["model"]["checkpoint"] = str(REPO / "models" / "tiny-code")
    spec["parallel"] = {"tensor": tp, "pipeline": pp}
    path, out = root / f"tp{tp}pp{pp}.yaml", root / f"tp{tp}pp{pp}"
    path.write_text(yaml.safe_dump(spec))
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "trtbuild.cli", "build", str(path), "-o", str(out),
                           "--json", "--log-level", "error"], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"build {tp}×{pp} failed:\n{proc.stderr}")
    return out, json.loads(proc.stdout), time.perf_counter() - start


def generate(engine: Path, batch: int, tokens: int, micro_batches: int = 1) -> dict:
    from trtbuild.runtime.engine_dir import load
    from trtbuild.runtime.llm import LLM
    from trtbuild.runtime.parallel.pipeline_parallel import StageRunner
    from trtbuild.runtime.core.sampling import SamplingParams
    from trtbuild.runtime.parallel.tensor_parallel import TensorParallelEngine

    d = load(engine)
    ranks = (TensorParallelEngine(d, micro_batches=micro_batches) if d.world_size > 1 else None)
    with LLM(engine, backend="onnxruntime", prefix_cache=False, token_budget=256, engine=ranks) as llm:
        llm.generate(PROMPTS[:1], SamplingParams(max_tokens=4))  # warm-up
        local = getattr(llm.engine, "local", None)  # rank 0's engine, with more than one rank
        stage = local if isinstance(local, StageRunner) else None
        counter = getattr(stage.engine if stage else local, "collective", None)
        before = (counter.calls, counter.bytes, counter.seconds) if counter else (0, 0, 0.0)
        stage_before = (stage.sent_bytes, stage.wait_seconds) if stage else (0, 0.0)
        steps_before, engine_before = llm.stats.decode_steps, llm.stats.engine_s
        prompts = (PROMPTS * 8)[: 2 * batch]
        start = time.perf_counter()
        done = llm.generate(prompts, SamplingParams(max_tokens=tokens, ignore_eos=True))
        seconds = time.perf_counter() - start
        generated = sum(len(c.token_ids) for c in done)
        steps = llm.stats.decode_steps - steps_before
        calls = (counter.calls - before[0]) if counter else 0
        pids = {0: "self", **({rank: process.pid for rank, process in ranks.processes.items()} if ranks else {})}
        return {"tok_s": generated / seconds, "tokens": [c.token_ids for c in done],
                "rank_rss_bytes": {rank: resident_bytes(pid) for rank, pid in pids.items()},
                "collective_s": (counter.seconds - before[2]) if counter else 0.0,
                "engine_s": llm.stats.engine_s - engine_before, "calls": calls,
                "sent_bytes": ((counter.bytes - before[1]) if counter else 0)
                + ((stage.sent_bytes - stage_before[0]) if stage else 0),
                "bubble_s": (stage.wait_seconds - stage_before[1]) if stage else 0.0,
                "steps": llm.stats.steps, "decode_steps": steps}


def resident_bytes(pid) -> int:
    """A process's resident memory now (VmRSS), from /proc."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def rank_rows(tp: int, pp: int, manifest: dict, summary: dict, rss: dict) -> list[list]:
    """One row per rank: where it sits, what it holds, what building and serving it took."""
    engines = {e["rank"]: e for e in summary.get("engines", [])}
    rows = []
    for rank, entry in enumerate(manifest["ranks"]):
        engine = engines.get(rank, {})
        stage, tensor_rank = divmod(rank, tp)
        first, last = entry["layers"]
        rows.append([f"{tp}×{pp}", rank, f"{stage} / {tensor_rank}", f"{first}–{last - 1}",
                     human_bytes(entry["weight_bytes"]), f"{engine.get('seconds', 0.0):.1f}",
                     human_bytes(engine.get("peak_rss_bytes") or 0), human_bytes(rss.get(rank, 0))])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--grid", default="1x1,2x1,4x1,1x2,1x4,2x2", help="T×P pairs, the first the baseline")
    args = parser.parse_args()
    grids = [tuple(int(n) for n in item.split("x")) for item in args.grid.split(",")]
    rows, per_rank, results = [], [], {}
    with tempfile.TemporaryDirectory() as tmp:
        reference, base = {}, None
        for tp, pp in grids:
            engine, summary, wall = build(tp, pp, Path(tmp))
            manifest = json.loads((engine / "manifest.json").read_text())
            layers = manifest["model"]["num_layers"]
            stage_layers = max(r["layers"][1] - r["layers"][0] for r in manifest["ranks"])
            row = {"tp": tp, "pp": pp, "build_s": wall,
                   "rank_weight_bytes": [r["weight_bytes"] for r in manifest["ranks"]],
                   "peak_rss_bytes": summary.get("peak_rss_bytes"),
                   "collectives_per_step": 0 if tp == 1 else 2 * stage_layers + (1 if pp == 1 else 0),
                   "layers": layers}
            for batch in (1, 8):
                figures = generate(engine, batch, args.tokens, micro_batches=pp)  # P micro-batches fill P stages
                reference.setdefault(batch, figures["tokens"])
                row[f"b{batch}_tok_s"] = figures["tok_s"]
                row[f"b{batch}_same_tokens"] = figures["tokens"] == reference[batch]
                row[f"b{batch}_collective_share"] = figures["collective_s"] / max(figures["engine_s"], 1e-9)
                row[f"b{batch}_bubble_share"] = figures["bubble_s"] / max(figures["engine_s"], 1e-9)
                row[f"b{batch}_bytes_per_step"] = figures["sent_bytes"] / max(1, figures["steps"])
                row["rank_rss_bytes"] = figures["rank_rss_bytes"]  # after the batch-8 run
            row["engine_build"] = [{k: e.get(k) for k in ("rank", "seconds", "peak_rss_bytes")}
                                   for e in summary.get("engines", [])]
            per_rank += rank_rows(tp, pp, manifest, summary, row["rank_rss_bytes"])
            if pp > 1:  # the same batch of 8 with the stages one after another
                serial = generate(engine, 8, args.tokens, micro_batches=1)
                row["b8_serial_tok_s"] = serial["tok_s"]
                row["b8_serial_bubble_share"] = serial["bubble_s"] / max(serial["engine_s"], 1e-9)
                row["b8_serial_same_tokens"] = serial["tokens"] == reference[8]
            results[f"{tp}x{pp}"] = row
            base = base or row
            rows.append([f"{tp}×{pp}", f"{wall:.1f}", human_bytes(max(row["rank_weight_bytes"])),
                         human_bytes(row["peak_rss_bytes"] or 0), row["collectives_per_step"],
                         human_bytes(int(row["b1_bytes_per_step"])), human_bytes(int(row["b8_bytes_per_step"])),
                         f"{row['b1_tok_s']:.0f} ({row['b1_tok_s'] / base['b1_tok_s']:.2f}×)",
                         f"{row['b8_tok_s']:.0f} ({row['b8_tok_s'] / base['b8_tok_s']:.2f}×)",
                         f"{100 * row['b1_collective_share']:.0f} % / {100 * row['b8_collective_share']:.0f} %",
                         "-" if pp == 1 else
                         f"{100 * row['b1_bubble_share']:.0f} % / {100 * row['b8_bubble_share']:.0f} %",
                         "-" if pp == 1 else
                         f"{row['b8_serial_tok_s']:.0f} tok/s, {100 * row['b8_serial_bubble_share']:.0f} % idle",
                         "yes" if row["b1_same_tokens"] and row["b8_same_tokens"]
                         and row.get("b8_serial_same_tokens", True) else "NO"])
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(table(rows, ["T×P", "build s", "weights/rank", "build peak RSS", "collectives/step", "rank 0 sent/step b1",
                       "sent/step b8", "tok/s b1", "tok/s b8", "collective share b1/b8", "rank 0 idle b1/b8",
                       "b8 without micro-batches", "same tokens"]))
    print()
    print(table(per_rank, ["T×P", "rank", "stage / tensor rank", "layers", "weights", "engine build s",
                           "engine build peak RSS", "RSS serving b8"]))


if __name__ == "__main__":
    main()

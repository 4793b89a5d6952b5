#!/usr/bin/env python3
"""Runtime benchmark on the bundled model's engine dir (ONNX Runtime backend, CPU).

    python benchmarks/runtime.py [--engine-dir DIR] [--json]

Builds specs/tiny-code.yaml into a temporary dir unless --engine-dir is given, then measures,
each pair side by side in this run:
  1. in-flight vs static batching on a skewed workload (outputs 8..512 tokens), same engine
     and max batch: output tokens/s (target >= 2.5x);
  2. the runtime vs transformers `generate` at batch 8 on the same prompts (greedy, 128 new
     tokens each): output tokens/s (target >= 5x);
  3. prefix caching on vs off with a 512-token shared prefix: TTFT p50 (target >= 4x lower);
  4. runtime overhead: share of step-loop time spent outside Engine.step at batch 8.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
from trtbuild.builder.progress import table as format_table  # noqa: E402


def build_engine(out: Path) -> None:
    subprocess.run([sys.executable, "-m", "trtbuild.cli", "build", str(REPO / "specs" / "tiny-code.yaml"),
                    "-o", str(out), "--log-level", "error"], check=True, capture_output=True)


def transformers_tokens_per_s(checkpoint: Path, prompts: list[list[int]], new_tokens: int, threads: int) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):  # left padding, as generate expects for decoder-only models
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    with torch.no_grad():
        model.generate(ids[:, -4:], attention_mask=mask[:, -4:], max_new_tokens=4, do_sample=False, pad_token_id=0)
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=0)
        seconds = time.perf_counter() - start
    return (out.shape[1] - width) * len(prompts) / seconds


def count_slot_copies(llm, whole: bool) -> dict:
    """Counts the engine's slot copies (bytes, seconds); ``whole`` copies every slot in full, as
    the runtime did before moves carried lengths."""
    d, engine = llm.engine_dir, llm.engine
    per_position = 2 * d.num_layers * d.num_kv_heads * d.head_dim * np.dtype(d.dtype).itemsize
    counts = {"copies": 0, "bytes": 0, "seconds": 0.0}
    copy = engine.copy_slot

    def counted(src: int, dst: int, length: int) -> None:
        length = d.max_seq_len if whole else length
        start = time.perf_counter()
        copy(src, dst, length)
        counts["seconds"] += time.perf_counter() - start
        counts["copies"] += 1
        counts["bytes"] += length * per_position

    engine.copy_slot = counted
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine-dir", type=Path, help="an engine dir of specs/tiny-code.yaml (default: build one)")
    ap.add_argument("--threads", type=int, default=2, help="CPU threads for both ONNX Runtime and torch")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    from trtbuild.runtime import bench
    from trtbuild.runtime.llm import LLM
    from trtbuild.runtime.core.sampling import SamplingParams
    from trtbuild.runtime.core.scheduler import Batching

    with tempfile.TemporaryDirectory() as tmp:
        engine_dir = args.engine_dir or Path(tmp) / "tiny-code"
        if args.engine_dir is None:
            build_engine(engine_dir)
        make = lambda **kw: LLM(engine_dir, backend="onnxruntime", threads=args.threads, **kw)  # noqa: E731
        d = make().engine_dir
        rows = []

        skewed = bench.preset("skewed", d.vocab_size, d.max_seq_len)
        inflight = bench.run(make(batching=Batching.inflight, prefix_cache=False), skewed)
        static = bench.run(make(batching=Batching.static, prefix_cache=False), skewed)
        rows.append(("in-flight vs static batching, skewed outputs 8..512 (output tok/s)",
                     inflight.output_tokens_per_s, static.output_tokens_per_s, 2.5, "higher"))

        tokenizer = make().tokenizer
        text = (REPO / "models" / "tiny-code" / "heldout.txt").read_text()
        rng = np.random.default_rng(0)
        starts = rng.integers(0, len(text) - 400, size=8)
        prompts = [tokenizer.encode(text[s:s + int(rng.integers(60, 400))]).ids for s in starts]
        llm = make(prefix_cache=False)
        t0 = time.perf_counter()
        engine0, loop0 = llm.stats.engine_s, llm.stats.loop_s
        outs = llm.generate(prompts, SamplingParams(max_tokens=128, ignore_eos=True))
        ours = sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0)
        overhead = 1 - (llm.stats.engine_s - engine0) / (llm.stats.loop_s - loop0)
        theirs = transformers_tokens_per_s(REPO / "models" / "tiny-code", prompts, 128, args.threads)
        rows.append(("runtime vs transformers generate, batch 8, 128 new tokens (output tok/s)", ours, theirs, 5.0, "higher"))

        # Slot moves: the filled positions (what the scheduler asks for) vs whole [H_kv, S_max, D] slots,
        # the same in-flight workload both ways.
        moves = {}
        for label, whole in (("filled", False), ("whole slot", True)):
            llm = make(batching=Batching.inflight, prefix_cache=False)
            moves[label] = count_slot_copies(llm, whole)
            bench.run(llm, skewed)
        rows.append(("slot moves: filled positions vs whole slots, skewed workload (MiB copied)",
                     moves["filled"]["bytes"] / 2**20, moves["whole slot"]["bytes"] / 2**20, 1.0, "lower"))

        shared = bench.preset("shared-prefix", d.vocab_size, d.max_seq_len)
        with_cache = bench.run(make(prefix_cache=True), shared)
        without = bench.run(make(prefix_cache=False), shared)
        rows.append(("prefix cache on vs off, 512-token shared prefix (TTFT p50 ms)",
                     with_cache.ttft_ms[0], without.ttft_ms[0], 4.0, "lower"))

    results = [{"comparison": name, "ours": round(a, 2), "baseline": round(b, 2),
                "ratio": round(b / a if better == "lower" else a / b, 2), "target": target,
                "meets_target": (b / a if better == "lower" else a / b) >= target} for name, a, b, target, better in rows]
    extra = {"runtime_overhead_share_batch8": round(overhead, 4), "slot_moves": moves,
             "inflight": inflight.as_dict(), "static": static.as_dict(),
             "prefix_on": with_cache.as_dict(), "prefix_off": without.as_dict()}
    if args.json:
        print(json.dumps({"results": results, **extra}, indent=2))
        return
    header = ["comparison", "ours", "baseline", "ratio", "target", "met"]
    table = [header] + [[r["comparison"], f"{r['ours']:.1f}", f"{r['baseline']:.1f}", f"{r['ratio']:.2f}x",
                         f">= {r['target']}x", "yes" if r["meets_target"] else "NO"] for r in results]
    print(format_table(table[1:], header))
    print(f"\nruntime overhead at batch 8: {100 * overhead:.1f}% of step-loop time outside Engine.step")
    print(f"in-flight: TTFT p50/p99 {inflight.ttft_ms[0]:.0f}/{inflight.ttft_ms[1]:.0f} ms, "
          f"ITL p50/p99 {inflight.itl_ms[0]:.1f}/{inflight.itl_ms[1]:.1f} ms; static: TTFT p50/p99 "
          f"{static.ttft_ms[0]:.0f}/{static.ttft_ms[1]:.0f} ms")
    print(f"prefix cache: {with_cache.prefix_hits} block hits, {with_cache.prefix_misses} misses")
    print(f"slot moves: {moves['filled']['copies']} copies; {moves['filled']['bytes'] / 2**20:.1f} MiB in "
          f"{moves['filled']['seconds'] * 1e3:.1f} ms (filled positions) vs {moves['whole slot']['bytes'] / 2**20:.1f} MiB "
          f"in {moves['whole slot']['seconds'] * 1e3:.1f} ms (whole slots)")


if __name__ == "__main__":
    main()

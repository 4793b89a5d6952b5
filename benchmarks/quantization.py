#!/usr/bin/env python3
"""Quantization quality and cost on the bundled model.

    python benchmarks/quantization.py [--json] [--max-tokens N] [--modes fp8-e4m3-per-tensor,...]

Builds tiny-code unquantized, per weight-only mode/algorithm, W8A8 SmoothQuant (alpha 0.5) and
FP8 (E4M3 per-tensor weights and activations, sm89+ targets; ONNX Runtime runs its Q/DQ pairs
literally, i.e. simulated FP8 at the engine's scales) and NVFP4 weights (sm120; ONNX Runtime runs
the FP4 weights folded to float by plugins/onnxruntime/fp4.py, i.e. simulated), then measures, in this run:
held-out perplexity (trtbuild eval: the rank ONNX in ONNX Runtime, windows of 512 tokens) and
its change vs unquantized, greedy (top-1) agreement with the unquantized checkpoint, weight
bytes (float tensors counted at 16 bit, integer codes as stored) vs fp16, build time, and ONNX
Runtime decode tokens/s at batch 1 and 8. Calibration text comes from the model's training
split (the stdlib files not held out), never from the held-out text.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
from train_tiny_model import corpus_files, read_text, split_files  # noqa: E402

from trtbuild.builder.progress import table as format_table  # noqa: E402

# (row name, quantization fields); "all" rows also quantize lm_head and the embeddings (int8 rows).
MODES = [("none", None)]
MODES += [("int8_weight_only-rtn", {"mode": "int8_weight_only"})]
MODES += [(f"int4_weight_only-{alg}-g{g}", {"mode": "int4_weight_only", "algorithm": alg, "group_size": g})
          for g in (128, 64) for alg in ("rtn", "awq", "gptq")]
MODES += [("w8a8-smoothquant-a0.5", {"mode": "w8a8"}), ("fp8-e4m3-per-tensor", {"mode": "fp8"}),
          ("nvfp4-weights", {"mode": "nvfp4"}),
          ("int8-all", {"mode": "int8_weight_only", "exclude": [], "quantize_embeddings": True}),
          ("int4-gptq-g64-all", {"mode": "int4_weight_only", "algorithm": "gptq", "group_size": 64, "exclude": [],
                                 "quantize_embeddings": True})]
# FP8 needs sm89+ targets (TensorRT-RTX refuses E4M3 for sm80/86), NVFP4 sm120; the rest build for Ampere too.
TARGETS = {"fp8": "[sm89, sm120]", "nvfp4": "[sm120]"}


def calibration_text(path: Path, limit: int = 400_000, skip: frozenset[str] = frozenset()) -> Path:
    """Every 7th training file of the stdlib, up to ``limit`` characters; ``skip``: paths relative
    to the stdlib kept out (a benchmark's evaluation text)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    train, _ = split_files(corpus_files(root), root)
    text, size = [], 0
    for file in [f for f in train if str(f.relative_to(root)) not in skip][::7]:
        text.append(read_text(file))
        size += len(text[-1])
        if size > limit:
            break
    path.write_text("\n".join(text))
    return path


def weight_bytes(onnx_path: Path) -> int:
    model = onnx.load(onnx_path, load_external_data=False)
    total = 0
    for t in model.graph.initializer:
        count = int(np.prod(t.dims)) if t.dims else 1
        if t.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16):
            total += 2 * count
        elif t.data_type in (onnx.TensorProto.INT4, onnx.TensorProto.FLOAT4E2M1):
            total += (count + 1) // 2
        elif t.data_type in (onnx.TensorProto.INT8, onnx.TensorProto.FLOAT8E4M3FN):
            total += count
    return total


def tokens_per_s(engine: Path, batch: int) -> float:
    from trtbuild.runtime.llm import LLM
    from trtbuild.runtime.core.sampling import SamplingParams

    llm = LLM(engine, backend="onnxruntime", threads=2, prefix_cache=False)
    text = (REPO / "models" / "tiny-code" / "heldout.txt").read_text()
    prompts = [text[i * 997: i * 997 + 200] for i in range(batch)]
    llm.generate(prompts[:1], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=64, ignore_eos=True))
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--max-tokens", type=int, default=65536, help="held-out tokens scored per mode")
    ap.add_argument("--modes", default=None, help="comma-separated subset of mode names (none is always run)")
    args = ap.parse_args()
    from trtbuild.runtime.evaluate import evaluate

    heldout = REPO / "models" / "tiny-code" / "heldout.txt"
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        calib = calibration_text(tmp / "calibration.txt")
        for name, fields in MODES:
            if args.modes and fields and name not in args.modes.split(","):
                continue
            spec = tmp / f"{name}.yaml"
            mode = fields["mode"] if fields else "none"
            quant = "" if not fields else "quantization: " + json.dumps(
                {**fields, "calibration": {"data": str(calib), "samples": 32, "seq_len": 256}}) + "\n"
            spec.write_text(f"model: {{checkpoint: {REPO / 'models' / 'tiny-code'}, dtype: float32}}\n"
                            f"build: {{targets: {TARGETS.get(mode, '[sm80, sm86, sm89]')}, max_batch_size: 8, "
                            "max_input_len: 256, "
                            "max_seq_len: 1024}\n" + quant)
            out = tmp / name
            start = time.perf_counter()
            subprocess.run([sys.executable, "-m", "trtbuild.cli", "build", str(spec), "-o", str(out),
                            "--log-level", "error"], check=True, capture_output=True)
            build_s = time.perf_counter() - start
            result = evaluate(out, heldout, 512, args.max_tokens, reference=REPO / "models" / "tiny-code")
            rows.append({"mode": name, "perplexity": result.perplexity, "agreement": result.agreement,
                         "weight_bytes": weight_bytes(out / "rank0.onnx"), "build_s": build_s,
                         "tok_s_b1": tokens_per_s(out, 1), "tok_s_b8": tokens_per_s(out, 8)})
            print(f"  {name}: perplexity {result.perplexity:.3f}", file=sys.stderr, flush=True)
    base = rows[0]
    for row in rows:
        row["delta_pct"] = 100 * (row["perplexity"] / base["perplexity"] - 1)
        row["weight_ratio_vs_fp16"] = row["weight_bytes"] / base["weight_bytes"]
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(format_table([[r["mode"], f"{r['perplexity']:.3f}", f"{r['delta_pct']:+.2f}%",
                         f"{100 * r['agreement']:.1f}%", f"{r['weight_bytes'] / 1e6:.2f} MB",
                         f"{r['weight_ratio_vs_fp16']:.2f}x", f"{r['build_s']:.1f}", f"{r['tok_s_b1']:.0f}",
                         f"{r['tok_s_b8']:.0f}"] for r in rows],
                       ["mode", "perplexity", "Δ vs none", "top-1 agree", "weights", "vs fp16", "build s",
                        "tok/s b1", "tok/s b8"]))
    print(f"\n(held-out: first {args.max_tokens} tokens of models/tiny-code/heldout.txt; "
          "weights: float tensors at 16 bit, codes as stored; lm_head and embeddings stay float except in *-all rows)")


if __name__ == "__main__":
    main()

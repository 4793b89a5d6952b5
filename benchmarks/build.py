#!/usr/bin/env python3
"""Build-time benchmark: wall time per stage and peak RSS of `trtbuild build`.

    python benchmarks/build.py [--json] [--skip-large]

Builds the bundled tiny-code model (specs/tiny-code.yaml) and a random-initialized ~0.5 B
parameter Llama config (fp16) in fresh processes, and prints one table. Targets: tiny model
end to end under 60 s; the 0.5 B model under 5 minutes with peak RSS under 3x its fp16
weight bytes.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

from trtbuild.builder.progress import table as format_table  # noqa: E402
# ~0.5 B parameters: Llama-style GQA, 16 layers of hidden 1536, vocabulary 32000.
LARGE = dict(vocab_size=32000, hidden_size=1536, intermediate_size=4096, num_hidden_layers=16,
             num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=4096,
             rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)


def make_large_checkpoint(directory: Path) -> int:
    """Writes the random 0.5 B checkpoint (fp16) and returns its parameter count."""
    code = f"""
import shutil, torch
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
config = LlamaConfig(**{LARGE!r}, architectures=["LlamaForCausalLM"], torch_dtype="float16")
with torch.device("meta"):
    model = LlamaForCausalLM(config)
model = model.to_empty(device="cpu").to(torch.float16)
with torch.no_grad():
    for p in model.parameters():
        p.normal_(0.0, 0.02) if p.dim() == 2 else p.fill_(1.0)
model.save_pretrained({str(directory)!r}, safe_serialization=True)
for name in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copyfile({str(REPO / 'models' / 'tiny-code')!r} + "/" + name, {str(directory)!r} + "/" + name)
print(sum(p.numel() for p in model.parameters()))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(proc.stdout.strip().splitlines()[-1])


def run_build(spec: Path, out: Path) -> dict:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "trtbuild.cli", "build", str(spec), "-o", str(out),
                           "--json", "--log-level", "error"], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"build of {spec} failed:\n{proc.stderr}")
    result = json.loads(proc.stdout)
    result["wall_s"] = time.perf_counter() - start
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ap.add_argument("--skip-large", action="store_true", help="only the tiny model")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        tiny = run_build(REPO / "specs" / "tiny-code.yaml", tmp / "tiny")
        rows.append({"model": "tiny-code (6.6 M, fp32)", "params": 6_622_464, "weight_bytes_fp16": 2 * 6_622_464,
                     **tiny, "target_s": 60})
        if not args.skip_large:
            ckpt = tmp / "llama-0.5b"
            t0 = time.perf_counter()
            params = make_large_checkpoint(ckpt)
            print(f"(random 0.5 B checkpoint written in {time.perf_counter() - t0:.0f} s)", file=sys.stderr)
            spec = tmp / "large.yaml"
            spec.write_text(f"model: {{checkpoint: {ckpt}, dtype: float16}}\n"
                            "build: {targets: [sm80, sm86, sm89], max_batch_size: 8, max_input_len: 512, max_seq_len: 2048}\n")
            large = run_build(spec, tmp / "large")
            rows.append({"model": f"random Llama ({params / 1e9:.2f} B, fp16)", "params": params,
                         "weight_bytes_fp16": 2 * params, **large, "target_s": 300})
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    stage_names = []
    for row in rows:
        for stage in row["stages"]:
            short = stage["stage"].split(" (")[0]
            if short not in stage_names:
                stage_names.append(short)
    header = ["model", *stage_names, "wall s", "target s", "engine MiB", "peak RSS GiB", "RSS / fp16 weights"]
    table = [header]
    for row in rows:
        per_stage = {s["stage"].split(" (")[0]: s["seconds"] for s in row["stages"]}
        table.append([row["model"], *[f"{per_stage.get(n, 0):.1f}" for n in stage_names], f"{row['wall_s']:.1f}",
                      str(row["target_s"]), f"{sum(e['bytes'] for e in row['engines']) / 2**20:.1f}",
                      f"{row['peak_rss_bytes'] / 2**30:.2f}", f"{row['peak_rss_bytes'] / row['weight_bytes_fp16']:.2f}x"])
    print(format_table(table[1:], header))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Peak memory of quantize_checkpoint, streamed from the weight map, against the whole model.

    python benchmarks/quantize_memory.py [--random-gb 1.0] [--modes int4-rtn,int4-gptq] [--json]

For the bundled model and (with --random-gb) a random Llama-shaped float16 checkpoint of about
that size written tensor by tensor, each mode runs in a fresh process that reports its peak RSS
(VmHWM of /proc/self/status: getrusage's maxrss would include the launching process's RSS,
which Linux carries across fork and exec): ``quantize`` is quantize_checkpoint from the weight map; ``whole model`` (the
baseline, same run) is a process that only loads the checkpoint with transformers, which the
quantizer needed before it streamed (it then held calibration statistics and every layer's
codes on top); transformers maps weights of the checkpoint's own dtype lazily, so this is the
floor of holding the model, not what quantizing it touched. ``imports`` is a process that imports torch and transformers and nothing else.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "models" / "tiny-code"
CALIB = REPO / "tools" / "train_tiny_model.py"
MODES = {
    "int4-rtn": {"mode": "int4_weight_only", "group_size": 128},
    "int4-gptq": {"mode": "int4_weight_only", "algorithm": "gptq", "group_size": 128,
                  "calibration": {"data": str(CALIB), "samples": 8, "seq_len": 128}},
    "int4-awq": {"mode": "int4_weight_only", "algorithm": "awq", "group_size": 128,
                 "calibration": {"data": str(CALIB), "samples": 8, "seq_len": 128}},
    "fp8": {"mode": "fp8"},
}

CHILD = """
import json, sys, time
from pathlib import Path
import torch, transformers  # the imports every mode pays
start = time.perf_counter()
kind, checkpoint, spec_json, out = sys.argv[1:5]
if kind == "quantize":
    from trtbuild.checkpoint.weight_map import WeightMap
    from trtbuild.builder.quant.quantize import quantize_checkpoint
    from trtbuild.builder.spec.resolve import spec_from_dict
    spec = spec_from_dict(json.loads(spec_json))
    quantize_checkpoint(WeightMap.from_checkpoint(Path(checkpoint)), spec, Path(out), progress=lambda m: None)
elif kind == "whole model":
    # transformers' own loader, as a loader that materializes the model does (our own maps it)
    transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=getattr(torch, json.loads(spec_json)["model"]["dtype"]),
                                                      use_safetensors=True, local_files_only=True)
with open("/proc/self/status") as status:
    peak = int(next(line for line in status if line.startswith("VmHWM")).split()[1]) * 1024
print(json.dumps({"peak": peak, "seconds": time.perf_counter() - start}))
"""


def write_random_checkpoint(directory: Path, gigabytes: float) -> Path:
    """A Llama-shaped float16 checkpoint (hidden 2048, intermediate 5632, GQA 16/4 heads, vocab
    32000) with as many layers as make about ``gigabytes``, written one tensor at a time."""
    hidden, inter, heads, kv_heads, vocab = 2048, 5632, 16, 4, 32000
    head_dim = hidden // heads
    per_layer = 2 * (2 * hidden * hidden + 2 * hidden * kv_heads * head_dim + 3 * hidden * inter + 2 * hidden)
    layers = max(1, round((gigabytes * 1e9 - 4 * vocab * hidden) / per_layer))
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,), "lm_head.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}"
        shapes.update({f"{p}.input_layernorm.weight": (hidden,), f"{p}.post_attention_layernorm.weight": (hidden,),
                       f"{p}.self_attn.q_proj.weight": (hidden, hidden),
                       f"{p}.self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
                       f"{p}.self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
                       f"{p}.self_attn.o_proj.weight": (hidden, hidden),
                       f"{p}.mlp.gate_proj.weight": (inter, hidden), f"{p}.mlp.up_proj.weight": (inter, hidden),
                       f"{p}.mlp.down_proj.weight": (hidden, inter)})
    header, offset = {}, 0
    for name, shape in shapes.items():
        size = 2 * int(np.prod(shape))
        header[name] = {"dtype": "F16", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    directory.mkdir(parents=True)
    rng = np.random.default_rng(0)
    with open(directory / "model.safetensors", "wb") as out:
        out.write(len(encoded).to_bytes(8, "little") + encoded)
        for name, shape in shapes.items():
            values = np.ones(shape, np.float16) if name.endswith("norm.weight") else \
                (rng.standard_normal(shape, np.float32) * 0.02).astype(np.float16)
            out.write(values.tobytes())
    config = json.loads((TINY / "config.json").read_text())
    config.update(hidden_size=hidden, intermediate_size=inter, num_attention_heads=heads, num_key_value_heads=kv_heads,
                  head_dim=head_dim, num_hidden_layers=layers, vocab_size=vocab, dtype="float16",
                  max_position_embeddings=2048)
    (directory / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(TINY / name, directory / name)
    return directory


def child(kind: str, checkpoint: Path, spec: dict, out: Path) -> dict:
    result = subprocess.run([sys.executable, "-c", CHILD, kind, str(checkpoint), json.dumps(spec), str(out)],
                            check=True, capture_output=True, text=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--random-gb", type=float, default=0.0, help="also a random float16 checkpoint of this size")
    ap.add_argument("--modes", default="int4-rtn,int4-gptq", help=f"comma-separated, of {', '.join(MODES)}")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    from trtbuild.builder.progress import table

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        checkpoints = [("tiny-code", TINY, "float32")]
        if args.random_gb:
            checkpoints.append((f"random {args.random_gb:g} GB", write_random_checkpoint(tmp / "random", args.random_gb),
                                "float16"))
        for label, checkpoint, dtype in checkpoints:
            weight_bytes = sum(p.stat().st_size for p in checkpoint.glob("*.safetensors"))
            base = {"model": {"checkpoint": str(checkpoint), "dtype": dtype},
                    "build": {"max_seq_len": 512, "targets": ["sm89"]}}
            baselines = {kind: child(kind, checkpoint, base, tmp / "unused") for kind in ("imports", "whole model")}
            for mode in args.modes.split(","):
                out = tmp / f"{label}-{mode}".replace(" ", "_")
                measured = child("quantize", checkpoint, {**base, "quantization": MODES[mode]}, out)
                shutil.rmtree(out)
                rows.append({"checkpoint": label, "weight_bytes": weight_bytes, "mode": mode,
                             "quantize_peak": measured["peak"], "quantize_s": measured["seconds"],
                             "imports_peak": baselines["imports"]["peak"],
                             "whole_model_peak": baselines["whole model"]["peak"]})
                print(f"  {label} {mode}: {measured['peak'] / 2**20:.0f} MiB", file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    mib = lambda b: f"{b / 2**20:.0f} MiB"  # noqa: E731
    print(table([[r["checkpoint"], mib(r["weight_bytes"]), r["mode"], mib(r["quantize_peak"]),
                  f"{r['quantize_s']:.1f}", mib(r["imports_peak"]), mib(r["whole_model_peak"]),
                  f"{(r['quantize_peak'] - r['imports_peak']) / r['weight_bytes']:.2f}",
                  f"{(r['whole_model_peak'] - r['imports_peak']) / r['weight_bytes']:.2f}"] for r in rows],
                ["checkpoint", "weights", "mode", "quantize peak", "s", "imports", "whole model",
                 "quantize above imports / weights", "whole model above imports / weights"]))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""A random-weight Llama checkpoint with the bundled model's tokenizer, wider and deeper than the
bundled model, and a spec that builds it: for runtime benchmarks that need an engine whose step
costs more than the bundled model's ~0.4 ms of CPU a token (benchmarks/serve_load.py: how the
server's per-token HTTP work compares with the engine's as the model grows).

    python benchmarks/random_checkpoint.py /tmp/tiny-code-144m          # 144M parameters, float32
    trtbuild build /tmp/tiny-code-144m/spec.yaml -o build/tiny-code-144m
    python benchmarks/serve_load.py build/tiny-code-144m --plot serve_144m.png --concurrency 1,8

The tokens it generates are noise (the weights are random); their cost is a real model's of
that shape. The spec is specs/tiny-code.yaml with the checkpoint pointing here.
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BUNDLED = REPO / "models" / "tiny-code"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="a new (or empty) directory")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.out.exists() and any(args.out.iterdir()):
        parser.error(f"{args.out}: not empty; give a new directory")
    if args.hidden % args.heads or args.heads % args.kv_heads:
        parser.error("--hidden must be a multiple of --heads, and --heads of --kv-heads")

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = json.loads((BUNDLED / "config.json").read_text())
    config.update(hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                  num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=args.hidden // args.heads)
    for key in ("architectures", "transformers_version"):
        config.pop(key, None)
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(LlamaConfig(**config)).to(torch.float32)
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(BUNDLED / name, args.out / name)
    spec, bundled = (REPO / "specs" / "tiny-code.yaml").read_text(), "checkpoint: ../models/tiny-code"
    if bundled not in spec:  # the spec would build the bundled model, not this one
        raise SystemExit(f"error: specs/tiny-code.yaml has no line '{bundled}' to point at {args.out}")
    spec = spec.replace(bundled, "checkpoint: .                 ")
    (args.out / "spec.yaml").write_text(spec)
    params = sum(p.numel() for p in model.parameters())
    print(f"{args.out}: {params / 1e6:.0f}M parameters (float32, {4 * params / 2**20:.0f} MiB), spec {args.out / 'spec.yaml'}")


if __name__ == "__main__":
    main()

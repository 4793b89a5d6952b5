#!/usr/bin/env python3
"""Held-out perplexity of a Hugging Face causal-LM checkpoint directory.

    python tools/eval_perplexity.py models/tiny-code [--data FILE] [--max-tokens N]

The text is tokenized whole and scored in non-overlapping windows of --context tokens;
perplexity is exp(mean negative log-likelihood) over every predicted token.
"""
from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class Perplexity:
    perplexity: float
    tokens: int
    context: int


def perplexity(checkpoint: Path, data: Path, context: int = 512, max_tokens: int | None = None,
               batch: int = 8) -> Perplexity:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    ids = tokenizer(Path(data).read_text(encoding="utf-8"), add_special_tokens=False,
                    return_tensors="pt")["input_ids"][0]
    if max_tokens is not None:
        ids = ids[: max_tokens + 1]
    n_windows = (len(ids) - 1) // context
    if n_windows == 0:
        raise ValueError(f"{data}: {len(ids)} tokens is fewer than one window of {context}")
    windows = ids[: n_windows * context + 1]
    inputs = windows[:-1].view(n_windows, context)   # [N, C]
    targets = windows[1:].view(n_windows, context)   # [N, C]
    nll, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, n_windows, batch):
            logits = model(input_ids=inputs[i:i + batch]).logits.float()  # [b, C, V]
            nll += torch.nn.functional.cross_entropy(
                logits.flatten(0, 1), targets[i:i + batch].flatten(), reduction="sum").item()
            count += targets[i:i + batch].numel()
    return Perplexity(math.exp(nll / count), count, context)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("--data", type=Path, help="text file (default: CHECKPOINT/heldout.txt)")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--max-tokens", type=int)
    args = ap.parse_args()
    data = args.data or args.checkpoint / "heldout.txt"
    if not data.is_file():
        ap.error(f"--data: {data} is not a file")
    result = perplexity(args.checkpoint, data, args.context, args.max_tokens)
    print(f"{args.checkpoint}: perplexity {result.perplexity:.3f} over {result.tokens} tokens "
          f"(windows of {result.context})")


if __name__ == "__main__":
    main()

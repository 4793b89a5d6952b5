#!/usr/bin/env python3
"""Held-out perplexity of a Hugging Face causal-LM checkpoint directory.

    python tools/eval_perplexity.py models/tiny-code [--data FILE] [--max-tokens N]

The text is tokenized whole and scored in non-overlapping windows of --context tokens;
perplexity is exp(mean negative log-likelihood) over every predicted token. The same
scoring serves engine dirs: `trtbuild eval` (trtbuild.runtime.evaluate).
"""
from __future__ import annotations

import argparse
from pathlib import Path

from trtbuild.runtime.evaluate import EvalResult, evaluate


def perplexity(checkpoint: Path, data: Path, context: int = 512, max_tokens: int | None = None) -> EvalResult:
    return evaluate(Path(checkpoint), Path(data), context, max_tokens)


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

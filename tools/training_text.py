"""Writes the bundled model's training-split text (stdlib files not held out) to one file.

Used for Medusa head training and quantization calibration, never for evaluation:
    python tools/training_text.py -o /tmp/train.txt --max-chars 2000000
"""
from __future__ import annotations

import argparse
import sysconfig
from pathlib import Path

from train_tiny_model import corpus_files, read_text, split_files


def training_text(max_chars: int, stride: int = 1) -> str:
    root = Path(sysconfig.get_paths()["stdlib"])
    train, _ = split_files(corpus_files(root), root)
    parts, size = [], 0
    for file in train[::stride]:
        parts.append(read_text(file))
        size += len(parts[-1])
        if size >= max_chars:
            break
    return "\n".join(parts)[:max_chars]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--out", type=Path, required=True)
    parser.add_argument("--max-chars", type=int, default=2_000_000)
    parser.add_argument("--stride", type=int, default=3, help="take every Nth training file (variety)")
    args = parser.parse_args()
    args.out.write_text(training_text(args.max_chars, args.stride))
    print(f"{args.out}: {args.out.stat().st_size} bytes")


if __name__ == "__main__":
    main()

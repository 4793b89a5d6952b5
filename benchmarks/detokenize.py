#!/usr/bin/env python3
"""Incremental detokenization: µs per token of each way the runtime could turn a request's
tokens into text as they arrive (runtime/detokenize.py), on the held-out text.

    python benchmarks/detokenize.py [--tokens 4000] [--repeat 5]

Ways: the byte table (ByteLevel tokenizers only), tokenizers' own ``decoders.DecodeStream``
(Rust, tokenizers ≥ 0.23; the runtime's way for other tokenizers) and the windowed decodes it
replaced (two ``tokenizer.decode`` calls a token). Tokenizers: the bundled model's (ByteLevel) and a SentencePiece-style one
(Metaspace decoder) trained here on the same text, for the decoders that are
not ByteLevel. Every way's pieces are checked against ``tokenizer.decode`` (without the final
flush, which a stream pays once); the figure is
the median of --repeat passes, ratios against the runtime's choice in the same run.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
from trtbuild.builder.progress import table as format_table  # noqa: E402


def sentencepiece_style(text: str):
    from tokenizers import SentencePieceBPETokenizer

    trained = SentencePieceBPETokenizer()
    trained.train_from_iterator([text], vocab_size=4096, show_progress=False)
    return trained._tokenizer


def per_token_us(make, tokenizer, ids: list[int], repeat: int) -> float:
    expected, times = tokenizer.decode(ids), []
    for _ in range(repeat):
        way, out, grown = make(), [], []
        start = time.perf_counter()
        for token in ids:
            grown.append(token)
            out.append(way(grown))
        times.append((time.perf_counter() - start) / len(ids) * 1e6)
        assert "".join(out) == expected[:len("".join(out))], "pieces differ from tokenizer.decode"
    return statistics.median(times)


class WindowedDecodes:
    """What the runtime did for tokenizers that are not ByteLevel before DecodeStream: decode
    the tokens since the last piece plus the previous piece, hold back a U+FFFD ending."""

    def __init__(self, tokenizer):
        self.tokenizer, self.prefix, self.read = tokenizer, 0, 0

    def push(self, ids: list[int]) -> str:
        before = self.tokenizer.decode(ids[self.prefix:self.read])
        after = self.tokenizer.decode(ids[self.prefix:])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(ids)
        return after[len(before):]


def ways(tokenizer):
    from trtbuild.runtime.detokenize import ByteStream, Detokenizer, IncrementalDecoder

    table = Detokenizer(tokenizer, tokenizer.get_vocab_size()).table
    makers = {"byte table": lambda: ByteStream(table)} if table is not None else {}
    makers |= {"DecodeStream": lambda: IncrementalDecoder(tokenizer),
               "windowed decodes (before)": lambda: WindowedDecodes(tokenizer)}
    return {name: (lambda make=make: make().push) for name, make in makers.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    from tokenizers import Tokenizer

    text = (REPO / "models" / "tiny-code" / "heldout.txt").read_text()
    tokenizers = {"bundled (ByteLevel)": Tokenizer.from_file(str(REPO / "models" / "tiny-code" / "tokenizer.json")),
                  "SentencePiece-style (Metaspace)": sentencepiece_style(text[:200_000])}
    rows = []
    for name, tokenizer in tokenizers.items():
        ids = tokenizer.encode(text[-200_000:]).ids[:args.tokens]
        results = {way: per_token_us(make, tokenizer, ids, args.repeat) for way, make in ways(tokenizer).items()}
        base = results.get("byte table", results["DecodeStream"])
        rows += [[name, way, f"{us:.2f}", f"{us / base:.2f}x"] for way, us in results.items()]
    print(format_table(rows, ["tokenizer", "way", "us/token", "vs the runtime's"]))


if __name__ == "__main__":
    main()

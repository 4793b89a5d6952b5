"""Incremental detokenization: the text of a growing token list, decoding only its tail.

Decoding the whole output at every step costs O(n) per token; this decodes the tokens since
the last emitted piece (plus the previous piece, for context) and holds back a piece that
ends inside a multi-byte character (decoded as U+FFFD) until it completes.
"""
from __future__ import annotations


class IncrementalDecoder:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.prefix = 0   # first token of the context window
        self.read = 0     # tokens whose text is already emitted
        self.text = ""

    def push(self, ids: list[int]) -> str:
        """The new text after ``ids`` grew (it holds every output token so far)."""
        before = self.tokenizer.decode(ids[self.prefix:self.read])
        after = self.tokenizer.decode(ids[self.prefix:])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        piece = after[len(before):]
        self.prefix, self.read = self.read, len(ids)
        self.text += piece
        return piece

    def flush(self, ids: list[int]) -> str:
        """At the end: whatever was held back (the full decode is done once, here)."""
        full = self.tokenizer.decode(ids)
        piece = full[len(self.text):] if full.startswith(self.text) else ""
        self.text = full
        return piece

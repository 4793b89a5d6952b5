"""Incremental detokenization: each request's text as its tokens arrive, piece by piece, equal
once joined to ``tokenizer.decode`` of all of them.

Two ways, chosen once per tokenizer by ``Detokenizer``:

- ``ByteStream`` for tokenizers whose decoder is ByteLevel (GPT-2, Llama 3, Qwen2, the bundled
  model): every token is a fixed byte string, so a token costs a table lookup and an incremental
  UTF-8 decode that holds back an unfinished character. Checked against ``tokenizer.decode``
  when the table is made; any disagreement falls back to the general way.
- ``IncrementalDecoder`` for any other tokenizer: tokenizers' ``DecodeStream`` (Rust), in
  place of two ``tokenizer.decode`` calls a token over a window, which it matches in speed
  (``python benchmarks/detokenize.py --repeat 9``, same run: 5.94 against 6.13 µs a token on a
  Metaspace tokenizer). On ByteLevel tokenizers it is ~15× slower than the byte table
  (6.10 against 0.40 µs), which therefore stays.
"""
from __future__ import annotations

import codecs

import numpy as np


class IncrementalDecoder:
    """Any tokenizer's incremental text through tokenizers' ``DecodeStream`` (Rust), which
    holds back a piece that ends inside a multi-byte character until it completes."""

    def __init__(self, tokenizer):
        from tokenizers.decoders import DecodeStream

        self.tokenizer = tokenizer
        self.stream = DecodeStream(skip_special_tokens=True)
        self.read = 0      # tokens already stepped through the stream
        self.pieces: list[str] = []  # joined only at the end (a growing str would be copied a token)

    def push(self, ids: list[int]) -> str:
        """The new text after ``ids`` grew (it holds every output token so far)."""
        new, step, tokenizer = len(ids) - self.read, self.stream.step, self.tokenizer
        if new == 1:  # the usual push: one token
            piece = step(tokenizer, ids[-1]) or ""
        else:
            piece = "".join(filter(None, (step(tokenizer, token) for token in ids[self.read:])))
        self.read = len(ids)
        if piece:
            self.pieces.append(piece)
        return piece

    def flush(self, ids: list[int]) -> str:
        """At the end: whatever was held back (an unfinished character comes out as U+FFFD, as
        decode gives it; the full decode is done once, here)."""
        text = "".join(self.pieces) + self.push(ids)
        full = self.tokenizer.decode(ids)
        self.pieces = [full]
        return full[len(text):] if full.startswith(text) else ""


class ByteStream:
    """``IncrementalDecoder``'s interface over a table of each token's bytes."""

    def __init__(self, table: list[bytes]):
        self.table = table
        self.read = 0
        self.utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def push(self, ids: list[int]) -> str:
        new = len(ids) - self.read
        if new <= 0:  # several tokens in one step (Medusa) arrive with the first push
            return ""
        data = self.table[ids[-1]] if new == 1 else b"".join([self.table[t] for t in ids[self.read:]])
        self.read = len(ids)
        return self.utf8.decode(data)

    def flush(self, ids: list[int]) -> str:
        """At the end: an unfinished character's bytes come out as U+FFFD, as decode gives them."""
        return self.push(ids) + self.utf8.decode(b"", final=True)


def _byte_level_chars() -> dict[str, int]:
    """ByteLevel's char → byte map (GPT-2's: printable bytes as themselves, the rest from U+0100)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _byte_table(tokenizer, vocab_size: int) -> list[bytes] | None:
    """Each id's bytes as tokenizer.decode (skipping special tokens) would emit them, or None
    when the tokenizer's decoder is not ByteLevel alone or the table disagrees with decode. Ids
    the tokenizer does not know (a model's vocabulary padded past it) decode to nothing, as in
    tokenizer.decode."""
    from tokenizers import decoders

    if not isinstance(tokenizer.decoder, decoders.ByteLevel):
        return None
    chars = _byte_level_chars()
    special = {int(i) for i, added in tokenizer.get_added_tokens_decoder().items() if added.special}
    vocab = tokenizer.get_vocab(with_added_tokens=True)  # token → id
    table = [b""] * max(max(vocab.values(), default=-1) + 1, vocab_size)
    for token, token_id in vocab.items():
        if token_id in special:
            continue
        try:
            table[token_id] = bytes([chars[c] for c in token])
        except KeyError:  # what ByteLevel does with a token outside its alphabet (an added token's text)
            table[token_id] = token.encode("utf-8")
    ids = np.random.default_rng(0).integers(0, len(table), (8, 256)).tolist()  # invalid UTF-8 included
    if any(b"".join(table[t] for t in row).decode("utf-8", "replace") != tokenizer.decode(row) for row in ids):
        return None
    return table


class Detokenizer:
    """Makes each request's incremental decoder; the byte table, if any, is made once here."""

    def __init__(self, tokenizer, vocab_size: int = 0):
        """``vocab_size``: the model's, which may pad the tokenizer's."""
        self.tokenizer = tokenizer
        self.table = _byte_table(tokenizer, vocab_size)

    def token_bytes(self, token: int) -> bytes:
        """The bytes ``token`` adds to a text (a logprob entry's ``bytes``): exact from the byte
        table; else a byte-fallback token's byte (``<0xE2>``), or the UTF-8 of its own decode."""
        if self.table is not None:
            return self.table[token] if 0 <= token < len(self.table) else b""
        piece = self.tokenizer.id_to_token(token) or ""
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        return self.tokenizer.decode([token]).encode("utf-8")

    def stream(self) -> ByteStream | IncrementalDecoder:
        return ByteStream(self.table) if self.table is not None else IncrementalDecoder(self.tokenizer)

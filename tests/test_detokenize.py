"""Incremental detokenization gives exactly the full decode, piece by piece, multi-byte text included."""
from __future__ import annotations

from tokenizers import Tokenizer

from trtbuild.runtime.detokenize import IncrementalDecoder

from conftest import TINY_CODE


def test_pieces_join_to_the_full_decode():
    tokenizer = Tokenizer.from_file(str(TINY_CODE / "tokenizer.json"))
    text = "def naïve(x):\n    return '日本語 ü' + x  # ✓ done\n"
    ids = tokenizer.encode(text).ids
    decoder = IncrementalDecoder(tokenizer)
    pieces = [decoder.push(ids[: n + 1]) for n in range(len(ids))]
    pieces.append(decoder.flush(ids))
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)

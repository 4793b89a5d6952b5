"""Incremental detokenization gives exactly the full decode, piece by piece, multi-byte text included,
whichever way a tokenizer gets (a byte table for ByteLevel decoders, DecodeStream otherwise)."""
from __future__ import annotations

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from trtbuild.runtime.detokenize import ByteStream, Detokenizer, IncrementalDecoder

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


def _pieces(decoder, ids: list[int], step: int = 1) -> list[str]:
    """Pushes ``ids`` ``step`` tokens at a time (Medusa commits several a step), then flushes."""
    pieces = []
    for end in range(step, len(ids) + step, step):
        pieces += [decoder.push(ids[:end])] + [decoder.push(ids[:end]) for _ in range(step - 1)]
    return pieces + [decoder.flush(ids)]


def test_byte_level_tokenizers_stream_from_a_byte_table():
    tokenizer = Tokenizer.from_file(str(TINY_CODE / "tokenizer.json"))
    vocab = tokenizer.get_vocab_size()
    detokenizer = Detokenizer(tokenizer, vocab + 64)  # a model's vocabulary padded past the tokenizer's
    assert isinstance(detokenizer.stream(), ByteStream)
    text = "def naïve(x):\n    return '日本語 ü' + x  # ✓ done\n"
    ids = tokenizer.encode(text).ids
    for step in (1, 3):
        pieces = _pieces(detokenizer.stream(), ids, step)
        assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)
    # Random ids: bytes that are not UTF-8, characters cut at the end, the special <|endoftext|>
    # (0), ids past the tokenizer's vocabulary (decoded as nothing).
    rng = np.random.default_rng(0)
    for _ in range(100):
        ids = rng.integers(0, vocab + 64, int(rng.integers(1, 30))).tolist()
        ids[int(rng.integers(len(ids)))] = 0
        assert "".join(_pieces(detokenizer.stream(), ids)) == tokenizer.decode(ids)
        assert "".join(_pieces(IncrementalDecoder(tokenizer), ids)) == tokenizer.decode(ids)


def test_other_decoders_stream_through_decode_stream():
    vocab = {"<unk>": 0, "▁hello": 1, "▁world": 2, "!": 3}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    detokenizer = Detokenizer(tokenizer)
    assert detokenizer.table is None and isinstance(detokenizer.stream(), IncrementalDecoder)
    ids = [1, 2, 3, 1]
    assert "".join(_pieces(detokenizer.stream(), ids)) == tokenizer.decode(ids) == "hello world! hello"

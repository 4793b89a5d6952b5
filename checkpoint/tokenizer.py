"""A checkpoint's tokenizer, loaded once and checked against the model: every id it can produce
(added tokens included) must be a row of the embedding, or a batch holding one would fail in
ONNX Runtime and read out of bounds in TensorRT."""
from __future__ import annotations

from pathlib import Path

from ..contract.errors import first_line
from .errors import CheckpointError
from .files import checkpoint_file
from .gguf_config import is_gguf
from .gguf_file import read_gguf


def tokenizer_from(data: bytes, where: str):
    """A ``tokenizers.Tokenizer`` from tokenizer.json's bytes; ``where`` names them in the error."""
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_str(data.decode("utf-8"))
    except Exception as exc:  # noqa: BLE001  (the tokenizers library raises a bare Exception)
        raise CheckpointError(f"{where}: not a loadable tokenizer ({first_line(exc)})") from None


def check_vocabulary(tokenizer, vocab_size: int, where: str) -> None:
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    outside = sorted((i, token) for token, i in vocab.items() if i >= vocab_size)
    if outside:
        shown = ", ".join(f"{token!r} = {i}" for i, token in outside[:3]) + (" …" if len(outside) > 3 else "")
        raise CheckpointError(f"{where}: {len(outside)} token id(s) outside the model's vocabulary of {vocab_size} "
                              f"(config.json vocab_size): {shown}; use the tokenizer the model was trained with, "
                              "or a checkpoint whose embedding has a row for every token")


def checkpoint_tokenizer(checkpoint: Path):
    """The checkpoint's tokenizer (a dir's tokenizer.json, or the one a GGUF file's metadata
    gives), checked to fit its config's vocab_size."""
    from .source import config_dict

    vocab_size = config_dict(checkpoint).get("vocab_size")
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size <= 0:
        raise CheckpointError(f"{checkpoint}: config vocab_size must be a positive integer, got {vocab_size!r}")
    if is_gguf(checkpoint):
        from .gguf_side_files import gguf_tokenizer

        tokenizer, where = gguf_tokenizer(read_gguf(checkpoint)), f"{checkpoint} (its tokenizer metadata)"
    else:
        path = checkpoint_file(checkpoint, "tokenizer.json")
        if path is None:
            raise CheckpointError(f"{checkpoint}: no tokenizer.json (a Hugging Face checkpoint dir holds it beside "
                                  "config.json)")
        tokenizer, where = tokenizer_from(path.read_bytes(), str(path)), str(path)
    check_vocabulary(tokenizer, vocab_size, where)
    return tokenizer

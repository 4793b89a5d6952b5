"""The files beside the weights that travel into the engine dir (contract.manifest.SIDE_FILES):
the tokenizer, its config and chat template, the generation config and config.json, from wherever
the checkpoint keeps them. Checked against the model before any work: a tokenizer whose ids reach
past the model's vocabulary would feed the embedding an out-of-range row in every batch that
holds one (ONNX Runtime fails the whole batch; TensorRT reads out of bounds).
"""
from __future__ import annotations

from pathlib import Path

from ...contract.json_file import read_json_object
from ...contract.manifest import SIDE_FILES
from ..errors import UserError


def checkpoint_side_files(checkpoint: Path) -> dict[str, Path]:
    """The side files a checkpoint dir has, by name: regular files directly inside it."""
    root = Path(checkpoint).resolve()
    found = {}
    for name in SIDE_FILES:
        path = Path(checkpoint) / name
        if not path.exists():
            continue
        if not path.is_file() or path.resolve().parent != root:
            raise UserError(f"{path}: not a regular file inside the checkpoint dir {checkpoint}; copy the file into it")
        found[name] = path
    return found


def check_side_files(files: dict[str, Path], checkpoint: Path, vocab_size: int) -> None:
    """The tokenizer loads and its every id (added tokens included) is a row of the model's
    embedding; the JSON files are objects; the chat template is text."""
    tokenizer = files.get("tokenizer.json")
    if tokenizer is None:
        raise UserError(f"{checkpoint}: no tokenizer.json; the engine dir needs the checkpoint's tokenizer "
                        "(a Hugging Face checkpoint dir holds tokenizer.json beside config.json)")
    _check_vocabulary(tokenizer, vocab_size)
    for name, path in files.items():
        if name.endswith(".json") and name != "tokenizer.json":
            try:
                read_json_object(path)
            except (ValueError, RecursionError) as exc:
                raise UserError(str(exc) if isinstance(exc, ValueError) else f"{path}: JSON nested too deeply") from None
    template = files.get("chat_template.jinja")
    if template is not None:
        try:
            template.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise UserError(f"{template}: not UTF-8 text") from None


def _check_vocabulary(path: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as exc:  # noqa: BLE001  (the tokenizers library raises a bare Exception)
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UserError(f"{path}: not a loadable tokenizer ({first})") from None
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    outside = sorted((i, token) for token, i in vocab.items() if i >= vocab_size)
    if outside:
        shown = ", ".join(f"{token!r} = {i}" for i, token in outside[:3]) + (" …" if len(outside) > 3 else "")
        raise UserError(f"{path}: {len(outside)} token id(s) outside the model's vocabulary of {vocab_size} "
                        f"(config.json vocab_size): {shown}; use the tokenizer the model was trained with, or a "
                        "checkpoint whose embedding has a row for every token")


def side_file_record(written: dict[str, Path]) -> dict[str, bool]:
    """manifest.json's ``side_files``: of every runtime-read side file, whether the build wrote it."""
    return {name: name in written for name in SIDE_FILES}


__all__ = ["checkpoint_side_files", "check_side_files", "side_file_record"]

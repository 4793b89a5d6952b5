"""The files beside the weights that travel into the engine dir (contract.manifest.SIDE_FILES):
the tokenizer, its config and chat template, the generation config and config.json, from wherever
the checkpoint keeps them (a dir's files; a GGUF file's metadata, checkpoint/gguf_side_files.py).
Checked against the model before any work: a tokenizer whose ids reach past the model's
vocabulary would feed the embedding an out-of-range row in every batch that holds one (ONNX
Runtime fails the whole batch; TensorRT reads out of bounds).
"""
from __future__ import annotations

from pathlib import Path

from ...checkpoint.errors import CheckpointError
from ...checkpoint.gguf_config import is_gguf
from ...checkpoint.gguf_side_files import gguf_side_files
from ...contract.json_file import parse_json
from ...contract.manifest import SIDE_FILES
from ..errors import UserError


def checkpoint_side_files(checkpoint: Path) -> dict[str, bytes]:
    """The side files of a checkpoint, by name: a dir's regular files directly inside it, or those
    a GGUF file's metadata gives."""
    if is_gguf(checkpoint):
        try:
            return gguf_side_files(checkpoint)
        except CheckpointError as exc:
            raise UserError(str(exc)) from None
    root = Path(checkpoint).resolve()
    found = {}
    for name in SIDE_FILES:
        path = Path(checkpoint) / name
        if not path.exists():
            continue
        if not path.is_file() or path.resolve().parent != root:
            raise UserError(f"{path}: not a regular file inside the checkpoint dir {checkpoint}; copy the file into it")
        found[name] = path.read_bytes()
    return found


def check_side_files(files: dict[str, bytes], checkpoint: Path, vocab_size: int) -> None:
    """The tokenizer loads and its every id (added tokens included) is a row of the model's
    embedding; the JSON files are objects; the chat template is text."""
    if "tokenizer.json" not in files:
        raise UserError(f"{checkpoint}: no tokenizer.json; the engine dir needs the checkpoint's tokenizer "
                        "(a Hugging Face checkpoint dir holds tokenizer.json beside config.json)")
    _check_vocabulary(files["tokenizer.json"], _where(checkpoint, "tokenizer.json"), vocab_size)
    for name, data in files.items():
        if name.endswith(".json") and name != "tokenizer.json":
            try:
                value = parse_json(data, _where(checkpoint, name))
            except ValueError as exc:
                raise UserError(str(exc)) from None
            if not isinstance(value, dict):
                raise UserError(f"{_where(checkpoint, name)}: not a JSON object")
    if "chat_template.jinja" in files:
        try:
            files["chat_template.jinja"].decode("utf-8")
        except UnicodeDecodeError:
            raise UserError(f"{_where(checkpoint, 'chat_template.jinja')}: not UTF-8 text") from None


def side_file_record(written: dict[str, bytes]) -> dict[str, bool]:
    """manifest.json's ``side_files``: of every runtime-read side file, whether the build wrote it."""
    return {name: name in written for name in SIDE_FILES}


def _where(checkpoint: Path, name: str) -> str:
    return f"{checkpoint} ({name} from its metadata)" if is_gguf(checkpoint) else str(Path(checkpoint) / name)


def _check_vocabulary(data: bytes, where: str, vocab_size: int) -> None:
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_str(data.decode("utf-8"))
    except Exception as exc:  # noqa: BLE001  (the tokenizers library raises a bare Exception)
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UserError(f"{where}: not a loadable tokenizer ({first})") from None
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    outside = sorted((i, token) for token, i in vocab.items() if i >= vocab_size)
    if outside:
        shown = ", ".join(f"{token!r} = {i}" for i, token in outside[:3]) + (" …" if len(outside) > 3 else "")
        raise UserError(f"{where}: {len(outside)} token id(s) outside the model's vocabulary of {vocab_size} "
                        f"(config.json vocab_size): {shown}; use the tokenizer the model was trained with, or a "
                        "checkpoint whose embedding has a row for every token")


__all__ = ["checkpoint_side_files", "check_side_files", "side_file_record"]

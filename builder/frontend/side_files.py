"""The files beside the weights that travel into the engine dir (contract.manifest.SIDE_FILES):
the tokenizer, its config and chat template, the generation config and config.json, from wherever
the checkpoint keeps them (a dir's files; a GGUF file's metadata, checkpoint/gguf_side_files.py).
Checked against the model before any work: the tokenizer's every id and the end-of-sequence ids
must be rows of the model's vocabulary (checkpoint/tokenizer.py says why).
"""
from __future__ import annotations

from pathlib import Path

from ...checkpoint.errors import CheckpointError
from ...checkpoint.files import checkpoint_file
from ...checkpoint.gguf_config import is_gguf
from ...checkpoint.gguf_side_files import gguf_side_files
from ...checkpoint.tokenizer import check_vocabulary, tokenizer_from
from ...contract.json_file import parse_json
from ...contract.manifest import EOS_FILES, SIDE_FILES, eos_token_ids
from ..errors import UserError


def checkpoint_side_files(checkpoint: Path) -> dict[str, bytes]:
    """The side files of a checkpoint, by name: a dir's regular files directly inside it, or those
    a GGUF file's metadata gives."""
    try:
        if is_gguf(checkpoint):
            return gguf_side_files(checkpoint)
        paths = {name: checkpoint_file(checkpoint, name) for name in SIDE_FILES}
    except CheckpointError as exc:
        raise UserError(str(exc)) from None
    return {name: path.read_bytes() for name, path in paths.items() if path is not None}


def check_side_files(files: dict[str, bytes], checkpoint: Path, vocab_size: int) -> None:
    """The tokenizer loads and fits the vocabulary, the JSON files are objects, the
    end-of-sequence ids are token ids, the chat template is text."""
    if "tokenizer.json" not in files:
        raise UserError(f"{checkpoint}: no tokenizer.json; the engine dir needs the checkpoint's tokenizer "
                        "(a Hugging Face checkpoint dir holds tokenizer.json beside config.json)")
    objects = {}
    try:
        where = _where(checkpoint, "tokenizer.json")
        check_vocabulary(tokenizer_from(files["tokenizer.json"], where), vocab_size, where)
        for name, data in files.items():
            if name.endswith(".json") and name != "tokenizer.json":
                objects[name] = parse_json(data, _where(checkpoint, name))
                if not isinstance(objects[name], dict):
                    raise ValueError(f"{_where(checkpoint, name)}: not a JSON object")
        eos_token_ids({name: objects[name] for name in EOS_FILES if name in objects}, vocab_size)
        if "chat_template.jinja" in files:
            files["chat_template.jinja"].decode("utf-8")
    except UnicodeDecodeError:
        raise UserError(f"{_where(checkpoint, 'chat_template.jinja')}: not UTF-8 text") from None
    except ValueError as exc:  # CheckpointError too
        message = str(exc)
        raise UserError(message if message.startswith(str(checkpoint)) else f"{checkpoint}: {message}") from None


def side_file_record(written: dict[str, bytes]) -> dict[str, bool]:
    """manifest.json's ``side_files``: of every runtime-read side file, whether the build wrote it."""
    return {name: name in written for name in SIDE_FILES}


def _where(checkpoint: Path, name: str) -> str:
    return f"{checkpoint} ({name} from its metadata)" if is_gguf(checkpoint) else str(Path(checkpoint) / name)

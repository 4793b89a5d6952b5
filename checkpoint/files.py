"""A named file of a checkpoint dir, never one that a link or path leads out of it: every reader
of a dir's files (config, index, tokenizer, side files) takes them from here."""
from __future__ import annotations

from pathlib import Path

from .errors import CheckpointError


def checkpoint_file(checkpoint: Path, name: str) -> Path | None:
    """``checkpoint/name`` if it exists, as a regular file directly inside the dir; None if absent."""
    path = Path(checkpoint) / name
    if not path.exists():
        return None
    if not path.is_file() or path.resolve().parent != Path(checkpoint).resolve():
        raise CheckpointError(f"{path}: not a regular file inside the checkpoint dir {checkpoint}; "
                              "copy the file into it")
    return path

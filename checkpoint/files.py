"""A named file of a checkpoint dir, never one that a link or path leads out of it: every reader
of a dir's files (config, index, tokenizer, side files) takes them from here."""
from __future__ import annotations

from pathlib import Path

from ..contract.paths import path_inside
from .errors import CheckpointError


def checkpoint_file(checkpoint: Path, name: str) -> Path | None:
    """``checkpoint/name`` if it exists, as a regular file inside the dir; None if absent."""
    path = Path(checkpoint) / name
    if not path.exists():
        return None
    inside = path_inside(checkpoint, name)
    if inside is None or not inside.is_file():
        raise CheckpointError(f"{path}: not a regular file inside the checkpoint dir {checkpoint}; "
                              "copy the file into it")
    return inside

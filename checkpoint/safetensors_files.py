"""Which files of a local Hugging Face checkpoint dir hold its weights: safetensors only.

A pickle (.bin/.pt/.pth) can run arbitrary code when loaded, so a checkpoint holding only
pickles is refused with the conversion to do. A dir with ``model.safetensors.index.json`` holds
exactly the files its ``weight_map`` names (each a plain file name in the dir); without one, every
``*.safetensors`` directly in the dir. Every command that reads a checkpoint (``trtbuild build``,
``eval`` and its ``--reference``, ``medusa train``) reads it through checkpoint.weight_map.
"""
from __future__ import annotations

from pathlib import Path

from ..contract.json_file import read_json_object
from .errors import CheckpointError
from .files import checkpoint_file

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
INDEX_FILE = "model.safetensors.index.json"


def read_index(checkpoint: Path) -> dict[str, str] | None:
    """The index's weight_map (tensor name → file name in the dir), or None without an index."""
    path = checkpoint_file(checkpoint, INDEX_FILE)
    if path is None:
        return None
    try:
        index = read_json_object(path)
    except (ValueError, OSError) as exc:
        raise CheckpointError(str(exc)) from None
    weight_map = index.get("weight_map")
    if not (isinstance(weight_map, dict) and weight_map
            and all(isinstance(f, str) for f in weight_map.values())):
        raise CheckpointError(f"{path}: weight_map must be a non-empty object of tensor name → file name")
    for name, file in weight_map.items():
        if Path(file).name != file or not file.endswith(".safetensors") or "\0" in file:
            raise CheckpointError(f"{path}: weight_map puts tensor {name} in {file!r}; each file must be a "
                                  "*.safetensors file name directly in the checkpoint dir")
    return weight_map


def weight_files(checkpoint: Path, index: dict[str, str] | None = None) -> list[Path]:
    """The checkpoint's safetensors files: those ``index`` names, else every ``*.safetensors`` in
    the dir; refuses pickle-only checkpoints."""
    checkpoint = Path(checkpoint)
    if index is not None:
        return [checkpoint / name for name in sorted(set(index.values()))]
    tensors = sorted(checkpoint.glob("*.safetensors"))
    if tensors:
        return tensors
    pickles = sorted(p.name for p in checkpoint.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise CheckpointError(f"{checkpoint}: holds only pickle weights ({', '.join(pickles)}); "
                              "trtbuild loads safetensors only, since unpickling can run code. Convert "
                              "once where you trust the file: model.save_pretrained(dir, "
                              "safe_serialization=True)")
    raise CheckpointError(f"{checkpoint}: no *.safetensors weights found")

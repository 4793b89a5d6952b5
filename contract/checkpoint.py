"""Reading a local Hugging Face checkpoint's weights: safetensors only.

A pickle (.bin/.pt/.pth) can run arbitrary code when loaded, so a checkpoint holding only
pickles is refused with the conversion to do. ``trtbuild build``, ``eval`` (target and
``--reference``) and ``medusa train`` all load through here.
"""
from __future__ import annotations

from pathlib import Path

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


class CheckpointError(ValueError):
    """The checkpoint cannot be loaded safely; the message names the dir and what to do."""


def weight_files(checkpoint: Path) -> list[Path]:
    """The checkpoint's safetensors files; refuses pickle-only checkpoints."""
    checkpoint = Path(checkpoint)
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


def load_safetensors_model(checkpoint: Path, dtype):
    """The transformers model of a checkpoint, from safetensors only, in eval mode: the one
    loader every entry point that reads a checkpoint uses (build, eval, medusa train)."""
    import os
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM

    if not (Path(checkpoint) / "config.json").is_file():
        raise CheckpointError(f"{checkpoint}: no config.json (a local Hugging Face checkpoint dir is expected)")
    weight_files(checkpoint)
    try:
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype, use_safetensors=True,
                                                     local_files_only=True)
    except Exception as exc:  # noqa: BLE001  (a corrupt file, a config transformers refuses)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"{checkpoint}: transformers cannot load it: {first}") from None
    return model.eval()

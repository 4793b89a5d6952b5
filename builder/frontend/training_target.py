"""What a trainer of draft sources (Medusa heads, a draft head) starts from: its text files
checked, the checkpoint's tokenizer, and the target model frozen in float32."""
from __future__ import annotations

from pathlib import Path

import torch

from ...checkpoint.errors import CheckpointError
from ...checkpoint.tokenizer import checkpoint_tokenizer
from ..errors import UserError
from .checkpoint import load_model


def training_target(checkpoint: Path, data: list[Path], seed: int):
    """(tokenizer, model): every ``--data`` file must exist (UserError naming it); the model in
    eval mode, no gradients, torch seeded with ``seed``."""
    for path in data:
        if not Path(path).is_file():
            raise UserError(f"--data {path}: not a file")
    try:
        tokenizer = checkpoint_tokenizer(Path(checkpoint))
    except CheckpointError as exc:
        raise UserError(str(exc)) from None
    torch.manual_seed(seed)
    model = load_model(Path(checkpoint), torch.float32).eval()
    model.requires_grad_(False)
    return tokenizer, model

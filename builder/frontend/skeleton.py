"""The builder's uses of the meta-device model (checkpoint.model): parts of it given
real weights and released again, and the truncated reference of the numerics check.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ...checkpoint.model import assign_weights, checkpoint_key, meta_model
from ...checkpoint.weight_map import WeightMap

__all__ = ["assign_weights", "checkpoint_key", "meta_model", "release_weights", "truncated_model"]


def release_weights(model: nn.Module, prefix: str) -> None:
    """Puts the parameters under ``prefix`` back on the meta device, so their bytes can go."""
    module = model.get_submodule(prefix)
    module.to_empty(device="meta")


def truncated_model(checkpoint: Path, weights: WeightMap, dtype: torch.dtype, num_layers: int,
                    vocab_rows: int | None = None) -> nn.Module:
    """The first ``num_layers`` decoder layers with the embedding, final norm and lm_head (their
    first ``vocab_rows`` rows), all with their real weights: the reference of the numerics check
    on a model too large to run whole."""
    model = meta_model(checkpoint, dtype, num_layers, vocab_rows)
    assign_weights(model, weights, "", dtype)
    return model

"""The draft's reduced vocabulary: the K target tokens the target itself predicts most often."""
from __future__ import annotations

import numpy as np
import torch

OUTSIDE = -100   # a target token outside the draft vocabulary (cross-entropy's ignore index)


def draft_vocabulary(argmax: torch.Tensor, size: int, target_vocab: int) -> torch.Tensor:
    """The ``size`` most frequent target argmaxes, most frequent first, ties by lower id; padded
    with the lowest unused ids when fewer distinct tokens occur. int64 [K]: draft id → target id."""
    counts = np.bincount(argmax.flatten().numpy(), minlength=target_vocab)
    order = np.lexsort((np.arange(target_vocab), -counts))   # by count descending, then id ascending
    return torch.from_numpy(order[:size].astype(np.int64))


def target_to_draft(draft_to_target: torch.Tensor, target_vocab: int) -> torch.Tensor:
    """int64 [V]: each target id's draft id, OUTSIDE where the draft has none."""
    table = torch.full((target_vocab,), OUTSIDE, dtype=torch.int64)
    table[draft_to_target] = torch.arange(len(draft_to_target))
    return table

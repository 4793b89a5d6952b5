"""The decoder layers a checkpoint's tensors hold must be the ones its config counts: a file
with more layers than ``num_hidden_layers`` (a GGUF's ``block_count``) would build a model cut
short without a word, one with fewer would fail only when the missing layer is read."""
from __future__ import annotations

import re
from collections.abc import Iterable

from .errors import CheckpointError

LAYER = re.compile(r"model\.layers\.(\d+)\.")  # the Hugging Face name of a decoder layer's tensor


def check_layer_count(names: Iterable[str], num_layers: object, where: str, field: str, files: str) -> None:
    """CheckpointError unless the tensors ``names`` (Hugging Face names) hold exactly layers
    0 .. ``num_layers`` − 1. ``where``: the file that states the count as ``field``; ``files``:
    the files holding the tensors. A count that is not a positive integer is the config check's to refuse."""
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers <= 0:
        return
    found = sorted({int(match.group(1)) for name in names if (match := LAYER.match(name))})
    if found != list(range(num_layers)):
        raise CheckpointError(f"{where}: {field} is {num_layers}, so the tensors should be of layers "
                              f"{layer_spans(range(num_layers))}; those in {files} are of layers {layer_spans(found)}")


def layer_spans(indices: Iterable[int]) -> str:
    """Sorted layer indices as runs: ``0-2, 5``; ``none`` if there are none (error messages and
    ``trtbuild inspect``'s notes)."""
    runs: list[list[int]] = []
    for index in indices:
        if runs and index == runs[-1][1] + 1:
            runs[-1][1] = index
        else:
            runs.append([index, index])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs) or "none"

"""Medusa heads in the layout public Medusa checkpoints use.

A heads dir holds ``config.json`` (``medusa_num_heads``, ``medusa_num_layers``, optionally
``hidden_size``/``vocab_size`` and our ``trtbuild`` block with measured accuracies) and
``medusa_lm_head.safetensors`` with, for head k and residual block j < L:
``{k}.{j}.linear.weight`` [D, D], ``{k}.{j}.linear.bias`` [D], and ``{k}.{L}.weight`` [V, D]
(the head's own vocabulary projection). Head k computes
``h = x + SiLU(W_j x + b_j)`` L times, then ``W_out h``: logits for the token k + 2
positions after ``x``'s (the base LM head predicts k + 1 = 1).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ...checkpoint.errors import CheckpointError
from ...contract.json_file import read_json_object
from ...checkpoint.weight_map import WeightMap
from ..errors import UserError

WEIGHTS_FILE = "medusa_lm_head.safetensors"
CONFIG_FILE = "config.json"
FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")


def tensor_shapes(num_heads: int, num_layers: int, hidden: int, vocab: int) -> dict[str, tuple[int, ...]]:
    """Every tensor of the public layout, by name, with its shape."""
    shapes = {}
    for k in range(num_heads):
        for j in range(num_layers):
            shapes[f"{k}.{j}.linear.weight"] = (hidden, hidden)
            shapes[f"{k}.{j}.linear.bias"] = (hidden,)
        shapes[f"{k}.{num_layers}.weight"] = (vocab, hidden)
    return shapes


class _Arrays:
    """Heads held in memory (just trained), as float32 arrays by name."""

    def __init__(self, arrays: dict[str, np.ndarray]):
        self.arrays = arrays

    def tensor(self, name: str) -> np.ndarray:
        return self.arrays[name]

    def rows(self, name: str, start: int, stop: int) -> np.ndarray:
        return self.arrays[name][start:stop]


class _Mapped:
    """Heads in their safetensors file, each tensor read through the weight map when asked for
    (memory-mapped; a float16/bfloat16 file converts that one tensor to float32)."""

    def __init__(self, weights: WeightMap):
        self.weights = weights

    def tensor(self, name: str) -> np.ndarray:
        return self.weights.tensor(name, torch.float32).numpy()

    def rows(self, name: str, start: int, stop: int) -> np.ndarray:
        return self.weights.rows(name, start, stop, torch.float32).numpy()


@dataclass(frozen=True)
class MedusaHeads:
    """Medusa heads whose tensors are read one at a time, when used: a heads dir's are never in
    memory all at once (four heads at 128k × 4096 are 8.4 GB of float32)."""

    num_heads: int
    num_layers: int
    hidden_size: int
    vocab_size: int
    source: _Arrays | _Mapped
    topk_accuracy: tuple[tuple[float, ...], ...] | None = None  # per head: top-1..top-n on held-out text

    @classmethod
    def from_arrays(cls, blocks, out, topk_accuracy=None) -> "MedusaHeads":
        """Heads from arrays: ``blocks[k][j]`` = (weight [D, D], bias [D]), ``out[k]`` [V, D]."""
        layers = len(blocks[0])
        arrays = {}
        for k, (head_blocks, proj) in enumerate(zip(blocks, out)):
            for j, (weight, bias) in enumerate(head_blocks):
                arrays[f"{k}.{j}.linear.weight"] = np.ascontiguousarray(weight, np.float32)
                arrays[f"{k}.{j}.linear.bias"] = np.ascontiguousarray(bias, np.float32)
            arrays[f"{k}.{layers}.weight"] = np.ascontiguousarray(proj, np.float32)
        return cls(num_heads=len(out), num_layers=layers, hidden_size=out[0].shape[1], vocab_size=out[0].shape[0],
                   source=_Arrays(arrays), topk_accuracy=topk_accuracy)

    def weight(self, k: int, j: int) -> np.ndarray:
        return self.source.tensor(f"{k}.{j}.linear.weight")              # [D, D]

    def bias(self, k: int, j: int) -> np.ndarray:
        return self.source.tensor(f"{k}.{j}.linear.bias")                # [D]

    def out(self, k: int, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Head k's vocabulary projection, rows [start, stop) (default: all), [V', D]."""
        return self.source.rows(f"{k}.{self.num_layers}.weight", start, self.vocab_size if stop is None else stop)

    @property
    def params(self) -> int:
        return sum(math.prod(s) for s in tensor_shapes(self.num_heads, self.num_layers, self.hidden_size,
                                                           self.vocab_size).values())

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        """Reference forward: hidden [..., D] (after the final norm) → [..., K, V]."""
        per_head = []
        for k in range(self.num_heads):
            h = hidden.astype(np.float32)
            for j in range(self.num_layers):
                z = h @ self.weight(k, j).T + self.bias(k, j)
                h = h + z / (1.0 + np.exp(-z))
            per_head.append(h @ self.out(k).T)
        return np.stack(per_head, axis=-2)


def save_heads(heads: MedusaHeads, out: Path, extra_config: dict | None = None) -> None:
    from safetensors.numpy import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    names = tensor_shapes(heads.num_heads, heads.num_layers, heads.hidden_size, heads.vocab_size)
    save_file({name: np.ascontiguousarray(heads.source.tensor(name), np.float32) for name in names},
              str(out / WEIGHTS_FILE))
    config = {"medusa_num_heads": heads.num_heads, "medusa_num_layers": heads.num_layers,
              "hidden_size": heads.hidden_size, "vocab_size": heads.vocab_size, **(extra_config or {})}
    if heads.topk_accuracy is not None:
        config.setdefault("trtbuild", {})["topk_accuracy"] = [list(a) for a in heads.topk_accuracy]
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")


@dataclass(frozen=True)
class HeadsConfig:
    num_heads: int
    num_layers: int
    hidden_size: int
    vocab_size: int
    topk_accuracy: tuple[tuple[float, ...], ...] | None


def read_heads_config(path: Path) -> HeadsConfig:
    """The heads dir's config, with sizes read from the weight file's header (no weights loaded)."""
    return _open_heads(Path(path))[0]


def load_heads(path: Path) -> MedusaHeads:
    """A heads dir whose every tensor's header entry is checked (present, shape, float dtype);
    the values are read one tensor at a time when used. Every problem is a one-line UserError
    naming the file."""
    config, weights = _open_heads(Path(path))
    weights_path = Path(path) / WEIGHTS_FILE
    expected = config.num_heads * (2 * config.num_layers + 1)
    if expected != len(weights):  # before naming them all: a hostile count would name billions
        raise UserError(f"{weights_path}: holds {len(weights)} tensors; medusa_num_heads={config.num_heads} × "
                        f"(2 × medusa_num_layers={config.num_layers} + 1) = {expected}")
    shapes = tensor_shapes(config.num_heads, config.num_layers, config.hidden_size, config.vocab_size)
    for name, shape in shapes.items():
        if name not in weights:
            raise UserError(f"{weights_path}: tensor {name!r} missing for medusa_num_heads={config.num_heads}, "
                            f"medusa_num_layers={config.num_layers}")
        entry = weights.entry(name)
        if entry.shape != shape:
            raise UserError(f"{weights_path}: {name} has shape {list(entry.shape)}, expected {list(shape)}")
        if entry.dtype not in FLOAT_DTYPES:
            raise UserError(f"{weights_path}: {name} is {entry.dtype}; heads are {', '.join(FLOAT_DTYPES)}")
    return MedusaHeads(num_heads=config.num_heads, num_layers=config.num_layers, hidden_size=config.hidden_size,
                       vocab_size=config.vocab_size, source=_Mapped(weights), topk_accuracy=config.topk_accuracy)


def _open_heads(path: Path) -> tuple[HeadsConfig, WeightMap]:
    """The config and the weight map of the heads file (its header checked, nothing read)."""
    config_path, weights_path = path / CONFIG_FILE, path / WEIGHTS_FILE
    if not path.is_dir():
        raise UserError(f"{path}: Medusa heads dir does not exist")
    if not weights_path.is_file():
        pickled = [p.name for p in path.glob("medusa_lm_head.*")]
        hint = (f" ({', '.join(pickled)} is a pickle, which trtbuild never loads: convert it to safetensors)"
                if pickled else "")
        raise UserError(f"{weights_path}: missing{hint}")
    if not config_path.is_file():
        raise UserError(f"{config_path}: missing (needs medusa_num_heads and medusa_num_layers)")
    try:
        config = read_json_object(config_path)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    try:
        num_heads, num_layers = int(config["medusa_num_heads"]), int(config.get("medusa_num_layers", 1))
    except (ValueError, KeyError, TypeError) as exc:
        raise UserError(f"{config_path}: needs integer medusa_num_heads and medusa_num_layers ({exc})") from None
    if num_heads < 1 or num_layers < 0:
        raise UserError(f"{config_path}: medusa_num_heads={num_heads}, medusa_num_layers={num_layers} "
                        "(need ≥ 1 and ≥ 0)")
    try:
        weights = WeightMap.from_files(path, [weights_path])
    except CheckpointError as exc:
        raise UserError(str(exc)) from None
    out_name = f"0.{num_layers}.weight"
    if out_name not in weights:
        raise UserError(f"{weights_path}: tensor {out_name!r} missing for medusa_num_layers={num_layers}")
    if len(weights.entry(out_name).shape) != 2:
        raise UserError(f"{weights_path}: {out_name} has shape {list(weights.entry(out_name).shape)}, "
                        "expected [vocab_size, hidden_size]")
    vocab, hidden = weights.entry(out_name).shape
    return HeadsConfig(num_heads=num_heads, num_layers=num_layers, hidden_size=hidden, vocab_size=vocab,
                       topk_accuracy=_accuracy(config, config_path)), weights


def _accuracy(config: dict, config_path: Path) -> tuple[tuple[float, ...], ...] | None:
    block = config.get("trtbuild", {})
    accuracy = block.get("topk_accuracy") if isinstance(block, dict) else None
    if not accuracy:
        return None
    try:
        return tuple(tuple(float(a) for a in row) for row in accuracy)
    except (TypeError, ValueError):
        raise UserError(f"{config_path}: trtbuild.topk_accuracy must be a list of lists of numbers") from None

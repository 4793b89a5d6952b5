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
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import UserError

WEIGHTS_FILE = "medusa_lm_head.safetensors"
CONFIG_FILE = "config.json"


@dataclass(frozen=True)
class MedusaHeads:
    """Heads as float32 numpy arrays; ``blocks[k][j]`` = (weight [D, D], bias [D])."""

    blocks: tuple[tuple[tuple[np.ndarray, np.ndarray], ...], ...]
    out: tuple[np.ndarray, ...]                 # [V, D] per head
    topk_accuracy: tuple[tuple[float, ...], ...] | None = None  # per head: top-1..top-n on held-out text

    @property
    def num_heads(self) -> int:
        return len(self.out)

    @property
    def num_layers(self) -> int:
        return len(self.blocks[0])

    @property
    def hidden_size(self) -> int:
        return self.out[0].shape[1]

    @property
    def vocab_size(self) -> int:
        return self.out[0].shape[0]

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        """Reference forward: hidden [..., D] (after the final norm) → [..., K, V]."""
        per_head = []
        for blocks, out in zip(self.blocks, self.out):
            h = hidden.astype(np.float32)
            for weight, bias in blocks:
                z = h @ weight.T + bias
                h = h + z / (1.0 + np.exp(-z))
            per_head.append(h @ out.T)
        return np.stack(per_head, axis=-2)


def save_heads(heads: MedusaHeads, out: Path, extra_config: dict | None = None) -> None:
    from safetensors.numpy import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for k, (blocks, proj) in enumerate(zip(heads.blocks, heads.out)):
        for j, (weight, bias) in enumerate(blocks):
            tensors[f"{k}.{j}.linear.weight"] = np.ascontiguousarray(weight, np.float32)
            tensors[f"{k}.{j}.linear.bias"] = np.ascontiguousarray(bias, np.float32)
        tensors[f"{k}.{heads.num_layers}.weight"] = np.ascontiguousarray(proj, np.float32)
    save_file(tensors, str(out / WEIGHTS_FILE))
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
    from safetensors import SafetensorError, safe_open

    path = Path(path)
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
        config = json.loads(config_path.read_text())
        num_heads, num_layers = int(config["medusa_num_heads"]), int(config.get("medusa_num_layers", 1))
    except (ValueError, KeyError, TypeError) as exc:
        raise UserError(f"{config_path}: needs integer medusa_num_heads and medusa_num_layers ({exc})") from None
    if num_heads < 1 or num_layers < 0:
        raise UserError(f"{config_path}: medusa_num_heads={num_heads}, medusa_num_layers={num_layers} "
                        "(need ≥ 1 and ≥ 0)")
    out_name = f"0.{num_layers}.weight"
    try:
        with safe_open(str(weights_path), framework="numpy") as handle:
            if out_name not in handle.keys():
                raise UserError(f"{weights_path}: tensor {out_name!r} missing for medusa_num_layers={num_layers}")
            vocab, hidden = handle.get_slice(out_name).get_shape()
    except (SafetensorError, OSError) as exc:
        raise UserError(f"{weights_path}: not a readable safetensors file ({exc})") from None
    accuracy = config.get("trtbuild", {}).get("topk_accuracy")
    return HeadsConfig(num_heads=num_heads, num_layers=num_layers, hidden_size=int(hidden), vocab_size=int(vocab),
                       topk_accuracy=tuple(tuple(float(a) for a in row) for row in accuracy) if accuracy else None)


def load_heads(path: Path) -> MedusaHeads:
    """Reads a heads dir; every problem is a one-line UserError naming the file."""
    from safetensors.numpy import load_file

    config = read_heads_config(path)
    weights_path = Path(path) / WEIGHTS_FILE
    tensors = load_file(str(weights_path))
    hidden, vocab, layers = config.hidden_size, config.vocab_size, config.num_layers

    def get(name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in tensors:
            raise UserError(f"{weights_path}: tensor {name!r} missing for medusa_num_heads={config.num_heads}, "
                            f"medusa_num_layers={layers}")
        value = tensors[name].astype(np.float32)
        if value.shape != shape:
            raise UserError(f"{weights_path}: {name} has shape {list(value.shape)}, expected {list(shape)}")
        return value

    return MedusaHeads(
        blocks=tuple(tuple((get(f"{k}.{j}.linear.weight", (hidden, hidden)), get(f"{k}.{j}.linear.bias", (hidden,)))
                           for j in range(layers)) for k in range(config.num_heads)),
        out=tuple(get(f"{k}.{layers}.weight", (vocab, hidden)) for k in range(config.num_heads)),
        topk_accuracy=config.topk_accuracy)

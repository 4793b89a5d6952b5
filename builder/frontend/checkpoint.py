"""Read a local Hugging Face checkpoint directory: architecture facts and safetensors weights.

Only safetensors are loaded: a pickle (.bin/.pt/.pth) can run arbitrary code when loaded,
so a checkpoint holding only pickles is refused with the conversion to do.
"""
from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from ..errors import UserError

# Architectures whose decoder layer is the Llama block (GQA + RoPE + RMSNorm + SwiGLU).
# Qwen3 adds an RMSNorm on each head's query and key; the rest differ only in config values.
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                           "Qwen3ForCausalLM")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


class ArchConfig(BaseModel):
    """The facts of a checkpoint's config.json that the builder uses, computed once."""

    model_config = ConfigDict(frozen=True)

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qk_norm: bool
    sliding_window: int | None
    attention_bias: bool = False

    @property
    def group_size(self) -> int:
        """Query heads per key/value head."""
        return self.num_heads // self.num_kv_heads


def read_config(checkpoint: Path) -> dict:
    path = Path(checkpoint) / "config.json"
    if not Path(checkpoint).is_dir():
        raise UserError(f"{checkpoint}: checkpoint directory does not exist")
    if not path.is_file():
        raise UserError(f"{path}: missing; a checkpoint dir holds config.json, *.safetensors "
                        "and tokenizer.json")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None


def arch_config(checkpoint: Path) -> ArchConfig:
    raw = read_config(checkpoint)
    archs = raw.get("architectures") or []
    arch = archs[0] if archs else raw.get("model_type", "<none>")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UserError(f"{Path(checkpoint) / 'config.json'}: architecture {arch!r} is not "
                        f"supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    heads = raw["num_attention_heads"]
    window = raw.get("sliding_window") if raw.get("use_sliding_window", True) else None
    return ArchConfig(
        architecture=arch,
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        max_position_embeddings=raw.get("max_position_embeddings", 2048),
        tie_word_embeddings=raw.get("tie_word_embeddings", False),
        qk_norm=arch == "Qwen3ForCausalLM",
        sliding_window=window,
        # Qwen2 always has q/k/v biases; Llama-style configs say so in attention_bias.
        attention_bias=bool(raw.get("attention_bias", arch == "Qwen2ForCausalLM")),
    )


def weight_files(checkpoint: Path) -> list[Path]:
    """The checkpoint's safetensors files; refuses pickle-only checkpoints."""
    checkpoint = Path(checkpoint)
    tensors = sorted(checkpoint.glob("*.safetensors"))
    if tensors:
        return tensors
    pickles = sorted(p.name for p in checkpoint.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise UserError(f"{checkpoint}: holds only pickle weights ({', '.join(pickles)}); "
                        "trtbuild loads safetensors only, since unpickling can run code. Convert "
                        "once where you trust the file: model.save_pretrained(dir, "
                        "safe_serialization=True)")
    raise UserError(f"{checkpoint}: no *.safetensors weights found")


def load_model(checkpoint: Path, dtype):
    """The transformers model of a checkpoint, from safetensors only, in eval mode."""
    import os
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM

    weight_files(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype, use_safetensors=True,
                                                 local_files_only=True)
    return model.eval()

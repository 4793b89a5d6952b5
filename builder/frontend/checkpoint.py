"""Read a checkpoint: a local Hugging Face checkpoint directory (architecture facts and
safetensors weights) or a GGUF file (its metadata as that config.json, checkpoint/gguf_config.py).

Only safetensors are loaded: a pickle (.bin/.pt/.pth) can run arbitrary code when loaded,
so a checkpoint holding only pickles is refused with the conversion to do.
"""
from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict

from ...checkpoint.errors import CheckpointError
from ...checkpoint.model import load_checkpoint_model
from ...contract.json_file import read_json_object
from ..errors import UserError
from ...checkpoint.gguf_config import is_gguf
from ...checkpoint.source import config_dict

# Architectures whose decoder layer is the Llama block (GQA + RoPE + RMSNorm + SwiGLU).
# Qwen3 adds an RMSNorm on each head's query and key; the rest differ only in config values.
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                           "Qwen3ForCausalLM")


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
    if is_gguf(checkpoint):
        try:
            return config_dict(checkpoint)
        except CheckpointError as exc:
            raise UserError(str(exc)) from None
    path = Path(checkpoint) / "config.json"
    if not Path(checkpoint).is_dir():
        raise UserError(f"{checkpoint}: checkpoint directory does not exist")
    if not path.is_file():
        raise UserError(f"{path}: missing; a checkpoint dir holds config.json, *.safetensors "
                        "and tokenizer.json")
    try:
        return read_json_object(path)
    except ValueError as exc:
        raise UserError(str(exc)) from None


MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
               "qwen3": "Qwen3ForCausalLM"}


def _positive_int(raw: dict, path: Path, key: str, required: bool = True) -> int | None:
    value = raw.get(key)
    if value is None and not required:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise UserError(f"{path}: {key} must be a positive integer, got {value!r}")
    return value


def _flag(raw: dict, path: Path, key: str, default: bool) -> bool:
    value = raw.get(key, default)
    if not isinstance(value, bool):
        raise UserError(f"{path}: {key} must be true or false, got {value!r}")
    return value


def arch_config(checkpoint: Path) -> ArchConfig:
    """config.json's facts, each number checked once here (build and plan both read them)."""
    return parse_arch(read_config(checkpoint), Path(checkpoint) if is_gguf(checkpoint) else Path(checkpoint) / "config.json")


def parse_arch(raw: dict, path: Path) -> ArchConfig:
    """The facts of a config.json mapping read from ``path`` (named in every error)."""
    archs = raw.get("architectures") or []
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise UserError(f"{path}: architectures must be a list of names, got {archs!r}")
    model_type = raw.get("model_type")
    if model_type is not None and not isinstance(model_type, str):
        raise UserError(f"{path}: model_type must be a name like 'llama', got {model_type!r}")
    arch = archs[0] if archs else MODEL_TYPES.get(model_type, str(model_type))
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UserError(f"{path}: architecture {arch!r} is not "
                        f"supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    if model_type is not None and MODEL_TYPES.get(model_type) != arch:
        raise UserError(f"{path}: model_type {model_type!r} disagrees with architectures {archs}; "
                        f"{arch} is model_type {next(k for k, v in MODEL_TYPES.items() if v == arch)!r}")
    sizes = {key: _positive_int(raw, path, key) for key in
             ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")}
    heads = sizes["num_attention_heads"]
    kv_heads = _positive_int(raw, path, "num_key_value_heads", required=False) or heads
    if heads % kv_heads:
        raise UserError(f"{path}: num_key_value_heads={kv_heads} does not divide num_attention_heads={heads}")
    head_dim = _positive_int(raw, path, "head_dim", required=False)
    if head_dim is None:
        if sizes["hidden_size"] % heads:
            raise UserError(f"{path}: num_attention_heads={heads} does not divide hidden_size={sizes['hidden_size']} "
                            "(and no head_dim is given)")
        head_dim = sizes["hidden_size"] // heads
    if head_dim % 2:
        raise UserError(f"{path}: head_dim={head_dim} is odd; rotary embeddings rotate pairs of channels")
    eps = raw.get("rms_norm_eps", 1e-6)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        raise UserError(f"{path}: rms_norm_eps must be a positive number, got {eps!r}")
    window = raw.get("sliding_window") if _flag(raw, path, "use_sliding_window", True) else None
    if window is not None:
        window = _positive_int(raw, path, "sliding_window")
    return ArchConfig(
        architecture=arch,
        vocab_size=sizes["vocab_size"],
        hidden_size=sizes["hidden_size"],
        intermediate_size=sizes["intermediate_size"],
        num_layers=sizes["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(eps),
        max_position_embeddings=_positive_int(raw, path, "max_position_embeddings", required=False) or 2048,
        tie_word_embeddings=_flag(raw, path, "tie_word_embeddings", False),
        qk_norm=arch == "Qwen3ForCausalLM",
        sliding_window=window,
        # Qwen2 always has q/k/v biases; Llama-style configs say so in attention_bias.
        attention_bias=_flag(raw, path, "attention_bias", arch == "Qwen2ForCausalLM"),
    )


def load_model(checkpoint: Path, dtype):
    """The transformers model of a checkpoint, read through the weight map (checkpoint.model)."""
    try:
        return load_checkpoint_model(checkpoint, dtype)
    except CheckpointError as exc:
        raise UserError(str(exc)) from None

"""A GGUF file's metadata as the config.json transformers makes of it (AutoConfig with
``gguf_file``), for the architectures whose decoder layer is the Llama block.

Every number is checked here under its GGUF key, so an error names what the file says; the
result then goes through the same parse_arch as a config.json.
"""
from __future__ import annotations

import math
from pathlib import Path

from .errors import CheckpointError
from .gguf_file import GGUFFile

SUFFIX = ".gguf"

# GGUF general.architecture → Hugging Face model_type and architecture, for the Llama block's family.
ARCHITECTURES = {"llama": ("llama", "LlamaForCausalLM"), "qwen2": ("qwen2", "Qwen2ForCausalLM"),
                 "qwen3": ("qwen3", "Qwen3ForCausalLM")}
PERMUTED_ROTARY = ("llama",)  # the architectures whose q/k rows llama.cpp's converter permutes


def is_gguf(checkpoint: Path) -> bool:
    """Whether ``model.checkpoint`` names a GGUF file (else it is a Hugging Face checkpoint dir)."""
    return Path(checkpoint).suffix.lower() == SUFFIX


def gguf_config(gguf: GGUFFile) -> dict:
    """The config.json mapping transformers makes of this file's metadata (AutoConfig with ``gguf_file``)."""
    meta, path = gguf.metadata, gguf.path
    arch = meta.get("general.architecture")
    if not isinstance(arch, str) or arch not in ARCHITECTURES:
        raise CheckpointError(f"{path}: general.architecture {arch!r} is not supported; "
                              f"supported: {', '.join(ARCHITECTURES)}")
    number = lambda key, required=True: _positive(meta, path, f"{arch}.{key}", required)  # noqa: E731
    hidden, heads = number("embedding_length"), number("attention.head_count")
    head_dim = number("attention.key_length", False) or number("rope.dimension_count", False) or hidden // heads
    if head_dim == 0 or head_dim % 2:
        raise CheckpointError(f"{path}: head dim {head_dim} (of {arch}.embedding_length {hidden} / "
                              f"{arch}.attention.head_count {heads}) must be a positive even number")
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling != "none":
        raise CheckpointError(f"{path}: {arch}.rope.scaling.type {scaling!r} is not supported (only 'none')")
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = number("vocab_size", False) or (len(tokens) if isinstance(tokens, list) else None)
    if vocab is None:
        raise CheckpointError(f"{path}: neither {arch}.vocab_size nor tokenizer.ggml.tokens gives the vocabulary size")
    eps = meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    if not isinstance(eps, float) or not 0 < eps < math.inf:
        raise CheckpointError(f"{path}: {arch}.attention.layer_norm_rms_epsilon must be a positive number, got {eps!r}")
    theta = meta.get(f"{arch}.rope.freq_base", 10000.0)
    if not isinstance(theta, float) or not 0 < theta < math.inf:
        raise CheckpointError(f"{path}: {arch}.rope.freq_base must be a positive number, got {theta!r}")
    model_type, architecture = ARCHITECTURES[arch]
    config = {
        "architectures": [architecture], "model_type": model_type, "vocab_size": vocab, "hidden_size": hidden,
        "intermediate_size": number("feed_forward_length"), "num_hidden_layers": number("block_count"),
        "num_attention_heads": heads, "num_key_value_heads": number("attention.head_count_kv", False) or heads,
        "head_dim": head_dim, "rms_norm_eps": eps, "max_position_embeddings": number("context_length"),
        "rope_parameters": {"rope_theta": theta, "rope_type": "default"}, "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in gguf.tensors,
        "attention_bias": "blk.0.attn_q.bias" in gguf.tensors,
    }
    for name, key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                      ("pad_token_id", "padding_token_id"), ("unk_token_id", "unknown_token_id")):
        token = _token_id(meta, path, key, vocab)
        if token is not None:
            config[name] = token
    return config


def _positive(meta: dict, path: Path, key: str, required: bool) -> int | None:
    value = meta.get(key)
    if value is None and not required:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise CheckpointError(f"{path}: metadata {key} must be a positive integer, got {value!r}")
    return value


def _token_id(meta: dict, path: Path, key: str, vocab: int) -> int | None:
    value = meta.get(f"tokenizer.ggml.{key}")
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocab):
        raise CheckpointError(f"{path}: metadata tokenizer.ggml.{key} must be a token id below {vocab}, got {value!r}")
    return value

"""A checkpoint's transformers model built on the meta device (structure, no weight bytes),
and real weights assigned to parts of it from the weight map, a part at a time.

The export traces the meta model; the numerics check's reference, layer-by-layer calibration,
eval and Medusa training assign real tensors to the modules they run, and those are all that is
ever materialized. Every weight comes through checkpoint.weight_map, never through transformers'
own loader, so one set of checks guards every command that reads a checkpoint.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from ..contract.errors import first_line
from .errors import CheckpointError
from .gguf_config import is_gguf
from .source import hf_config, open_weights
from .weight_map import WeightMap


def meta_model(checkpoint: Path, dtype: torch.dtype, num_layers: int | None = None,
               vocab_rows: int | None = None) -> nn.Module:
    """The transformers CausalLM of ``checkpoint``'s config.json on the meta device, in eval mode,
    with ``num_layers`` decoder layers (default: all) and the first ``vocab_rows`` rows of the
    embedding and lm_head (default: all). Its rotary ``inv_freq`` (a non-persistent buffer
    computed from the config, not stored in the checkpoint) is real."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM

    gguf = is_gguf(checkpoint)
    if not gguf and not (Path(checkpoint) / "config.json").is_file():
        raise CheckpointError(f"{checkpoint}: no config.json (a local Hugging Face checkpoint dir is expected)")
    try:
        config = hf_config(checkpoint)
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001  (a config transformers refuses)
        where = checkpoint if gguf else f"{checkpoint}/config.json"
        raise CheckpointError(f"{where}: transformers cannot read it: {first_line(exc)}") from None
    if num_layers is not None:
        config.num_hidden_layers = num_layers
        if getattr(config, "layer_types", None):  # per-layer attention kinds (Qwen2/3) must match the count
            config.layer_types = config.layer_types[:num_layers]
    if vocab_rows is not None:
        config.vocab_size = vocab_rows
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    rotary = model.model.rotary_emb
    with torch.device("cpu"):
        model.model.rotary_emb = type(rotary)(config)
    return model.eval()


def checkpoint_key(name: str, tie_word_embeddings: bool) -> str:
    """The checkpoint's key for parameter ``name`` of the CausalLM: the same name, except a tied
    ``lm_head.weight``, which the checkpoint stores only as the embedding."""
    if name == "lm_head.weight" and tie_word_embeddings:
        return "model.embed_tokens.weight"
    return name


def assign_weights(model: nn.Module, weights: WeightMap, prefix: str, dtype: torch.dtype) -> int:
    """Gives every parameter under module path ``prefix`` (e.g. ``model.layers.3``, or ``""`` for
    the whole model) its real tensor from ``weights``, converted to ``dtype``; returns the bytes
    assigned. Tied embeddings stay one tensor."""
    module = model.get_submodule(prefix) if prefix else model
    dot = f"{prefix}." if prefix else ""
    state, read = {}, {}
    for name, param in module.named_parameters(remove_duplicate=False):
        key = checkpoint_key(dot + name, model.config.tie_word_embeddings)
        tensor = read[key] if key in read else read.setdefault(key, weights.for_shape(key, tuple(param.shape), dtype))
        if tuple(tensor.shape) != tuple(param.shape):
            raise CheckpointError(f"tensor {key} has shape {tuple(tensor.shape)}; config.json implies "
                                  f"{tuple(param.shape)}")
        state[name] = tensor
    module.load_state_dict(state, strict=True, assign=True)
    if not prefix and model.config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return sum(t.numel() * t.element_size() for t in read.values())


def load_checkpoint_model(checkpoint: Path, dtype: torch.dtype) -> nn.Module:
    """The whole transformers model of a checkpoint in eval mode, every weight read through the
    weight map (memory-mapped where the stored dtype is ``dtype``): the loader of every entry point
    that runs a whole checkpoint (eval and its ``--reference``, medusa train)."""
    weights = open_weights(Path(checkpoint))
    model = meta_model(checkpoint, dtype)
    assign_weights(model, weights, "", dtype)
    return model

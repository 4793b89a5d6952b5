"""The Hugging Face side files of a GGUF file, rebuilt from its metadata: what a checkpoint dir
holds beside its weights, and what an engine dir ships (tokenizer, chat template, eos ids).

The tokenizer is transformers' own GGUF conversion (the class llama.cpp's ``tokenizer.ggml.model``
names, given the file's vocabulary, merges and token types), fed with metadata that has passed
checkpoint/gguf_file.py's bounds and the type checks here.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..contract.errors import first_line
from .errors import CheckpointError
from .gguf_config import gguf_config
from .gguf_file import GGUFFile, read_gguf

# metadata key → (the name in transformers' tokenizer dict, the type each value must have)
TOKENIZER_KEYS = {"ggml.model": ("tokenizer_type", str), "ggml.pre": ("pre_tokenizer_type", str),
                  "ggml.tokens": ("tokens", list), "ggml.scores": ("scores", np.ndarray),
                  "ggml.token_type": ("token_type", np.ndarray), "ggml.merges": ("merges", list),
                  "ggml.add_space_prefix": ("add_prefix_space", bool)}
LIST_ITEMS = {"tokens": str, "merges": str}
NUMBER_KINDS = {"scores": ("f", "floats"), "token_type": ("iu", "integers")}  # numpy dtype kinds
SPECIAL_TOKENS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unk_token_id",
                  "pad_token": "pad_token_id"}


def gguf_side_files(path: Path) -> dict[str, bytes]:
    """config.json, tokenizer.json, tokenizer_config.json, generation_config.json and
    chat_template.jinja (when the file has a template) of the GGUF file at ``path``."""
    gguf = read_gguf(path)
    config = gguf_config(gguf)
    tokenizer = gguf_tokenizer(gguf)  # checks tokenizer.ggml.tokens is a list of strings
    tokens = gguf.metadata["tokenizer.ggml.tokens"]
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast"}
    for flag in ("add_bos_token", "add_eos_token"):
        value = gguf.metadata.get(f"tokenizer.ggml.{flag}")
        if value is not None:
            tokenizer_config[flag] = _typed(gguf, f"tokenizer.ggml.{flag}", value, bool)
    for name, key in SPECIAL_TOKENS.items():
        if key in config and config[key] < len(tokens):
            tokenizer_config[name] = tokens[config[key]]
    template = gguf.metadata.get("tokenizer.chat_template")
    files = {"config.json": _json(config), "tokenizer.json": tokenizer.to_str().encode("utf-8"),
             "generation_config.json": _json({k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")
                                              if k in config})}
    if template is not None:
        template = _typed(gguf, "tokenizer.chat_template", template, str)
        files["chat_template.jinja"] = template.encode("utf-8")
    files["tokenizer_config.json"] = _json(tokenizer_config)
    return files


def gguf_tokenizer(gguf: GGUFFile):
    """The ``tokenizers.Tokenizer`` transformers builds from this file's metadata."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

    tokenizer = {}
    for key, (name, kind) in TOKENIZER_KEYS.items():
        value = gguf.metadata.get(f"tokenizer.{key}")
        if value is not None:
            tokenizer[name] = _typed(gguf, f"tokenizer.{key}", value, kind)
    for name, kind in LIST_ITEMS.items():
        if name in tokenizer and not all(isinstance(item, kind) and not isinstance(item, bool)
                                         for item in tokenizer[name]):
            raise CheckpointError(f"{gguf.path}: metadata tokenizer.ggml.{name} must be a list of {kind.__name__}")
    for name, (kinds, words) in NUMBER_KINDS.items():
        if name in tokenizer:
            if tokenizer[name].dtype.kind not in kinds:
                raise CheckpointError(f"{gguf.path}: metadata tokenizer.ggml.{name} must be an array of {words}")
            tokenizer[name] = tokenizer[name].tolist()  # what transformers' conversion reads
    if "tokens" not in tokenizer or "tokenizer_type" not in tokenizer:
        raise CheckpointError(f"{gguf.path}: no tokenizer.ggml.model and tokenizer.ggml.tokens; "
                              "the file carries no tokenizer")
    try:
        backend, _ = convert_gguf_tokenizer(gguf.metadata["general.architecture"], tokenizer)
    except Exception as exc:  # noqa: BLE001  (transformers refuses a tokenizer kind, or bad merges)
        raise CheckpointError(f"{gguf.path}: transformers cannot build its tokenizer: {first_line(exc)}") from None
    return backend


def _typed(gguf: GGUFFile, key: str, value, kind: type):
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise CheckpointError(f"{gguf.path}: metadata {key} must be a {kind.__name__}, got {type(value).__name__}")
    return value


def _json(value: dict) -> bytes:
    return (json.dumps(value, indent=2, ensure_ascii=False) + "\n").encode("utf-8")

"""Which reader a checkpoint takes: a ``.gguf`` file, or a Hugging Face dir of safetensors. The
one place that tells them apart for the config and the weights."""
from __future__ import annotations

from pathlib import Path

from .errors import CheckpointError
from .files import checkpoint_file
from .gguf_config import gguf_config, is_gguf
from .gguf_file import read_gguf


def config_dict(checkpoint: Path) -> dict:
    """The config.json mapping: the dir's file, or the one a GGUF file's metadata gives."""
    from ..contract.json_file import read_json_object

    if is_gguf(checkpoint):
        return gguf_config(read_gguf(checkpoint))
    path = checkpoint_file(checkpoint, "config.json")
    if path is None:
        raise CheckpointError(f"{checkpoint}: no config.json (a local Hugging Face checkpoint dir is expected)")
    try:
        return read_json_object(path)
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None


def open_weights(checkpoint: Path):
    """The checkpoint's weight map (tensors by Hugging Face name): a GGUF file's (dequantized as
    read) or a checkpoint dir's safetensors files'."""
    from .gguf_weights import GGUFWeightMap  # torch: imported by the readers of weights only
    from .weight_map import WeightMap

    return GGUFWeightMap.from_gguf(checkpoint) if is_gguf(checkpoint) else WeightMap.from_checkpoint(checkpoint)


def hf_config(checkpoint: Path):
    """The transformers config of the checkpoint."""
    from transformers import AutoConfig

    config = dict(config_dict(checkpoint))  # read here, inside the dir, not by transformers
    model_type = config.pop("model_type", None)
    if not isinstance(model_type, str):
        raise CheckpointError(f"{checkpoint}: config.json has no model_type (e.g. 'llama')")
    return AutoConfig.for_model(model_type, **config)


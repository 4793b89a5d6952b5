"""Which reader a checkpoint takes: a ``.gguf`` file, or a Hugging Face dir of safetensors. The
one place that tells them apart for the config and the weights."""
from __future__ import annotations

from pathlib import Path

from .errors import CheckpointError
from .files import checkpoint_file
from .gguf_config import gguf_config, is_gguf
from .gguf_file import read_gguf
from .layer_count import check_layer_count


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
    read) or a checkpoint dir's safetensors files', holding the layers its config counts."""
    from .gguf_weights import GGUFWeightMap  # torch: imported by the readers of weights only
    from .weight_map import WeightMap

    checkpoint = Path(checkpoint)
    if is_gguf(checkpoint):
        weights = GGUFWeightMap.from_gguf(checkpoint)
        config, where = gguf_config(weights.gguf), checkpoint
        field = f"{weights.gguf.metadata['general.architecture']}.block_count"
        files = [checkpoint.name]
    else:
        weights = WeightMap.from_checkpoint(checkpoint)
        config, where, field = config_dict(checkpoint), checkpoint / "config.json", "num_hidden_layers"
        files = sorted({entry.file.name for entry in weights.entries.values()})
    held = ", ".join(files) if len(files) <= 2 else f"its {len(files)} safetensors files"
    check_layer_count(weights.names, config.get("num_hidden_layers"), str(where), field, held)
    return weights


def hf_config(checkpoint: Path):
    """The transformers config of the checkpoint."""
    from transformers import AutoConfig

    config = dict(config_dict(checkpoint))  # read here, inside the dir, not by transformers
    model_type = config.pop("model_type", None)
    if not isinstance(model_type, str):
        raise CheckpointError(f"{checkpoint}: config.json has no model_type (e.g. 'llama')")
    return AutoConfig.for_model(model_type, **config)


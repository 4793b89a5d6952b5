"""Which reader a checkpoint takes: a ``.gguf`` file, or a Hugging Face dir of safetensors. The
one place that tells them apart for the weights and the transformers config."""
from __future__ import annotations

from pathlib import Path

from .errors import CheckpointError
from .gguf_config import gguf_config, is_gguf
from .gguf_file import read_gguf


def config_dict(checkpoint: Path) -> dict:
    """The config.json mapping: the dir's file, or the one a GGUF file's metadata gives."""
    from ..contract.json_file import read_json_object

    if is_gguf(checkpoint):
        return gguf_config(read_gguf(checkpoint))
    try:
        return read_json_object(Path(checkpoint) / "config.json")
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

    if not is_gguf(checkpoint):
        return AutoConfig.from_pretrained(checkpoint, local_files_only=True)
    config = config_dict(checkpoint)
    return AutoConfig.for_model(config.pop("model_type"), **config)


def checkpoint_tokenizer(checkpoint: Path):
    """The checkpoint's ``tokenizers.Tokenizer``: a dir's tokenizer.json, or the one a GGUF file's
    metadata gives (checkpoint/gguf_side_files.py)."""
    from tokenizers import Tokenizer

    if is_gguf(checkpoint):
        from .gguf_side_files import gguf_tokenizer

        return gguf_tokenizer(read_gguf(checkpoint))
    path = Path(checkpoint) / "tokenizer.json"
    if not path.is_file():
        raise CheckpointError(f"{checkpoint}: no tokenizer.json (a Hugging Face checkpoint dir holds it beside "
                              "config.json)")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # noqa: BLE001  (the tokenizers library raises a bare Exception)
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise CheckpointError(f"{path}: not a loadable tokenizer ({first})") from None

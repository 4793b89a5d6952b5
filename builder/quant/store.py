"""Quantized layers on disk, written a block at a time and read back lazily.

Layout of the directory ``quantize_checkpoint`` writes (inside the build's workdir):

    index.json                 bits, group, the error report, and layer name → its file
    layers.0.safetensors       codes, scales (and input/activation/global scales, block offsets) of that
    ...                        decoder layer's quantized linears
    lm_head.safetensors        (when quantized)
    embed_tokens.safetensors   (quantize_embeddings)

One file per decoder layer, so writing holds one layer's codes at a time; ``index.json`` is
written last, so a directory without it is an unfinished one. Reading goes through the same
WeightMap as the checkpoint (headers checked against file sizes, tensors memory-mapped), so
``load_quantized`` returns a mapping whose layers cost nothing until their codes are touched.
FP8 codes are stored as their uint8 bit patterns (the map reads only plain dtypes), NVFP4 codes
(E2M1 values, all multiples of 0.5 within ±6) as int8 twice their value: a quarter of float32.
"""
from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file

from ...checkpoint.errors import CheckpointError
from ...checkpoint.weight_map import WeightMap
from .algorithms import QuantizedLinear

INDEX = "index.json"


class QuantizedWriter:
    """Writes blocks of quantized layers to ``directory``, one safetensors file per block."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=False)
        self.layers: dict[str, dict] = {}

    def write(self, block: str, layers: dict[str, QuantizedLinear]) -> None:
        """``block``: ``layers.3``, ``lm_head`` or ``embed_tokens`` (its file's name)."""
        if not layers:
            return
        file = f"{block}.safetensors"
        tensors = {}
        for name, layer in layers.items():
            tensors[f"{name}.codes"] = _stored_codes(layer).contiguous()
            tensors[f"{name}.scales"] = layer.scales.contiguous()
            if layer.input_scale is not None:
                tensors[f"{name}.input_scale"] = layer.input_scale.clone()  # layers may share one s
            if layer.activation_scale is not None:
                tensors[f"{name}.activation_scale"] = torch.tensor([layer.activation_scale])
            if layer.global_scale is not None:
                tensors[f"{name}.global_scale"] = torch.tensor([layer.global_scale], dtype=torch.float64)
            if layer.offsets is not None:
                tensors[f"{name}.offsets"] = layer.offsets.contiguous()
            self.layers[name] = {"file": file, "bits": layer.bits, "group": layer.group, "codes": _codes_kind(layer)}
        save_file(tensors, str(self.directory / file))

    def finish(self, report: dict[str, dict]) -> None:
        (self.directory / INDEX).write_text(json.dumps({"layers": self.layers, "report": report}))


def _codes_kind(layer: QuantizedLinear) -> str:
    return "fp8" if layer.fp8 else "fp4x2" if layer.nvfp4 else "int8"


def _stored_codes(layer: QuantizedLinear) -> torch.Tensor:
    if layer.fp8:
        return layer.codes.view(torch.uint8)
    return (layer.codes * 2).to(torch.int8) if layer.nvfp4 else layer.codes


def _loaded_codes(stored: torch.Tensor, kind: str) -> torch.Tensor:
    """The codes as QuantizedLinear holds them (int8 and FP8 still memory-mapped; FP4 as float32)."""
    if kind == "fp8":
        return stored.view(torch.float8_e4m3fn)
    return stored.float() / 2 if kind == "fp4x2" else stored


class QuantizedLayers(Mapping):
    """Layer name → QuantizedLinear, built when asked from memory-mapped tensors."""

    def __init__(self, weights: WeightMap, layers: dict[str, dict]):
        self.weights, self.layers = weights, layers

    def __getitem__(self, name: str) -> QuantizedLinear:
        info = self.layers[name]
        codes = _loaded_codes(self.weights.tensor(f"{name}.codes"), info["codes"])
        optional = lambda key: self.weights.tensor(key) if key in self.weights else None  # noqa: E731
        activation, global_scale = optional(f"{name}.activation_scale"), optional(f"{name}.global_scale")
        return QuantizedLinear(codes=codes,
                               scales=self.weights.tensor(f"{name}.scales"), bits=info["bits"], group=info["group"],
                               input_scale=optional(f"{name}.input_scale"),
                               activation_scale=None if activation is None else float(activation[0]),
                               global_scale=None if global_scale is None else float(global_scale[0]),
                               offsets=optional(f"{name}.offsets"))

    def __contains__(self, name) -> bool:  # Mapping's would build the layer to find out
        return name in self.layers

    def __iter__(self) -> Iterator[str]:
        return iter(self.layers)

    def __len__(self) -> int:
        return len(self.layers)


def load_quantized(directory: Path) -> tuple[QuantizedLayers, dict[str, dict]]:
    """The layers ``QuantizedWriter`` wrote (lazily) and the error report."""
    directory = Path(directory)
    index_path = directory / INDEX
    if not index_path.is_file():
        raise CheckpointError(f"{directory}: no {INDEX}; the quantization did not finish")
    index = json.loads(index_path.read_text())
    weights = WeightMap.from_checkpoint(directory)
    missing = [name for name in index["layers"] if f"{name}.codes" not in weights]
    if missing:
        raise CheckpointError(f"{directory}: {INDEX} lists layers without codes: {missing[:4]}")
    return QuantizedLayers(weights, index["layers"]), index["report"]

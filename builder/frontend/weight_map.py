"""The checkpoint's weight map, as the builder's code imports it: it lives in the contract
(contract.weight_map), since eval reads checkpoints through it too."""
from __future__ import annotations

from ...contract.safetensors_header import DTYPES, TensorEntry
from ...contract.weight_map import VOCAB_KEYS, WeightMap

__all__ = ["DTYPES", "TensorEntry", "VOCAB_KEYS", "WeightMap"]

"""A GGUF file's tensors behind the same WeightMap interface as safetensors, under Hugging
Face's names (its metadata as a config.json: checkpoint/gguf_config.py).

Each tensor is dequantized when asked for, one at a time (``rows`` reads and dequantizes only the
blocks of those rows), so a build holds one tensor, never the dequantized model. llama.cpp
stores a Llama's q/k projection rows permuted for its interleaved rotary (convert_hf_to_gguf's
``permute``); they are put back in Hugging Face's half-split order here, as transformers' GGUF
loader does (LlamaTensorProcessor). Qwen2/Qwen3 files are not permuted.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from .errors import CheckpointError
from .gguf_config import PERMUTED_ROTARY, gguf_config
from .gguf_file import GGUFFile, GGUFTensor, read_gguf
from .safetensors_header import DTYPES, TensorEntry
from .weight_map import WeightMap, as_torch

TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
LAYER_NAMES = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
               "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
               "attn_k_norm": "self_attn.k_norm", "ffn_norm": "post_attention_layernorm",
               "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
FLOAT_TYPES = ("F32", "F16", "BF16")  # read as they are; every other type dequantizes to F32


def hf_name(path: Path, name: str) -> str:
    """The Hugging Face state-dict name of a GGUF tensor name (``blk.3.attn_q.weight`` →
    ``model.layers.3.self_attn.q_proj.weight``); refuses a tensor the Llama block has no place for."""
    stem, _, kind = name.rpartition(".")
    parts = stem.split(".")
    if kind in ("weight", "bias"):
        if len(parts) == 1 and parts[0] in TOP_NAMES:
            return f"{TOP_NAMES[parts[0]]}.{kind}"
        if len(parts) == 3 and parts[0] == "blk" and parts[1].isascii() and parts[1].isdigit() and parts[2] in LAYER_NAMES:
            return f"model.layers.{int(parts[1])}.{LAYER_NAMES[parts[2]]}.{kind}"
    raise CheckpointError(f"{path}: tensor {name} has no place in a Llama-family model "
                          f"(expected {', '.join(TOP_NAMES)} or blk.N.{{{', '.join(LAYER_NAMES)}}})")


class GGUFWeightMap(WeightMap):
    """A GGUF file's tensors by Hugging Face name, dequantized one at a time when read."""

    def __init__(self, gguf: GGUFFile, config: dict):
        self.gguf = gguf
        self.sources: dict[str, GGUFTensor] = {}
        # Rows per rotary head of the q/k projections to un-permute (none for Qwen files).
        self.rotary_rows: dict[str, int] = {}
        entries = {}
        permuted = gguf.metadata["general.architecture"] in PERMUTED_ROTARY
        for tensor in gguf.tensors.values():
            name = hf_name(gguf.path, tensor.name)
            if name in entries:
                raise CheckpointError(f"{gguf.path}: tensors {self.sources[name].name} and {tensor.name} "
                                      f"are both {name}")
            self.sources[name] = tensor
            dtype = tensor.type_name if tensor.type_name in FLOAT_TYPES else "F32"
            entries[name] = TensorEntry(name=name, file=gguf.path, offset=tensor.offset, dtype=dtype,
                                        shape=tensor.shape)
            if permuted and (name.endswith("self_attn.q_proj.weight") or name.endswith("self_attn.k_proj.weight")):
                head = config["head_dim"]
                if head % 2 or tensor.shape[0] % head:
                    raise CheckpointError(f"{gguf.path}: tensor {tensor.name}: {tensor.shape[0]} rows are not whole "
                                          f"rotary heads of head_dim {head} (an even number)")
                self.rotary_rows[name] = head
        super().__init__(entries)

    @classmethod
    def from_gguf(cls, path: Path) -> "GGUFWeightMap":
        gguf = read_gguf(path)
        return cls(gguf, gguf_config(gguf))

    def entry(self, name: str) -> TensorEntry:
        entry = self.entries.get(name)
        if entry is None:
            raise CheckpointError(f"tensor {name} is not in {self.gguf.path.name} (it has {len(self.entries)} "
                                  "tensors, named as Hugging Face names them)")
        return entry

    def tensor(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The whole tensor (a float tensor copy-on-write memory-mapped; a quantized one dequantized to F32)."""
        return self.rows(name, 0, self.entry(name).shape[0], dtype)

    def rows(self, name: str, start: int, stop: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Rows ``[start, stop)`` of axis 0, reading (and dequantizing) only their blocks; for a
        permuted q/k projection, only the rotary heads those rows lie in."""
        entry = self.entry(name)
        if not 0 <= start <= stop <= entry.shape[0]:
            raise ValueError(f"{name}: rows [{start}, {stop}) outside shape {entry.shape}")
        head = self.rotary_rows.get(name)
        if head is None:
            return as_torch(self._read(name, start, stop), entry, (stop - start, *entry.shape[1:]), dtype)
        first, last = start // head * head, -(-stop // head) * head
        values = _unpermute(self._read(name, first, last).reshape(last - first, -1), head)  # [heads·D, in]
        return as_torch(values[start - first:stop - first].reshape(-1), entry, (stop - start, *entry.shape[1:]), dtype)

    def blocks(self, name: str) -> tuple[str, np.ndarray]:
        """A 2-D tensor's GGML type name and its raw blocks as stored, ``[rows, row bytes]``
        uint8 (a copy), rows in Hugging Face's order: a block holds consecutive values of one
        row, so un-permuting q/k rows moves whole blocks (checkpoint/gguf_blocks.py reads them)."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        source, entry = self.sources[name], self.entry(name)
        if len(entry.shape) != 2:
            raise ValueError(f"{name}: blocks are read for 2-D tensors; shape {entry.shape}")
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[source.type_name]]
        rows, row_bytes = entry.shape[0], entry.shape[1] // block * type_size
        raw = self.gguf.opened.bytes_at(source.offset, rows * row_bytes).reshape(rows, row_bytes).copy()
        head = self.rotary_rows.get(name)
        return source.type_name, raw if head is None else _unpermute(raw, head)

    def _read(self, name: str, start: int, stop: int) -> np.ndarray:
        """The flat values of rows [start, stop), in the entry's numpy dtype."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

        source, entry = self.sources[name], self.entries[name]
        row = entry.numel // entry.shape[0]
        if len(entry.shape) == 1:  # a vector: one block row, read whole (norms, biases: small)
            start, stop, row, cut = 0, 1, entry.numel, (start, stop)
        else:
            cut = None
        kind = GGMLQuantizationType[source.type_name]
        block, type_size = GGML_QUANT_SIZES[kind]
        row_bytes = row // block * type_size
        # Through the handle the header was read from (checkpoint/opened_file.py), never the path again.
        float_type = source.type_name in FLOAT_TYPES
        raw = self.gguf.opened.bytes_at(source.offset + start * row_bytes, (stop - start) * row_bytes,
                                        writable=float_type)
        if float_type:
            values = raw.view(DTYPES[source.type_name][1])  # copy-on-write, as the safetensors map's
        else:
            values = quants.dequantize(raw.reshape(stop - start, row_bytes), kind).reshape(-1)
        return values if cut is None else values[cut[0]:cut[1]]


def _unpermute(weight: np.ndarray, head: int) -> np.ndarray:
    """[heads·D, in] rows of llama.cpp's interleaved rotary order back to Hugging Face's halves:
    row 2j+k of a head becomes row k·D/2+j (the inverse of convert_hf_to_gguf's permute)."""
    heads = weight.shape[0] // head
    return weight.reshape(heads, head // 2, 2, -1).swapaxes(1, 2).reshape(weight.shape)

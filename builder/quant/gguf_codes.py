"""Quantized in, quantized out: a GGUF tensor already in a block format that the spec's
weight-only mode represents keeps its codes and scales instead of being dequantized and
rounded again (which can only add error: the file's values are the target, and RTN of them
lands on other codes wherever its absmax scale differs from the file's).

What is kept (checkpoint/gguf_blocks.py reads the blocks):
- Q4_0 under int4_weight_only, rtn, group_size 32: codes q − 8 ∈ [−8, 7] (the int4
  DequantizeLinear admits −8; our own RTN uses [−7, 7]) and the f16 block scales, which may be
  negative (llama.cpp divides by the signed extreme; DequantizeLinear takes any sign).
- Q4_1 under the same mode: x = d·q + m = d·(q − 8) + o with o = m + 8d, i.e. Q4_0's form plus
  one offset per block. TensorRT's int4 DequantizeLinear takes no zero point, so the offsets
  become a correction the quantize_weights pass adds to the MatMul: y = x·DQ(c, d)ᵀ + S(x)·Oᵀ,
  where S(x) sums x over each block of 32 inputs ([…, in/32]) and O [out, in/32] holds the
  offsets in the model's dtype: 1/32 of the weight's multiply-adds, in float. The engine then
  computes the file's weights (to float32 rounding), where re-quantizing Q4_1's asymmetric grid
  onto a symmetric one cost SmolLM2-135M +50 % perplexity (docs/benchmarks.md). Single-rank
  graphs only: the tensor-parallel pass does not shard the correction.
- Q8_0 or Q4_0 under int8_weight_only (or the int8 embedding table) only where every row's
  blocks share one scale: our int8 form is one scale per output channel, which cannot hold
  per-32 scales in general.
Everything else is re-quantized from the dequantized values as usual, with the reason noted.

Seen with TensorRT-RTX 1.7.1 building for sm89 (no GPU): int4 block_size 32 with codes −8 and
negative scales builds; int8 with block_size 32 parses and builds too (so Q8_0 could be kept by
an int8 mode with groups, which we do not have yet); a non-zero int4 zero point is refused
("Non-zero zero point is not supported") and a uint4 initializer cannot be imported, hence the
offsets' separate correction.
"""
from __future__ import annotations

import torch

from ...checkpoint.gguf_blocks import BLOCK, SYMMETRIC_TYPES, block_codes, offset_block_codes
from ...checkpoint.gguf_weights import FLOAT_TYPES, GGUFWeightMap
from ...checkpoint.weight_map import WeightMap
from ..spec.document import QuantizationSection
from .algorithms import QuantizedLinear

WEIGHT_ONLY = ("int8_weight_only", "int4_weight_only")
KEPT_WITH_OFFSETS = "kept GGUF Q4_1 codes and block offsets"


def gguf_type(weights: WeightMap, key: str) -> str | None:
    """The GGML block type of checkpoint tensor ``key``; None for a float tensor or a safetensors checkpoint."""
    if not isinstance(weights, GGUFWeightMap):
        return None
    type_name = weights.sources[key].type_name
    return None if type_name in FLOAT_TYPES else type_name


def kept_codes(weights: WeightMap, key: str, q: QuantizationSection, bits: int,
               group: int | None, embedding: bool = False,
               tensor_parallel: int = 1) -> tuple[QuantizedLinear | None, str | None]:
    """(the file's codes as a QuantizedLinear, or None to quantize as usual; the note for the
    quantization report: None when ``key`` is not a GGUF block tensor). ``embedding``: the int8
    table ``quantize_embeddings`` makes, RTN whatever the linears' mode and algorithm."""
    type_name = gguf_type(weights, key)
    if type_name is None:
        return None, None
    reason = _not_kept(type_name, q, bits, group, embedding, tensor_parallel)
    if reason is None and type_name == "Q4_1":
        codes, scales, offsets = offset_block_codes(weights.blocks(key)[1])  # [out, in], [out, in/32] × 2
        return QuantizedLinear(codes=torch.from_numpy(codes), scales=torch.from_numpy(scales), bits=4, group=BLOCK,
                               offsets=torch.from_numpy(offsets)), KEPT_WITH_OFFSETS
    if reason is None:
        codes, scales = block_codes(type_name, weights.blocks(key)[1])  # [out, in], [out, in/32]
        if bits == 4:
            return QuantizedLinear(codes=torch.from_numpy(codes), scales=torch.from_numpy(scales),
                                   bits=4, group=BLOCK), f"kept GGUF {type_name} codes"
        if (scales == scales[:, :1]).all():
            return QuantizedLinear(codes=torch.from_numpy(codes), scales=torch.from_numpy(scales[:, 0].copy()),
                                   bits=8, group=None), f"kept GGUF {type_name} codes"
        reason = (f"{type_name}'s scales are per {BLOCK} inputs and int8 here is one scale per output "
                  "channel; this tensor's rows have more than one")
    return None, f"re-quantized GGUF {type_name}: {reason}"


def _not_kept(type_name: str, q: QuantizationSection, bits: int, group: int | None, embedding: bool,
              tensor_parallel: int) -> str | None:
    """Why a tensor of ``type_name`` cannot keep its codes under this quantization, or None."""
    if not q.keep_gguf_codes:
        return "quantization.keep_gguf_codes is false"
    if q.mode not in WEIGHT_ONLY and not embedding:
        return f"mode {q.mode} is not an integer weight-only mode"
    if q.algorithm != "rtn" and not embedding:
        return f"algorithm {q.algorithm} computes its own codes"
    if type_name == "Q4_1":
        if bits != 4:
            return "Q4_1's block offsets are kept by int4_weight_only only"
        if group != BLOCK:
            return f"group_size {group} is not {type_name}'s block of {BLOCK}"
        if tensor_parallel > 1:
            return (f"its block offsets' correction is not sharded across ranks (parallel.tensor "
                    f"{tensor_parallel}; keeping them needs 1)")
        return None
    if type_name not in SYMMETRIC_TYPES:
        return f"only {' and '.join(SYMMETRIC_TYPES)} blocks are kept ({type_name}'s codes are no int4/int8 block of {BLOCK})"
    if bits == 4 and type_name != "Q4_0":
        return f"{type_name}'s 8-bit codes do not fit int4"
    if bits == 4 and group != BLOCK:
        return f"group_size {group} is not {type_name}'s block of {BLOCK}"
    return None

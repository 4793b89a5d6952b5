"""Quantized in, quantized out: a GGUF tensor already in a block format that the spec's
weight-only mode represents keeps its codes and scales instead of being dequantized and
rounded again (which can only add error: the file's values are the target, and RTN of them
lands on other codes wherever its absmax scale differs from the file's).

What is kept (checkpoint/gguf_blocks.py and gguf_kept_blocks.py read the blocks):
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
- Symmetric codes whose blocks share one scale per row become int8 per output channel (the
  cheaper form), under int8_weight_only, and the only form the int8 embedding table keeps.
Everything else is re-quantized from the dequantized values as usual, with the reason noted.

Seen with TensorRT-RTX 1.7.1 building for sm89 (no GPU): int4 block_size 32 with codes −8 and
negative scales builds; int8 with block_size 16 or 32 parses and builds; a non-zero int4 zero point is refused
("Non-zero zero point is not supported") and a uint4 initializer cannot be imported, hence the
offsets' separate correction.

K-quants and the 5/6/8-bit types (checkpoint/gguf_kept_blocks.py reads every kept type):
- Q4_K under int4_weight_only, rtn, group_size 32 keeps Q4_1's form per sub-block of 32: int4
  codes q − 8, scales d·sc and offsets 8·d·sc − dmin·mn, decoded from the super-block's 6-bit
  scales and minimums; the offsets take the same correction as Q4_1's.
- Q5_0, Q5_1, Q5_K, Q6_K and Q8_0 codes fit int8, not int4: under either weight-only mode they
  are kept as int8 codes with their own block scales (block_size 32, or 16 for Q6_K's
  sub-blocks) and Q5_1/Q5_K's offsets. Under an int4 spec this is a per-tensor precision mix, as
  the file itself is (llama.cpp's Q4_K_M puts some tensors in Q6_K, Q5_0 or Q8_0). Under
  int8_weight_only the 4-bit types are kept as int8 blocks too (int4 codes fit int8).
  TensorRT-RTX 1.7 parses and builds int8 DequantizeLinear with block_size 16 and 32 (sm89, no
  GPU); ONNX Runtime's CPU DequantizeLinear runs int8 blocks, and with the session's accuracy
  level 1 (plugins/onnxruntime/session.py) its DequantizeLinear → MatMul rewrite keeps float
  activations: checked to float32 rounding. (At ONNX Runtime's default level the fused n-bit
  GEMM quantizes activations: ~0.7 % error.) TensorRT refuses a negative int8 scale at parse, so
  a negative block scale (Q5_0's, Q6_K's) moves its sign into the block's codes.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from ...checkpoint.gguf_kept_blocks import KEPT_TYPES, BlockCodes, read_block_codes
from ...checkpoint.gguf_weights import FLOAT_TYPES, GGUFWeightMap
from ...checkpoint.weight_map import WeightMap
from ..spec.document import QuantizationSection
from .algorithms import QuantizedLinear

WEIGHT_ONLY = ("int8_weight_only", "int4_weight_only")


def kept_source(type_name: str, bits: int, group: int | None, offsets: bool) -> str:
    """The quantization report's note for a kept tensor: its GGUF type and the form it is kept in."""
    form = f"int{bits} per output channel" if group is None else f"int{bits} group {group}"
    return f"kept GGUF {type_name} codes as {form}{' with block offsets' if offsets else ''}"


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
    quantization report: None when ``key`` is not a GGUF block tensor). ``bits``/``group``: the
    spec's; a tensor whose codes need more bits than ``bits`` is kept at 8. ``embedding``: the
    int8 table ``quantize_embeddings`` makes, one scale per row, RTN whatever the linears' mode
    and algorithm."""
    type_name = gguf_type(weights, key)
    if type_name is None:
        return None, None
    reason = _not_kept(type_name, q, bits, group, embedding, tensor_parallel)
    if reason is None:
        read = read_block_codes(type_name, weights.blocks(key)[1])  # [out, in], [out, in/g] (× 2 with offsets)
        if max(bits, read.bits) == 8 or embedding:
            read = _positive_scales(read)
            if read is None:
                return None, (f"re-quantized GGUF {type_name}: a negative block scale over code −128 (TensorRT's int8 "
                              "DequantizeLinear takes positive scales only, and +128 is no int8)")
        kept = _per_channel(read) if embedding or bits == 8 else None
        if kept is not None:
            return kept, kept_source(type_name, 8, None, False)
        if embedding:
            reason = (f"{type_name}'s scales are per {read.group} inputs and the int8 table has one scale per row; "
                      "this tensor's rows have more than one" + (" or block offsets" if read.offsets is not None else ""))
        else:
            out_bits = max(bits, read.bits)
            offsets = None if read.offsets is None else torch.from_numpy(read.offsets)
            return (QuantizedLinear(codes=torch.from_numpy(read.codes), scales=torch.from_numpy(read.scales),
                                    bits=out_bits, group=read.group, offsets=offsets),
                    kept_source(type_name, out_bits, read.group, offsets is not None))
    return None, f"re-quantized GGUF {type_name}: {reason}"


def _positive_scales(read: BlockCodes) -> BlockCodes | None:
    """The same weights with each negative block scale's sign moved into its codes (s·c = (−s)·(−c)):
    TensorRT refuses an int8 DequantizeLinear with a negative scale at parse ("Scale coefficients
    must all be positive"; int4 takes them), and llama.cpp writes negative Q5_0 and Q6_K scales
    (it divides by the signed extreme). None where such a block holds −128."""
    negative = read.scales < 0                                              # [rows, cols/g]
    if not negative.any():
        return read
    rows, cols = read.codes.shape
    flip = np.repeat(negative, read.group, axis=1)                          # [rows, cols]
    if (read.codes[flip] == -128).any():
        return None
    return replace(read, codes=np.where(flip, -read.codes, read.codes).astype(np.int8),
                   scales=np.abs(read.scales))


def _per_channel(read: BlockCodes) -> QuantizedLinear | None:
    """Symmetric codes whose blocks share one scale per row, as int8 per output channel (the
    cheaper form, and the only one the embedding table has); else None."""
    if read.offsets is not None or not (read.scales == read.scales[:, :1]).all():
        return None
    return QuantizedLinear(codes=torch.from_numpy(read.codes), scales=torch.from_numpy(read.scales[:, 0].copy()),
                           bits=8, group=None)


def _not_kept(type_name: str, q: QuantizationSection, bits: int, group: int | None, embedding: bool,
              tensor_parallel: int) -> str | None:
    """Why a tensor of ``type_name`` cannot keep its codes under this quantization, or None."""
    if not q.keep_gguf_codes:
        return "quantization.keep_gguf_codes is false"
    if q.mode not in WEIGHT_ONLY and not embedding:
        return f"mode {q.mode} is not an integer weight-only mode"
    if q.algorithm != "rtn" and not embedding:
        return f"algorithm {q.algorithm} computes its own codes"
    if type_name not in KEPT_TYPES:
        return f"{type_name} blocks are not kept (kept: {', '.join(KEPT_TYPES)})"
    code_bits, block, offsets = KEPT_TYPES[type_name]
    if embedding:
        return None
    if bits == 4 and code_bits == 4 and group != block:
        return f"group_size {group} is not {type_name}'s block of {block}"
    if offsets and tensor_parallel > 1:
        return (f"its block offsets' correction is not sharded across ranks (parallel.tensor "
                f"{tensor_parallel}; keeping them needs 1)")
    return None

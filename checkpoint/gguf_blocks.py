"""The integer codes and scales inside GGUF blocks, read as stored (not dequantized).

Q4_0 and Q8_0 are symmetric block formats: per 32 consecutive values of a row, an f16 scale d
and integer codes, x = d·c. They are exactly what a symmetric ``DequantizeLinear`` with
block_size 32 computes, so the builder can keep them (builder/quant/gguf_codes.py). Layouts as
llama.cpp's ggml-quants.c and the ``gguf`` package define them:

    Q4_0  18 bytes: d (f16), 16 bytes of nibbles; value j < 16 is byte j's low nibble, value
          16 + j its high nibble; c = nibble − 8 ∈ [−8, 7]
    Q8_0  34 bytes: d (f16), 32 int8 codes ∈ [−128, 127]

Q4_1 is asymmetric: per block an f16 scale d, an f16 minimum m and nibbles q ∈ [0, 15] laid out
as Q4_0's, x = d·q + m. Written as x = d·(q − 8) + (m + 8d), it is Q4_0's symmetric form plus one
additive offset per block (``offset_block_codes``), which the builder keeps as int4 codes and a
small float correction (builder/quant/gguf_codes.py):

    Q4_1  20 bytes: d (f16), m (f16), 16 bytes of nibbles as Q4_0's
"""
from __future__ import annotations

import numpy as np

BLOCK = 32
BLOCK_BYTES = {"Q4_0": 18, "Q8_0": 34}
SYMMETRIC_TYPES = tuple(BLOCK_BYTES)
Q4_1_BYTES = 20


def block_codes(type_name: str, raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Codes int8 [rows, cols] and scales float32 [rows, cols / 32] of raw blocks [rows, row bytes]
    of a symmetric type; d·c in float32 is what ``gguf.quants.dequantize`` returns, bit for bit."""
    if type_name not in BLOCK_BYTES:
        raise ValueError(f"GGUF type {type_name} has no symmetric block codes (only {', '.join(SYMMETRIC_TYPES)})")
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, BLOCK_BYTES[type_name])                  # [rows, cols/32, bytes]
    scales = np.ascontiguousarray(blocks[:, :, :2]).view(np.float16)[:, :, 0].astype(np.float32)  # [rows, cols/32]
    body = np.ascontiguousarray(blocks[:, :, 2:])
    if type_name == "Q8_0":
        codes = body.view(np.int8)                                           # [rows, cols/32, 32]
    else:
        codes = _centred_nibbles(body)
    return codes.reshape(rows, -1), scales


def offset_block_codes(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Codes int8 [rows, cols] in [−8, 7], scales and offsets float32 [rows, cols / 32] of raw Q4_1
    blocks [rows, row bytes]: x = d·c + o with c = q − 8 and o = m + 8d. In float32 d·c is exact
    (an f16 times a 4-bit integer) and o is rounded once, so d·c + o is within an ulp of what
    ``gguf.quants.dequantize`` returns (d·q + m)."""
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, Q4_1_BYTES)                                # [rows, cols/32, 20]
    halves = np.ascontiguousarray(blocks[:, :, :4]).view(np.float16).astype(np.float32)  # [rows, cols/32, 2]
    scales, minimums = halves[:, :, 0], halves[:, :, 1]
    codes = _centred_nibbles(np.ascontiguousarray(blocks[:, :, 4:]))
    return codes.reshape(rows, -1), np.ascontiguousarray(scales), minimums + np.float32(8) * scales


def _centred_nibbles(body: np.ndarray) -> np.ndarray:
    """[rows, blocks, 16] bytes → [rows, blocks, 32] int8 nibble − 8: low nibbles, then high."""
    nibbles = np.concatenate([body & 0x0F, body >> 4], axis=2)
    return nibbles.astype(np.int8) - np.int8(8)

"""The integer codes and scales inside GGUF blocks, read as stored (not dequantized).

Q4_0 and Q8_0 are symmetric block formats: per 32 consecutive values of a row, an f16 scale d
and integer codes, x = d·c. They are exactly what a symmetric ``DequantizeLinear`` with
block_size 32 computes, so the builder can keep them (builder/quant/gguf_codes.py). Layouts as
llama.cpp's ggml-quants.c and the ``gguf`` package define them:

    Q4_0  18 bytes: d (f16), 16 bytes of nibbles; value j < 16 is byte j's low nibble, value
          16 + j its high nibble; c = nibble − 8 ∈ [−8, 7]
    Q8_0  34 bytes: d (f16), 32 int8 codes ∈ [−128, 127]

Q4_1 (d, m, x = d·q + m) is not symmetric and has no reader here: its m is no integer zero point.
"""
from __future__ import annotations

import numpy as np

BLOCK = 32
BLOCK_BYTES = {"Q4_0": 18, "Q8_0": 34}
SYMMETRIC_TYPES = tuple(BLOCK_BYTES)


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
        nibbles = np.concatenate([body & 0x0F, body >> 4], axis=2)           # [rows, cols/32, 32]: low, then high
        codes = nibbles.astype(np.int8) - np.int8(8)
    return codes.reshape(rows, -1), scales

"""Every GGUF block type the builder keeps, read as codes, scales and offsets (not dequantized).

Each type is, per block of ``group`` consecutive values of a row, x = s·c (+ o): integer codes c,
a float scale s and, for the asymmetric types, one additive offset o. Codes are centred on zero
(q − 2^(bits−1)), so the offset is o = m + 2^(bits−1)·s for a stored x = s·q + m: int4 codes for
the 4-bit types, int8 for the 5-, 6- and 8-bit ones. Layouts as llama.cpp's ggml-quants.c and the
``gguf`` package define them (QK_K = 256 values per K-quant super-block):

    Q5_0  22 bytes: d (f16), qh (u32: bit j is value j's 5th bit), 16 bytes of nibbles as Q4_0's;
          x = d·(q − 16)
    Q5_1  24 bytes: d, m (f16), qh, nibbles; x = d·q + m
    Q4_K  144 bytes: d, dmin (f16), 12 bytes of 6-bit sub-block scales sc and minimums mn (8 of
          each, packed as ``_scale_min`` reads them), 128 bytes of nibbles: 32-byte chunk j holds
          sub-block 2j in its low nibbles, 2j + 1 in its high ones; per sub-block of 32
          x = (d·sc)·q − (dmin·mn)
    Q5_K  176 bytes: d, dmin, the 12 scale bytes, qh (32 bytes: bit i of byte l is the 5th bit of
          value l of sub-block i), nibbles as Q4_K's; x = (d·sc)·q − (dmin·mn)
    Q6_K  210 bytes: ql (128), qh (64), 16 int8 sub-block scales, d (f16); per sub-block of 16
          x = (d·sc)·(q − 32), q = low nibble | 2 high bits << 4

d·sc is exact in float32 (an f16 times an integer of at most 8 bits), so kept scales are the
format's sub-block scales; offsets are rounded once. Q4_0, Q4_1 and Q8_0: checkpoint/gguf_blocks.py.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .gguf_blocks import BLOCK, block_codes, offset_block_codes

QK_K = 256


@dataclass(frozen=True)
class BlockCodes:
    codes: np.ndarray           # int8 [rows, cols], centred: [−8, 7] (bits 4) up to [−128, 127]
    scales: np.ndarray          # float32 [rows, cols / group]
    offsets: np.ndarray | None  # float32 [rows, cols / group], None for a symmetric type
    bits: int                   # the narrowest signed integer DequantizeLinear takes that holds the codes
    group: int


# type → (code bits, values per scale, has offsets)
KEPT_TYPES = {"Q4_0": (4, BLOCK, False), "Q4_1": (4, BLOCK, True), "Q4_K": (4, BLOCK, True),
              "Q5_0": (8, BLOCK, False), "Q5_1": (8, BLOCK, True), "Q5_K": (8, BLOCK, True),
              "Q6_K": (8, 16, False), "Q8_0": (8, BLOCK, False)}


def read_block_codes(type_name: str, raw: np.ndarray) -> BlockCodes:
    """The codes, scales and offsets of raw blocks [rows, row bytes] of a kept type; s·c + o is
    what ``gguf.quants.dequantize`` returns, to float32 rounding (bit for bit without offsets)."""
    if type_name not in KEPT_TYPES:
        raise ValueError(f"GGUF type {type_name} is not kept (kept: {', '.join(KEPT_TYPES)})")
    bits, group, _ = KEPT_TYPES[type_name]
    rows = raw.shape[0]
    if type_name in ("Q4_0", "Q8_0"):
        codes, scales = block_codes(type_name, raw)
        offsets = None
    elif type_name == "Q4_1":
        codes, scales, offsets = offset_block_codes(raw)
    else:
        codes, scales, offsets = _READERS[type_name](raw.reshape(-1, raw.shape[1]))
        codes, scales = codes.reshape(rows, -1), scales.reshape(rows, -1)
        offsets = None if offsets is None else offsets.reshape(rows, -1)
    return BlockCodes(codes=codes, scales=scales, offsets=offsets, bits=bits, group=group)


def _f16(body: np.ndarray) -> np.ndarray:
    """[..., 2] bytes → [...] float32."""
    return np.ascontiguousarray(body).view(np.float16)[..., 0].astype(np.float32)


def _nibbles_32(body: np.ndarray) -> np.ndarray:
    """[..., 16] bytes → [..., 32] uint8: low nibbles, then high (Q4_0's order)."""
    return np.concatenate([body & 0x0F, body >> 4], axis=-1)


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """[..., 4] bytes (a little-endian u32) → [..., 32] uint8 bit j of it, shifted to 16."""
    word = np.ascontiguousarray(qh).view("<u4")                                 # [..., 1]
    return (((word >> np.arange(32, dtype=np.uint32)) & 1) << 4).astype(np.uint8)


def _q5_0(raw):
    blocks = raw.reshape(raw.shape[0], -1, 22)                                  # [rows, cols/32, 22]
    q = _nibbles_32(blocks[..., 6:]) | _fifth_bits(blocks[..., 2:6])
    return q.astype(np.int8) - np.int8(16), _f16(blocks[..., :2]), None


def _q5_1(raw):
    blocks = raw.reshape(raw.shape[0], -1, 24)
    d, m = _f16(blocks[..., :2]), _f16(blocks[..., 2:4])
    q = _nibbles_32(blocks[..., 8:]) | _fifth_bits(blocks[..., 4:8])
    return q.astype(np.int8) - np.int8(16), d, m + np.float32(16) * d


def _scale_min(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[..., 12] bytes → the 8 sub-block scales and minimums [..., 8] (6-bit each): bytes 0-3
    hold scales 0-3 in their low 6 bits, bytes 4-7 minimums 0-3; scales and minimums 4-7 are a
    low nibble of bytes 8-11 (scales) or their high nibble (minimums) under the 2 top bits of
    bytes 0-3 (scales) or 4-7 (minimums)."""
    d, m, m_d = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scale = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    minimum = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return scale.astype(np.float32), minimum.astype(np.float32)


def _k_sub_blocks(blocks: np.ndarray, centre: int):
    """Scales d·sc and offsets centre·d·sc − dmin·mn [rows, supers, 8] of Q4_K/Q5_K super-blocks."""
    d, dmin = _f16(blocks[..., 0:2])[..., None], _f16(blocks[..., 2:4])[..., None]
    sc, mn = _scale_min(blocks[..., 4:16])
    scales = d * sc
    return scales, np.float32(centre) * scales - dmin * mn


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """[rows, supers, 128] → [rows, supers, 8, 32]: chunk j's low nibbles, then its high ones."""
    chunks = qs.reshape(*qs.shape[:-1], 4, 32)
    return np.stack([chunks & 0x0F, chunks >> 4], axis=-2).reshape(*qs.shape[:-1], 8, 32)


def _q4_k(raw):
    blocks = raw.reshape(raw.shape[0], -1, 144)                                 # [rows, cols/256, 144]
    scales, offsets = _k_sub_blocks(blocks, 8)
    return _k_nibbles(blocks[..., 16:]).astype(np.int8) - np.int8(8), scales, offsets


def _q5_k(raw):
    blocks = raw.reshape(raw.shape[0], -1, 176)
    scales, offsets = _k_sub_blocks(blocks, 16)
    qh = blocks[..., 16:48][..., None, :]                                       # [rows, supers, 1, 32]
    high = ((qh >> np.arange(8, dtype=np.uint8)[:, None]) & 1) << 4             # [rows, supers, 8, 32]
    return (_k_nibbles(blocks[..., 48:]) | high).astype(np.int8) - np.int8(16), scales, offsets


def _q6_k(raw):
    blocks = raw.reshape(raw.shape[0], -1, 210)
    lead = blocks.shape[:-1]
    ql = blocks[..., :128].reshape(*lead, 2, 1, 64) >> np.array([0, 4], np.uint8)[:, None]
    ql = (ql & 0x0F).reshape(*lead, 8, 32)                                      # [rows, supers, 8, 32]
    qh = blocks[..., 128:192].reshape(*lead, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]
    qh = (qh & 0x03).reshape(*lead, 8, 32)
    codes = (ql | (qh << 4)).astype(np.int8) - np.int8(32)
    sub = np.ascontiguousarray(blocks[..., 192:208]).view(np.int8).astype(np.float32)  # [rows, supers, 16]
    return codes, _f16(blocks[..., 208:210])[..., None] * sub, None


_READERS = {"Q5_0": _q5_0, "Q5_1": _q5_1, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}

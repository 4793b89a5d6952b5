"""GGUF block encoders for tests: the `gguf` package quantizes Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0
but not the K-quants, so Q4_K, Q5_K and Q6_K blocks are encoded here from the format's
description (ggml-quants.c's layouts; a plain round-to-nearest, not llama.cpp's search for
scales). Checked against ``gguf.quants.dequantize`` by tests/test_gguf_kquants.py."""
from __future__ import annotations

import gguf
import numpy as np


def encode(values: np.ndarray, type_name: str) -> np.ndarray:
    """Raw blocks uint8 [rows, row bytes] of ``values`` float32 [rows, cols] in ``type_name``."""
    values = np.asarray(values, np.float32)
    if type_name in ENCODERS:
        return ENCODERS[type_name](values)
    return gguf.quants.quantize(values, gguf.GGMLQuantizationType[type_name])


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    """[...] float → [..., 2] uint8 of its f16."""
    return x.astype(np.float16)[..., None].view(np.uint8)


def _safe_divide(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.divide(a, b, out=np.zeros(np.broadcast_shapes(a.shape, b.shape), np.float32), where=b != 0)


def _asymmetric_k(values: np.ndarray, top: int):
    """Q4_K/Q5_K's sub-block codes [rows, supers, 8, 32] in [0, top] and the super-blocks'
    d, dmin [rows, supers] and 6-bit scales, minimums [rows, supers, 8]: x ≈ d·sc·q − dmin·mn."""
    rows, cols = values.shape
    x = values.reshape(rows, cols // 256, 8, 32)
    low, high = np.minimum(x.min(-1), 0), np.maximum(x.max(-1), 0)
    step, lift = (high - low) / top, -low
    d = (step.max(-1) / 63).astype(np.float16).astype(np.float32)
    dmin = (lift.max(-1) / 63).astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(_safe_divide(step, d[..., None])), 0, 63)
    mn = np.clip(np.rint(_safe_divide(lift, dmin[..., None])), 0, 63)
    q = np.clip(np.rint(_safe_divide(x + (dmin[..., None] * mn)[..., None], (d[..., None] * sc)[..., None])), 0, top)
    return q.astype(np.uint8), d, dmin, sc.astype(np.uint8), mn.astype(np.uint8)


def _scale_bytes(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """[..., 8] 6-bit scales and minimums → the 12 packed bytes Q4_K/Q5_K hold."""
    first = (sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6)
    second = (mn[..., :4] & 63) | ((mn[..., 4:] >> 4) << 6)
    third = (sc[..., 4:] & 15) | ((mn[..., 4:] & 15) << 4)
    return np.concatenate([first, second, third], axis=-1).astype(np.uint8)


def _k_nibble_bytes(q: np.ndarray) -> np.ndarray:
    """[..., 8, 32] codes → [..., 128]: byte l of chunk j = sub-block 2j's low nibble | 2j + 1's high."""
    low = q & 15
    return (low[..., 0::2, :] | (low[..., 1::2, :] << 4)).reshape(*q.shape[:-2], 128)


def _q4_k(values: np.ndarray) -> np.ndarray:
    q, d, dmin, sc, mn = _asymmetric_k(values, 15)
    blocks = np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _scale_bytes(sc, mn), _k_nibble_bytes(q)], axis=-1)
    return blocks.reshape(values.shape[0], -1)


def _q5_k(values: np.ndarray) -> np.ndarray:
    q, d, dmin, sc, mn = _asymmetric_k(values, 31)
    fifth = (q >> 4) & 1                                              # [rows, supers, 8, 32]
    qh = (fifth << np.arange(8, dtype=np.uint8)[:, None]).sum(axis=-2, dtype=np.uint8)  # bit i: sub-block i
    blocks = np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _scale_bytes(sc, mn), qh, _k_nibble_bytes(q)], axis=-1)
    return blocks.reshape(values.shape[0], -1)


def _q6_k(values: np.ndarray) -> np.ndarray:
    rows, cols = values.shape
    x = values.reshape(rows, cols // 256, 16, 16)
    step = np.abs(x).max(-1) / 31
    d = (step.max(-1) / 127).astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(_safe_divide(step, d[..., None])), -128, 127)
    q = np.clip(np.rint(_safe_divide(x, (d[..., None] * sc)[..., None])), -32, 31) + 32
    q = q.astype(np.uint8).reshape(rows, cols // 256, 2, 128)          # halves of 128 values
    ql = (q[..., :64] & 15) | ((q[..., 64:] & 15) << 4)                # [rows, supers, 2, 64]
    high = (q >> 4) & 3                                                # value h·128 + k·32 + p → byte h·32 + p, bits 2k
    qh = sum(high[..., 32 * k:32 * (k + 1)] << (2 * k) for k in range(4)).astype(np.uint8)  # [rows, supers, 2, 32]
    blocks = np.concatenate([ql.reshape(rows, -1, 128), qh.reshape(rows, -1, 64),
                             sc.astype(np.int8).view(np.uint8), _f16_bytes(d)], axis=-1)
    return blocks.reshape(rows, -1)


ENCODERS = {"Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}

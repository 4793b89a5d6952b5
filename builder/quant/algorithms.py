"""Symmetric weight quantizers for one linear layer ``y = x @ W.T`` (W: [out, in]).

Each returns a ``QuantizedLinear``: codes, scales and (AWQ) an input-channel scale folded
into the activations. Codes are what ``DequantizeLinear`` expands back: int8 per output
channel, int4 per group of ``group`` input channels, FP8 per tensor, NVFP4 per 16 inputs.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

INT_RANGE = {8: 127, 4: 7}


FP8_MAX = 448.0  # largest finite float8 E4M3FN


@dataclass
class QuantizedLinear:
    codes: torch.Tensor           # int8 [out, in], values in [-qmax, qmax]
    scales: torch.Tensor          # float32 [out] (int8) or [out, in // group] (int4)
    bits: int
    group: int | None             # None: per output channel
    input_scale: torch.Tensor | None = None  # AWQ/SmoothQuant: x is divided by it, W was multiplied by it
    activation_scale: float | None = None    # W8A8/FP8: x / input_scale is quantized with this scale
    global_scale: float | None = None        # NVFP4: codes are FP4 values, scales FP8 values × this
    offsets: torch.Tensor | None = None      # int4 kept from GGUF Q4_1: W = codes·scales + offsets, [out, in // group]

    @property
    def nvfp4(self) -> bool:
        return self.global_scale is not None

    @property
    def fp8(self) -> bool:
        """FP8 E4M3 codes with one per-tensor scale (weights and activations)."""
        return self.codes.dtype == torch.float8_e4m3fn

    def rows(self, start: int, stop: int) -> "QuantizedLinear":
        """Output rows ``[start, stop)`` (a view): codes and per-row or per-block scales sliced,
        per-tensor and per-input-channel scales shared."""
        return replace(self, codes=self.codes[start:stop], scales=self.scales if self.fp8 else self.scales[start:stop],
                       offsets=None if self.offsets is None else self.offsets[start:stop])

    def fake_quantize_input(self, x: torch.Tensor) -> torch.Tensor:
        """What the engine feeds the GEMM, expressed in the original input space (W8A8, FP8)."""
        smoothed = x / self.input_scale if self.input_scale is not None else x
        if self.activation_scale is not None:
            a = self.activation_scale
            if self.fp8:  # QuantizeLinear saturates to ±448, then rounds to the nearest E4M3 value
                smoothed = torch.clamp(smoothed / a, -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * a
            else:  # int8 QuantizeLinear saturates to [-128, 127] (ONNX and TensorRT alike)
                smoothed = torch.clamp(torch.round(smoothed / a), -128, 127) * a
        return smoothed * self.input_scale if self.input_scale is not None else smoothed

    def dequantize(self) -> torch.Tensor:
        """The weight the engine computes with, [out, in], in the original input space."""
        if self.nvfp4:
            return self.codes.float() * self.scales.repeat_interleave(self.group, dim=1) * self.global_scale
        if self.group is None:
            w = self.codes.float() * self.scales[:, None]
        else:
            out_features, in_features = self.codes.shape
            w = self.codes.float().view(out_features, -1, self.group) * self.scales[:, :, None]
            if self.offsets is not None:
                w = w + self.offsets[:, :, None]
            w = w.view(out_features, in_features)
        return w / self.input_scale[None, :] if self.input_scale is not None else w


def fp8_per_tensor(w: torch.Tensor, input_amax: float | None) -> QuantizedLinear:
    """FP8 E4M3 with absmax per-tensor scales (amax / 448) for the weight and, from calibration
    amax, for the activations: the recipe TensorRT's FP8 GEMMs take."""
    w = w.float()
    scale = w.abs().max().clamp(min=1e-8) / FP8_MAX
    codes = torch.clamp(w / scale, -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    activation = None if input_amax is None else max(float(input_amax), 1e-8) / FP8_MAX
    return QuantizedLinear(codes=codes, scales=scale.reshape(1), bits=8, group=None, activation_scale=activation)


FP4_MAX, NVFP4_BLOCK = 6.0, 16


def nvfp4(w: torch.Tensor) -> QuantizedLinear:
    """NVFP4: E2M1 codes in blocks of 16 input channels, each block's scale an E4M3 value, times
    one float32 global scale (amax / (448 · 6)) so the block scales use FP8's whole range."""
    import ml_dtypes

    w = w.float()
    out_features, in_features = w.shape
    global_scale = max(float(w.abs().max()), 1e-8) / (FP8_MAX * FP4_MAX)
    blocks = w.view(out_features, -1, NVFP4_BLOCK)                               # [out, in/16, 16]
    block_scale = (blocks.abs().amax(dim=2) / FP4_MAX / global_scale).clamp(max=FP8_MAX)
    block_scale = block_scale.to(torch.float8_e4m3fn).float().clamp(min=2 ** -9)  # representable, non-zero
    scaled = (blocks / (block_scale * global_scale)[:, :, None]).clamp(-FP4_MAX, FP4_MAX)
    codes = torch.from_numpy(scaled.numpy().astype(ml_dtypes.float4_e2m1fn).astype(np.float32))
    return QuantizedLinear(codes=codes.view(out_features, in_features), scales=block_scale, bits=4,
                           group=NVFP4_BLOCK, global_scale=global_scale)


def _scales(w: torch.Tensor, bits: int, group: int | None) -> torch.Tensor:
    qmax = INT_RANGE[bits]
    if group is None:
        return w.abs().amax(dim=1).clamp(min=1e-8) / qmax                       # [out]
    return w.view(w.shape[0], -1, group).abs().amax(dim=2).clamp(min=1e-8) / qmax  # [out, in/g]


def _expand(scales: torch.Tensor, group: int | None, in_features: int) -> torch.Tensor:
    return scales[:, None].expand(-1, in_features) if group is None else scales.repeat_interleave(group, dim=1)


def rtn(w: torch.Tensor, bits: int, group: int | None) -> QuantizedLinear:
    """Round to nearest with absmax scales: the baseline."""
    w = w.float()
    scales = _scales(w, bits, group)
    qmax = INT_RANGE[bits]
    codes = torch.clamp(torch.round(w / _expand(scales, group, w.shape[1])), -qmax, qmax).to(torch.int8)
    return QuantizedLinear(codes=codes, scales=scales, bits=bits, group=group)


def gptq(w: torch.Tensor, hessian: torch.Tensor, bits: int, group: int | None, damp: float = 0.01,
         block: int = 128) -> QuantizedLinear:
    """GPTQ: quantize input columns in order, spreading each column's rounding error over the
    columns not yet quantized through the inverse Hessian (H = Xᵀ X of the layer's inputs)."""
    w = w.float().clone()
    out_features, in_features = w.shape
    h = hessian.float().clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    h += damp * torch.mean(torch.diag(h)) * torch.eye(in_features)
    # Upper Cholesky factor of H⁻¹: row i holds the update weights for columns after i.
    h_inv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    qmax = INT_RANGE[bits]
    # Per-channel scales come from the weights as they are; group scales from each group's
    # weights after the errors of earlier columns were folded in (a block is one group).
    scales = _scales(w, bits, None) if group is None else torch.zeros(out_features, in_features // group)
    codes = torch.zeros_like(w, dtype=torch.int8)
    step = group or block
    for start in range(0, in_features, step):
        end = min(start + step, in_features)
        w_block = w[:, start:end].clone()
        if group is not None:
            scales[:, start // group] = w_block.abs().amax(dim=1).clamp(min=1e-8) / qmax
        scale = scales if group is None else scales[:, start // group]
        errors = torch.zeros_like(w_block)
        h_block = h_inv[start:end, start:end]
        for i in range(end - start):
            q = torch.clamp(torch.round(w_block[:, i] / scale), -qmax, qmax)
            codes[:, start + i] = q.to(torch.int8)
            error = (w_block[:, i] - q * scale) / h_block[i, i]
            w_block[:, i:] -= error[:, None] * h_block[i, i:][None, :]
            errors[:, i] = error
        w[:, end:] -= errors @ h_inv[start:end, end:]
    return QuantizedLinear(codes=codes, scales=scales, bits=bits, group=group)


def awq(w: torch.Tensor, x_abs_mean: torch.Tensor, x_sample: torch.Tensor, bits: int, group: int | None,
        grid: int = 20) -> QuantizedLinear:
    """AWQ of one linear (see ``awq_shared``)."""
    return awq_shared([w], x_abs_mean, x_sample, bits, group, grid)[0]


def awq_shared(weights: list[torch.Tensor], x_abs_mean: torch.Tensor, x_sample: torch.Tensor, bits: int,
               group: int | None, grid: int = 20) -> list[QuantizedLinear]:
    """AWQ for linears that read one input (q/k/v; gate/up): scale salient input channels up
    before rounding (s = mean|x|^α, α searched on calibration activations to minimize the
    layers' summed output error), divide x by s at run time. One s for all of them, as AWQ
    does, so the division folds into the norm that produces x and the layers keep one input
    (the CPU stage packs q/k/v only then)."""
    weights = [w.float() for w in weights]
    x = x_sample.float()                                     # [n, in]
    references = [x @ w.T for w in weights]                  # [n, out] each
    best, best_error = None, float("inf")
    for step in range(grid + 1):
        alpha = step / grid
        s = x_abs_mean.float().clamp(min=1e-5).pow(alpha)
        s = s / (s.max() * s.min()).sqrt()  # keep scales around 1
        candidates = [rtn(w * s[None, :], bits, group) for w in weights]
        error = 0.0
        for candidate, reference in zip(candidates, references):
            candidate.input_scale = s
            error += ((x @ candidate.dequantize().T) - reference).pow(2).sum().item()
        if error < best_error:
            best, best_error = candidates, error
    return best


def smoothquant(weights: list[torch.Tensor], x_amax: torch.Tensor, alpha: float) -> tuple[list[QuantizedLinear], torch.Tensor]:
    """SmoothQuant W8A8 for linears that share one input: per-input-channel scales
    s = max|x|^α / max|W|^(1-α) move activation outliers into the weights; weights are then
    int8 per output channel, activations int8 per tensor with a static scale from calibration.
    Returns the layers and s (the caller folds 1/s into whatever produces x)."""
    w_amax = torch.stack([w.float().abs().amax(dim=0) for w in weights]).amax(dim=0).clamp(min=1e-5)  # [in]
    s = (x_amax.float().clamp(min=1e-5).pow(alpha) / w_amax.pow(1 - alpha)).clamp(min=1e-5)
    activation_scale = float((x_amax.float() / s).max().clamp(min=1e-8) / 127)
    layers = []
    for w in weights:
        layer = rtn(w.float() * s[None, :], 8, None)
        layer.input_scale, layer.activation_scale = s, activation_scale
        layers.append(layer)
    return layers, s

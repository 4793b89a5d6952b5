"""Quantizers on small hand-made layers: known error bounds, and GPTQ/AWQ beating RTN where they should."""
from __future__ import annotations

import pytest
import torch

from trtbuild.builder.quant.algorithms import awq, gptq, rtn


def output_error(x, w, quantized) -> float:
    return ((x @ quantized.dequantize().T) - x @ w.T).pow(2).mean().item()


@pytest.mark.parametrize("bits, group", [(8, None), (4, 32)])
def test_rtn_error_is_within_half_a_step(bits, group):
    torch.manual_seed(0)
    w = torch.randn(64, 128)
    q = rtn(w, bits, group)
    step = q.scales[:, None].expand_as(w) if group is None else q.scales.repeat_interleave(group, dim=1)
    assert (q.dequantize() - w).abs().le(step / 2 + 1e-6).all()
    assert q.codes.dtype == torch.int8 and q.codes.abs().max() <= (127 if bits == 8 else 7)


def correlated_inputs(n=2048, features=128, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(features, features, generator=g) * 0.3 + torch.eye(features)
    return torch.randn(n, 16, generator=g) @ torch.randn(16, features, generator=g) + 0.1 * torch.randn(n, features, generator=g) @ mix


@pytest.mark.parametrize("bits, group", [(4, 32), (8, None)])
def test_gptq_error_is_below_rtn_on_correlated_inputs(bits, group):
    torch.manual_seed(1)
    w = torch.randn(64, 128)
    x = correlated_inputs()
    h = x.T @ x
    assert output_error(x, w, gptq(w, h, bits, group)) < 0.7 * output_error(x, w, rtn(w, bits, group))


def test_awq_error_is_below_rtn_when_a_few_input_channels_dominate():
    torch.manual_seed(2)
    w = torch.randn(64, 128)
    x = torch.randn(1024, 128)
    x[:, :4] *= 30.0  # salient channels, as LLM activations have
    q = awq(w, x.abs().mean(dim=0), x[:256], bits=4, group=32)
    assert q.input_scale is not None
    assert output_error(x, w, q) < output_error(x, w, rtn(w, 4, 32))

"""Calibration statistics of every linear layer's inputs, from text run through the checkpoint
one decoder layer at a time.

The way GPTQ and llm-compressor's sequential onloading do it: the calibration tokens are
embedded (their rows read from the weight map), then each decoder layer gets its real weights,
runs the carried hidden states with hooks on its linears, and is released before the next; the
final norm's output feeds lm_head's statistics. Memory is one layer plus the activations, never
the model. The carried activations are the float model's (the layer's own weights, not their
quantized version), so the statistics are those of running the whole model with hooks.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..frontend.skeleton import assign_weights, meta_model, release_weights
from ...checkpoint.tokenizer import checkpoint_tokenizer
from ...checkpoint.weight_map import WeightMap

SAMPLE_ROWS = 512  # input rows kept per layer for AWQ's search and the output-error report


@dataclass
class InputStats:
    hessian: torch.Tensor | None     # Σ xᵀx, float32 [in, in]; None when not asked for (only GPTQ reads it)
    abs_sum: torch.Tensor            # Σ |x| per input channel
    abs_max: torch.Tensor | None = None  # max |x| per input channel
    rows: int = 0
    sample: list[torch.Tensor] = field(default_factory=list)

    @classmethod
    def empty(cls, features: int, hessian: bool = False) -> "InputStats":
        return cls(torch.zeros(features, features) if hessian else None, torch.zeros(features))

    def add(self, x: torch.Tensor) -> None:
        """Accumulates one forward's inputs, any leading shape [..., in]."""
        x = x.detach().float().reshape(-1, x.shape[-1])  # [tokens, in]
        if self.hessian is not None:
            self.hessian += x.T @ x
        self.abs_sum += x.abs().sum(dim=0)
        channel_max = x.abs().amax(dim=0)
        self.abs_max = channel_max if self.abs_max is None else torch.maximum(self.abs_max, channel_max)
        self.rows += x.shape[0]
        if sum(len(s) for s in self.sample) < SAMPLE_ROWS:
            self.sample.append(x[:: max(1, x.shape[0] // 64)])

    @property
    def abs_mean(self) -> torch.Tensor:
        return self.abs_sum / max(self.rows, 1)

    @property
    def sample_rows(self) -> torch.Tensor:
        return torch.cat(self.sample)[:SAMPLE_ROWS]


def calibration_batches(checkpoint: Path, data: tuple[Path, ...], samples: int, seq_len: int) -> torch.Tensor:
    """``samples`` non-overlapping windows of ``seq_len`` tokens from the texts (in order), [N, L]."""
    tokenizer = checkpoint_tokenizer(checkpoint)
    ids: list[int] = []
    for path in data:
        ids += tokenizer.encode(Path(path).read_text(encoding="utf-8", errors="replace")).ids
    windows = min(samples, len(ids) // seq_len)
    if windows == 0:
        names = ", ".join(str(p) for p in data)
        raise ValueError(f"{names}: {len(ids)} tokens is fewer than one calibration window of {seq_len}")
    return torch.tensor(ids[: windows * seq_len]).view(windows, seq_len)


def block_of(name: str) -> str:
    """The unit a linear is calibrated and stored with: ``layers.3.mlp.up_proj`` → ``layers.3``."""
    return ".".join(name.split(".")[:2]) if name.startswith("layers.") else name


def layer_by_layer(checkpoint: Path, weights: WeightMap, dtype: torch.dtype, names: list[str],
                   batches: torch.Tensor, progress=print, hessian: bool = False
                   ) -> Iterator[tuple[str, dict[str, InputStats]]]:
    """Yields ``(block, statistics of its named linears)`` for each decoder layer in order, then
    ``("lm_head", ...)`` when lm_head is named; stops after the last block with a named linear.
    Each layer's weights are released before its block is yielded. ``hessian``: also Σ xᵀx."""
    wanted = {block_of(n) for n in names}
    model = meta_model(checkpoint, dtype)
    layers = model.model.layers
    last = max((i for i in range(len(layers)) if f"layers.{i}" in wanted), default=-1)
    if "lm_head" in wanted:
        last = len(layers) - 1
    hidden, kwargs = _layer_inputs(model, weights, dtype, batches)   # per batch: [1, L, D], layer kwargs
    for i in range(last + 1):
        prefix = f"layers.{i}"
        assign_weights(model, weights, f"model.{prefix}", dtype)
        hidden, stats = _run_layer(model, layers[i], [n for n in names if block_of(n) == prefix], hidden, kwargs,
                                   hessian)
        release_weights(model, f"model.{prefix}")
        progress(f"  calibration: layer {i + 1}/{len(layers)}")
        if prefix in wanted:
            yield prefix, stats
    if "lm_head" in wanted:
        assign_weights(model, weights, "model.norm", dtype)
        lm_head = InputStats.empty(hidden[0].shape[-1], hessian)
        with torch.no_grad():
            for h in hidden:
                lm_head.add(model.model.norm(h))
        release_weights(model, "model.norm")
        yield "lm_head", {"lm_head": lm_head}


class _Captured(Exception):
    """Raised by the first decoder layer's pre-hook: what the model hands its layers."""

    def __init__(self, hidden: torch.Tensor, kwargs: dict):
        self.hidden, self.kwargs = hidden, kwargs


def _layer_inputs(model: nn.Module, weights: WeightMap, dtype: torch.dtype,
                  batches: torch.Tensor) -> tuple[list[torch.Tensor], list[dict]]:
    """Per batch, the first decoder layer's hidden states [1, L, D] and keyword arguments
    (mask, rotary embeddings, positions) exactly as transformers' model forward makes them;
    the embedding rows come from the weight map, the layers never run (they are on meta)."""
    table = weights.tensor("model.embed_tokens.weight")  # memory-mapped: only the rows used are read
    hidden, kwargs = [], []

    def capture(module, args, kw):
        raise _Captured(args[0] if args else kw.pop("hidden_states"), kw)

    handle = model.model.layers[0].register_forward_pre_hook(capture, with_kwargs=True)
    try:
        with torch.no_grad():
            for batch in batches:
                try:
                    model.model(inputs_embeds=table[batch].to(dtype)[None], use_cache=False)
                except _Captured as captured:
                    hidden.append(captured.hidden)
                    kwargs.append(captured.kwargs)
    finally:
        handle.remove()
    return hidden, kwargs


def _run_layer(model: nn.Module, layer: nn.Module, names: list[str], hidden: list[torch.Tensor],
               kwargs: list[dict], hessian: bool) -> tuple[list[torch.Tensor], dict[str, InputStats]]:
    """The layer's outputs on each batch, and the statistics of the named linears' inputs."""
    stats: dict[str, InputStats] = {}

    def hook(name):
        def record(module, inputs, output):
            if name not in stats:
                stats[name] = InputStats.empty(inputs[0].shape[-1], hessian)
            stats[name].add(inputs[0])
        return record

    handles = [model.get_submodule(f"model.{name}").register_forward_hook(hook(name)) for name in names]
    try:
        with torch.no_grad():
            outputs = [layer(h, **kw) for h, kw in zip(hidden, kwargs)]
    finally:
        for handle in handles:
            handle.remove()
    return outputs, stats

"""Calibration statistics of every linear layer's inputs, from text run through the checkpoint."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

SAMPLE_ROWS = 512  # input rows kept per layer for AWQ's search and the output-error report


@dataclass
class InputStats:
    hessian: torch.Tensor            # Σ xᵀx, float32 [in, in]
    abs_sum: torch.Tensor            # Σ |x| per input channel
    abs_max: torch.Tensor | None = None  # max |x| per input channel
    rows: int = 0
    sample: list[torch.Tensor] = field(default_factory=list)

    @property
    def abs_mean(self) -> torch.Tensor:
        return self.abs_sum / max(self.rows, 1)

    @property
    def sample_rows(self) -> torch.Tensor:
        return torch.cat(self.sample)[:SAMPLE_ROWS]


def calibration_batches(checkpoint: Path, data: tuple[Path, ...], samples: int, seq_len: int) -> torch.Tensor:
    """``samples`` non-overlapping windows of ``seq_len`` tokens from the texts (in order), [N, L]."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(checkpoint) / "tokenizer.json"))
    ids: list[int] = []
    for path in data:
        ids += tokenizer.encode(Path(path).read_text(encoding="utf-8", errors="replace")).ids
    windows = min(samples, len(ids) // seq_len)
    if windows == 0:
        names = ", ".join(str(p) for p in data)
        raise ValueError(f"{names}: {len(ids)} tokens is fewer than one calibration window of {seq_len}")
    return torch.tensor(ids[: windows * seq_len]).view(windows, seq_len)


def collect(model: torch.nn.Module, names: list[str], batches: torch.Tensor, progress=print) -> dict[str, InputStats]:
    """Runs ``batches`` through ``model`` and accumulates input statistics of the named linears."""
    stats: dict[str, InputStats] = {}
    modules = dict(model.named_modules())
    hooks = []

    def hook(name):
        def record(module, inputs, output):
            x = inputs[0].detach().float().reshape(-1, inputs[0].shape[-1])  # [tokens, in]
            entry = stats.get(name)
            if entry is None:
                entry = stats[name] = InputStats(torch.zeros(x.shape[1], x.shape[1]), torch.zeros(x.shape[1]))
            entry.hessian += x.T @ x
            entry.abs_sum += x.abs().sum(dim=0)
            channel_max = x.abs().amax(dim=0)
            entry.abs_max = channel_max if entry.abs_max is None else torch.maximum(entry.abs_max, channel_max)
            entry.rows += x.shape[0]
            if sum(len(s) for s in entry.sample) < SAMPLE_ROWS:
                entry.sample.append(x[:: max(1, x.shape[0] // 64)])
        return record

    for name in names:
        hooks.append(modules[_module_path(model, name)].register_forward_hook(hook(name)))
    try:
        with torch.no_grad():
            for index, batch in enumerate(batches):
                model(input_ids=batch[None])
                progress(f"  calibration {index + 1}/{len(batches)}")
    finally:
        for h in hooks:
            h.remove()
    return stats


def _module_path(model: torch.nn.Module, name: str) -> str:
    """transformers puts decoder layers under ``model.``; the lm_head sits at the top."""
    return name if name == "lm_head" else f"model.{name}"

"""Medusa-1 training: the base model frozen, only the heads learn.

Each head is a residual block (zero-initialised, so it starts as the identity) plus its own
vocabulary projection initialised from the base LM head. Head k learns the token k + 2
positions ahead of each hidden state. With ``self_distill`` (the default) the training text
is the base model's own greedy continuation of prompts from the data: the heads then learn
what the model will say, which is what greedy verification accepts, rather than what the
data says.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch import nn

from ..errors import UserError
from ..frontend.training_target import training_target
from .heads import MedusaHeads, save_heads

TOP_K_REPORTED = 10


@dataclass(frozen=True)
class TrainOptions:
    heads: int = 4
    layers: int = 1
    seq_len: int = 256
    sequences: int = 640         # training + held-out sequences of seq_len tokens
    steps: int = 300
    batch: int = 4               # sequences per step
    lr: float = 1e-3
    self_distill: bool = True
    # False: each head's vocabulary projection stays the base LM head's (only the residual blocks
    # learn): a third less work per step, which is what a real vocabulary on a CPU needs.
    train_out: bool = True
    prompt_len: int = 32         # data tokens each self-distilled sequence starts from
    eval_fraction: float = 0.05
    seed: int = 0

    def check(self) -> None:
        if self.heads < 1 or self.layers < 1:
            raise UserError(f"--heads {self.heads} / --layers {self.layers}: each must be ≥ 1")
        if self.seq_len < self.heads + 8:
            raise UserError(f"--seq-len {self.seq_len}: must exceed --heads + 8")
        if self.self_distill and not 1 <= self.prompt_len < self.seq_len:
            raise UserError(f"--prompt-len {self.prompt_len}: must be in [1, --seq-len)")
        if self.steps < 1 or self.batch < 1 or self.sequences < 4:
            raise UserError(f"--steps {self.steps} / --batch {self.batch} / --sequences {self.sequences}: "
                            "steps and batch must be ≥ 1, sequences ≥ 4")
        if not self.lr > 0:
            raise UserError(f"--lr {self.lr}: must be > 0")


@dataclass(frozen=True)
class TrainReport:
    heads: MedusaHeads
    train_tokens: int
    eval_tokens: int
    seconds: float
    final_loss: float


class _Head(nn.Module):
    def __init__(self, hidden: int, layers: int, lm_head: torch.Tensor):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(layers))
        for block in self.blocks:
            nn.init.zeros_(block.weight)
            nn.init.zeros_(block.bias)
        self.out = nn.Linear(hidden, lm_head.shape[0], bias=False)
        self.out.weight.data.copy_(lm_head)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + nn.functional.silu(block(x))
        return self.out(x)


def train_heads(checkpoint: Path, data: list[Path], out: Path, options: TrainOptions,
                progress: Callable[[str], None] = print) -> TrainReport:
    options.check()
    checkpoint = Path(checkpoint)
    start = time.perf_counter()
    tokenizer, model = training_target(checkpoint, data, options.seed)
    windows = _windows(tokenizer, data, options)
    progress(f"medusa: {len(windows)} sequences of {options.seq_len} tokens from {len(data)} file(s)")
    if options.self_distill:
        windows = _greedy_continuations(model, windows, options, progress)
    hidden = _hidden_states(model, windows, progress)  # [N, L, D]
    n_eval = max(2, int(len(windows) * options.eval_fraction))
    train_ids, eval_ids = windows[n_eval:], windows[:n_eval]
    train_hidden, eval_hidden = hidden[n_eval:], hidden[:n_eval]

    lm_head = model.lm_head.weight.detach().float()
    heads = nn.ModuleList(_Head(lm_head.shape[1], options.layers, lm_head) for _ in range(options.heads))
    for head in heads:
        head.out.weight.requires_grad_(options.train_out)
    loss = _fit(heads, train_hidden, train_ids, options, progress)
    accuracy = _accuracy(heads, eval_hidden, eval_ids)
    trained = MedusaHeads.from_arrays(
        blocks=tuple(tuple((b.weight.detach().numpy().copy(), b.bias.detach().numpy().copy()) for b in h.blocks)
                     for h in heads),
        out=tuple(h.out.weight.detach().numpy().copy() for h in heads),
        topk_accuracy=accuracy)
    save_heads(trained, out, {"base_model_name_or_path": str(checkpoint),
                              "trtbuild": {"self_distill": options.self_distill,
                                           "train_tokens": int(train_ids.numel()),
                                           "eval_tokens": int(eval_ids.numel()),
                                           "steps": options.steps, "seed": options.seed,
                                           "train_out": options.train_out}})
    return TrainReport(heads=trained, train_tokens=int(train_ids.numel()), eval_tokens=int(eval_ids.numel()),
                       seconds=time.perf_counter() - start, final_loss=loss)


def _windows(tokenizer, data: list[Path], options: TrainOptions) -> torch.Tensor:
    ids: list[int] = []
    for path in data:
        ids += tokenizer.encode(Path(path).read_text(encoding="utf-8", errors="replace")).ids
    count = min(options.sequences, len(ids) // options.seq_len)
    if count < 4:
        raise UserError(f"--data: {len(ids)} tokens make fewer than 4 sequences of --seq-len {options.seq_len}")
    # Spread the windows over the whole text rather than taking its beginning.
    starts = np.linspace(0, len(ids) - options.seq_len, count).astype(np.int64)
    rng = np.random.default_rng(options.seed)
    rng.shuffle(starts)
    return torch.tensor(np.stack([ids[s:s + options.seq_len] for s in starts]))  # [N, L]


@torch.no_grad()
def _greedy_continuations(model, windows: torch.Tensor, options: TrainOptions, progress) -> torch.Tensor:
    """Keeps each window's first prompt_len tokens and lets the model continue greedily."""
    out = []
    batch, new = 64, options.seq_len - options.prompt_len
    t0 = time.perf_counter()
    for first in range(0, len(windows), batch):
        ids = windows[first:first + batch, :options.prompt_len]
        result = model(input_ids=ids, use_cache=True)
        cache, tokens = result.past_key_values, [ids]
        for _ in range(new):
            nxt = result.logits[:, -1].argmax(-1, keepdim=True)  # [b, 1]
            tokens.append(nxt)
            result = model(input_ids=nxt, past_key_values=cache, use_cache=True)
            cache = result.past_key_values
        out.append(torch.cat(tokens, dim=1))
        done = min(first + batch, len(windows))
        elapsed = time.perf_counter() - t0
        progress(f"  self-distill: {done}/{len(windows)} sequences generated, "
                 f"{done * new / elapsed:.0f} tok/s, eta {elapsed / done * (len(windows) - done):.0f} s")
    return torch.cat(out)


@torch.no_grad()
def _hidden_states(model, windows: torch.Tensor, progress) -> torch.Tensor:
    """The base model's last hidden state (after its final norm) at every position."""
    chunks = [model.model(input_ids=windows[i:i + 32]).last_hidden_state for i in range(0, len(windows), 32)]
    progress(f"  hidden states: {len(windows) * windows.shape[1]} positions")
    return torch.cat(chunks)


def _head_loss(head: nn.Module, hidden: torch.Tensor, ids: torch.Tensor, k: int) -> torch.Tensor:
    shift = k + 2
    logits = head(hidden[:, :-shift])  # [B, L - shift, V]
    return nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, shift:].flatten())


def _fit(heads: nn.ModuleList, hidden: torch.Tensor, ids: torch.Tensor, options: TrainOptions, progress) -> float:
    opt = torch.optim.AdamW([p for p in heads.parameters() if p.requires_grad], lr=options.lr, weight_decay=0.0)
    rng = np.random.default_rng(options.seed)
    warmup = max(1, options.steps // 20)
    t0, last = time.perf_counter(), float("nan")
    for step in range(options.steps):
        lr = options.lr * min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / options.steps))
        for group in opt.param_groups:
            group["lr"] = lr
        rows = torch.from_numpy(rng.integers(0, len(ids), size=options.batch))
        # Farther heads are harder and noisier: their losses weigh less (Medusa's 0.8^k).
        loss = sum(0.8 ** k * _head_loss(head, hidden[rows], ids[rows], k) for k, head in enumerate(heads))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        last = loss.item()
        if step % 25 == 0 or step == options.steps - 1:
            elapsed = time.perf_counter() - t0
            progress(f"  step {step + 1}/{options.steps}  loss {last:.3f}  "
                     f"{(step + 1) * options.batch * options.seq_len / elapsed:.0f} tok/s  "
                     f"eta {elapsed / (step + 1) * (options.steps - step - 1):.0f} s")
    return last


@torch.no_grad()
def _accuracy(heads: nn.ModuleList, hidden: torch.Tensor, ids: torch.Tensor) -> tuple[tuple[float, ...], ...]:
    """Per head, the held-out fraction whose target is within its top-1..top-10 guesses."""
    rows = []
    for k, head in enumerate(heads):
        shift = k + 2
        logits = head(hidden[:, :-shift])                      # [B, L - shift, V]
        top = logits.topk(TOP_K_REPORTED, dim=-1).indices      # [B, L - shift, 10]
        hit = top == ids[:, shift:, None]
        rows.append(tuple(round(float(hit[..., :n].any(-1).float().mean()), 4) for n in range(1, TOP_K_REPORTED + 1)))
    return tuple(rows)

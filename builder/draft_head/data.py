"""The draft head's training data: token windows from text, the target's own greedy continuation
of a prompt from each (self-distillation), and per position the target's tapped hidden states and
its argmax.

A tap is the raw output of one decoder layer (a forward hook on ``model.model.layers[i]``, so the
last layer's tap is before the final norm, as the built target's step graph outputs it).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from ..errors import UserError

TAP_DTYPE = torch.bfloat16   # taps kept in 16 bits: half the RSS of float32, enough for a feature


def read_token_streams(tokenizer, data: list[Path]) -> list[list[int]]:
    streams = []
    for path in data:
        streams.append(tokenizer.encode(Path(path).read_text(encoding="utf-8", errors="replace")).ids)
    return streams


def prompt_windows(tokenizer, streams: list[list[int]], names: list[str], count: int, length: int,
                   prompt_len: int, seed: int, held_fraction: float) -> tuple[torch.Tensor, np.ndarray]:
    """About ``count`` windows of ``length`` tokens, an equal share from each file (a small file of
    chat prompts counts as much as a large one of prose), spread over it, and which are held out:
    those in the last ``held_fraction`` of each file, a region no training window reaches (windows
    drawn from the whole file overlapped their neighbours, and a file given twice gave the same
    windows twice: a held-out figure measured on text trained on read 0.73 where the model's
    answers to new questions kept 0.11–0.44). Identical windows are kept once. Each window's
    first ``prompt_len`` tokens end just after a line end where there is one close by: a prompt
    cut mid-word teaches little, and one cut after a chat template's user turn or assistant header
    makes the model answer. Returns windows [N, L] and held bool [N]."""
    line_end = np.array(["\n" in tokenizer.decode([t]) for t in range(tokenizer.get_vocab_size())])
    windows, held = [], []
    for i, (ids, name) in enumerate(zip(streams, names)):
        if len(ids) < 2 * length:
            raise UserError(f"--data {name}: {len(ids)} tokens, fewer than two windows of --seq-len {length} "
                            "(one to train on, one held out)")
        share = count // len(streams) + (1 if i < count % len(streams) else 0)
        n_held = max(1, int(round(share * held_fraction)))
        cut = min(max(length, int(len(ids) * (1 - held_fraction))), len(ids) - length)
        stream = np.asarray(ids, dtype=np.int64)
        for starts, low, high, is_held in (
                (np.linspace(0, cut - length, max(share - n_held, 1)), 0, cut - length, False),
                (np.linspace(cut, len(ids) - length, n_held), cut, len(ids) - length, True)):
            starts = _aligned(starts.astype(np.int64), stream, line_end, length, prompt_len).clip(low, high)
            windows += [stream[s:s + length] for s in starts]
            held += [is_held] * len(starts)
    stacked, first = np.unique(np.stack(windows), axis=0, return_index=True)
    held_of = np.asarray(held)[first]
    order = np.random.default_rng(seed).permutation(len(stacked))
    return torch.from_numpy(stacked[order]), held_of[order]  # [N, L], [N]


def _aligned(starts: np.ndarray, stream: np.ndarray, line_end: np.ndarray, length: int, prompt_len: int) -> np.ndarray:
    """Each start moved (by less than ``length``) to the nearest one whose token
    ``prompt_len - 1`` holds a line end, where there is one."""
    aligned_at = np.flatnonzero(line_end[stream[prompt_len - 1:len(stream) - length + prompt_len]])
    if not len(aligned_at):
        return starts
    nearest = aligned_at[np.searchsorted(aligned_at, starts).clip(max=len(aligned_at) - 1)]
    return np.where(np.abs(nearest - starts) < length, nearest, starts)


class _Taps:
    """Forward hooks that keep the given decoder layers' outputs of each forward call."""

    def __init__(self, model, layers: tuple[int, ...]):
        self.outputs: dict[int, torch.Tensor] = {}
        self.handles = [model.model.layers[i].register_forward_hook(self._keeper(i)) for i in layers]
        self.layers = layers

    def _keeper(self, index: int):
        def keep(_module, _inputs, output):
            self.outputs[index] = (output[0] if isinstance(output, tuple) else output).detach()
        return keep

    def take(self) -> torch.Tensor:
        """The last call's taps [B, S, 3H]."""
        return torch.cat([self.outputs[i] for i in self.layers], dim=-1).to(TAP_DTYPE)

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


@torch.no_grad()
def collect(model, windows: torch.Tensor, taps: tuple[int, ...], prompt_len: int | None,
            progress: Callable[[str], None], batch: int = 64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per window: the teacher tokens, taps and argmax. With ``prompt_len`` the window keeps its
    first ``prompt_len`` tokens and the target continues greedily to the window's length (one
    decode step per new token, each step's taps and argmax kept); without, one prefill pass."""
    hooks = _Taps(model, taps)
    count, length = windows.shape
    ids_out, taps_out, argmax_out = [], [], []
    t0 = time.perf_counter()
    try:
        for first in range(0, count, batch):
            ids = windows[first:first + batch]
            if prompt_len is None:
                logits = model(input_ids=ids, use_cache=False).logits  # [b, L, V]
                ids_out.append(ids)
                taps_out.append(hooks.take())
                argmax_out.append(logits.argmax(-1))
            else:
                ids = ids[:, :prompt_len]
                result = model(input_ids=ids, use_cache=True)
                tokens, tapped, greedy = [ids], [hooks.take()], [result.logits.argmax(-1)]
                for _ in range(length - prompt_len):
                    nxt = greedy[-1][:, -1:]  # [b, 1]
                    tokens.append(nxt)
                    result = model(input_ids=nxt, cache=result.cache, use_cache=True)
                    tapped.append(hooks.take())
                    greedy.append(result.logits.argmax(-1))
                ids_out.append(torch.cat(tokens, dim=1))
                taps_out.append(torch.cat(tapped, dim=1))
                argmax_out.append(torch.cat(greedy, dim=1))
            done = min(first + batch, count)
            elapsed = time.perf_counter() - t0
            progress(f"  target pass: {done}/{count} windows, {done * length / elapsed:.0f} tok/s, "
                     f"eta {elapsed / done * (count - done):.0f} s")
    finally:
        hooks.close()
    return torch.cat(ids_out), torch.cat(taps_out), torch.cat(argmax_out)

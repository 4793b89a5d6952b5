"""Draft head training (EAGLE-3 style) by self-distillation from a frozen target.

The target's greedy continuations of prompts from the data are the teacher text; one pass of
the target gives, per position, the outputs of the three tap layers and the target's argmax.
The draft learns the target's argmax over a reduced vocabulary (the K tokens the target predicts
most often on the training windows) with cross-entropy: greedy verification accepts exactly the
argmax, so top-1 of the argmax is what pays, and the argmax is all that needs keeping per
position (a full distribution over 49k tokens per position would not fit in memory; a top-k
one would spend the time on tokens verification never accepts).

Training-time test: ``ttt_depth`` passes over each window. Pass 1 reads ``fuse(taps)``; pass j
reads pass j - 1's output hidden one position back, and attends as drafting does (``ttt_mask``).
Token inputs at every depth are the teacher tokens (EAGLE-3's choice).
"""
from __future__ import annotations

import math
import resource
import time
from dataclasses import asdict, dataclass, field, replace
from enum import Enum
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch import nn

from ...contract.draft_head import NUM_TAPS, DraftHeadConfig, DraftLayerShape, default_taps
from ..errors import UserError
from ..frontend.training_target import training_target
from .data import collect, prompt_windows, read_token_streams
from .model import DraftHead, save_draft_head
from .vocab import OUTSIDE, draft_vocabulary, target_to_draft


class TrainPrecision(Enum):
    """The arithmetic of the draft's training passes (its weights, optimizer and loss stay float32).

    ``bfloat16``: the matmuls under torch's CPU autocast in bfloat16; on a CPU with AMX (Intel
    Sapphire Rapids and later) oneDNN runs them on its tile units, and a training step of the
    SmolLM2-sized draft ran 1.61× faster (benchmarks/draft_train_precision.py). ``auto``: bfloat16
    where the CPU has AMX bf16, else float32 (bfloat16 without AMX was not measured).

    The target's pass that makes the labels stays float32: in bfloat16 it ran 2.4× faster, but
    its argmax agreed with float32's at 0.93 of positions (random ids: near-ties), and the argmax
    is what the draft learns and what greedy verification accepts."""

    auto = "auto"
    float32 = "float32"
    bfloat16 = "bfloat16"

    def resolved(self) -> "TrainPrecision":
        if self is not TrainPrecision.auto:
            return self
        return TrainPrecision.bfloat16 if cpu_has_amx_bf16() else TrainPrecision.float32

    def autocast(self):
        """The context the draft's training passes run in (``auto`` must be resolved first)."""
        if self is TrainPrecision.auto:
            raise ValueError("TrainPrecision.auto: resolve it first")
        return torch.autocast("cpu", dtype=torch.bfloat16, enabled=self is TrainPrecision.bfloat16)


def cpu_has_amx_bf16() -> bool:
    """Whether this CPU has AMX bf16 tiles: torch says where it can (``torch.cpu.get_capabilities``,
    torch ≥ 2.13); before that, Linux's CPU flags; False where neither tells."""
    capabilities = getattr(torch.cpu, "get_capabilities", None)
    if capabilities is not None:
        return bool(capabilities().get("amx_bf16"))
    try:
        return "amx_bf16" in Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False


DEPTH_WEIGHT = 0.8   # deeper depths see their own errors and weigh less (EAGLE/Medusa's 0.8^(j-1))
MIN_SEQ_LEN = 8


@dataclass(frozen=True)
class DraftTrainOptions:
    draft_vocab: int = 8192      # K, clamped to the target's vocabulary
    ttt_depth: int = 3
    seq_len: int = 160
    sequences: int = 240         # windows of seq_len tokens (eval_fraction of them held out)
    prompt_len: int = 32         # data tokens each self-distilled window starts from
    steps: int = 360
    batch: int = 4               # windows per step
    lr: float = 2e-3
    self_distill: bool = True
    taps: tuple[int, ...] | None = None   # default: contract's default_taps
    eval_fraction: float = 0.05
    seed: int = 0
    precision: TrainPrecision = TrainPrecision.auto

    def check(self) -> None:
        if self.draft_vocab < 2:
            raise UserError(f"--draft-vocab {self.draft_vocab}: must be ≥ 2")
        if self.ttt_depth < 1:
            raise UserError(f"--ttt-depth {self.ttt_depth}: must be ≥ 1")
        if self.seq_len < self.ttt_depth + MIN_SEQ_LEN:
            raise UserError(f"--seq-len {self.seq_len}: must be ≥ --ttt-depth + {MIN_SEQ_LEN} "
                            f"({self.ttt_depth + MIN_SEQ_LEN})")
        if self.self_distill and not 1 <= self.prompt_len < self.seq_len:
            raise UserError(f"--prompt-len {self.prompt_len}: must be in [1, --seq-len {self.seq_len})")
        if self.steps < 1 or self.batch < 1 or self.sequences < 4:
            raise UserError(f"--steps {self.steps} / --batch {self.batch} / --sequences {self.sequences}: "
                            "steps and batch must be ≥ 1, sequences ≥ 4")
        if not self.lr > 0:
            raise UserError(f"--lr {self.lr}: must be > 0")

    def checked_taps(self, num_layers: int) -> tuple[int, ...]:
        taps = self.taps if self.taps is not None else default_taps(num_layers)
        if len(taps) != NUM_TAPS or not all(0 <= t < num_layers for t in taps):
            raise UserError(f"--taps {','.join(map(str, taps))}: {NUM_TAPS} decoder layers in "
                            f"[0, {num_layers}) expected (this target has {num_layers} layers)")
        return tuple(taps)


@dataclass(frozen=True)
class DraftTrainReport:
    config: DraftHeadConfig
    losses: tuple[float, ...] = field(repr=False)   # per step
    seconds: float = 0.0


def ttt_mask(seq: int, depth: int) -> torch.Tensor:
    """Which keys pass ``depth``'s query at position p sees: bool [S, depth * S], keys in pass
    order. Drafting the ``depth``-th chain token at p after a verified prefix ending at
    q = p - depth + 1 sees positions ≤ q as the target's features made them (pass 1) and
    q + 1 .. p as its own earlier chain steps made them (pass d at position q + d - 1)."""
    p = torch.arange(seq)[:, None]
    r = torch.arange(seq)[None, :]
    blocks = [r <= p - depth + 1] + [r == p - depth + d for d in range(2, depth + 1)]
    return torch.cat(blocks, dim=1)


def unroll(draft: DraftHead, ids: torch.Tensor, taps: torch.Tensor, depth: int) -> list[torch.Tensor]:
    """Each depth's logits [B, S, K] over a window (S = L - 1 positions: position p reads
    token p + 1)."""
    batch, length = ids.shape
    seq = length - 1
    inputs = ids[:, 1:]                                                 # [B, S]
    positions = torch.arange(seq)[None, :].expand(batch, seq)          # [B, S]
    features = draft.fuse_taps(taps[:, :seq].float())                  # [B, S, H]
    prior, out = [], []
    for j in range(1, depth + 1):
        mask = ttt_mask(seq, j)[None, None]                             # [1, 1, S, j*S]
        logits, hidden, kv = draft(inputs, features, positions, mask, prior)
        out.append(logits)
        prior.append(kv)
        features = torch.cat((torch.zeros_like(hidden[:, :1]), hidden[:, :-1]), dim=1)  # feature at p = hidden at p-1
    return out


def depth_labels(argmax: torch.Tensor, to_draft: torch.Tensor, depth: int) -> list[torch.Tensor]:
    """Per depth, the draft id of the target's argmax at p + 1 [B, S]; OUTSIDE where the argmax is
    outside the vocabulary or the depth has no verified prefix (p < depth - 1)."""
    mapped = to_draft[argmax[:, 1:]]                                    # [B, S]
    labels = []
    for j in range(1, depth + 1):
        label = mapped.clone()
        label[:, :j - 1] = OUTSIDE
        labels.append(label)
    return labels


def train_draft_head(checkpoint: Path, data: list[Path], out: Path, options: DraftTrainOptions,
                     progress: Callable[[str], None] = print) -> DraftTrainReport:
    options.check()
    checkpoint = Path(checkpoint)
    start = time.perf_counter()
    tokenizer, model = training_target(checkpoint, data, options.seed)
    config = model.config
    taps = options.checked_taps(config.num_hidden_layers)
    vocab_size = config.vocab_size
    k = min(options.draft_vocab, vocab_size)

    streams = read_token_streams(tokenizer, data)
    names = [Path(path).name for path in data]
    windows, held_out = prompt_windows(tokenizer, streams, names, options.sequences, options.seq_len,
                                       options.prompt_len if options.self_distill else 1, options.seed,
                                       options.eval_fraction)
    progress(f"draft head: {len(windows)} windows of {options.seq_len} tokens from {len(data)} file(s) "
             f"({sum(map(len, streams))} tokens), taps {list(taps)}, vocabulary {k} of {vocab_size}")
    ids, tapped, argmax = collect(model, windows, taps, options.prompt_len if options.self_distill else None,
                                  progress)
    data_seconds = time.perf_counter() - start
    held = torch.from_numpy(held_out)
    train, n_eval = ~held, int(held.sum())

    draft_to_target = draft_vocabulary(argmax[train], k, vocab_size)
    to_draft = target_to_draft(draft_to_target, vocab_size)
    shape = DraftLayerShape(hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
                            num_heads=config.num_attention_heads, num_kv_heads=config.num_key_value_heads,
                            head_dim=config.head_dim, rms_norm_eps=float(config.rms_norm_eps),
                            rope_theta=float(config.rope_parameters["rope_theta"]))
    draft_config = DraftHeadConfig(taps=taps, target_vocab_size=vocab_size,
                                   target_num_layers=config.num_hidden_layers, draft_vocab_size=k, layer=shape)
    draft = DraftHead(draft_config, model.model.embed_tokens)
    with torch.no_grad():
        # The draft's last norm and LM head start as the target's own (over the draft vocabulary):
        # the layer then only has to learn a hidden state the target's head reads well.
        draft.lm_head.weight.copy_(model.lm_head.weight[draft_to_target])
        draft.norm.weight.copy_(model.model.norm.weight)
        draft.draft_to_target.copy_(draft_to_target)

    precision = options.precision.resolved()
    progress(f"  training in {precision.value}" + (" (the CPU has AMX)" if options.precision is TrainPrecision.auto
                                                   and precision is TrainPrecision.bfloat16 else ""))
    losses = _fit(draft, ids[train], tapped[train], argmax[train], to_draft, replace(options, precision=precision),
                  progress)
    accuracy = evaluate(draft, ids[held], tapped[held], argmax[held], argmax[train], to_draft, options.ttt_depth)
    seconds = time.perf_counter() - start
    training = {"text": [{"name": n, "tokens": len(t)} for n, t in zip(names, streams)],
                "windows": len(ids), "held_out_windows": n_eval,
                "tokens_per_window": options.seq_len, "steps": options.steps, "seconds": round(seconds, 1),
                "data_seconds": round(data_seconds, 1), "peak_rss_mib": round(peak_rss_mib()),
                "draft_vocab": k, "ttt_depth": options.ttt_depth, "loss": "cross-entropy to the target argmax",
                "final_loss": round(float(np.mean(losses[-20:])), 4),
                "precision": precision.value,
                "options": {name: (list(v) if isinstance(v, tuple) else v.value if isinstance(v, Enum) else v)
                            for name, v in asdict(options).items()},
                "checkpoint": checkpoint.name}
    draft.config = draft_config = replace(draft_config, accuracy=accuracy, training=training)
    save_draft_head(draft, out)
    return DraftTrainReport(config=draft_config, losses=tuple(losses), seconds=seconds)


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024   # Linux: KiB


def _loss(draft: DraftHead, ids, taps, argmax, to_draft, depth: int) -> torch.Tensor:
    total = 0.0
    for j, (logits, label) in enumerate(zip(unroll(draft, ids, taps, depth), depth_labels(argmax, to_draft, depth))):
        counted = (label != OUTSIDE).sum().clamp(min=1)
        ce = nn.functional.cross_entropy(logits.flatten(0, 1), label.flatten(), ignore_index=OUTSIDE,
                                         reduction="sum") / counted
        total = total + DEPTH_WEIGHT ** j * ce
    return total


def _fit(draft: DraftHead, ids, taps, argmax, to_draft, options: DraftTrainOptions, progress) -> list[float]:
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=options.lr, weight_decay=0.0)
    rng = np.random.default_rng(options.seed)
    warmup = max(1, options.steps // 20)
    losses: list[float] = []
    t0 = time.perf_counter()
    draft.train()
    for step in range(options.steps):
        lr = options.lr * min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / options.steps))
        for group in opt.param_groups:
            group["lr"] = lr
        rows = torch.from_numpy(rng.integers(0, len(ids), size=options.batch))
        with options.precision.autocast():
            loss = _loss(draft, ids[rows], taps[rows], argmax[rows], to_draft, options.ttt_depth)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(loss.item())
        if step % 25 == 0 or step == options.steps - 1:
            elapsed = time.perf_counter() - t0
            progress(f"  step {step + 1}/{options.steps}  loss {np.mean(losses[-25:]):.3f}  "
                     f"{(step + 1) * options.batch * ids.shape[1] / elapsed:.0f} tok/s  "
                     f"eta {elapsed / (step + 1) * (options.steps - step - 1):.0f} s")
    draft.eval()
    return losses


@torch.no_grad()
def evaluate(draft: DraftHead, ids, taps, argmax, train_argmax, to_draft, depth: int) -> dict:
    """Held-out accuracies against the target's argmax (an argmax outside the draft vocabulary is
    a miss): depth 1's top-1/top-5, each depth's top-1 (teacher tokens in, so a chain-acceptance
    proxy), the best unigram's top-1 and the share of argmaxes the vocabulary covers."""
    to_target = draft.draft_to_target
    truth = argmax[:, 1:]                                              # [B, S]
    hits = {1: [], 5: []}
    by_depth: list[list[torch.Tensor]] = [[] for _ in range(depth)]
    for first in range(0, len(ids), 8):
        rows = slice(first, first + 8)
        for j, logits in enumerate(unroll(draft, ids[rows], taps[rows], depth)):
            top = to_target[logits.topk(min(5, logits.shape[-1]), dim=-1).indices]   # [b, S, 5] target ids
            hit = top == truth[rows, :, None]
            by_depth[j].append(hit[:, j:, 0].flatten())
            if j == 0:
                hits[1].append(hit[..., 0].flatten())
                hits[5].append(hit.any(-1).flatten())
    unigram = int(np.bincount(train_argmax.flatten().numpy()).argmax())
    mean = lambda parts: round(float(torch.cat(parts).float().mean()), 4)  # noqa: E731
    return {"top1": mean(hits[1]), "top5": mean(hits[5]),
            "by_depth_top1": [mean(parts) for parts in by_depth],
            "unigram_top1": round(float((truth == unigram).float().mean()), 4),
            "vocab_coverage": round(float((to_draft[truth] != OUTSIDE).float().mean()), 4),
            "positions": int(truth.numel())}

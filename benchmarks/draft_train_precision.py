#!/usr/bin/env python3
"""What `trtbuild draft train --precision` buys: a draft head's training step, and the target's
teacher-forced pass, in float32 and in bfloat16 (torch's CPU autocast), on this CPU.

    python benchmarks/draft_train_precision.py [--checkpoint SmolLM2.gguf] [--rounds 5] [--batch 4]

* training step: a SmolLM2-shaped draft head (hidden 576, 9 / 3 heads, intermediate 1536, draft
  vocabulary 8192 over 49,152), random weights and data, ``--batch`` windows of 160 tokens, three
  training-time-test depths, forward, backward, gradient clipping and AdamW, as `draft train`
  runs it (the same loss and autocast);
* with ``--checkpoint``: the target's forward over 8 windows of 160 tokens of random ids (what
  `--no-self-distill` collection runs), and how often its argmax and its taps agree between the
  two precisions (argmax agreement: share of positions; taps: median relative error).

The precisions take turns for ``--rounds`` rounds of 3 timed calls; a figure is the median over
all rounds. On a machine shared with other jobs one round can read anywhere from 0.1× to 1.8×:
take the figure from a quiet machine and several rounds.
AMX (Intel Sapphire Rapids and later) is what makes bfloat16 pay: the table says whether this CPU
has it (`torch.cpu.get_capabilities()`).
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from trtbuild.builder.progress import table as format_table

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 576, 9, 3, 64, 1536
TARGET_VOCAB, DRAFT_VOCAB, SEQ, TAPS = 49152, 8192, 160, (2, 15, 27)
PRECISIONS = ("float32", "bfloat16")  # TrainPrecision values


def training_step(batch: int):
    """A function running one training step of a SmolLM2-shaped draft in a given precision."""
    from torch import nn

    from trtbuild.builder.draft_head.model import DraftHead
    from trtbuild.builder.draft_head.train import TrainPrecision, _loss
    from trtbuild.contract.draft_head import DraftHeadConfig, DraftLayerShape

    torch.manual_seed(0)
    shape = DraftLayerShape(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_heads=HEADS,
                            num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, rms_norm_eps=1e-5, rope_theta=1e5)
    config = DraftHeadConfig(taps=TAPS, target_vocab_size=TARGET_VOCAB, target_num_layers=30,
                             draft_vocab_size=DRAFT_VOCAB, layer=shape)
    draft = DraftHead(config, nn.Embedding(TARGET_VOCAB, HIDDEN))
    ids = torch.randint(0, TARGET_VOCAB, (batch, SEQ))
    taps = torch.randn(batch, SEQ, 3 * HIDDEN).to(torch.bfloat16)
    argmax = torch.randint(0, TARGET_VOCAB, (batch, SEQ))
    to_draft = torch.randint(0, DRAFT_VOCAB, (TARGET_VOCAB,))
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)

    def step(precision: str) -> None:
        with TrainPrecision(precision).autocast():
            loss = _loss(draft, ids, taps, argmax, to_draft, 3)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
    return step


def target_pass(checkpoint: Path):
    """A function running the target over 8 windows in a given precision, returning (argmax, taps)."""
    from trtbuild.builder.draft_head.data import _Taps
    from trtbuild.builder.draft_head.train import TrainPrecision
    from trtbuild.builder.frontend.training_target import training_target

    _, model = training_target(checkpoint, [], 0)
    hooks = _Taps(model, TAPS)
    ids = torch.randint(0, model.config.vocab_size, (8, SEQ), generator=torch.Generator().manual_seed(0))

    @torch.no_grad()
    def run(precision: str):
        with TrainPrecision(precision).autocast():
            logits = model(input_ids=ids, use_cache=False).logits
        return logits.argmax(-1), hooks.take().float()
    return run


def timed(fn, precision: str) -> float:
    began = time.perf_counter()
    fn(precision)
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=Path, help="SmolLM2's GGUF file or dir (adds the target's pass)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch", type=int, default=4, help="windows per training step")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    jobs = {"draft training step": (training_step(args.batch), args.batch * SEQ)}
    if args.checkpoint is not None:
        jobs["target pass (teacher-forced)"] = (target_pass(args.checkpoint), 8 * SEQ)
    times = {(job, p): [] for job in jobs for p in PRECISIONS}
    for _ in range(args.rounds):
        for job, (fn, _) in jobs.items():
            for precision in PRECISIONS:
                fn(precision)  # warm-up of this precision's kernels
                times[job, precision] += [timed(fn, precision) for _ in range(3)]
    rows = []
    for job, (_, tokens) in jobs.items():
        f32, bf16 = (statistics.median(times[job, p]) for p in PRECISIONS)
        rows.append([job, f"{f32 * 1e3:.0f}", f"{bf16 * 1e3:.0f}", f"{f32 / bf16:.2f}×",
                     f"{tokens / f32:.0f}", f"{tokens / bf16:.0f}"])
    from trtbuild.builder.draft_head.train import cpu_has_amx_bf16

    print(f"AMX bf16: {cpu_has_amx_bf16()}, {args.threads} threads, {args.rounds} rounds")
    print(format_table(rows, ["", "float32 ms", "bfloat16 ms", "speed-up", "float32 tok/s", "bfloat16 tok/s"]))
    if args.checkpoint is not None:
        run = jobs["target pass (teacher-forced)"][0]
        (a32, t32), (a16, t16) = run("float32"), run("bfloat16")
        error = ((t16 - t32).norm(dim=-1) / t32.norm(dim=-1).clamp(min=1e-6)).median()
        print(f"target pass, bfloat16 against float32: argmax agreement {float((a32 == a16).float().mean()):.4f} "
              f"of {a32.numel()} positions, taps' median relative error {float(error):.4f}")


if __name__ == "__main__":
    main()

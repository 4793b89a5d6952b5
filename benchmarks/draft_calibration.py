#!/usr/bin/env python3
"""What a draft head's own probability says about whether the target keeps its token.

Serves a built engine's draft head alone in ``always`` mode (every chain verified at full length,
greedy) over a workload's prompts at batch 1, records every verification (the probability the
draft gave each token, how many were kept) and prints the share kept per tenth of the stated
probability and per depth (a token counts as tried where every token before it was kept). The
runtime's policy estimates a draft head's tokens by the first table (runtime/speculation/host.py,
``per_token``); the second is what a depth-averaged estimate would see.

    python benchmarks/draft_calibration.py build/bench-speculation/smollm2-float32-draft [--workload free_chat]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))


def tried_tokens(verifications: list[tuple[tuple[float, ...], int]]) -> np.ndarray:
    """[T, 3] (depth, stated probability, kept 0/1) of every token a verification reached."""
    rows = [(depth, q, depth < kept) for stated, kept in verifications
            for depth, q in enumerate(stated) if depth <= kept]
    return np.array(rows, np.float64).reshape(-1, 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("engine", type=Path, help="an engine dir built with a draft head")
    parser.add_argument("--workload", default="free_chat")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    from speculation import texts
    from speculation_workloads import WORKLOADS
    from trtbuild.contract.speculation import Source
    from trtbuild.runtime.core.sampling import SamplingParams
    from trtbuild.runtime.engine_dir import load
    from trtbuild.runtime.llm import LLM
    from trtbuild.runtime.server.chat import chat_template
    from trtbuild.runtime.speculation.adaptive import SpeculationMode

    if args.workload not in WORKLOADS:
        parser.error(f"--workload {args.workload}: valid {', '.join(WORKLOADS)}")
    engine_dir = load(args.engine)
    if engine_dir.draft_head is None:
        parser.error(f"{args.engine}: built without a draft head (speculative.draft_head in its spec)")
    prompts = texts(args.workload, args.prompts, chat_template(engine_dir))
    verifications: list[tuple[tuple[float, ...], int]] = []
    with LLM(args.engine, backend="onnxruntime", threads=args.threads, speculation=(Source.draft_head,),
             speculation_mode=SpeculationMode.always, prefix_cache=False) as llm:
        model = llm.speculation.draft_head.model
        record = model.record

        def recorded(rid, source, stated, kept):
            verifications.append((tuple(map(float, stated)), int(kept)))
            record(rid, source, stated, kept)

        model.record = recorded
        start = time.perf_counter()
        for prompt in prompts:
            llm.generate([prompt], [SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)])
        seconds = time.perf_counter() - start
    tokens = tried_tokens(verifications)
    print(f"{args.engine.name}, {args.workload}: {len(prompts)} prompts × {args.max_tokens} tokens, "
          f"{len(verifications)} verifications, {len(tokens)} tokens tried, {seconds:.0f} s")
    print(f"{'stated':>9} {'tried':>6} {'kept':>6}")
    for tenth in range(10):
        cell = tokens[np.minimum((tokens[:, 1] * 10).astype(int), 9) == tenth]
        share = f"{cell[:, 2].mean():.2f}" if len(cell) else "-"
        print(f"{tenth / 10:.1f}–{(tenth + 1) / 10:.1f} {len(cell):>6} {share:>6}")
    print(f"{'depth':>9} {'tried':>6} {'kept':>6}")
    for depth in range(int(tokens[:, 0].max(initial=-1)) + 1):
        cell = tokens[tokens[:, 0] == depth]
        print(f"{depth + 1:>9} {len(cell):>6} {cell[:, 2].mean():>6.2f}")


if __name__ == "__main__":
    main()

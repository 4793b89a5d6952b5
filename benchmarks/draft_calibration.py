#!/usr/bin/env python3
"""What a draft head's own probability says about whether the target keeps its token.

Serves a built engine's draft head alone in ``always`` mode (every draft verified whole, greedy;
chains unless ``--draft-tree-width`` asks for trees) over a workload's prompts at batch 1, records
every verification (the probability the draft gave each node, which were kept) and prints the
share kept per tenth of the stated probability and per depth (a node counts as tried where its
parent was kept, as the runtime's calibration counts it). The runtime's policy estimates a draft
head's tokens by the first table (runtime/speculation/host.py, ``per_token``); the second is what
a depth-averaged estimate would see.

    python benchmarks/draft_calibration.py build/bench-speculation/smollm2-float32-draft [--workload free_chat]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))


def recording(model) -> list[tuple[int, float, bool]]:
    """Every node a verification of ``model``'s drafts (a HostDrafting) tried, as (depth from 0,
    stated probability, kept), appended from then on; the model learns from them as before."""
    from trtbuild.runtime.speculation.host import tried_nodes

    tried: list[tuple[int, float, bool]] = []
    verified = model.verified

    def recorded(rid, draft, path):
        tried.extend((int(draft.tree.depths[node]) - 1, float(draft.probabilities[node - 1]), kept)
                     for node, kept in tried_nodes(draft.tree, path))
        verified(rid, draft, path)

    model.verified = recorded
    return tried


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("engine", type=Path, help="an engine dir built with a draft head")
    parser.add_argument("--workload", default="free_chat")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--draft-tree-width", type=int, default=1,
                        help="tokens the draft offers at each depth (1: chains, as the runtime.md figures were measured)")
    args = parser.parse_args()
    if args.draft_tree_width < 1:
        parser.error(f"--draft-tree-width {args.draft_tree_width}: valid 1 (chains) or more")

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
    with LLM(args.engine, backend="onnxruntime", threads=args.threads, speculation=(Source.draft_head,),
             speculation_mode=SpeculationMode.always, prefix_cache=False,
             draft_tree_width=args.draft_tree_width) as llm:
        tried = recording(llm.speculation.draft_head.model)
        start = time.perf_counter()
        for prompt in prompts:
            llm.generate([prompt], [SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)])
        seconds = time.perf_counter() - start
        verifications = llm.speculation.stats.verified_rows
    tokens = np.array(tried, np.float64).reshape(-1, 3)  # [T, 3]: depth, stated probability, kept 0/1
    print(f"{args.engine.name}, {args.workload}: {len(prompts)} prompts × {args.max_tokens} tokens, "
          f"{verifications} verifications, {len(tokens)} tokens tried, {seconds:.0f} s")
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

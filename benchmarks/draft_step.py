#!/usr/bin/env python3
"""What a draft head's step costs on the CPU, against a target step.

    python benchmarks/draft_step.py [--engine-dir DIR] [--threads 2] [--reps 40] [--past 128] [--json]

A SmolLM2-shaped draft head with random weights (hidden 576, 9 q / 3 kv heads of 64, intermediate
1536, a draft vocabulary of K = 8192 over the target's 49,152, S_max = 2048) is exported as
``draft.onnx`` and made into ``draft.cpu.onnx`` (builder/draft_head/cpu_graph.py); each runs in
the drafter (runtime/speculation/draft_head.py): ``draft.onnx`` with numpy feeds, the caches
copied in and out (before), ``draft.cpu.onnx`` with the slot pool bound in place (after). Every
request has ``--past`` positions observed. Timed, median of ``--reps`` after warm-up:

* a draft step: ``propose(k=2)``, one S = 1 run over the rows and two softmaxes over K;
* a chain of 4 (3 runs), and per drafted token;
* an observe of 3 positions a row (the catch-up after a verification that accepted 2).

With ``--engine-dir`` (a SmolLM2 float32 engine dir built with the CPU stage) also the target's
plain decode step (its step model, bound as the runtime binds it, ``--past`` tokens cached), each
draft figure as a share of it, and the target step timed with a draft chain of 4 between steps,
the draft session spinning or not (``Spinning``): a second session's spinning pool on the same
cores can slow the target.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from trtbuild.builder.progress import table as format_table  # noqa: E402

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 576, 9, 3, 64, 1536
TARGET_VOCAB, DRAFT_VOCAB, MAX_SEQ = 49152, 8192, 2048
PER_ROUND, PAUSE_S = 5, 0.05


def make_graphs(out: Path) -> tuple[Path, Path, np.ndarray]:

    from trtbuild.builder.draft_head.cpu_graph import draft_cpu_graph
    from trtbuild.builder.draft_head.export import export_draft_graph
    from trtbuild.builder.draft_head.model import random_draft_head
    from trtbuild.contract.draft_head import DraftHeadConfig, DraftLayerShape

    config = DraftHeadConfig(taps=(2, 15, 27), target_vocab_size=TARGET_VOCAB, target_num_layers=30,
                             draft_vocab_size=DRAFT_VOCAB,
                             layer=DraftLayerShape(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_heads=HEADS,
                                                   num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, rms_norm_eps=1e-5,
                                                   rope_theta=100000.0))
    draft = random_draft_head(config, std=0.02)
    plain = export_draft_graph(draft, MAX_SEQ, max_batch=8, max_step_tokens=512, path=out / "draft.onnx")
    return plain, draft_cpu_graph(plain, rows=8), draft.draft_to_target.numpy()


def medians_ms(runs: dict[str, callable], rounds: int, per_round: int) -> dict[str, float]:
    """Median ms of each run, the runs taking turns for ``rounds`` rounds of ``per_round`` timed
    calls each (after a warm-up call), so a load that comes and goes on a shared machine falls on
    all of them alike; a pause after each turn lets a spinning thread pool go idle."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, fn in runs.items():
            fn()
            for _ in range(per_round):
                began = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - began)
            time.sleep(PAUSE_S)
    return {name: statistics.median(values) * 1e3 for name, values in times.items()}


def drafter_with_history(graph: Path, mapping: np.ndarray, threads: int, past: int, spinning=None):
    from trtbuild.runtime.speculation.draft_head import DRAFT_SPINNING, DraftHeadDrafter, Observation

    d = DraftHeadDrafter(graph, mapping, MAX_SEQ, capacity=8, threads=threads,
                         spinning=DRAFT_SPINNING if spinning is None else spinning)
    rng = np.random.default_rng(0)
    rids = [f"r{i}" for i in range(8)]
    d.observe([Observation(rid, 0, rng.normal(0, 1, (past, HIDDEN)).astype(np.float32),
                           rng.integers(0, TARGET_VOCAB, past).tolist()) for rid in rids])
    return d, rids


def draft_runs(d, rids: list[str], past: int, tag: str) -> dict[str, callable]:
    from trtbuild.runtime.speculation.draft_head import Observation

    rng = np.random.default_rng(1)
    # The catch-up rewrites positions past − 3 .. past − 1 every time (the rollback makes it repeatable).
    catch_up = [Observation(rid, past - 3, rng.normal(0, 1, (3, HIDDEN)).astype(np.float32),
                            rng.integers(0, TARGET_VOCAB, 3).tolist()) for rid in rids]
    runs = {}
    for batch in (1, 8):
        runs[f"{tag}|draft step B={batch}"] = lambda b=batch: d.propose(rids[:b], 2)
        runs[f"{tag}|chain of 4 B={batch}"] = lambda b=batch: d.propose(rids[:b], 4)
        runs[f"{tag}|observe 3 B={batch}"] = lambda b=batch: d.observe(catch_up[:b])
    return runs


def target_step(engine: Path, batch: int, threads: int, past: int):
    import cpu_step_overheads

    cpu_step_overheads.PAST = past
    return cpu_step_overheads.bound_step(engine, cpu_step_overheads.MODELS[0], batch, threads)


def after_chain(d, rids: list[str], step) -> callable:
    """A draft chain of 4 at B = 1, then the target's B = 1 step: (the chain's time, the step's)."""
    def run():
        began = time.perf_counter()
        d.propose(rids[:1], 4)
        drafted = time.perf_counter()
        step()
        return drafted - began, time.perf_counter() - drafted
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine-dir", type=Path, help="a SmolLM2 float32 engine dir with rank0.cpu.onnx")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=40, help="timed calls of each configuration (≥ 20)")
    parser.add_argument("--past", type=int, default=128, help="positions each request has cached")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    from trtbuild.plugins.onnxruntime.session import Spinning

    with tempfile.TemporaryDirectory() as tmp:
        plain, cpu, mapping = make_graphs(Path(tmp))
        drafters = {"before": drafter_with_history(plain, mapping, args.threads, args.past),
                    "after": drafter_with_history(cpu, mapping, args.threads, args.past)}
        runs = {name: fn for tag, (d, rids) in drafters.items() for name, fn in draft_runs(d, rids, args.past, tag).items()}
        mixed_runs = {}
        if args.engine_dir is not None:
            for batch in (1, 8):
                runs[f"target|B={batch}"] = target_step(args.engine_dir, batch, args.threads, args.past)
            step = runs["target|B=1"]
            for spinning, threads in ((Spinning.never, args.threads), (Spinning.always, args.threads),
                                      (Spinning.never, 1)):
                d, rids = drafter_with_history(cpu, mapping, threads, args.past, spinning)
                mixed_runs[f"draft spinning {spinning.value}, {threads} thread(s)"] = after_chain(d, rids, step)
        rounds = max(1, -(-args.reps // PER_ROUND))
        timed = medians_ms(runs, rounds, PER_ROUND)
        mixed = {name: [] for name in mixed_runs}
        for _ in range(rounds):  # the two spinning settings taking turns, as the runs above
            for name, fn in mixed_runs.items():
                fn()
                mixed[name] += [fn() for _ in range(PER_ROUND)]
                time.sleep(PAUSE_S)
        mixed = {name: {"chain of 4": statistics.median(v[0] for v in values) * 1e3,
                        "target step after it": statistics.median(v[1] for v in values) * 1e3,
                        "both": statistics.median(sum(v) for v in values) * 1e3}
                 for name, values in mixed.items()}
    before = {k.split("|")[1]: v for k, v in timed.items() if k.startswith("before|")}
    after = {k.split("|")[1]: v for k, v in timed.items() if k.startswith("after|")}
    targets = {int(k.split("=")[1]): v for k, v in timed.items() if k.startswith("target|")}
    result = {"before_ms": before, "after_ms": after, "target_ms": targets, "interleaved_ms": mixed,
              "threads": args.threads, "past": args.past, "reps": rounds * PER_ROUND}
    if args.json:
        print(json.dumps(result, indent=2))
        return
    rows = []
    for name in before:
        batch = int(name.rsplit("=", 1)[1])
        target = targets.get(batch)
        share = (lambda ms: f"{100 * ms / target:.1f} %") if target else (lambda ms: "–")
        rows.append([name, f"{before[name]:.2f}", f"{after[name]:.2f}", f"{before[name] / after[name]:.1f}×",
                     share(before[name]), share(after[name])])
    print(format_table(rows, ["", "draft.onnx ms", "draft.cpu.onnx ms", "speed-up", "before / target step",
                              "after / target step"]))
    if targets:
        print("target step ms: " + ", ".join(f"B={b} {ms:.2f}" for b, ms in targets.items()))
        for name, parts in mixed.items():  # B = 1: a chain, then a target step, in turn
            print(f"{name}: " + ", ".join(f"{part} {ms:.2f} ms" for part, ms in parts.items()))


if __name__ == "__main__":
    main()

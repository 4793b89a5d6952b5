"""A verification step of B rows × S tokens on the CPU: the verification graph (rows folded into
GroupQueryAttention's heads) against the rank graph, in one session, on one engine dir.

    python benchmarks/cpu_verify_rows.py                          # SmolLM2-135M float32 (built once)
    python benchmarks/cpu_verify_rows.py --engine-dir DIR --starts 20,300,1500

Each row verifies a chain of S - 1 guesses after ``start + 7·row`` cached positions (rows at
different lengths, as in a real batch); B = 1..8, S = 5 (and S = 3 at B = 8), 2 threads, median of
``--repeats`` steps after two warm ones. The plain decode step of B rows (the CPU decode graph) is
the baseline a verification has to beat.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine-dir", type=Path, help="an engine dir built with a draft source "
                        "(default: benchmarks/speculation.py's smollm2-float32, built the first time)")
    parser.add_argument("--starts", default="300", help="comma-separated cached lengths of row 0")
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    from trtbuild.runtime.backends.onnxruntime.engine import OnnxRuntimeEngine
    from trtbuild.runtime.core.step import Step, StepKind
    from trtbuild.runtime.engine_dir import load
    from trtbuild.runtime.speculation.chain import chain_tree

    if args.engine_dir is None:
        import speculation
        args.engine_dir = speculation.engine_dir("smollm2-float32", speculation.REPO / "build" / "bench-speculation")
    engine = OnnxRuntimeEngine(load(args.engine_dir), threads=args.threads)
    rows = engine.verify_rows
    if not rows:
        sys.exit(f"{args.engine_dir} has no CPU verification graph: build it with a speculative source")
    rng = np.random.default_rng(0)

    def step(batch: int, seq: int, start: int) -> Step:
        tokens = tuple(tuple(int(t) for t in rng.integers(100, 1000, seq)) for _ in range(batch))
        return Step(StepKind.decode, 0, tuple(f"r{i}" for i in range(batch)), tokens,
                    tuple(start + 7 * i for i in range(batch)), (True,) * batch,
                    tuple(chain_tree(seq - 1) for _ in range(batch)) if seq > 1 else ())

    def ms(one: Step) -> float:
        engine.step(one), engine.step(one)
        times = []
        for _ in range(args.repeats):
            began = time.perf_counter()
            engine.step(one)
            times.append(time.perf_counter() - began)
        return float(np.median(times)) * 1e3

    print(f"{args.engine_dir}: verification graph holds up to {rows} rows; ms per step (median of {args.repeats})")
    print(f"{'start':>5} {'B':>2} {'S':>2} {'plain step':>10} {'verify graph':>12} {'rank graph':>10} {'ratio':>6}")
    for start in (int(s) for s in args.starts.split(",")):
        for batch, seq in ((1, 5), (2, 5), (4, 5), (8, 5), (8, 3)):
            plain = ms(step(batch, 1, start))
            engine.verify_rows = rows
            folded = ms(step(batch, seq, start))
            engine.verify_rows = 0  # the same step on the step model's rank-graph branch
            ranked = ms(step(batch, seq, start))
            engine.verify_rows = rows
            print(f"{start:>5} {batch:>2} {seq:>2} {plain:>10.1f} {folded:>12.1f} {ranked:>10.1f} {ranked / folded:>5.2f}×",
                  flush=True)


if __name__ == "__main__":
    main()

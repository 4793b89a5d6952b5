#!/usr/bin/env python3
"""An engine's CPU decode speed with its weights on 2 MiB pages against 4 KiB pages.

    python benchmarks/cpu_huge_pages.py ENGINE_DIR [--rounds 6] [--threads 2] [--json]

With transparent huge pages set to `madvise` (/sys/kernel/mm/transparent_hugepage/enabled),
ONNX Runtime's buffers, the prepacked float32 weights among them, sit on 4 KiB pages: a batch-1
step streams ~540 MB of SmolLM2's weights through a TLB miss every 4 KiB (a two-level walk in a
virtual machine). The runtime collapses what a session added, and the heap, onto 2 MiB pages
(plugins/onnxruntime/huge_pages.py); this compares it with that step left out.

Configurations: the runtime as it is; the same with the collapse left out (4 KiB pages); and the
same with glibc's `glibc.malloc.hugetlb=1` tunable instead (malloc advises MADV_HUGEPAGE on what
it maps: 2 MiB pages from the first touch, no copy at load). Each round runs
benchmarks/cpu_decode.py's trtbuild measurement (64-token random prompts, 128 greedy tokens,
decode tok/s at batch 1 and 8) once in a process of each, who goes first rotating; per batch the
median over rounds of each and of the per-round ratio to the 4 KiB pages.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from trtbuild.builder.progress import table as format_table  # noqa: E402

@dataclass(frozen=True)
class Config:
    collapse: bool  # the runtime's collapse onto 2 MiB pages after a session loads
    tunable: str | None = None  # GLIBC_TUNABLES for the process


BASE = "4 KiB pages (no collapse)"
CONFIGS = {BASE: Config(collapse=False),
           "runtime (collapse after load)": Config(collapse=True),
           "glibc.malloc.hugetlb=1, no collapse": Config(collapse=False, tunable="glibc.malloc.hugetlb=1")}

# The child: cpu_decode.py's --one trtbuild, with huge_pages.collapse_added made a no-op when asked.
CHILD = """
import contextlib, runpy, sys
if sys.argv.pop(1) == "off":
    from trtbuild.plugins.onnxruntime import huge_pages
    huge_pages.collapse_added = contextlib.nullcontext
sys.argv[0] = {script!r}
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def one(engine: Path, threads: int, seed: int, config: Config) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    if config.tunable:
        env["GLIBC_TUNABLES"] = config.tunable
    script = str(REPO / "benchmarks" / "cpu_decode.py")
    out = subprocess.run([sys.executable, "-c", CHILD.format(script=script), "on" if config.collapse else "off",
                          "--one", "trtbuild", str(engine), "--threads", str(threads), "--seed", str(seed)],
                         check=True, capture_output=True, text=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("engine", type=Path)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if not (args.engine / "manifest.json").is_file():
        sys.exit(f"{args.engine}: no manifest.json; give a built engine dir")
    names = list(CONFIGS)
    samples = {name: {1: [], 8: []} for name in names}
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            figures = one(args.engine, args.threads, r, CONFIGS[name])
            for batch in (1, 8):
                samples[name][batch].append(figures[str(batch)][0])
        print(f"round {r + 1}: " + ", ".join(f"{n}: b1 {samples[n][1][-1]:.1f} b8 {samples[n][8][-1]:.1f}"
                                              for n in names), file=sys.stderr, flush=True)
    result = {name: {} for name in names}
    for name in names:
        for batch in (1, 8):
            ratios = [h / b for h, b in zip(samples[name][batch], samples[BASE][batch])]
            result[name][batch] = {"tok/s": statistics.median(samples[name][batch]),
                                   "ratio median": statistics.median(ratios), "ratio range": [min(ratios), max(ratios)]}
    if args.json:
        print(json.dumps({"samples": samples, "result": result}, indent=1))
        return
    rows = [[name] + [f"{r[b]['tok/s']:.1f}   {r[b]['ratio median']:.3f} "
                      f"({r[b]['ratio range'][0]:.3f}–{r[b]['ratio range'][1]:.3f})" for b in (1, 8)]
            for name, r in result.items()]
    print(f"{args.engine}, {args.threads} threads, {args.rounds} rounds "
          f"(decode tok/s, median; × {BASE}: per-round median (range))")
    print(format_table(rows, ["", "batch 1", "batch 8"]))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""How long the CPU runtime takes to load an engine dir of the bundled model.

    python benchmarks/engine_load.py [--engine-dir DIR] [--repeats 5] [--threads 2] [--json]

Times, in this process after one warm-up load each, the median of --repeats loads of:
  - ``verify + engine``: reading and verifying the engine dir (manifest, every file's sha256) and
    constructing OnnxRuntimeEngine as ``trtbuild run`` does (its ONNX Runtime session included);
  - ``engine``: the engine alone (hashes not checked): what a rewrite at load would add to;
  - ``engine, rank graph``: the engine with ``use_decode_graph=False`` (every step on rank0.onnx):
    the session of the rank graph alone, for scale.
Only APIs every version of the runtime has are used, so the same script run on an older checkout
measures that runtime's load (an engine dir built before the CPU stage existed rewrote the rank
graph into the decode graph at every load). Builds specs/tiny-code.yaml into a temporary dir
unless --engine-dir is given.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def build_engine(out: Path) -> None:
    subprocess.run([sys.executable, "-m", "trtbuild.cli", "build", str(REPO / "specs" / "tiny-code.yaml"),
                    "-o", str(out), "--log-level", "error"], check=True, capture_output=True)


def median_ms(load, repeats: int) -> float:
    load()  # warm-up: imports, ONNX Runtime's kernel registry
    times = []
    for _ in range(repeats):
        begin = time.perf_counter()
        load()
        times.append(time.perf_counter() - begin)
    return statistics.median(times) * 1000


def measure(engine: Path, repeats: int, threads: int) -> dict[str, float]:
    from trtbuild.runtime.engine_dir import load
    from trtbuild.runtime.backends.onnxruntime.engine import OnnxRuntimeEngine

    return {"verify + engine": median_ms(lambda: OnnxRuntimeEngine(load(engine), threads=threads), repeats),
            "engine": median_ms(lambda: OnnxRuntimeEngine(load(engine, verify_hashes=False), threads=threads), repeats),
            "engine, rank graph": median_ms(lambda: OnnxRuntimeEngine(load(engine, verify_hashes=False), threads=threads,
                                                                      use_decode_graph=False), repeats)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine-dir", type=Path)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        engine = args.engine_dir
        if engine is None:
            engine = Path(tmp) / "tiny-code"
            build_engine(engine)
        figures = measure(engine, args.repeats, args.threads)
    if args.json:
        print(json.dumps(figures))
        return
    import trtbuild.runtime

    print(f"engine load, median of {args.repeats} (runtime at {Path(trtbuild.runtime.__file__).parent})")
    for name, ms in figures.items():
        print(f"  {name:<20} {ms:8.1f} ms")


if __name__ == "__main__":
    main()

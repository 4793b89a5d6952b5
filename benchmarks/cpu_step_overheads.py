#!/usr/bin/env python3
"""What the CPU step model costs around its decode graph, timed alone (no LLM loop around it).

    python benchmarks/cpu_step_overheads.py [--engine-dir DIR] [--genai-dir DIR] [--no-genai] [--rounds 8]
                                            [--threads 2] [--json]

1. A plain decode step of the step model (the If choosing the decode graph, then the next-input
   nodes: builder/emit/cpu_step_model.py) against the decode graph with the next-input nodes and no
   If, and against the decode graph alone, at batch 1 and 8 with 128 cached tokens a row.
   With onnxruntime-genai installed (`pip install -e ".[bench]"`), beside them: genai's fp32
   graph (its model builder on the same checkpoint) timed the same way, and a step of genai's own
   C++ loop (generate_next_token over a 64-token prompt to 192 tokens, so 128 cached on average):
   what its loop adds to its graph, to set against what the step model and our Python add.
2. How much slower a step runs after the calling thread spent a while elsewhere (a busy pause
   standing in for Python's commit between multi-step runs), against steps back to back.

Each configuration runs in a process of its own (a thread pool one leaves spinning would slow
the next), the processes taking turns --rounds times; a figure is the median over rounds of each
process's median step, with the fastest process's median beside it. Builds specs/tiny-code.yaml
into a temporary dir unless --engine-dir is given.
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

import numpy as np

REPO = Path(__file__).resolve().parents[1]
from trtbuild.builder.progress import table as format_table  # noqa: E402

MODELS = ("step model", "decode graph + next inputs", "decode graph")
GENAI = ("genai graph", "genai loop")
PAUSES_US = (0, 50, 100, 200, 400, 800, 1600)
PAST, WARM, STEPS = 128, 200, 600
GENAI_LENGTH = 192  # genai's loop: 64 prompt tokens + 128 new, 128 cached on average


def bound_step(engine: Path, model: str, batch: int, threads: int):
    """A function running one plain decode step of ``model`` on reused IO bindings."""
    import onnxruntime as ort

    import onnx

    from trtbuild.builder.emit.cpu_step_model import decode_branch, feeding_decode_model
    from trtbuild.plugins.onnxruntime import session as ort_config
    from trtbuild.contract.step import DRAFT_HEADS, PLAIN_DECODE, StepArrays
    from trtbuild.runtime.backends.onnxruntime.step_graph import cpu_graph, fill_decode_inputs
    from trtbuild.runtime.engine_dir import load
    from trtbuild.runtime.core.kv_pools import PoolShape

    d = load(engine)
    source, decode = cpu_graph(d)
    if decode is None:
        raise SystemExit(f"{engine}: the engine dir has no CPU decode graph (rank0.cpu.onnx)")
    if model != MODELS[0]:  # the step model's decode branch, with the next-input nodes or alone
        branch = decode_branch(onnx.load(source, load_external_data=False))
        source = (feeding_decode_model(branch) if model == MODELS[1] else branch).SerializeToString()
    session = ort_config.session(source, threads, d.rank_file(0, "onnx").parent, activations=d.cpu_activations)
    names = {i.name for i in session.get_inputs()}
    arrays = StepArrays.empty(batch, 1, 1, d.max_seq_len)
    binding = session.io_binding()
    for name, value in arrays.as_dict().items():
        if name in names:
            binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(value))
    if PLAIN_DECODE in names:
        binding.bind_cpu_input(PLAIN_DECODE, np.array(True))
    if DRAFT_HEADS in names:  # a Medusa dir: a greedy run's plain step, heads skipped
        binding.bind_cpu_input(DRAFT_HEADS, np.array(False))
    shape = PoolShape.of(d, np.float32, 0, 16)
    rng = np.random.default_rng(0)
    for name in shape.names:  # each cache its own buffer, written in place as the runtime's pools are
        cache = ort.OrtValue.ortvalue_from_numpy(rng.standard_normal((batch, *shape.slot), dtype=np.float32))
        binding.bind_ortvalue_input(f"past_{name}", cache)
        binding.bind_ortvalue_output(f"present_{name}", cache)
    logits = np.empty((batch, 1, d.vocab_size), np.float32)  # [B, 1, V]
    binding.bind_ortvalue_output("logits", ort.OrtValue.ortvalue_from_numpy(logits))
    # Fixed inputs every step (the next-input outputs are left to ONNX Runtime), so every step
    # attends over the same PAST tokens.
    fill_decode_inputs(arrays.input_ids, arrays.write_index, arrays.kv_length, [[5]] * batch, [PAST] * batch)
    return lambda: session.run_with_iobinding(binding)


def genai_graph_step(genai: Path, batch: int, threads: int):
    """A function running one decode step of genai's graph in ONNX Runtime on reused IO bindings,
    its KV buffers as long as its loop's (max_length 192), PAST tokens cached."""
    import onnxruntime as ort

    config = json.loads((genai / "genai_config.json").read_text())["model"]["decoder"]
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    session = ort.InferenceSession(str(genai / config["filename"]), options, providers=["CPUExecutionProvider"])
    binding = session.io_binding()
    binding.bind_cpu_input("input_ids", np.full((batch, 1), 5, np.int64))
    binding.bind_cpu_input("attention_mask", np.ones((batch, PAST + 1), np.int64))
    rng = np.random.default_rng(0)
    for info in session.get_inputs():
        if info.name.startswith("past_key_values"):
            cache = ort.OrtValue.ortvalue_from_numpy(rng.standard_normal(
                (batch, config["num_key_value_heads"], GENAI_LENGTH, config["head_size"]), dtype=np.float32))
            binding.bind_ortvalue_input(info.name, cache)
            binding.bind_ortvalue_output(info.name.replace("past_key_values", "present"), cache)
    binding.bind_output("logits")
    return lambda: session.run_with_iobinding(binding)


def genai_loop_ms(genai: Path, batch: int) -> float:
    """Median ms of a step of genai's loop (generate_next_token, then reading the tokens), the
    median over three generations of 64 prompt tokens to GENAI_LENGTH."""
    import onnxruntime_genai as og

    model = og.Model(str(genai))
    vocab = json.loads((genai / "genai_config.json").read_text())["model"]["vocab_size"]
    medians = []
    for seed in range(4):  # the first is a warm-up
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=GENAI_LENGTH, batch_size=batch, do_sample=False)
        generator = og.Generator(model, params)
        generator.append_tokens(np.random.default_rng(seed).integers(4, vocab, (batch, 64)).astype(np.int32))
        generator.generate_next_token()
        steps = []
        while not generator.is_done():
            begin = time.perf_counter()
            generator.generate_next_token()
            generator.get_next_tokens()
            steps.append(time.perf_counter() - begin)
        medians.append(statistics.median(steps))
    return statistics.median(medians[1:]) * 1e3


def step_ms(run, pause_us: int = 0) -> float:
    """Median ms of STEPS steps, each after ``pause_us`` of the calling thread busy elsewhere."""
    for _ in range(WARM):
        run()
    times = []
    for _ in range(STEPS):
        if pause_us:
            end = time.perf_counter() + pause_us * 1e-6
            while time.perf_counter() < end:
                pass
        begin = time.perf_counter()
        run()
        times.append(time.perf_counter() - begin)
    return statistics.median(times) * 1e3


def one(engine: Path, genai: Path | None, kind: str, batch: int, threads: int) -> dict:
    """This process's figures: one model's step (ms), or the step model's step after each pause."""
    if kind == GENAI[0]:
        return {"ms": step_ms(genai_graph_step(genai, batch, threads))}
    if kind == GENAI[1]:
        return {"ms": genai_loop_ms(genai, batch)}
    if kind == "pauses":
        run = bound_step(engine, MODELS[0], batch, threads)
        return {str(pause): step_ms(run, pause) for pause in PAUSES_US}
    return {"ms": step_ms(bound_step(engine, kind, batch, threads))}


def taking_turns(engine: Path, genai: Path | None, kinds: list[str], batch: int, threads: int, rounds: int
                 ) -> dict[str, list[dict]]:
    samples: dict[str, list[dict]] = {kind: [] for kind in kinds}
    for round_ in range(rounds):
        for kind in kinds[round_ % len(kinds):] + kinds[:round_ % len(kinds)]:  # who goes first rotates
            out = subprocess.run([sys.executable, __file__, "--one", kind, "--engine-dir", str(engine),
                                  *(["--genai-dir", str(genai)] if genai else []),
                                  "--batch", str(batch), "--threads", str(threads)],
                                 check=True, capture_output=True, text=True).stdout
            samples[kind].append(json.loads(out.strip().splitlines()[-1]))
    return samples


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine-dir", type=Path, help="engine dir of specs/tiny-code.yaml (default: build one)")
    ap.add_argument("--genai-dir", type=Path, help="onnxruntime-genai fp32 model of models/tiny-code "
                                                    "(default: build one if onnxruntime-genai is installed)")
    ap.add_argument("--no-genai", action="store_true", help="skip onnxruntime-genai even if installed")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--one", choices=[*MODELS, *GENAI, "pauses"], help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.engine_dir, args.genai_dir, args.one, args.batch, args.threads)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        engine, genai = args.engine_dir, args.genai_dir
        if engine is None:
            engine = Path(tmp) / "tiny-code"
            subprocess.run([sys.executable, "-m", "trtbuild.cli", "build", str(REPO / "specs" / "tiny-code.yaml"),
                            "-o", str(engine), "--log-level", "error"], check=True, capture_output=True)
        if genai is None and not args.no_genai:
            try:
                import onnxruntime_genai  # noqa: F401
            except ImportError:
                print("onnxruntime-genai not installed (pip install -e \".[bench]\"): no genai rows", file=sys.stderr)
            else:
                sys.path.insert(0, str(REPO / "benchmarks"))
                from cpu_decode import genai_build

                genai = genai_build(Path(tmp) / "genai-fp32", "fp32", args.threads)
        kinds = [*MODELS, *(GENAI if genai is not None and not args.no_genai else ())]
        models = {batch: taking_turns(engine, genai, kinds, batch, args.threads, args.rounds) for batch in (1, 8)}
        pauses = {batch: taking_turns(engine, None, ["pauses"], batch, args.threads, args.rounds)["pauses"]
                  for batch in (1, 8)}
    figures = {
        "models": {batch: {kind: {"median_ms": statistics.median(r["ms"] for r in runs),
                                  "fastest_ms": min(r["ms"] for r in runs)} for kind, runs in by_kind.items()}
                   for batch, by_kind in models.items()},
        "pauses": {batch: {pause: statistics.median(r[str(pause)] for r in runs) for pause in PAUSES_US}
                   for batch, runs in pauses.items()}}
    if args.json:
        print(json.dumps(figures, indent=2))
        return
    print(f"a plain decode step alone, {PAST} cached tokens a row ({args.threads} threads, {args.rounds} processes "
          "each, taking turns): median ms (fastest process); genai loop: a step of its generate loop")
    rows = []
    for batch, by_kind in figures["models"].items():
        base = by_kind[MODELS[0]]["median_ms"]
        for kind, f in by_kind.items():
            rows.append([str(batch), kind, f"{f['median_ms']:.3f} ({f['fastest_ms']:.3f})",
                         f"{(base - f['median_ms']) * 1e3:+.1f}"])
    print(format_table(rows, ["batch", "model", "step ms", "step model minus this, us"]))
    print("\nthe step model's step after the calling thread was busy elsewhere for a while: median ms")
    print(format_table([[str(batch), *(f"{by_pause[p]:.3f}" for p in PAUSES_US)]
                        for batch, by_pause in figures["pauses"].items()],
                       ["batch", *(f"pause {p} us" for p in PAUSES_US)]))


if __name__ == "__main__":
    main()

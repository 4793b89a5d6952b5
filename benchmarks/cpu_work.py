#!/usr/bin/env python3
"""CPU work per decoded token, trtbuild against onnxruntime-genai, at one intra-op thread.

    python benchmarks/cpu_work.py ENGINE_DIR [ENGINE_DIR ...] --genai GENAI_DIR [--batch 1] [--rounds 6]
    python benchmarks/cpu_work.py ENGINE_DIR --genai GENAI_DIR --graph   # the decode graph alone

Why: on this shared 2-core machine wall-clock tok/s moves ±20–40 % with the other agents' load,
and with two spinning threads a process's wall time depends on how often it is preempted, not on
what it computes. With one intra-op thread nothing spins, so the CPU seconds a decode step takes
(``time.process_time``) are the work it does, nearly whatever the load: two engines compared
within one process, taking turns, give ratios within a few percent from run to run.
What this cannot show: gains from running fewer parallel ops at two threads (fork and join),
which only a wall-clock run on a quiet machine measures (benchmarks/real_model.py's speed part).

Default: each engine's whole decode loop (trtbuild's LLM with its Python step loop and the CPU
step model; genai's C++ generator), 64-token random prompts, 128 greedy tokens, CPU ms per
decoded token, ratio to genai per round. ``--graph``: one ONNX Runtime run of a plain decode step
at 128 cached tokens through IO binding (past = present), for the first engine's step model
(rankN.cpu.onnx: the If, then the next-input nodes), its decode graph inlined (no If), that without
the next-input nodes (ArgMax, which genai computes outside its graph), and genai's model.onnx.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cpu_decode  # noqa: E402

FILLED = 128  # cached tokens at the --graph step


def genai_loop(path: Path, batch: int, vocab: int):
    """genai's generator on a copy of ``path``'s config at one thread: CPU ms per decoded token."""
    import onnxruntime_genai as og

    one = Path(f"/tmp/cpu_work-{path.resolve().name}-1thread")
    one.mkdir(exist_ok=True)
    for f in path.iterdir():
        if f.name != "genai_config.json" and not (one / f.name).exists():
            os.symlink(f.resolve(), one / f.name)
    config = json.loads((path / "genai_config.json").read_text())
    config["model"]["decoder"].setdefault("session_options", {})["intra_op_num_threads"] = 1
    (one / "genai_config.json").write_text(json.dumps(config))
    model = og.Model(str(one))

    def run(seed: int) -> float:
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=cpu_decode.PROMPT_LEN + cpu_decode.NEW_TOKENS, batch_size=batch,
                                  do_sample=False)
        generator = og.Generator(model, params)
        generator.append_tokens(np.asarray(cpu_decode.prompts(batch, seed, vocab), np.int32))
        generator.generate_next_token()  # the prefill's token
        begin, tokens = time.process_time(), 0
        while not generator.is_done():
            generator.generate_next_token()
            generator.get_next_tokens()
            tokens += batch
        return (time.process_time() - begin) / tokens * 1e3
    return run


def trtbuild_loop(path: Path, batch: int, vocab: int):
    """trtbuild's LLM (one thread, plain decoding): CPU ms per decoded token after the prefill."""
    from trtbuild.runtime.core.sampling import SamplingParams
    from trtbuild.runtime.llm import LLM

    llm = LLM(path, backend="onnxruntime", threads=1, prefix_cache=False, speculation=())

    def run(seed: int) -> float:
        params = SamplingParams(max_tokens=cpu_decode.NEW_TOKENS, ignore_eos=True)
        rids = {llm.submit(p, params) for p in cpu_decode.prompts(batch, seed, vocab)}
        started: set = set()
        while started != rids:
            deltas, _ = llm.step()
            started |= {d.rid for d in deltas}
        begin, tokens = time.process_time(), 0
        while llm.has_work():
            deltas, _ = llm.step()
            tokens += sum(d.token_id >= 0 for d in deltas)
        return (time.process_time() - begin) / tokens * 1e3
    return run


def graph_runs(engine: Path, genai: Path, batch: int) -> dict:
    """--graph: name → a function running 20 decode steps, returning CPU ms per run."""
    import onnx
    import onnxruntime as ort

    from trtbuild.plugins.onnxruntime import session as ort_config
    from trtbuild.runtime.engine_dir import load

    engine_dir = load(engine)
    step = onnx.load(engine_dir.rank_file(0, "cpu_onnx"), load_external_data=False)
    decode = next(a.g for a in step.graph.node[0].attribute if a.name == "then_branch")
    inlined = onnx.ModelProto()
    inlined.CopyFrom(step)
    del inlined.graph.node[:]
    for node in decode.node:  # the branch's outputs are tagged "decode/…": untag them
        copy = inlined.graph.node.add()
        copy.CopyFrom(node)
        for i, name in enumerate(copy.output):
            copy.output[i] = name.removeprefix("decode/")
    inlined.graph.node.extend(step.graph.node[1:])
    inlined.graph.initializer.extend(decode.initializer)
    read = {name for node in inlined.graph.node for name in node.input}
    inputs = [i for i in inlined.graph.input if i.name in read]
    del inlined.graph.input[:]
    inlined.graph.input.extend(inputs)
    bare = onnx.ModelProto()
    bare.CopyFrom(inlined)
    del bare.graph.node[len(decode.node):]
    outputs = [o for o in bare.graph.output if not o.name.startswith("next_")]
    del bare.graph.output[:]
    bare.graph.output.extend(outputs)
    sessions = {name: ort_config.session(model, 1, engine, ort_config.Spinning.never, engine_dir.cpu_activations)
                for name, model in (("step model", step), ("decode graph inlined", inlined),
                                    ("inlined, no next inputs", bare))}
    genai_options = ort.SessionOptions()
    genai_options.intra_op_num_threads = 1
    genai_options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    sessions["genai model.onnx"] = ort.InferenceSession(str(genai / "model.onnx"), genai_options,
                                                        providers=["CPUExecutionProvider"])
    rng, held = np.random.default_rng(0), []

    def cache(name: str, shape: tuple, binding) -> None:
        buffer = rng.standard_normal(shape).astype(np.float32)
        held.append(buffer)
        value = ort.OrtValue.ortvalue_from_numpy(buffer)
        binding.bind_ortvalue_input(name, value)
        binding.bind_ortvalue_output(name.replace("past_key_values", "present").replace("past_", "present_"), value)

    kv = (engine_dir.manifest["model"]["num_kv_heads"], engine_dir.max_seq_len, engine_dir.manifest["model"]["head_dim"])
    runs = {}
    for name, session in sessions.items():
        binding = session.io_binding()
        for i in session.get_inputs():
            dtype = np.int32 if "int32" in i.type else np.int64
            if i.name.startswith("past_"):
                cache(i.name, (batch, *kv), binding)
            elif name.startswith("genai"):
                shape = (batch, 1) if i.name == "input_ids" else (batch, FILLED + 1)
                binding.bind_cpu_input(i.name, np.full(shape, 5 if i.name == "input_ids" else 1, dtype))
            else:
                binding.bind_cpu_input(i.name, {
                    "input_ids": np.full((batch, 1), 5, dtype), "position_ids": np.full((batch, 1), FILLED, dtype),
                    "write_index": np.full(batch, FILLED, dtype), "kv_length": np.full(batch, FILLED + 1, dtype),
                    "attention_mask": np.ones((batch, 1, 1, kv[1]), bool), "logits_index": np.zeros((batch, 1), dtype),
                    "plain_decode": np.array(True), "tree_verify": np.array(False), "draft_heads": np.array(False),
                }[i.name])
        for o in session.get_outputs():
            if not o.name.startswith("present"):
                binding.bind_output(o.name)

        def run(seed: int, session=session, binding=binding) -> float:
            begin = time.process_time()
            for _ in range(20):
                session.run_with_iobinding(binding)
            return (time.process_time() - begin) / 20 * 1e3
        run(0)
        runs[name] = run
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("engines", type=Path, nargs="+", help="trtbuild engine dirs")
    ap.add_argument("--genai", type=Path, required=True, help="an onnxruntime-genai model dir (the reference)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--graph", action="store_true", help="the decode graph alone (the first engine), not the loop")
    args = ap.parse_args()
    vocab = json.loads((args.engines[0] / "manifest.json").read_text())["model"]["vocab_size"]
    if args.graph:
        runs = graph_runs(args.engines[0], args.genai, args.batch)
    else:
        runs = {str(path): trtbuild_loop(path, args.batch, vocab) for path in args.engines}
        runs["onnxruntime-genai"] = genai_loop(args.genai, args.batch, vocab)
        for run in runs.values():
            run(99)  # warm-up
    names, reference = list(runs), list(runs)[-1]
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            samples[name].append(runs[name](r))
    print(f"batch {args.batch}, 1 intra-op thread, {args.rounds} rounds; CPU ms per "
          f"{'run' if args.graph else 'decoded token'}, and / {reference} in the same round (median [range])")
    for name in names:
        ratios = [a / b for a, b in zip(samples[name], samples[reference])]
        print(f"  {name:60s} {statistics.median(samples[name]):8.3f}   {statistics.median(ratios):.3f} "
              f"[{min(ratios):.3f}..{max(ratios):.3f}]")


if __name__ == "__main__":
    main()

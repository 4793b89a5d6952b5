#!/usr/bin/env python3
"""CPU decode speed of the ONNX Runtime backend, side by side with onnxruntime-genai, and where a
decode step's time goes.

    python benchmarks/cpu_decode.py [--fp32-dir DIR] [--int4-dir DIR] [--int4-a8-dir DIR] [--repeats 3]
                                    [--no-genai] [--no-llama-cpp] [--json]

Engines: specs/tiny-code.yaml (fp32) and the same with int4 GPTQ, group 128 (float
activations), and once more with ``quantization.cpu_activations: int8`` and lm_head quantized too
(``exclude: []``), as onnxruntime-genai's int4 models have it (built into a temporary dir unless
given). Each engine at batch 1 and 8: random 64-token prompts (seeded), 128
greedy tokens; decode tok/s = the median over decode steps of the tokens a step made / its time,
and the batch-1 prefill time (to each row's first token); the median of --repeats rounds of each.
Ratios against a peer pair the two engines within each round (they run back to back, who goes
first rotating) and report the median and range of those per-round ratios.

With onnxruntime-genai installed (`pip install -e ".[bench]"`), its model builder converts the
same checkpoint in this run, measured the same way (every engine in a process of its own, the
engines taking turns --repeats times; its steps decode each new token to text with its
TokenizerStream, as ours do): fp32; int4 block 128 at accuracy level 1
(float activations, like ours) and at its CPU default, level 4 (int8 activations). Perplexity of
each int4 model on the bundled held-out text (4096 tokens) shows whether activations were
quantized. Compare within one run: figures move ±20 % between runs on a shared 2-core machine.

With llama-cpp-python installed, llama.cpp at batch 1 and 8 (its C API: benchmarks/llama_cpp_decode.py) on an
f16 GGUF of the same checkpoint (benchmarks/gguf_export.py), each token detokenized, in the same
rotation.

trtbuild rows run multi-step decoding as the spec's runtime.multi_step says (default 8 greedy
steps back to back, runtime/llm.py); "--multi-step 1" is the fp32 engine with a scheduler step
per token, as before it.

Then the time of each decoded token at batch 1 and 8: the step loop outside the engine
(scheduler, sampling, detokenization), the engine's host side (step arrays, bindings, argmax
feeding) and ONNX Runtime's run, with multi-step runs and without; the same with ONNX Runtime's
workers sleeping between ops, and with the rank graph instead of the CPU decode graph
(rank0.cpu.onnx, made by the build's CPU stage) — each a before/after in the same run, each configuration in a
process of its own; the first ONNX Runtime run of a multi-step run (after the step's Python)
against the later ones; and ONNX Runtime's profile by op type and by node (a node of every layer summed).
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
CHECKPOINT = REPO / "models" / "tiny-code"
sys.path.insert(0, str(REPO / "benchmarks"))
from trtbuild.builder.progress import table as format_table  # noqa: E402

PROMPT_LEN, NEW_TOKENS = 64, 128
FP32 = "trtbuild fp32"
FP32_SINGLE = "trtbuild fp32, --multi-step 1"
INT4 = "trtbuild int4 gptq g128 (float activations)"
INT4_A8 = "trtbuild int4 gptq g128 + lm_head, cpu_activations: int8"
GENAI_FP32 = "onnxruntime-genai fp32"
GENAI_INT4 = "onnxruntime-genai int4 rtn b128, accuracy 1 (float activations)"
GENAI_INT4_A8 = "onnxruntime-genai int4 rtn b128, accuracy 4 (int8 activations, its CPU default)"
LLAMA_CPP = "llama.cpp f16 (llama-cpp-python)"


def build(out: Path, quantization: dict | None, workdir: Path, spec: Path = REPO / "specs" / "tiny-code.yaml",
          checkpoint: Path = CHECKPOINT) -> dict:
    """``spec`` with model.checkpoint set to ``checkpoint`` (a dir or a .gguf) and ``quantization``
    (none: the spec's own) built into ``out``; the build's --json summary (stages, process peaks)."""
    import yaml

    spec_fields = yaml.safe_load(spec.read_text())
    spec_fields["model"]["checkpoint"] = str(checkpoint)
    if quantization:
        spec_fields["quantization"] = quantization
    path = workdir / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(spec_fields))
    done = subprocess.run([sys.executable, "-m", "trtbuild.cli", "build", str(path), "-o", str(out),
                           "--log-level", "error", "--json"], check=True, capture_output=True, text=True)
    return json.loads(done.stdout)


def gptq_int4(workdir: Path, int8_activations: bool = False) -> dict:
    """The quantization benchmark's int4 GPTQ g128; with ``int8_activations`` also lm_head
    quantized, as in onnxruntime-genai's int4 models, the row it is compared with."""
    from quantization import calibration_text  # the quantization benchmark's calibration text

    extra = {"cpu_activations": "int8", "exclude": []} if int8_activations else {}
    return {"mode": "int4_weight_only", "algorithm": "gptq", "group_size": 128, **extra,
            "calibration": {"data": [str(calibration_text(workdir / "calibration.txt"))]}}


def prompts(batch: int, seed: int, vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(4, vocab, size=(batch, PROMPT_LEN)).tolist()


# -- trtbuild ---------------------------------------------------------------------------------

def trtbuild_run(llm, batch: int, seed: int) -> tuple[float, float]:
    """(decode tok/s, prefill s): the median over decode steps of the tokens a step made / its
    time (an LLM step makes each row one token, or up to --multi-step of them in a greedy run;
    the median shrugs off a step a neighbour process delayed)."""
    from trtbuild.runtime.core.sampling import SamplingParams

    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    rids = {llm.submit(p, params) for p in prompts(batch, seed, llm.engine_dir.vocab_size)}
    start, started = time.perf_counter(), set()
    while started != rids:  # prefill: until every row has its first token
        deltas, _ = llm.step()
        started |= {d.rid for d in deltas}
    prefill, rates = time.perf_counter() - start, []
    while llm.has_work():
        begin = time.perf_counter()
        deltas, _ = llm.step()
        rates.append(sum(d.token_id >= 0 for d in deltas) / (time.perf_counter() - begin))
    return statistics.median(rates), prefill


def trtbuild_measure(engine: Path, threads: int, seed: int, multi_step: int | None) -> dict:
    from trtbuild.runtime.llm import LLM

    # Plain decoding, as the peers decode: an engine dir's draft sources (specs/smollm2-135m.yaml has
    # prompt lookup and suffix) are benchmarks/speculation.py's subject.
    llm = LLM(engine, backend="onnxruntime", threads=threads, prefix_cache=False, multi_step=multi_step,
              speculation=())
    trtbuild_run(llm, 1, seed=99)  # warm-up
    return {str(batch): trtbuild_run(llm, batch, seed) for batch in (1, 8)}


EVAL_TOKENS, EVAL_CONTEXT = 4096, 512  # trtbuild eval's windows (runtime/evaluate.py)


def trtbuild_perplexity(engine: Path, threads: int) -> float:
    from trtbuild.runtime.evaluate import evaluate

    return evaluate(engine, CHECKPOINT / "heldout.txt", EVAL_CONTEXT, EVAL_TOKENS, threads=threads).perplexity


# -- onnxruntime-genai ------------------------------------------------------------------------

def genai_build(out: Path, precision: str, threads: int, accuracy_level: int | None = None,
                checkpoint: Path = CHECKPOINT) -> Path:
    """onnxruntime-genai's model builder on ``checkpoint`` (a Hugging Face dir); ``accuracy_level``
    with block 128, else its defaults."""
    extra = ["--extra_options", f"accuracy_level={accuracy_level}", "block_size=128"] if accuracy_level else []
    subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(checkpoint), "-o", str(out),
                    "-p", precision, "-e", "cpu", "-c", str(out.parent / "cache"), *extra],
                   check=True, capture_output=True)
    config_path = out / "genai_config.json"
    config = json.loads(config_path.read_text())
    config["model"]["decoder"].setdefault("session_options", {})["intra_op_num_threads"] = threads
    config_path.write_text(json.dumps(config, indent=2))
    return out


def genai_run(model, tokenizer, batch: int, seed: int, vocab: int) -> tuple[float, float]:
    """As trtbuild_run; each step also decodes every row's new token to text with genai's
    TokenizerStream (as its streaming examples do), since a trtbuild step makes the text too."""
    import onnxruntime_genai as og

    params = og.GeneratorParams(model)
    params.set_search_options(max_length=PROMPT_LEN + NEW_TOKENS, batch_size=batch, do_sample=False)
    generator = og.Generator(model, params)
    streams = [tokenizer.create_stream() for _ in range(batch)]
    start = time.perf_counter()
    generator.append_tokens(np.asarray(prompts(batch, seed, vocab), np.int32))
    generator.generate_next_token()  # each row's first token, from the prefill's logits
    for stream, token in zip(streams, generator.get_next_tokens()):
        stream.decode(int(token))
    prefill, steps = time.perf_counter() - start, []
    while not generator.is_done():
        begin = time.perf_counter()
        generator.generate_next_token()
        for stream, token in zip(streams, generator.get_next_tokens()):
            stream.decode(int(token))
        steps.append(time.perf_counter() - begin)
    return batch / statistics.median(steps), prefill


def genai_measure(path: Path, seed: int, vocab: int) -> dict:
    import onnxruntime_genai as og

    model = og.Model(str(path))
    tokenizer = og.Tokenizer(model)
    genai_run(model, tokenizer, 1, 99, vocab)  # warm-up
    return {str(batch): genai_run(model, tokenizer, batch, seed, vocab) for batch in (1, 8)}


# -- llama.cpp (llama-cpp-python) --------------------------------------------------------------

def llama_cpp_measure(path: Path, threads: int, seed: int, vocab: int) -> dict:
    """Batch 1 and 8 through llama.cpp's C API (benchmarks/llama_cpp_decode.py), a context each."""
    from llama_cpp_decode import LlamaCpp

    figures = {}
    for batch in (1, 8):
        llm = LlamaCpp(path, threads, batch, PROMPT_LEN, NEW_TOKENS)
        try:
            llm.run(prompts(batch, 99, vocab), NEW_TOKENS)  # warm-up
            figures[str(batch)] = llm.run(prompts(batch, seed, vocab), NEW_TOKENS)
        finally:
            llm.close()
    return figures


def measure(engines: dict[str, tuple[str, Path]], blocks: list[list[str]], threads: int, repeats: int,
            vocab: int) -> dict[str, dict]:
    """Each engine in a process of its own (ONNX Runtime thread pools left spinning by one
    engine would slow the next), ``repeats`` rounds; in a round the engines of a block (ours and
    the peer it is compared with) run one right after the other, who goes first rotating, so a
    slow spell of the shared machine hits both sides of a ratio alike. Per engine and batch the
    samples in round order (one a round: ratios pair them), and batch-1 prefill ms."""
    samples: dict[str, dict] = {name: {1: [], 8: [], "prefill_ms": []} for name in engines}
    for seed in range(repeats):
        for block in blocks:
            for name in block[seed % len(block):] + block[:seed % len(block)]:
                kind, path = engines[name]
                out = subprocess.run([sys.executable, __file__, "--one", kind, str(path), "--threads", str(threads),
                                      "--seed", str(seed), "--vocab", str(vocab)],
                                     check=True, capture_output=True, text=True).stdout
                figures = json.loads(out.strip().splitlines()[-1])
                for batch in (1, 8):
                    samples[name][batch].append(figures[str(batch)][0])
                samples[name]["prefill_ms"].append(figures["1"][1] * 1e3)
    return samples


def medians(samples: dict[str, dict]) -> dict[str, dict]:
    return {name: {key: statistics.median(values) if values else None for key, values in s.items()}
            for name, s in samples.items()}


def paired_ratio(samples: dict[str, dict], ours: str, theirs: str, batch: int) -> tuple[float, float, float]:
    """(median, lowest, highest) over rounds of ours / theirs tok/s, each from the same round."""
    ratios = [a / b for a, b in zip(samples[ours][batch], samples[theirs][batch])]
    return statistics.median(ratios), min(ratios), max(ratios)


def genai_perplexity(path: Path, threads: int) -> float:
    """Perplexity of the genai model's ONNX graph over trtbuild eval's windows, in ONNX Runtime."""
    import onnxruntime as ort
    from tokenizers import Tokenizer

    from trtbuild.runtime.evaluate import windows

    ids = Tokenizer.from_file(str(CHECKPOINT / "tokenizer.json")).encode((CHECKPOINT / "heldout.txt").read_text()).ids
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    session = ort.InferenceSession(str(path / "model.onnx"), options, providers=["CPUExecutionProvider"])
    config = json.loads((path / "genai_config.json").read_text())["model"]["decoder"]
    heads, head_dim = config["num_key_value_heads"], config["head_size"]
    nll, count = 0.0, 0
    for window in windows(ids, EVAL_CONTEXT, EVAL_TOKENS):
        tokens, targets = window[None, :-1], window[1:]
        feeds = {"input_ids": tokens, "attention_mask": np.ones_like(tokens)}
        for info in session.get_inputs():
            if info.name == "position_ids":
                feeds["position_ids"] = np.arange(tokens.shape[1], dtype=np.int64)[None]
            elif info.name.startswith("past_key_values"):
                dtype = np.float16 if "float16" in info.type else np.float32
                feeds[info.name] = np.zeros((1, heads, 0, head_dim), dtype)
        logits = session.run(["logits"], feeds)[0][0].astype(np.float64)  # [C, V]
        top = logits.max(axis=-1, keepdims=True)
        logz = top[:, 0] + np.log(np.exp(logits - top).sum(axis=-1))
        nll += float((logz - logits[np.arange(len(targets)), targets]).sum())
        count += len(targets)
    return float(np.exp(nll / count))


# -- where a decode step's time goes ----------------------------------------------------------

# The breakdown's configurations: LLM/engine options, each the state before one change.
BREAKDOWN = {"multi_step": {}, "single_step": {"multi_step": 1}, "sleeping": {"spinning": "never"},
             "rank_graph": {"use_decode_graph": False}}


def breakdown_one(engine: Path, threads: int, batch: int, config: str, profile: Path | None = None) -> dict:
    """In this process, one BREAKDOWN configuration at ``batch``: per decoded token of every row
    (ms, medians over LLM steps that only decode) the step loop outside the engine, the engine's
    host side and ONNX Runtime's run; with ``profile`` (a file prefix), ONNX Runtime's profile of
    the same steps summed by op type instead."""
    import onnxruntime as ort

    from trtbuild.plugins.onnxruntime import session as ort_config
    from trtbuild.plugins.onnxruntime.int8_gemm import needs_float_gemms
    from trtbuild.plugins.onnxruntime.session import Spinning
    from trtbuild.runtime.engine_dir import load
    from trtbuild.runtime.llm import LLM
    from trtbuild.runtime.backends.onnxruntime.step_graph import cpu_graph
    from trtbuild.runtime.backends.onnxruntime.engine import OnnxRuntimeEngine
    from trtbuild.runtime.core.sampling import SamplingParams

    options = BREAKDOWN[config]
    spinning, use_decode_graph = Spinning(options.get("spinning", "always")), options.get("use_decode_graph", True)
    llm = LLM(engine, backend="onnxruntime", prefix_cache=False, multi_step=options.get("multi_step"), speculation=(),
              engine=OnnxRuntimeEngine(load(engine), threads=threads, spinning=spinning,
                                       use_decode_graph=use_decode_graph))
    session = llm.engine.session
    if profile is not None:  # the same graph, in a session that profiles
        source, _ = cpu_graph(llm.engine_dir, 0, use_decode_graph)
        session_options = ort_config.session_options(threads, llm.engine_dir.rank_file(0, "onnx").parent, spinning,
                                                     llm.engine_dir.cpu_activations, needs_float_gemms(source))
        session_options.enable_profiling, session_options.profile_file_prefix = True, str(profile)
        session = llm.engine.session = ort.InferenceSession(source, session_options,
                                                            providers=["CPUExecutionProvider"])
    run, runs = session.run_with_iobinding, []  # seconds of each ONNX Runtime run in an LLM step

    def timed(binding, *args):
        begin = time.perf_counter()
        run(binding, *args)
        runs.append(time.perf_counter() - begin)

    session.run_with_iobinding = timed

    def measure() -> dict:
        params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
        for p in prompts(batch, 7, llm.engine_dir.vocab_size):
            llm.submit(p, params)
        rows: dict[str, list[float]] = {"loop": [], "engine": [], "run": [], "first_run": [], "later_run": []}
        while llm.has_work():
            stats = llm.stats
            before = (stats.loop_s, stats.engine_s, stats.prefill_steps, stats.decode_steps)
            runs.clear()
            llm.step()
            steps = stats.decode_steps - before[3]
            if stats.prefill_steps == before[2] and steps:  # decode only
                rows["loop"].append((stats.loop_s - before[0]) / steps)
                rows["engine"].append((stats.engine_s - before[1]) / steps)
                rows["run"].append(sum(runs) / steps)
                if len(runs) > 1:  # a multi-step run: its first run comes after the step's Python
                    rows["first_run"].append(runs[0])
                    rows["later_run"].append(statistics.mean(runs[1:]))
        return {f"{k}_ms": statistics.median(v) * 1e3 if v else None for k, v in rows.items()}

    if profile is None:
        measure()  # warm-up
        return {**measure(), "steps": llm.multi_step}
    measure()  # warm-up: the first steps fault in the pools' pages (2 s of a first batch-8 prefill)
    measure()
    trace = json.loads(Path(session.end_profiling()).read_text())
    runs: dict[tuple[str, str], list[float]] = defaultdict(list)  # (node, op) → ms of each run, in order
    for event in trace:
        # The If choosing the decode graph spans its ops: count the ops, not the If.
        if (event.get("cat") == "Node" and event["name"].endswith("_kernel_time")
                and event["args"]["op_name"] != "If"):
            runs[(event["name"][:-len("_kernel_time")], event["args"]["op_name"])].append(event["dur"] / 1e3)
    by_op: dict[str, float] = defaultdict(float)
    by_node: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])  # node family → [ms, runs]
    for (name, op), times in runs.items():
        measured = times[len(times) // 2:]  # the two passes ran the same steps: the second's
        by_op[op] += sum(measured)
        # One family for a node of every layer (layers.3/mlp/up_proj → layers.N/mlp/up_proj).
        family = by_node[re.sub(r"layers\.\d+", "layers.N", name)]
        family[0] += sum(measured)
        family[1] += len(measured)
    total = sum(by_op.values())
    top = sorted(by_node.items(), key=lambda kv: -kv[1][0])[:12]
    return {"ops": {op: ms / total for op, ms in sorted(by_op.items(), key=lambda kv: -kv[1])},
            "nodes": {name: {"share": ms / total, "us_per_run": ms / count * 1e3} for name, (ms, count) in top}}


def breakdown(engine: Path, threads: int, batch: int, workdir: Path, repeats: int) -> dict:
    """Where a decoded token's time goes: breakdown_one for each BREAKDOWN configuration, with the
    default multi-step runs and with --multi-step 1 (a scheduler step per token: before); the same
    with ONNX Runtime's workers sleeping between ops, and with decode steps on the rank graph
    instead of the CPU decode graph (each the configuration before); then the profile by op. The
    configurations take turns ``repeats`` times, each in a process of its own (a spinning pool
    left behind by one would slow the next for tens of milliseconds)."""
    def one(*extra: str) -> dict:
        out = subprocess.run([sys.executable, __file__, "--one", "breakdown", str(engine), "--threads", str(threads),
                              "--batch", str(batch), *extra], check=True, capture_output=True, text=True).stdout
        return json.loads(out.strip().splitlines()[-1])

    results: dict[str, list[dict]] = {name: [] for name in BREAKDOWN}
    for _ in range(repeats):
        for name in BREAKDOWN:
            results[name].append(one("--config", name))
    figures = {name: {key: statistics.median(r[key] for r in results[name]) for key, value in results[name][0].items()
                      if value is not None}  # single steps have no first and later runs
               for name in ("multi_step", "single_step")}
    figures["sleeping_loop_ms"] = statistics.median(r["loop_ms"] for r in results["sleeping"])
    figures["rank_graph_loop_ms"] = statistics.median(r["loop_ms"] for r in results["rank_graph"])
    profile = one("--config", "multi_step", "--profile", str(workdir / f"profile-b{batch}"))
    figures["ops"], figures["nodes"] = profile["ops"], profile["nodes"]
    return figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fp32-dir", type=Path, help="engine dir of specs/tiny-code.yaml (default: build one)")
    ap.add_argument("--int4-dir", type=Path, help="the same with int4 GPTQ g128 (default: build one)")
    ap.add_argument("--int4-a8-dir", type=Path, help="the same with lm_head too and quantization.cpu_activations: "
                                                     "int8 (default: build one)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-genai", action="store_true", help="skip onnxruntime-genai even if installed")
    ap.add_argument("--no-llama-cpp", action="store_true", help="skip llama.cpp even if llama-cpp-python is installed")
    ap.add_argument("--json", action="store_true")
    # One measurement in this process (the parent runs each engine in a process of its own).
    ap.add_argument("--one", nargs=2, metavar=("KIND", "PATH"), help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--vocab", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--config", choices=sorted(BREAKDOWN), default="multi_step", help=argparse.SUPPRESS)
    ap.add_argument("--profile", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        kind, path = args.one[0], Path(args.one[1])
        figures = (breakdown_one(path, args.threads, args.batch, args.config, args.profile) if kind == "breakdown" else
                   trtbuild_measure(path, args.threads, args.seed, None) if kind == "trtbuild" else
                   trtbuild_measure(path, args.threads, args.seed, 1) if kind == "trtbuild-single" else
                   genai_measure(path, args.seed, args.vocab) if kind == "genai" else
                   llama_cpp_measure(path, args.threads, args.seed, args.vocab))
        print(json.dumps(figures))
        return
    try:
        import onnxruntime_genai  # noqa: F401
        genai = not args.no_genai
    except ImportError:
        genai = False
        print("onnxruntime-genai not installed (pip install -e \".[bench]\"): no genai rows", file=sys.stderr)
    try:
        import llama_cpp  # noqa: F401
        llama = not args.no_llama_cpp
    except ImportError:
        llama = False
        print("llama-cpp-python not installed (pip install llama-cpp-python: it compiles llama.cpp, minutes): "
              "no llama.cpp row", file=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        fp32 = args.fp32_dir or Path(build(work / "fp32", None, work)["out"])
        int4 = args.int4_dir or Path(build(work / "int4-gptq-g128", gptq_int4(work), work)["out"])
        int4_a8 = args.int4_a8_dir or Path(build(work / "int4-gptq-g128-a8", gptq_int4(work, int8_activations=True),
                                                 work)["out"])
        vocab = json.loads((fp32 / "manifest.json").read_text())["model"]["vocab_size"]
        engines = {FP32: ("trtbuild", fp32), FP32_SINGLE: ("trtbuild-single", fp32),
                   INT4: ("trtbuild", int4), INT4_A8: ("trtbuild", int4_a8)}
        perplexity = {name: trtbuild_perplexity(engines[name][1], args.threads) for name in (INT4, INT4_A8)}
        if genai:
            models = {GENAI_FP32: genai_build(work / "genai-fp32", "fp32", args.threads),
                      GENAI_INT4: genai_build(work / "genai-int4-l1", "int4", args.threads, accuracy_level=1),
                      GENAI_INT4_A8: genai_build(work / "genai-int4-l4", "int4", args.threads, accuracy_level=4)}
            engines.update({name: ("genai", path) for name, path in models.items()})
            perplexity.update({name: genai_perplexity(path, args.threads) for name, path in models.items()
                               if "int4" in name})
        if llama:
            from gguf_export import export

            engines[LLAMA_CPP] = ("llama.cpp", export(CHECKPOINT, work / "tiny-code-f16.gguf", "f16"))
        blocks = [[name for name in block if name in engines] for block in
                  ([FP32, FP32_SINGLE, GENAI_FP32], [INT4, GENAI_INT4], [INT4_A8, GENAI_INT4_A8],
                   [LLAMA_CPP])]
        samples = measure(engines, [b for b in blocks if b], args.threads, args.repeats, vocab)
        figures = medians(samples)
        rows = [(name, figures[name], perplexity.get(name)) for name in engines]
        steps = {batch: breakdown(fp32, args.threads, batch, work, args.repeats) for batch in (1, 8)}
    comparisons = [(ours, theirs, label) for ours, theirs, label in (
        (FP32, GENAI_FP32, "fp32"), (FP32_SINGLE, GENAI_FP32, "fp32, --multi-step 1"),
        (INT4, GENAI_INT4, "int4, float activations"), (INT4_A8, GENAI_INT4_A8, "int4, int8 activations"),
        (FP32, LLAMA_CPP, "fp32 vs llama.cpp f16")) if theirs in engines]
    ratios = {label: {batch: paired_ratio(samples, ours, theirs, batch) for batch in (1, 8) if samples[theirs][batch]}
              for ours, theirs, label in comparisons}
    if args.json:
        print(json.dumps({"rows": [{"engine": n, **r, "perplexity": p} for n, r, p in rows], "ratios": ratios,
                          "breakdown": steps}, indent=2, default=str))
        return
    table = [[name, f"{r[1]:.0f}", "—" if r[8] is None else f"{r[8]:.0f}", f"{r['prefill_ms']:.1f}",
              "" if p is None else f"{p:.3f}"] for name, r, p in rows]
    print(f"decode tok/s ({PROMPT_LEN}-token random prompts, {NEW_TOKENS} greedy tokens, median of "
          f"{args.repeats}, {args.threads} threads)")
    print(format_table(table, ["engine", "batch 1 tok/s", "batch 8 tok/s", "prefill 64 ms (b1)", "perplexity"]))
    if ratios:
        print(f"\ntrtbuild / peer, tok/s: the median over the {args.repeats} rounds of the ratio within a round "
              "(the two ran back to back), and its range")
        for label, by_batch in ratios.items():
            print(f"  {label}: " + ", ".join(f"{m:.2f}x at batch {b} ({lo:.2f}–{hi:.2f})"
                                              for b, (m, lo, hi) in by_batch.items()))
    print("\nwhere a decoded token's time goes (trtbuild fp32, ms per token of each row; with the spec's "
          "runtime.multi_step, and 1 as before it)")
    print(format_table([[str(b), label, f"{t['loop_ms']:.3f}", f"{t['loop_ms'] - t['engine_ms']:.3f}",
                         f"{t['engine_ms'] - t['run_ms']:.3f}", f"{t['run_ms']:.3f}"]
                        for b, s in steps.items()
                        for label, t in ((str(s["multi_step"]["steps"]), s["multi_step"]), ("1", s["single_step"]))],
                       ["batch", "multi-step", "per token", "loop outside engine", "engine host side",
                        "onnxruntime run"]))
    for b, s in steps.items():
        t = s["multi_step"]
        print(f"batch {b}: in a multi-step run the first ONNX Runtime run (after the step's Python) takes "
              f"{t['first_run_ms']:.3f} ms, the later ones {t['later_run_ms']:.3f} ms")
    for b, s in steps.items():
        base = s["multi_step"]["loop_ms"]
        print(f"batch {b}: workers sleeping between ops {s['sleeping_loop_ms'] / base:.2f}x, rank graph "
              f"instead of the decode graph {s['rank_graph_loop_ms'] / base:.2f}x the time per token")
    for b, s in steps.items():
        top = ", ".join(f"{op} {share * 100:.0f} %" for op, share in list(s["ops"].items())[:6])
        print(f"onnxruntime ops at batch {b}: {top}")
        nodes = ", ".join(f"{name} {n['share'] * 100:.0f} % ({n['us_per_run']:.0f} us)"
                          for name, n in list(s["nodes"].items())[:6])
        print(f"onnxruntime nodes at batch {b} (share, time per run): {nodes}")


if __name__ == "__main__":
    main()

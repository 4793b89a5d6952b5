#!/usr/bin/env python3
"""Load benchmark of ``trtbuild serve`` (guidellm over loopback) against ``LLM`` offline on the
same workload, in the same run.

    python benchmarks/serve_load.py build/tiny-code --plot serve_load.png \\
        [--guidellm .loadgen-venv/bin/guidellm] [--concurrency 1,2,4,8] [--requests 24] \\
        [--prompt-tokens 64] [--output-tokens 64]

The load generator is guidellm (https://github.com/vllm-project/guidellm), installed in a venv of
its own because it pins another torch than this project's:

    python3 -m venv .loadgen-venv && .loadgen-venv/bin/pip install guidellm

Why guidellm and not ``vllm bench serve``: both drive an OpenAI server with a concurrency sweep
and report TTFT and inter-token latency percentiles, but ``vllm bench serve`` needs the whole of
vLLM importable (its CUDA build of torch, its kernels: gigabytes, and no CPU wheel on PyPI),
while guidellm is a plain HTTP client that installs from PyPI and runs here. Its JSON report
keeps every request's body, so the offline side replays exactly the prompts it sent.

What runs, in order:
  1. ``trtbuild serve ENGINE_DIR`` on 127.0.0.1, port 0 (ONNX Runtime backend), one warm-up request;
  2. ``guidellm run``: the concurrent profile at each --concurrency (closed loop: that many
     requests in flight), --requests per level, synthetic prompts of --prompt-tokens tokens (the
     engine dir's tokenizer), ``ignore_eos`` so each request generates exactly --output-tokens;
  3. right after each level, with the server idle, ``LLM`` (same engine dir and backend) replays
     that level's prompts in process with the same cap on requests in flight (interleaved so that
     both sides see the same load from whatever else runs on the machine).
Where they run: by default the server and the offline ``LLM`` get the first half of this
process's CPUs and guidellm the other half (--engine-cpus / --loadgen-cpus; 'all' pins
nothing), and ONNX Runtime gets as many threads as the engine side has CPUs. guidellm parsing
the streams costs about a core at 8 in flight on the bundled model; on shared cores that came
out of the server's share while the offline run had the whole machine (the overhead read +57 to
+67 % on 2 cores, most of it the load generator's), so both sides run their engine on the same
CPUs and the load generator on others.

The table gives, per concurrency, guidellm's p50/p99 TTFT and inter-token latency, total tokens/s
(prompt + generated, first request sent to last answered) through the server and offline, and the
server's overhead: 1 - server / offline tokens/s (goal at saturation, the engine's batch size:
<= 10 %); and the CPU time each side spends per token (the server process's user + system time,
all its threads; the offline process's around its replay). The last columns give the cores each
side used (CPU seconds over wall time; guidellm's with the worker processes it sends requests
from). The server's and guidellm's CPU times are sampled from /proc every 50 ms and counted
between the level's first request's start and its last one's end; then the milliseconds a
step spends inside the engine on each side (the server's from its /metrics totals, offline's from
``LLM.stats``). The plot (PNG) goes to --plot.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
from trtbuild.builder.progress import table as format_table  # noqa: E402

MODEL_NAME = "tiny"


def pinned(command: list[str], cpus: set[int] | None) -> list[str]:
    """``command`` confined (with every process it starts) to ``cpus``, by taskset."""
    return command if cpus is None else ["taskset", "-c", ",".join(map(str, sorted(cpus))), *command]


@contextlib.contextmanager
def on_cpus(cpus: set[int] | None):
    """This thread runs on ``cpus`` meanwhile."""
    before = os.sched_getaffinity(0)
    if cpus is not None:
        os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def start_server(engine_dir: Path, log: Path, cpus: set[int] | None, threads: int) -> tuple[subprocess.Popen, str]:
    command = [sys.executable, "-m", "trtbuild.cli", "serve", str(engine_dir), "--port", "0",
               "--model-name", MODEL_NAME, "--backend", "onnxruntime", "--max-queue", "256",
               "--threads", str(threads)]
    with open(log, "w") as sink:
        proc = subprocess.Popen(pinned(command, cpus), stdout=subprocess.DEVNULL, stderr=sink)
    deadline = time.monotonic() + 120
    while not (found := re.search(r"on http://127\.0\.0\.1:(\d+)", log.read_text())):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"error: the server did not start:\n{log.read_text()}")
        time.sleep(0.1)
    return proc, f"http://127.0.0.1:{found.group(1)}"


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def run_guidellm(guidellm: str, base: str, concurrency: int, args, report: Path, cpus: set[int] | None,
                 server_pid: int) -> dict:
    """One concurrency level (guidellm's concurrent profile), its JSON report's benchmark, and
    CPU-time samples of guidellm and of the server."""
    command = [guidellm, "run",
               "--backend", f"kind=openai_http,target={base},model={MODEL_NAME},request_format=/v1/completions",
               "--tokenizer", f"kind=huggingface_auto,model={REPO / 'models' / 'tiny-code'}",
               "--data", f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},output_tokens={args.output_tokens}",
               "--profile", f"kind=concurrent,streams={concurrency}",
               "--constraint", f"kind=max_requests,count={args.requests}",
               "--output", f"kind=json,path={report}", "--disable-console"]
    report.unlink(missing_ok=True)
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(pinned(command, cpus), stdout=out, stderr=subprocess.STDOUT, cwd=report.parent)
        # (time.time(), CPU seconds of guidellm and every process it started (it sends its requests
        # from worker processes), the server's CPU seconds): each side's share of the cores between
        # the level's first request and its last answer, not guidellm's start-up and report.
        samples, seen = [], {}
        with on_cpus(cpus):  # the sampling costs CPU: not on the server's
            while proc.poll() is None:
                samples.append((time.time(), tree_cpu_seconds(proc.pid, seen), cpu_seconds(server_pid)))
                time.sleep(0.05)
        proc.wait()
        if proc.returncode != 0 or not report.is_file():
            out.seek(0)
            raise SystemExit(f"error: guidellm failed ({proc.returncode}):\n{out.read()[-6000:]}")
    return {**json.loads(report.read_text())["benchmarks"][0], "cpu_samples": samples}


def cpu_between(samples: list[tuple], column: int, start: float, end: float) -> float:
    """CPU seconds a sampled process spent between two times (linear between samples)."""
    import numpy as np

    times, cpu = np.array([s[0] for s in samples]), np.array([s[column] for s in samples])
    return float(np.interp(end, times, cpu) - np.interp(start, times, cpu))


def server_level(benchmark: dict) -> dict:
    """One concurrency level of guidellm's report: its latency percentiles, our throughput figure
    from its per-request timings, and the prompts it sent (in the order it sent them)."""
    metrics, requests = benchmark["metrics"], benchmark["requests"]["successful"]
    percentile = lambda name, p: metrics[name]["successful"]["percentiles"][p]  # noqa: E731
    wall = max(r["request_end_time"] for r in requests) - min(r["request_start_time"] for r in requests)
    ordered = sorted(requests, key=lambda r: r["request_start_time"])
    start, end = min(r["request_start_time"] for r in requests), max(r["request_end_time"] for r in requests)
    return {"concurrency": benchmark["config"]["strategy"]["streams"], "requests": len(requests),
            "loadgen_cores": cpu_between(benchmark["cpu_samples"], 1, start, end) / (end - start),
            "server_cpu_s": cpu_between(benchmark["cpu_samples"], 2, start, end),
            "errored": benchmark["metrics"]["request_totals"]["errored"],
            "ttft_p50": percentile("time_to_first_token_ms", "p50"), "ttft_p99": percentile("time_to_first_token_ms", "p99"),
            "itl_p50": percentile("inter_token_latency_ms", "p50"), "itl_p99": percentile("inter_token_latency_ms", "p99"),
            "tokens": sum(r["prompt_tokens"] + r["output_tokens"] for r in requests), "wall_s": wall,
            "prompts": [json.loads(r["request_args"])["body"]["prompt"] for r in ordered],
            "max_tokens": [json.loads(r["request_args"])["body"]["max_tokens"] for r in ordered]}


def proc_stat(stat: Path) -> tuple[int, float]:
    """A process's parent pid and user + system CPU time (all its threads), from its /proc stat."""
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    return proc_stat(Path(f"/proc/{pid}/stat"))[1]


def tree_cpu_seconds(root: int, seen: dict[int, float]) -> float:
    """CPU time of ``root`` and all its descendants. ``seen`` keeps each process's last reading,
    so one that has ended still counts what it used."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = proc_stat(stat)
        except OSError:  # ended while we looked
            continue
    tree, grew = {root}, True
    while grew:
        children = {pid for pid, (parent, _) in parents.items() if parent in tree} - tree
        tree |= children
        grew = bool(children)
    for pid in tree & parents.keys():
        seen[pid] = parents[pid][1]
    return sum(seen.values())


def engine_totals(base: str) -> tuple[float, float]:
    """The server's engine steps and seconds inside them so far, from its /metrics."""
    import httpx

    values = {}
    for line in httpx.get(f"{base}/metrics", timeout=30).text.splitlines():
        name, _, value = line.partition(" ")
        if name in ("trtbuild:engine_steps", "trtbuild:engine_busy_seconds"):
            values[name] = float(value)
    return values["trtbuild:engine_steps"], values["trtbuild:engine_busy_seconds"]


def offline_level(llm, prompts: list[str], max_tokens: list[int], concurrency: int) -> dict:
    """The same prompts through ``LLM`` in process, at most ``concurrency`` in flight (refilled as
    each finishes, as guidellm's concurrent profile does)."""
    from trtbuild.runtime.core.sampling import SamplingParams

    pending = list(zip(prompts, max_tokens))
    in_flight, tokens = set(), 0
    started, cpu = time.perf_counter(), time.process_time()
    steps, engine_s = llm.stats.steps, llm.stats.engine_s
    while pending or in_flight:
        while pending and len(in_flight) < concurrency:
            prompt, limit = pending.pop(0)
            in_flight.add(llm.submit(prompt, SamplingParams(max_tokens=limit, temperature=1.0, ignore_eos=True)))
        _, finished = llm.step()
        for completion in finished:
            in_flight.discard(completion.rid)
            tokens += len(completion.prompt_token_ids) + len(completion.token_ids)
    return {"tokens": tokens, "wall_s": time.perf_counter() - started, "cpu_s": time.process_time() - cpu,
            "engine_ms_per_step": 1e3 * (llm.stats.engine_s - engine_s) / max(1, llm.stats.steps - steps)}


def cpu_list(text: str) -> set[int]:
    """'0', '0,2', '0-3', or 'all' (an empty set: not pinned)."""
    if text == "all":
        return set()
    cpus = set()
    for part in text.split(","):
        first, _, last = part.partition("-")
        cpus |= set(range(int(first), int(last or first) + 1))
    return cpus


def split_cpus(engine: set[int] | None, loadgen: set[int] | None) -> tuple[set[int] | None, set[int] | None]:
    """Where the engine side (server, offline LLM) and the load generator run. By default each
    gets half of this process's CPUs, so that what guidellm spends parsing streams (a core at
    8 in flight on a 2-core machine) is not taken from the server while the offline run has
    the whole machine: both sides run their engine on the same CPUs."""
    mine = sorted(os.sched_getaffinity(0))
    if engine is None and loadgen is None and len(mine) >= 2:
        half = len(mine) // 2
        return set(mine[:half]), set(mine[half:])
    if engine and loadgen is None:      # one side given: the other gets the rest
        loadgen = set(mine) - engine or set()
    if loadgen and engine is None:
        engine = set(mine) - loadgen or set()
    return engine or None, loadgen or None


def shown(cpus: set[int] | None) -> str:
    return "any" if cpus is None else ",".join(map(str, sorted(cpus)))


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = [r["concurrency"] for r in rows]
    fig, (throughput, latency) = plt.subplots(1, 2, figsize=(11, 4))
    throughput.plot(levels, [r["server_tps"] for r in rows], "o-", label="trtbuild serve (guidellm)")
    throughput.plot(levels, [r["offline_tps"] for r in rows], "s--", label="LLM offline")
    throughput.set(xlabel="requests in flight", ylabel="total tokens/s", title="throughput")
    throughput.legend()
    for key, style in (("ttft_p50", "o-"), ("ttft_p99", "o:"), ("itl_p50", "s-"), ("itl_p99", "s:")):
        latency.plot(levels, [r[key] for r in rows], style, label=key.replace("_", " "))
    latency.set(xlabel="requests in flight", ylabel="ms", title="latency (guidellm)", yscale="log")
    latency.legend()
    for axes in (throughput, latency):
        axes.set_xscale("log", base=2)
        axes.set_xticks(levels, [str(c) for c in levels])
        axes.minorticks_off()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("engine_dir", type=Path)
    parser.add_argument("--plot", type=Path, required=True, help="where to write the PNG")
    parser.add_argument("--guidellm", default=str(REPO / ".loadgen-venv" / "bin" / "guidellm"),
                        help="the guidellm executable (default: .loadgen-venv/bin/guidellm)")
    parser.add_argument("--concurrency", type=lambda s: [int(c) for c in s.split(",")], default=[1, 2, 4, 8])
    parser.add_argument("--requests", type=int, default=24, help="requests per concurrency level")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--engine-cpus", type=cpu_list, default=None,
                        help="CPUs the server and the offline LLM run on, e.g. 0 or 0-3 (default: the first "
                             "half of this process's CPUs); 'all' shares every CPU with the load generator")
    parser.add_argument("--loadgen-cpus", type=cpu_list, default=None,
                        help="CPUs guidellm runs on (default: the CPUs the engine side does not use)")
    args = parser.parse_args()
    engine_cpus, loadgen_cpus = split_cpus(args.engine_cpus, args.loadgen_cpus)
    if not Path(args.guidellm).is_file():
        raise SystemExit(f"error: --guidellm {args.guidellm}: not found; install it with "
                         "python3 -m venv .loadgen-venv && .loadgen-venv/bin/pip install guidellm")

    from trtbuild.runtime.llm import LLM
    from trtbuild.runtime.core.sampling import SamplingParams

    rows, threads = [], len(engine_cpus or ())  # ONNX Runtime threads on both sides (0: its choice)
    if engine_cpus is not None:
        os.sched_setaffinity(0, engine_cpus)  # the offline side runs in this process
    with tempfile.TemporaryDirectory() as scratch, \
            LLM(args.engine_dir, backend="onnxruntime", threads=threads) as llm:
        scratch = Path(scratch)
        llm.generate(["def f(x):"], SamplingParams(max_tokens=16))   # warm-up: ONNX Runtime's first runs
        proc, base = start_server(args.engine_dir, scratch / "serve.log", engine_cpus, threads)
        try:
            import httpx

            httpx.post(f"{base}/v1/completions", timeout=60, json={"model": MODEL_NAME, "prompt": "def f(x):",
                                                                   "max_tokens": 16})   # the same warm-up
            # Per level: guidellm through the server, then the same prompts offline while the
            # server idles (its engine loop sleeps without requests), so both see the same machine.
            for concurrency in args.concurrency:
                steps, engine_s = engine_totals(base)
                level = server_level(run_guidellm(args.guidellm, base, concurrency, args, scratch / "guidellm.json",
                                                  loadgen_cpus, proc.pid))
                server_cpu = level["server_cpu_s"]
                steps_after, engine_after = engine_totals(base)
                offline = offline_level(llm, level["prompts"], level["max_tokens"], concurrency)
                server_tps, offline_tps = level["tokens"] / level["wall_s"], offline["tokens"] / offline["wall_s"]
                rows.append({**level, "server_tps": server_tps, "offline_tps": offline_tps,
                             "overhead": 1 - server_tps / offline_tps,
                             "server_cores": server_cpu / level["wall_s"],
                             "server_engine_ms_per_step": 1e3 * (engine_after - engine_s) / max(1, steps_after - steps),
                             "offline_engine_ms_per_step": offline["engine_ms_per_step"],
                             "server_cpu_ms_per_token": 1e3 * server_cpu / level["tokens"],
                             "offline_cpu_ms_per_token": 1e3 * offline["cpu_s"] / offline["tokens"]})
        finally:
            stop_server(proc)

    header = ["in flight", "requests", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms",
              "server tok/s", "offline tok/s", "overhead", "CPU ms/token server", "offline", "CPU overhead",
              "cores: server", "guidellm", "engine ms/step server", "offline"]
    print(f"trtbuild serve vs LLM offline: {args.engine_dir}, {args.prompt_tokens}-token prompts, "
          f"{args.output_tokens} tokens each (ignore_eos), ONNX Runtime, guidellm over loopback; "
          f"server and offline on CPUs {shown(engine_cpus)}, guidellm on {shown(loadgen_cpus)}")
    print(format_table([[r["concurrency"], f"{r['requests']} ({r['errored']} err)", f"{r['ttft_p50']:.1f}",
                                 f"{r['ttft_p99']:.1f}", f"{r['itl_p50']:.2f}", f"{r['itl_p99']:.2f}",
                                 f"{r['server_tps']:.0f}", f"{r['offline_tps']:.0f}", f"{r['overhead']:+.1%}",
                                 f"{r['server_cpu_ms_per_token']:.3f}", f"{r['offline_cpu_ms_per_token']:.3f}",
                                 f"{r['server_cpu_ms_per_token'] / r['offline_cpu_ms_per_token'] - 1:+.1%}",
                                 f"{r['server_cores']:.2f}", f"{r['loadgen_cores']:.2f}",
                                 f"{r['server_engine_ms_per_step']:.2f}", f"{r['offline_engine_ms_per_step']:.2f}"]
                                for r in rows], header))
    saturated = max(rows, key=lambda r: r["concurrency"])
    print(f"server overhead at {saturated['concurrency']} in flight: {saturated['overhead']:+.1%} of tokens/s "
          f"(goal <= 10 %), {saturated['server_cpu_ms_per_token'] / saturated['offline_cpu_ms_per_token'] - 1:+.1%} "
          f"of CPU time per token; guidellm took {saturated['loadgen_cores']:.2f} of the machine's "
          f"{os.cpu_count()} cores meanwhile")
    plot(rows, args.plot)
    print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()

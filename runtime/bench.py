"""Workloads and the serving benchmark behind ``trtbuild bench`` and benchmarks/runtime.py."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .llm import LLM
from .core.sampling import SamplingParams

PRESETS = ("skewed", "uniform", "shared-prefix")


@dataclass(frozen=True)
class WorkItem:
    prompt: list[int]
    max_tokens: int


@dataclass(frozen=True)
class Workload:
    name: str
    items: tuple[WorkItem, ...]
    warmup: tuple[WorkItem, ...] = ()   # run to completion first, not measured (fills the prefix cache)


def preset(name: str, vocab_size: int, max_seq_len: int, seed: int = 0) -> Workload:
    """Synthetic token workloads; output lengths are exact (EOS is ignored)."""
    rng = np.random.default_rng(seed)
    tokens = lambda n: rng.integers(1, vocab_size, size=n).tolist()  # noqa: E731
    if name == "skewed":  # most answers short, a few long: where static batching idles
        lengths = np.clip(np.round(np.exp(rng.uniform(np.log(8), np.log(512), size=32))), 8, 512).astype(int)
        items = [WorkItem(tokens(int(rng.integers(16, 65))), int(n)) for n in lengths]
        return Workload(name, tuple(_fit(items, max_seq_len)))
    if name == "uniform":
        return Workload(name, tuple(_fit([WorkItem(tokens(32), 64) for _ in range(16)], max_seq_len)))
    if name == "shared-prefix":
        prefix = tokens(512)
        make = lambda: WorkItem(prefix + tokens(16), 16)  # noqa: E731
        return Workload(name, tuple(_fit([make() for _ in range(16)], max_seq_len)), warmup=(make(),))
    raise ValueError(f"unknown workload preset {name!r}; presets: {', '.join(PRESETS)}")


def load_workload(path: Path, tokenizer) -> Workload:
    """JSON lines: {"prompt": "text" | [ids], "max_tokens": N}."""
    items = []
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not UTF-8 text") from None
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            prompt = row["prompt"]
            ids = tokenizer.encode(prompt).ids if isinstance(prompt, str) else list(prompt)
            vocab = tokenizer.get_vocab_size()
            bad = next((t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab), None)
            if bad is not None:
                raise ValueError(f"token id {bad!r} is outside the vocabulary [0, {vocab})")
            max_tokens = row.get("max_tokens", 64)
            if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
                raise ValueError(f"max_tokens must be a positive integer, got {max_tokens!r}")
            items.append(WorkItem(ids, max_tokens))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}:{number}: expected {{\"prompt\": text or token ids, \"max_tokens\": N}} "
                             f"({type(exc).__name__}: {exc})") from None
    if not items:
        raise ValueError(f"{path}: no requests")
    return Workload(Path(path).stem, tuple(items))


def _fit(items: list[WorkItem], max_seq_len: int) -> list[WorkItem]:
    return [WorkItem(i.prompt[: max(1, max_seq_len - i.max_tokens)], i.max_tokens) for i in items]


@dataclass(frozen=True)
class BenchResult:
    workload: str
    requests: int
    seconds: float
    output_tokens: int
    ttft_ms: tuple[float, float]          # p50, p99
    itl_ms: tuple[float, float]           # p50, p99
    engine_share: float                   # share of step-loop time inside Engine.step
    prefix_hits: int
    prefix_misses: int

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.seconds

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    def as_dict(self) -> dict:
        return {"workload": self.workload, "requests": self.requests, "seconds": round(self.seconds, 3),
                "requests_per_s": round(self.requests_per_s, 3),
                "output_tokens_per_s": round(self.output_tokens_per_s, 1),
                "ttft_ms_p50": round(self.ttft_ms[0], 2), "ttft_ms_p99": round(self.ttft_ms[1], 2),
                "itl_ms_p50": round(self.itl_ms[0], 2), "itl_ms_p99": round(self.itl_ms[1], 2),
                "runtime_overhead_share": round(1 - self.engine_share, 4),
                "prefix_hits": self.prefix_hits, "prefix_misses": self.prefix_misses}


def run(llm: LLM, workload: Workload) -> BenchResult:
    for item in workload.warmup:
        llm.submit(item.prompt, SamplingParams(max_tokens=item.max_tokens, ignore_eos=True))
    llm.run_until_done()
    stats = llm.scheduler.kv.stats
    hits0, misses0 = stats.hits, stats.misses
    engine0, loop0 = llm.stats.engine_s, llm.stats.loop_s
    start = time.perf_counter()
    rids = [llm.submit(i.prompt, SamplingParams(max_tokens=i.max_tokens, ignore_eos=True)) for i in workload.items]
    stamps: dict[str, list[float]] = {rid: [] for rid in rids}
    completions = []
    while llm.has_work():
        deltas, finished = llm.step()
        now = time.perf_counter()
        for delta in deltas:
            stamps[delta.rid].append(now)
        completions += finished
    seconds = time.perf_counter() - start
    ttft = [1000 * (stamps[rid][0] - start) for rid in rids]
    itl = [1000 * d for rid in rids for d in np.diff(stamps[rid])]
    loop = llm.stats.loop_s - loop0
    return BenchResult(
        workload=workload.name, requests=len(rids), seconds=seconds,
        output_tokens=sum(len(c.token_ids) for c in completions), ttft_ms=_p50_p99(ttft), itl_ms=_p50_p99(itl),
        engine_share=(llm.stats.engine_s - engine0) / loop if loop else 0.0,
        prefix_hits=stats.hits - hits0,
        prefix_misses=stats.misses - misses0)


def _p50_p99(values: list[float]) -> tuple[float, float]:
    if not values:
        return (0.0, 0.0)
    return float(np.percentile(values, 50)), float(np.percentile(values, 99))

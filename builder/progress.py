"""Progress lines on stderr for long work, and the final summary table."""
from __future__ import annotations

import resource
import sys
import time
from contextlib import contextmanager
from enum import IntEnum
from typing import Iterator


class Verbosity(IntEnum):
    error = 0
    info = 1
    debug = 2


class Progress:
    def __init__(self, verbosity: Verbosity = Verbosity.info, stream=None):
        self.verbosity = verbosity
        self.stream = stream or sys.stderr
        self.stages: list[tuple[str, float]] = []

    def say(self, message: str, level: Verbosity = Verbosity.info) -> None:
        if self.verbosity >= level:
            print(message, file=self.stream, flush=True)

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        self.say(f"▸ {name} …")
        start = time.perf_counter()
        yield
        seconds = time.perf_counter() - start
        self.stages.append((name, seconds))
        self.say(f"✓ {name} ({seconds:.1f} s, RSS {human_bytes(current_rss_bytes())}, "
                 f"peak so far {human_bytes(peak_rss_bytes())})")

    def pass_record(self, record: dict) -> None:
        rank = "all" if record["rank"] is None else record["rank"]
        parts = [f"  rank {rank:<3} {record['pass']:<25}", f"{record['ms']:8.1f} ms",
                 f"nodes {record['nodes_before']:>5} → {record['nodes_after']:<5}"]
        if "matches" in record:
            parts.append(f"matches {record['matches']}")
        numerics = record.get("numerics")
        if numerics and "vs_torch" in numerics:
            parts.append(f"max_abs vs torch {numerics['vs_torch']['max_abs']:.2g}")
        elif numerics:  # a CPU-stage pass: its decode graph at a decode step
            parts.append(f"max_abs vs rank graph (decode step) {numerics['vs_rank_graph']['max_abs']:.2g}")
        self.say("  ".join(parts))
        if "skipped" in record:
            self.say(f"    skipped: {record['skipped']}", Verbosity.debug)


def table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return f"{n:.1f} GiB"


def peak_rss_bytes() -> int:
    """The process's peak resident set size so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def current_rss_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * resource.getpagesize()

"""Progress lines on stderr for long work, and the final summary table."""
from __future__ import annotations

import os
import resource
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
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


@dataclass(frozen=True)
class ProcessPeak:
    """One process's memory high-water marks: the kernel's peak RSS, and the largest anonymous
    (heap: what the process allocated) and file-backed (mapped weights, which the kernel can
    drop and re-read) parts seen by polling /proc."""

    name: str
    peak: int
    anon: int
    file: int

    def describe(self) -> str:
        return f"{human_bytes(self.peak)} (anon {human_bytes(self.anon)}, file {human_bytes(self.file)})"


class _Sampler:
    def __init__(self, name: str, interval_s: float):
        self.name, self.interval_s = name, interval_s
        self.anon = self.file = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while True:
            anon, file = rss_parts()
            self.anon, self.file = max(self.anon, anon), max(self.file, file)
            if self.stop.wait(self.interval_s):
                return

    def result(self) -> ProcessPeak:
        # VmHWM, not getrusage: a spawned child's ru_maxrss starts at its parent's peak (kept across exec).
        return ProcessPeak(self.name, max(status_bytes("VmHWM"), self.anon + self.file), self.anon, self.file)


@contextmanager
def sample_peak(name: str = "", interval_s: float = 0.05) -> Iterator[_Sampler]:
    """Polls this process's RssAnon/RssFile while the block runs; ``.result()`` after it."""
    sampler = _Sampler(name or f"pid {os.getpid()}", interval_s)
    sampler.thread.start()
    try:
        yield sampler
    finally:
        sampler.stop.set()
        sampler.thread.join()
        anon, file = rss_parts()
        sampler.anon, sampler.file = max(sampler.anon, anon), max(sampler.file, file)


def _status(pid: int | str = "self") -> dict[str, int]:
    """The memory lines of /proc/PID/status in bytes (empty once the process is gone)."""
    fields = {}
    try:
        with open(f"/proc/{pid}/status") as handle:
            for line in handle:
                if line.startswith(("Rss", "Vm")) and line.rstrip().endswith("kB"):
                    key, value = line.split(":", 1)
                    fields[key] = int(value.split()[0]) * 1024
    except OSError:
        return {}
    return fields


def status_bytes(key: str, pid: int | str = "self") -> int:
    return _status(pid).get(key, 0)


def rss_parts(pid: int | str = "self") -> tuple[int, int]:
    """(RssAnon, RssFile + RssShmem) of a process now, in bytes (0, 0 once it is gone)."""
    fields = _status(pid)
    return fields.get("RssAnon", 0), fields.get("RssFile", 0) + fields.get("RssShmem", 0)


def dir_size(path: Path) -> int:
    """Bytes of the regular files under ``path`` (hard links counted once)."""
    seen, total = set(), 0
    for root, _, files in os.walk(path):
        for name in files:
            stat = os.lstat(os.path.join(root, name))
            if (stat.st_dev, stat.st_ino) not in seen:
                seen.add((stat.st_dev, stat.st_ino))
                total += stat.st_size
    return total

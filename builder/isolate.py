"""Run a memory-heavy stage in a fresh process, so its peak (and what its allocator keeps
after freeing) never adds to the next stage's.

torch.export leaves the model's weights resident in the parent (allocator caches and
exporter state), and TensorRT's builder holds its own copies while it builds: run apart,
the build's peak is the larger of the two, not their sum. Children are spawned (not
forked) so they start without the parent's memory.
"""
from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from typing import Callable, TypeVar

T = TypeVar("T")


def run_isolated(fn: Callable[..., T], *args) -> T:
    """``fn(*args)`` in a spawned child; its result or exception comes back (both must pickle)."""
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def map_isolated(fn: Callable[..., T], items: list, workers: int) -> list[T]:
    """``fn(item)`` for each item, at most ``workers`` children at once, results in order."""
    with ProcessPoolExecutor(max_workers=max(1, workers), mp_context=multiprocessing.get_context("spawn")) as pool:
        return list(pool.map(fn, items))

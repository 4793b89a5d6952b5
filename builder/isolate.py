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
from contextlib import contextmanager
from typing import Callable, Iterator, TypeVar

from ..contract.processes import die_with_parent

T = TypeVar("T")


@contextmanager
def _pool(workers: int) -> Iterator[ProcessPoolExecutor]:
    """Spawned children that die with this process (no orphaned half-gigabyte export worker, and
    the resource tracker sees its pipes close). Interrupted (SIGTERM, Ctrl-C), the parent
    does not wait for them to finish their work: it leaves, and they die with it."""
    pool = ProcessPoolExecutor(max_workers=max(1, workers), mp_context=multiprocessing.get_context("spawn"),
                               initializer=die_with_parent)
    try:
        yield pool
    except BaseException:
        # Killed, not asked: a worker still starting (importing torch: tens of seconds on a busy
        # machine) reads no shutdown message, and the interpreter's exit would wait for it.
        workers = list((pool._processes or {}).values())  # kill_workers() from Python 3.14 on
        pool.shutdown(wait=False, cancel_futures=True)
        for worker in workers:
            worker.kill()
        raise
    pool.shutdown(wait=True)


def run_isolated(fn: Callable[..., T], *args) -> T:
    """``fn(*args)`` in a spawned child; its result or exception comes back (both must pickle)."""
    with _pool(1) as pool:
        return pool.submit(fn, *args).result()


def map_isolated(fn: Callable[..., T], items: list, workers: int) -> list[T]:
    """``fn(item)`` for each item, at most ``workers`` children at once, results in order."""
    with _pool(workers) as pool:
        return list(pool.map(fn, items))

"""Constraints compiled off the caller's event loop: a small fixed pool of threads, a bounded
wait for one, and a deadline counted from when a compile starts.

llguidance cannot be interrupted mid-compile, so a compile that overruns its deadline keeps
its thread until it ends (its result is cached for whoever asks next); the pool counts it as
busy meanwhile. That is why the pool is bounded on both sides: ``workers`` compiles run at
once and at most ``max_waiting`` more wait for a thread; past that, ``submit`` refuses at once
(``CompilerBusy``) instead of queueing work nobody bounds. A waiting compile's deadline starts
when its thread picks it up, so a request is never refused as "too complex" for time it spent
queued behind others. Equal constraints asked for while one compiles share that compile.
Cache hits never touch the pool. ``close()`` ends every waiter at once (``CompilePoolClosed``),
queued or compiling, and later submits raise it."""
from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor

from .compiler import CompiledConstraint, ConstraintCompiler
from .constraint import Constraint, ConstraintError

WORKERS = 2             # compiles at once: each holds a core while it runs
MAX_WAITING = 8         # compiles queued for a thread before submit refuses
TIMEOUT_S = 10.0        # seconds a compile may run (llguidance's own limits stop most sooner)


class CompilerBusy(RuntimeError):
    """Every compile thread is busy and the wait for one is full: retry shortly."""


class CompileTimeout(ConstraintError):
    """The constraint's compile ran past its deadline (it finishes in its thread, cached)."""


class CompilePoolClosed(RuntimeError):
    """The pool was closed (its LLM was) before the compile was asked for, or before it ended."""


class CompileJob:
    """One constraint's compile in the pool: ``started`` resolves (to its monotonic start time)
    when a thread picks it up, ``result`` when it ends."""

    def __init__(self, constraint: Constraint):
        self.constraint = constraint
        self.started: Future = Future()
        self.result: Future = Future()

    async def wait(self, timeout_s: float) -> CompiledConstraint:
        """The compiled constraint, or ``CompileTimeout`` once it has run ``timeout_s`` seconds
        (time queued not counted); a ``ConstraintError`` if it cannot be compiled. Cancelling the
        waiter leaves the compile running for anyone else waiting on it."""
        started_at = await asyncio.shield(asyncio.wrap_future(self.started))
        if self.result.done():   # a shared compile that has just ended: no deadline left to miss
            return self.result.result()
        left = timeout_s - (time.monotonic() - started_at)
        try:
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(self.result)), max(left, 0.0))
        except TimeoutError:
            raise CompileTimeout(f"{self.constraint.kind}: took over {timeout_s:g} s to compile; simplify it") from None


class CompilePool:
    """Compiles for one ``ConstraintCompiler``; thread-safe, usable from any event loop."""

    def __init__(self, compiler: ConstraintCompiler, workers: int = WORKERS, max_waiting: int = MAX_WAITING,
                 timeout_s: float = TIMEOUT_S):
        if workers < 1 or max_waiting < 0 or timeout_s <= 0:
            raise ValueError(f"compile pool: workers ≥ 1, max_waiting ≥ 0 and timeout_s > 0 "
                             f"(got {workers}, {max_waiting}, {timeout_s})")
        self.compiler, self.workers, self.max_waiting, self.timeout_s = compiler, workers, max_waiting, timeout_s
        self._threads = ThreadPoolExecutor(workers, "trtbuild-compile")
        self._lock = threading.Lock()
        self._jobs: dict[Constraint, CompileJob] = {}   # queued or running, until they end
        self._closed = False
        self.refused = 0   # submits refused busy since start (the server's /metrics)

    @property
    def pending(self) -> int:
        """Compiles queued or running (an overrunning one counts until it ends)."""
        with self._lock:
            return len(self._jobs)

    def submit(self, constraint: Constraint) -> CompileJob:
        """The constraint's compile job: a new one, or the one already compiling it; raises
        ``CompilerBusy`` when ``workers + max_waiting`` compiles are already pending,
        ``CompilePoolClosed`` once closed."""
        with self._lock:   # held while the job is queued too: a close() between would strand it
            if self._closed:
                raise CompilePoolClosed("the constraint compile pool is closed")
            job = self._jobs.get(constraint)
            if job is not None:
                return job
            if len(self._jobs) >= self.workers + self.max_waiting:
                self.refused += 1
                raise CompilerBusy(f"constraint compiler busy: {self.workers} compiling and {self.max_waiting} waiting; "
                                   "retry shortly")
            job = self._jobs[constraint] = CompileJob(constraint)
            self._threads.submit(self._run, job)
        return job

    async def compile(self, constraint: Constraint, timeout_s: float | None = None) -> CompiledConstraint:
        """The compiled constraint: from the cache at once, else from the pool (``CompilerBusy``,
        ``CompileTimeout``, ``ConstraintError`` as ``submit`` and ``CompileJob.wait`` raise them)."""
        hit = self.compiler.cached(constraint)
        if hit is not None:
            return hit
        return await self.submit(constraint).wait(self.timeout_s if timeout_s is None else timeout_s)

    def close(self) -> None:
        """Ends every pending compile's waiters now with ``CompilePoolClosed`` (an exception, not
        a cancellation, which an ``except Exception`` would miss): queued compiles never run, and
        running ones end in their threads, their results cached for nobody waiting."""
        closed = CompilePoolClosed("the constraint compile pool is closed")
        with self._lock:
            self._closed = True
            self._threads.shutdown(wait=False, cancel_futures=True)
            jobs, self._jobs = list(self._jobs.values()), {}
            for job in jobs:   # under the lock: _run starts a job under it too
                if not job.started.done():
                    job.started.set_exception(closed)
        for job in jobs:
            _settle(job.result, exception=closed)

    def _run(self, job: CompileJob) -> None:
        with self._lock:
            if job.started.done():   # the pool closed before a thread picked it up
                return
            job.started.set_result(time.monotonic())
        try:
            _settle(job.result, result=self.compiler.compile(job.constraint))
        except BaseException as exc:  # noqa: BLE001  (every failure reaches the waiters)
            _settle(job.result, exception=exc)
        finally:
            with self._lock:
                if self._jobs.get(job.constraint) is job:
                    del self._jobs[job.constraint]


def _settle(future: Future, result=None, exception: BaseException | None = None) -> None:
    """Sets the future's outcome unless it has one (the pool's close() may have set it first)."""
    try:
        if exception is not None:
            future.set_exception(exception)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass

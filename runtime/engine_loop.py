"""The engine loop: the one owner of engine-core steps and of where their outputs go.

Requests arrive already checked (``ValidRequest``, made by the LLM's input processor), each with
a ``Sink``: a front end's reader (``generate``'s waiter, ``stream``'s queue, an ``AsyncLLM``
group) and the request's index there. Each step's outputs go to each request's own sink, one
``put`` per request per step (a greedy run's pieces together), whoever ran the step; so a front
end reads its own requests' outputs however many others use the same LLM.

Who steps: a thread, started when a request with a sink arrives and ending when none is open
(an idle LLM holds no thread), or at ``close()``. Requests submitted without a sink are the
polling API's (``LLM.submit`` then ``LLM.step``/``run_until_done``, for tests and benchmarks
that drive and count steps themselves): the thread does not step for them alone, and their
outputs wait for the next ``step()`` call to return them. A step that raises ends every request
with a sink with that error (``Subscriber.fail``) and takes them out of the core; a polling
caller gets the exception from its own ``step()``.

Why a thread, not a process: a step is ONNX Runtime or TensorRT work that lets go of the GIL, so
a thread overlaps the event loop as a process would, without moving the engine (device memory,
a tensor-parallel engine's rank processes) into another process or paying IPC per step for
every request's tokens."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Protocol

from .core.engine_core import EngineCore
from .input_processor import InputProcessor, ValidRequest
from .structured import CompiledConstraint
from .output_processor import OutputProcessor
from .outputs import Completion, Delta
from .core.scheduler import Request


class Subscriber(Protocol):
    """A front end's reader of one or more requests' outputs (called on the stepping thread)."""

    def put(self, index: int, pieces: list[Delta]) -> None:
        """One step's pieces of request ``index``, in order; a ``finished`` last one carries its Completion."""

    def fail(self, error: Exception) -> None:
        """The subscriber's open requests ended with this error (once per failure)."""


@dataclass(frozen=True)
class Sink:
    """Where one request's outputs go: its reader, and the request's index there."""
    subscriber: Subscriber
    index: int = 0


class _Dropped:
    """Where the outputs of a request that already failed go: nowhere (it waits in the core for
    the next step to take it out)."""

    def put(self, index: int, pieces: list[Delta]) -> None:
        pass

    def fail(self, error: Exception) -> None:
        pass


_DROPPED = Sink(_Dropped())


@dataclass(frozen=True)
class _Arrival:
    request: Request
    arrival_s: float
    constraint: CompiledConstraint | None = None


class EngineLoop:
    def __init__(self, core: EngineCore, outputs: OutputProcessor, issuer: InputProcessor):
        self.core, self.outputs, self._issuer = core, outputs, issuer
        self._step_lock = threading.Lock()   # held for a whole step, and by close()
        # What callers touch between steps, under a lock held only for a moment, so a caller (an
        # event loop) never blocks behind a running step; the next step takes it in.
        self._lock = threading.Lock()
        self._inbox: list[_Arrival] = []
        self._aborts: set[str] = set()
        self._open: dict[str, Sink | None] = {}   # every request not yet completed → its sink (None: polled)
        self._subscribed = 0                      # open requests with a sink: the thread runs while any are
        self._thread: threading.Thread | None = None
        self._closed = False
        self._released = False                    # the engine freed (close)
        self._polled: tuple[list[Delta], list[Completion]] = ([], [])   # under the step lock

    # -- callers' side ----------------------------------------------------------------------------
    def submit(self, jobs: list[tuple[str, ValidRequest, Sink | None]]) -> None:
        """Queues ``(rid, request, sink)`` jobs for the next step, all or none: TypeError for a
        request this LLM's input processor did not make, ValueError for a request id in use,
        RuntimeError once closed."""
        if any(not isinstance(request, ValidRequest) or request.checked_by is not self._issuer for _, request, _ in jobs):
            raise TypeError("the engine loop takes ValidRequests made by this LLM's input processor (LLM.inputs)")
        if any((request.constraint.constraint if request.constraint else None) != request.params.constraint
               for _, request, _ in jobs):  # refused here: in a step it would fail every reader
            raise TypeError("a ValidRequest's constraint must be its params.constraint, compiled (LLM.inputs.request)")
        now = time.perf_counter()
        with self._lock:
            if self._closed:
                raise RuntimeError("the LLM is closed")
            seen: set[str] = set()
            for rid, _, _ in jobs:
                if rid in self._open or rid in seen:
                    raise ValueError(f"request id {rid!r} is already in use")
                seen.add(rid)
            for rid, request, sink in jobs:
                self._open[rid] = sink
                self._inbox.append(_Arrival(Request(rid=rid, prompt=request.tokens, params=request.params), now,
                                            request.constraint))
                self._subscribed += sink is not None
            if self._subscribed and self._thread is None:
                self._thread = threading.Thread(target=self._run, name="trtbuild-engine-loop", daemon=True)
                self._thread.start()

    def abort(self, rid: str) -> None:
        """Ends a request at the next step; unknown or finished ids are ignored."""
        with self._lock:
            if rid in self._open:
                self._aborts.add(rid)

    def has_work(self) -> bool:
        return bool(self._inbox) or self.core.has_work()

    def queue_depth(self) -> int:
        """Requests waiting for a KV slot, including those submitted since the last step."""
        return len(self._inbox) + len(self.core.scheduler.waiting)

    def step(self) -> tuple[list[Delta], list[Completion]]:
        """One step run by the caller (the polling API): the deltas and completions of requests
        submitted without a sink, made since the last call (by this step and any the thread ran)."""
        with self._step_lock:
            self._step()
            (deltas, completions), self._polled = self._polled, ([], [])
        return deltas, completions

    def close(self) -> None:
        """Once any running step has ended: frees the engine (device memory; a tensor-parallel
        engine's rank processes), fails every open request with a sink ("the LLM is closed") and
        ends the thread; later submits and steps raise."""
        with self._lock:
            self._closed = True
            thread = self._thread
        with self._step_lock:
            try:
                if not self._released:
                    self._released = True
                    self.core.engine.close()
            finally:  # a failing close (a rank already gone) must not leave callers waiting
                self._fail_subscribed(RuntimeError("the LLM is closed"))
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    # -- the stepping side ------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._lock:
                if self._closed or not (self._subscribed and (self._inbox or self._aborts or self.core.has_work())):
                    self._thread = None
                    return
            try:
                with self._step_lock:
                    self._step()
            except Exception:  # noqa: BLE001  (its requests heard of it through their sinks)
                pass

    def _step(self) -> None:
        """One engine-core step, under the step lock; its outputs to their sinks."""
        if self._closed:
            raise RuntimeError("the LLM is closed")
        try:
            self._take_inbox()
            finished = self.core.step(self.outputs.on_token, self._interrupts_run)
            # Inside the try: the core has already let go of what finished, so a failure while
            # making or delivering its outputs must reach every reader too, or one would wait forever.
            self._publish(*self.outputs.finish(finished))
        except Exception as exc:
            self._fail_subscribed(exc)
            raise

    def _interrupts_run(self) -> bool:
        """A greedy run ends after its current step for a request that could take a free slot,
        or an abort."""
        return bool((self._inbox and self.core.scheduler.slots.free) or self._aborts)

    def _take_inbox(self) -> None:
        """Admits what was submitted since the last step, then applies aborts."""
        if not self._inbox and not self._aborts:  # most steps; one arriving now waits for the next
            return
        with self._lock:
            arrived, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, set()
        for arrival in arrived:
            self.core.add(arrival.request, arrival.constraint)
            self.outputs.add(arrival.request.rid, arrival.arrival_s)
        for rid in aborts:
            self.core.abort(rid)

    def _publish(self, deltas: list[Delta], completions: list[Completion]) -> None:
        pieces: dict[str, list[Delta]] = {}
        for delta in deltas:
            pieces.setdefault(delta.rid, []).append(delta)
        with self._lock:
            sinks = {rid: self._open.get(rid) for rid in pieces}
            for completion in completions:
                sink = self._open.pop(completion.rid, None)
                self._aborts.discard(completion.rid)  # a late abort must not hit a new request of that id
                self._subscribed -= sink is not None and sink is not _DROPPED
        for rid, mine in pieces.items():
            sink = sinks[rid]
            if sink is not None:
                sink.subscriber.put(sink.index, mine)
        if any(sink is None for sink in sinks.values()):  # polled requests made output
            polled_deltas, polled_completions = self._polled
            polled_deltas += [d for d in deltas if sinks[d.rid] is None]
            polled_completions += [c for c in completions if sinks[c.rid] is None]

    def _fail_subscribed(self, error: Exception) -> None:
        """Every open request with a sink ends with ``error``; those the core holds leave it at
        the next step that runs."""
        self.outputs.finish([])  # the failed step's half-made pieces
        with self._lock:
            failed = {rid: sink for rid, sink in self._open.items() if sink is not None and sink is not _DROPPED}
            queued = {a.request.rid for a in self._inbox} & failed.keys()
            self._inbox = [a for a in self._inbox if a.request.rid not in queued]
            for rid in failed:
                if rid in queued:
                    del self._open[rid]
                else:
                    self._open[rid] = _DROPPED
                    self._aborts.add(rid)
            self._subscribed = 0
        for subscriber in {id(s.subscriber): s.subscriber for s in failed.values()}.values():
            subscriber.fail(error)

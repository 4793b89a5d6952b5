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
outputs wait for the next ``step()`` call to return them.

Failures reach exactly the readers of the requests they touched, once (``Subscriber.fail``): a
failing core step every request the core held, a failing output processor the requests with
outputs in that step, a reader whose ``put`` raises its own requests, a request the core refuses
itself alone, ``close()`` every open request. Each such request leaves the core, the output
processor and the open set at once, so no id stays taken after its request ended; a polled
request's failure is raised by the next ``step()`` (and a polling caller's own failing step
raises there too).

Why a thread, not a process: a step is ONNX Runtime or TensorRT work that lets go of the GIL, so
a thread overlaps the event loop as a process would, without moving the engine (device memory,
a tensor-parallel engine's rank processes) into another process or paying IPC per step for
every request's tokens."""
from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass
from typing import Protocol

from .engine_core import EngineCore
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


_GONE = object()   # what a step's piece finds for a request no longer open (it ended meanwhile)


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
        self._open: dict[str, Sink | None] = {}   # every request not yet ended → its sink (None: polled)
        self._subscribed = 0                      # open requests with a sink: the thread runs while any are
        self._names = itertools.count()           # for the ids the loop gives (req-N)
        self._thread: threading.Thread | None = None
        self._closed = False
        self._released = False                    # the engine freed (close)
        # The polling API's, under the step lock: outputs of polled requests made since the last
        # step() call, and the first failure that ended one of them meanwhile (step() raises it).
        self._polled: tuple[list[Delta], list[Completion]] = ([], [])
        self._polled_error: Exception | None = None

    # -- callers' side ----------------------------------------------------------------------------
    def submit(self, jobs: list[tuple[str | None, ValidRequest, Sink | None]]) -> list[str]:
        """Queues ``(rid, request, sink)`` jobs for the next step, all or none, and returns their
        request ids: a ``None`` rid is given one (``req-N``) that no open request holds. TypeError
        for a request this LLM's input processor did not make, ValueError for a request id in
        use, RuntimeError once closed."""
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
                if rid is not None and (rid in self._open or rid in seen):
                    raise ValueError(f"request id {rid!r} is already in use")
                seen.add(rid)
            # Named here, under the lock, after the callers' own ids: a given id is never one a
            # caller holds (a caller's own "req-3" included), nor taken by one before it is submitted.
            rids = [rid if rid is not None else self._unused_rid(seen) for rid, _, _ in jobs]
            for rid, (_, request, sink) in zip(rids, jobs):
                self._open[rid] = sink
                self._inbox.append(_Arrival(Request(rid=rid, prompt=request.tokens, params=request.params), now,
                                            request.constraint))
                self._subscribed += sink is not None
            if self._subscribed and self._thread is None:
                self._thread = threading.Thread(target=self._run, name="trtbuild-engine-loop", daemon=True)
                self._thread.start()
        return rids

    def _unused_rid(self, taken: set[str]) -> str:
        """A ``req-N`` id neither open nor in ``taken`` (which it joins); under the lock."""
        while (rid := f"req-{next(self._names)}") in self._open or rid in taken:
            pass
        taken.add(rid)
        return rid

    def abort(self, rid: str) -> None:
        """Ends a request at the next step; unknown or finished ids are ignored."""
        with self._lock:
            if rid in self._open:
                self._aborts.add(rid)

    @property
    def closed(self) -> bool:
        return self._closed

    def open_rids(self) -> set[str]:
        """The ids of requests submitted and not yet ended (however they end): ids in use."""
        with self._lock:
            return set(self._open)

    def has_work(self) -> bool:
        """Requests queued or running, or what the next ``step()`` has to hand a polling caller:
        outputs of polled requests that the thread's steps made, or the failure that ended one."""
        deltas, completions = self._polled
        return (bool(self._inbox) or self.core.has_work() or self._polled_error is not None
                or bool(deltas or completions))

    def queue_depth(self) -> int:
        """Requests waiting for a KV slot, including those submitted since the last step."""
        return len(self._inbox) + len(self.core.scheduler.waiting)

    def step(self) -> tuple[list[Delta], list[Completion]]:
        """One step run by the caller (the polling API): the deltas and completions of requests
        submitted without a sink, made since the last call (by this step and any the thread ran).
        Raises the step's own failure, else the failure that ended a polled request since the
        last call (its outputs made meanwhile wait for the next call)."""
        with self._step_lock:
            try:
                self._step()
            except Exception as exc:
                if self._polled_error is exc:   # raised here: not again at the next call
                    self._polled_error = None
                raise
            if self._polled_error is not None:
                error, self._polled_error = self._polled_error, None
                raise error
            (deltas, completions), self._polled = self._polled, ([], [])
        return deltas, completions

    def close(self) -> None:
        """Once any running step has ended: frees the engine (device memory; a tensor-parallel
        engine's rank processes), ends every open request ("the LLM is closed": its reader's
        ``fail``; a polled one's by the next ``step()``), queued or running, and the thread;
        later submits and steps raise."""
        with self._lock:
            self._closed = True
            thread = self._thread
        with self._step_lock:
            try:
                if not self._released:
                    self._released = True
                    self.core.engine.close()
            finally:  # a failing close (a rank already gone) must not leave callers waiting
                with self._lock:
                    everything = set(self._open)
                self._end(everything, RuntimeError("the LLM is closed"))
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
            except Exception:  # noqa: BLE001  (its requests heard of it through their readers)
                pass

    def _step(self) -> None:
        """One engine-core step, under the step lock; its outputs to their readers. A failure
        ends the requests it touched, and only those, with its error (``_end``): a failing core
        step every request the core held (their state is the step's), a failing output
        processor the requests with outputs in this step; both are raised to the caller. A
        reader whose ``put`` raises ends its own requests only (``_publish``)."""
        if self._closed:
            raise RuntimeError("the LLM is closed")
        self._take_inbox()
        try:
            finished = self.core.step(self.outputs.on_token, self._interrupts_run)
        except Exception as exc:
            with self._lock:  # every admitted request, those the core let go of before it failed too
                queued = {a.request.rid for a in self._inbox}
                admitted = {rid for rid in self._open if rid not in queued}
            self._end(admitted, exc)
            raise
        try:
            deltas, completions = self.outputs.finish(finished)
        except Exception as exc:
            # The core has already let go of what finished: its readers must hear of it here, and
            # so must those whose pieces of this step were lost with it.
            self._end({r.rid for r, _ in finished} | self.outputs.pending(), exc)
            raise
        self._publish(deltas, completions)

    def _interrupts_run(self) -> bool:
        """A greedy run ends after its current step for a request that could take a free slot,
        or an abort."""
        return bool((self._inbox and self.core.scheduler.slots.free) or self._aborts)

    def _take_inbox(self) -> None:
        """Admits what was submitted since the last step, then applies aborts. A request the
        core refuses ends alone, with the core's error."""
        if not self._inbox and not self._aborts:  # most steps; one arriving now waits for the next
            return
        with self._lock:
            arrived, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, set()
        for arrival in arrived:
            try:
                self.core.add(arrival.request, arrival.constraint)
                self.outputs.add(arrival.request.rid, arrival.arrival_s)
            except Exception as exc:  # noqa: BLE001  (its reader is told; the others run on)
                self._end({arrival.request.rid}, exc)
        for rid in aborts:
            self.core.abort(rid)

    def _publish(self, deltas: list[Delta], completions: list[Completion]) -> None:
        pieces: dict[str, list[Delta]] = {}
        for delta in deltas:
            pieces.setdefault(delta.rid, []).append(delta)
        with self._lock:
            sinks = {rid: self._open.get(rid, _GONE) for rid in pieces}
            for completion in completions:
                sink = self._open.pop(completion.rid, None)
                self._aborts.discard(completion.rid)  # a late abort must not hit a new request of that id
                self._subscribed -= sink is not None
        broken: dict[int, tuple[Subscriber, Exception]] = {}   # readers whose put raised, by id
        for rid, mine in pieces.items():
            sink = sinks[rid]
            if sink is None or sink is _GONE or id(sink.subscriber) in broken:
                continue
            try:
                sink.subscriber.put(sink.index, mine)
            except Exception as exc:  # noqa: BLE001  (that reader's requests end; the others' puts go on)
                broken[id(sink.subscriber)] = (sink.subscriber, exc)
        if any(sink is None for sink in sinks.values()):  # polled requests made output
            polled_deltas, polled_completions = self._polled
            polled_deltas += [d for d in deltas if sinks[d.rid] is None]
            polled_completions += [c for c in completions if sinks.get(c.rid) is None]
        for subscriber, exc in broken.values():
            with self._lock:
                theirs = {rid for rid, sink in self._open.items() if sink is not None and sink.subscriber is subscriber}
            self._end(theirs, exc, also=subscriber)   # told even if its last request just finished

    def _end(self, rids: set[str], error: Exception, also: Subscriber | None = None) -> None:
        """These requests ended with ``error``, wherever they were (queued, in the core, finished
        but not delivered): they leave the core, the output processor and the open set at once,
        so their ids are free, and each of their readers (and ``also``) hears ``fail`` once; a
        polled one's error waits for the next ``step()``."""
        try:
            self.core.drop(rids)
            self.outputs.drop(rids)
        finally:  # their readers hear of it whatever else broke
            with self._lock:
                sinks = [self._open.pop(rid) for rid in rids if rid in self._open]
                self._aborts -= rids
                self._inbox = [a for a in self._inbox if a.request.rid not in rids]
                self._subscribed -= sum(sink is not None for sink in sinks)
            self._tell(sinks, error, also)

    def _tell(self, sinks: list[Sink | None], error: Exception, also: Subscriber | None) -> None:
        """Each reader's ``fail``, once however many of its requests ended."""
        if any(sink is None for sink in sinks) and self._polled_error is None:
            self._polled_error = error
        readers = {id(s.subscriber): s.subscriber for s in sinks if s is not None}
        if also is not None:
            readers[id(also)] = also
        for reader in readers.values():
            try:
                reader.fail(error)
            except Exception:  # noqa: BLE001  (a broken reader must not keep the others from hearing)
                pass

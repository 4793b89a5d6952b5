"""``LLM``: generate text from an engine dir (Python API), a thin front over three parts:

- the input processor (runtime/input_processor.py): prompts to checked token ids;
- the engine core (runtime/engine_core.py): schedule, run the engine, sample, commit;
- the output processor (runtime/output_processor.py): text, stop strings, deltas, completions.

``LLM`` adds what callers share: an inbox that submissions and aborts wait in (so a caller
never blocks behind a running step), the lock a step holds, and delivery to the callers that
wait (``generate``, ``stream``). Async streaming is runtime/async_llm.py."""
from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from ..checkpoint.errors import CheckpointError
from ..checkpoint.tokenizer import tokenizer_from
from ..contract.onnxruntime import CpuActivations, Spinning
from .detokenize import Detokenizer
from .engine import Engine
from .engine_core import EngineCore, RuntimeStats
from .engine_dir import EngineDirError, load
from .engines import make_engine
from .input_processor import InputProcessor, checked_multi_step
from .output_processor import OutputProcessor
from .outputs import Completion, Delta
from .prefix_cache import PrefixCache
from .sampling import SamplingParams
from .scheduler import Batching, Request, Scheduler
from .speculation import SpeculationPolicy, policy_for
from .structured import CompiledConstraint, ConstraintCompiler

__all__ = ["LLM", "RuntimeStats"]


def default_prefix_blocks(engine_dir, block_size: int) -> int:
    """The prefix store's size unless the caller gives one: as many tokens as two full slots."""
    return 2 * engine_dir.max_seq_len // block_size


@dataclass(frozen=True)
class _Submitted:
    request: Request
    arrival_s: float
    constraint: CompiledConstraint | None = None


class LLM:
    """Loads an engine dir and generates with in-flight batching.

    >>> llm = LLM("build/tiny-code")
    >>> llm.generate(["def fibonacci(n):"], SamplingParams(max_tokens=32))[0].text
    """

    def __init__(self, engine_dir: str | Path, backend: str = "auto", threads: int = 0,
                 prefix_cache: bool | None = None, prefix_cache_blocks: int | None = None, block_size: int = 16,
                 batching: Batching = Batching.inflight, token_budget: int | None = None,
                 verify: bool = True, medusa_tree_size: int | None = None, multi_step: int | None = None,
                 engine: Engine | None = None, spinning: Spinning = Spinning.always):
        """``medusa_tree_size``: for engine dirs with Medusa heads, None picks the tree prefix per
        batch from measured step times and acceptance; an int pins it (0: no speculation).
        ``multi_step``: decode steps a batch of greedy requests runs back to back, each row fed
        its own argmax, before the scheduler, detokenizer and stop strings see the tokens (1:
        every step goes through them; None: the spec's runtime.multi_step). Greedy tokens are
        the same either way. ``engine``: run this Engine (made for this dir, with
        ``prefix_cache_blocks`` blocks of ``block_size``) instead of the backend's; tests and
        benchmarks pass a configured one in. ``spinning``: whether the CPU engine's threads spin
        between ops (contract.onnxruntime.Spinning); a server, whose event loop shares the cores
        with the engine, runs them sleeping."""
        if multi_step is not None:
            checked_multi_step(multi_step)
        d = self.engine_dir = load(Path(engine_dir), verify_hashes=verify)
        use_prefix = d.runtime_defaults.get("prefix_cache", True) if prefix_cache is None else prefix_cache
        blocks = (prefix_cache_blocks if prefix_cache_blocks is not None
                  else default_prefix_blocks(d, block_size)) if use_prefix else 0
        try:
            path = d.side_file("tokenizer.json")
            self.tokenizer = tokenizer_from(path.read_bytes(), str(path))
        except CheckpointError as exc:
            raise EngineDirError(str(exc)) from None
        self.inputs = InputProcessor(self.tokenizer, d)
        self.constraints = ConstraintCompiler(self.tokenizer, d.vocab_size, d.eos_token_ids())
        engine = engine if engine is not None else make_engine(d, backend, threads, blocks, block_size, verify, spinning)
        scheduler = Scheduler(
            capacity=d.max_batch_size, max_seq_len=d.max_seq_len, max_chunk=d.max_input_len,
            token_budget=token_budget, prefix_cache=PrefixCache(block_size, blocks) if use_prefix else None,
            eos_token_ids=d.eos_token_ids(), batching=batching)
        multi_step = multi_step or d.multi_step
        try:
            speculation = policy_for(d, engine, medusa_tree_size, multi_step)
        except BaseException:
            engine.close()
            raise
        self.core = EngineCore(engine, scheduler, speculation, multi_step)
        self.outputs = OutputProcessor(Detokenizer(self.tokenizer, d.vocab_size), self.core.sampling)
        self._ids = itertools.count()
        self._lock = threading.Lock()          # held for a whole step, and by close()
        self._closed = False
        # Submissions and aborts wait here, under a lock held only for a moment, so a caller (an
        # event loop) never blocks behind an engine step; the next step takes them in.
        self._inbox_lock = threading.Lock()
        self._inbox: deque[_Submitted] = deque()
        self._aborts: set[str] = set()
        self._rids: set[str] = set()           # every request not yet completed
        self._collect: dict[str, Completion | None] = {}   # rid → completion, for callers that wait
        self._streams: dict[str, deque[Delta]] = {}         # rid → deltas, for sync stream() callers

    # -- the parts, for callers that read them ---------------------------------------------------
    @property
    def engine(self) -> Engine:
        return self.core.engine

    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    @property
    def speculation(self) -> SpeculationPolicy | None:
        return self.core.speculation

    @property
    def stats(self) -> RuntimeStats:
        return self.core.stats

    @property
    def multi_step(self) -> int:
        return self.core.multi_step

    @property
    def backend(self) -> str:
        return self.engine.name

    @property
    def backend_label(self) -> str:
        """The backend as the CLI prints it: ONNX Runtime says when it quantizes activations."""
        if self.backend.startswith("onnxruntime") and self.engine_dir.cpu_activations == CpuActivations.int8:
            return f"{self.backend}, int8 activations"
        return self.backend

    def close(self) -> None:
        """Releases the engine (device memory; a tensor-parallel engine's rank processes) once
        any running step has ended; later steps raise."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def default_params(self, **overrides) -> SamplingParams:
        return self.inputs.default_params(**overrides)

    def tokens(self, prompt: str | list[int]) -> list[int]:
        """The prompt's token ids; refuses text that is not UTF-8 and ids outside the vocabulary."""
        return self.inputs.tokens(prompt)

    # -- requests --------------------------------------------------------------------------------
    def submit(self, prompt: str | list[int], params: SamplingParams, rid: str | None = None) -> str:
        """Queues one request without waiting for a running step; raises ValueError (and changes
        nothing) if it cannot run. The next step admits it."""
        tokens = self.inputs.process(prompt, params, "prompt")
        return self._enqueue(tokens, params, rid or self.new_rid(), self.compile(params))

    def compile(self, params: SamplingParams) -> CompiledConstraint | None:
        """The request's constraint compiled (cached; raises ConstraintError, a ValueError, if it
        cannot be), in the caller's thread: never in a step."""
        return self.constraints.compile(params.constraint) if params.constraint is not None else None

    def new_rid(self) -> str:
        """A request id no other request of this LLM has been given."""
        return f"req-{next(self._ids)}"

    def _enqueue(self, tokens: list[int], params: SamplingParams, rid: str,
                 constraint: CompiledConstraint | None = None) -> str:
        submitted = _Submitted(Request(rid=rid, prompt=tokens, params=params), time.perf_counter(), constraint)
        with self._inbox_lock:
            if rid in self._rids:
                raise ValueError(f"request id {rid!r} is already in use")
            self._rids.add(rid)
            self._inbox.append(submitted)
        return rid

    def abort(self, rid: str) -> None:
        """Ends a request at the next step (its KV slot is freed then); its completion, if anyone
        waits for it, has finish_reason "abort". Unknown or finished ids are ignored."""
        with self._inbox_lock:
            if rid in self._rids:
                self._aborts.add(rid)

    def has_work(self) -> bool:
        return bool(self._inbox) or self.core.has_work()

    @property
    def inbox_size(self) -> int:
        return len(self._inbox)

    def queue_depth(self) -> int:
        """Requests waiting for a KV slot, including those submitted since the last step."""
        return len(self._inbox) + len(self.scheduler.waiting)

    def generate(self, prompts: list[str] | str | list[list[int]], params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[Completion]:
        """Completions in prompt order. Every request is validated before any runs."""
        single = isinstance(prompts, str)
        prompts = [prompts] if single else list(prompts)
        params_list = params if isinstance(params, list) else [params or self.default_params()] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(params_list)} SamplingParams for {len(prompts)} prompts")
        token_lists = [self.inputs.process(p, q, f"prompt {i}") for i, (p, q) in enumerate(zip(prompts, params_list))]
        constraints = [self.compile(q) for q in params_list]
        rids = [self.new_rid() for _ in prompts]
        for rid in rids:
            self._collect[rid] = None
        for rid, tokens, p, constraint in zip(rids, token_lists, params_list, constraints):
            self._enqueue(tokens, p, rid, constraint)
        # Steps run every request in flight; completions of other callers' requests stay theirs.
        while any(self._collect[rid] is None for rid in rids):
            self.step()
        return [self._collect.pop(rid) for rid in rids]

    def run_until_done(self) -> list[Completion]:
        """Steps until nothing is queued or running; the completions that finished meanwhile
        (but those a generate() call waits for)."""
        completions = []
        while self.has_work():
            _, finished = self.step()
            completions += finished
        return completions

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None) -> Iterator[Delta]:
        """Yields text pieces of one request as they are produced (other queued requests run too;
        their pieces go to their own callers). Leaving the loop early aborts the request."""
        rid = self.new_rid()
        mine = self._streams[rid] = deque()
        finished = False
        try:
            self.submit(prompt, params or self.default_params(), rid=rid)
            while not finished:
                while not mine:
                    self.step()
                delta = mine.popleft()
                finished = delta.finished
                yield delta
        finally:
            self._streams.pop(rid, None)
            if not finished:
                self.abort(rid)

    # -- the step loop ------------------------------------------------------------------------------
    def step(self) -> tuple[list[Delta], list[Completion]]:
        """One engine-core step (cache ops, one engine step or a greedy run of ``multi_step``,
        sampling, commit, detokenization): its deltas, and the completions no generate() call
        waits for."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the LLM is closed")
            self._take_inbox()
            finished = self.core.step(self.outputs.on_token, self._interrupts_run)
            deltas, completions = self.outputs.finish(finished)
            self._deliver(deltas, completions)
            # Filtered under the lock: a generate() in another thread may collect its rid right after.
            unclaimed = [c for c in completions if c.rid not in self._collect]
        return deltas, unclaimed

    def _interrupts_run(self) -> bool:
        """A greedy run ends after its current step for a request that could take a free slot,
        or an abort."""
        return bool((self._inbox and self.scheduler.slots.free) or self._aborts)

    def _take_inbox(self) -> None:
        """Admits what was submitted since the last step, then applies aborts."""
        if not self._inbox and not self._aborts:  # most steps; one arriving now waits for the next
            return
        with self._inbox_lock:
            arrived, self._inbox = list(self._inbox), deque()
            aborts, self._aborts = self._aborts, set()
        for submitted in arrived:
            self.core.add(submitted.request, submitted.constraint)
            self.outputs.add(submitted.request.rid, submitted.arrival_s)
        for rid in aborts:
            self.core.abort(rid)

    def _deliver(self, deltas: list[Delta], completions: list[Completion]) -> None:
        """Completions to waiting generate() callers, deltas to sync stream() callers."""
        if completions:
            with self._inbox_lock:
                self._rids -= {c.rid for c in completions}
            for completion in completions:
                if completion.rid in self._collect:
                    self._collect[completion.rid] = completion
        if self._streams:
            for delta in deltas:
                stream = self._streams.get(delta.rid)
                if stream is not None:
                    stream.append(delta)


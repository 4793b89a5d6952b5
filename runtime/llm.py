"""``LLM``: generate text from an engine dir (Python API), sync and async streaming."""
from __future__ import annotations

import asyncio
import itertools
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator, Iterator

from .engine import Engine, StepOutput
from .medusa import Accepted, Tree, accept_greedy, accept_typical
from .speculation import AcceptanceModel, SpeculationPolicy, StepTimes, calibrate
from .detokenize import IncrementalDecoder
from .engine_dir import EngineDir, load
from .prefix_cache import PrefixCache
from .sampling import Sampler, SamplingParams
from .scheduler import (Batching, CopySlot, Draft, KeepPath, LoadBlock, Phase, Plan, Request, SaveBlock, Scheduler, Step,
                        StepKind)


@dataclass
class Completion:
    rid: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list[float] | None
    cached_tokens: int
    decode_steps: int        # engine steps that produced this request's tokens after the first
    accepted_tokens: int     # Medusa guesses accepted (each saved one decode step)
    arrival_s: float
    first_token_s: float
    finish_s: float

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s


@dataclass(frozen=True)
class Delta:
    """A streamed piece of one request's output."""
    rid: str
    text: str
    token_id: int
    finished: bool
    finish_reason: str | None = None


@dataclass
class _Live:
    request: Request
    sampler: Sampler
    decoder: IncrementalDecoder
    arrival_s: float
    first_token_s: float | None = None
    decode_steps: int = 0
    accepted_tokens: int = 0
    text: str = ""
    logprobs: list[float] = field(default_factory=list)


@dataclass
class RuntimeStats:
    steps: int = 0
    engine_s: float = 0.0       # inside Engine.step
    loop_s: float = 0.0         # whole step loop, engine included
    prefill_steps: int = 0
    decode_steps: int = 0


def make_engine(engine_dir: EngineDir, backend: str, threads: int, prefix_blocks: int, block_size: int,
                verify: bool = True) -> Engine:
    """``auto`` runs the TensorRT engine on a GPU machine with TensorRT, else the rank ONNX on CPU.
    A tensor-parallel engine dir runs one process per rank (runtime/tensor_parallel.py)."""
    if backend not in ("auto", "tensorrt", "onnxruntime"):
        raise ValueError(f"backend {backend!r}: valid: auto, tensorrt, onnxruntime")
    if engine_dir.tensor_parallel > 1:
        if backend == "tensorrt":
            raise ValueError(f"--backend tensorrt: {engine_dir.path} has {engine_dir.tensor_parallel} ranks and the "
                             "TensorRT backend runs one rank so far; use --backend onnxruntime")
        from .tensor_parallel import TensorParallelEngine

        return TensorParallelEngine(engine_dir, threads=threads, prefix_blocks=prefix_blocks, block_size=block_size,
                                    verify=verify)
    if backend in ("auto", "tensorrt"):
        from .tensorrt_engine import TensorRTEngine, tensorrt_available

        reason = tensorrt_available(engine_dir)
        if reason is None:
            return TensorRTEngine(engine_dir, prefix_blocks=prefix_blocks, block_size=block_size)
        if backend == "tensorrt":
            raise ValueError(f"--backend tensorrt: {reason}")
    from .onnxruntime_engine import OnnxRuntimeEngine

    return OnnxRuntimeEngine(engine_dir, threads=threads, prefix_blocks=prefix_blocks, block_size=block_size)


class LLM:
    """Loads an engine dir and generates with in-flight batching.

    >>> llm = LLM("build/tiny-code")
    >>> llm.generate(["def fibonacci(n):"], SamplingParams(max_tokens=32))[0].text
    """

    def __init__(self, engine_dir: str | Path, backend: str = "auto", threads: int = 0,
                 prefix_cache: bool | None = None, prefix_cache_blocks: int | None = None, block_size: int = 16,
                 batching: Batching = Batching.inflight, token_budget: int | None = None,
                 verify: bool = True, medusa_tree_size: int | None = None):
        """``medusa_tree_size``: for engine dirs with Medusa heads, None picks the tree prefix per
        batch from measured step times and acceptance; an int pins it (0: no speculation)."""
        from tokenizers import Tokenizer

        self.engine_dir = load(Path(engine_dir), verify_hashes=verify)
        d = self.engine_dir
        use_prefix = d.runtime_defaults.get("prefix_cache", True) if prefix_cache is None else prefix_cache
        # By default the prefix store holds as many tokens as two full slots.
        blocks = (prefix_cache_blocks if prefix_cache_blocks is not None
                  else 2 * d.max_seq_len // block_size) if use_prefix else 0
        self.tokenizer = Tokenizer.from_file(str(d.path / "tokenizer.json"))
        self.engine = make_engine(d, backend, threads, blocks, block_size, verify)
        self.scheduler = Scheduler(
            capacity=d.max_batch_size, max_seq_len=d.max_seq_len, max_chunk=d.max_input_len,
            token_budget=token_budget, prefix_cache=PrefixCache(block_size, blocks) if use_prefix else None,
            eos_token_ids=d.eos_token_ids(), batching=batching)
        self.stats = RuntimeStats()
        self.speculation = self._speculation(medusa_tree_size)
        self._live: dict[str, _Live] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()

    def _speculation(self, fixed: int | None) -> SpeculationPolicy | None:
        medusa = self.engine_dir.medusa
        if medusa is None:
            if fixed:
                raise ValueError(f"medusa_tree_size {fixed}: {self.engine_dir.path} was built without Medusa heads")
            return None
        tree = Tree(tuple(tuple(path) for path in medusa["tree"]))
        acceptance = AcceptanceModel(medusa["rank_accuracy"])
        if fixed is not None:
            return SpeculationPolicy(tree, acceptance, StepTimes(), fixed)
        times = calibrate(self.engine, tree, self.engine_dir.max_batch_size)
        return SpeculationPolicy(tree, acceptance, times)

    @property
    def backend(self) -> str:
        return self.engine.name

    def close(self) -> None:
        """Stops the engine's other processes (tensor-parallel ranks), if it has any."""
        close = getattr(type(self.engine), "close", None)
        if close is not None:
            close(self.engine)

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def default_params(self, **overrides) -> SamplingParams:
        defaults = self.engine_dir.runtime_defaults
        values = {k: defaults[k] for k in ("max_tokens", "temperature", "top_k", "top_p") if k in defaults}
        return SamplingParams(**{**values, **overrides})

    # -- requests --------------------------------------------------------------------------------
    def submit(self, prompt: str | list[int], params: SamplingParams, rid: str | None = None) -> str:
        """Queues one request; raises ValueError (and changes nothing) if it cannot run."""
        tokens = self.tokenizer.encode(prompt).ids if isinstance(prompt, str) else list(prompt)
        rid = rid or f"req-{next(self._ids)}"
        request = Request(rid=rid, prompt=tokens, params=params)
        with self._lock:
            self.scheduler.add(request)
            self._live[rid] = _Live(request, Sampler(params), IncrementalDecoder(self.tokenizer), time.perf_counter())
        return rid

    def generate(self, prompts: list[str] | str | list[list[int]], params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[Completion]:
        """Completions in prompt order. Every request is validated before any runs."""
        single = isinstance(prompts, str)
        prompts = [prompts] if single else list(prompts)
        params_list = params if isinstance(params, list) else [params or self.default_params()] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(params_list)} SamplingParams for {len(prompts)} prompts")
        token_lists = [self.tokenizer.encode(p).ids if isinstance(p, str) else list(p) for p in prompts]
        for index, (tokens, p) in enumerate(zip(token_lists, params_list)):
            self._check(tokens, p, index)
        rids = [self.submit(tokens, p) for tokens, p in zip(token_lists, params_list)]
        done = {c.rid: c for c in self.run_until_done()}
        return [done[rid] for rid in rids]

    def _check(self, tokens: list[int], params: SamplingParams, index: int) -> None:
        limit = self.engine_dir.max_seq_len
        if not tokens:
            raise ValueError(f"prompt {index}: empty")
        if len(tokens) + params.max_tokens > limit:
            raise ValueError(f"prompt {index}: {len(tokens)} tokens + max_tokens {params.max_tokens} exceeds "
                             f"max_seq_len {limit}")

    def run_until_done(self) -> list[Completion]:
        completions = []
        while self.scheduler.has_work():
            _, finished = self.step()
            completions += finished
        return completions

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None) -> Iterator[Delta]:
        """Yields text pieces of one request as they are produced (other queued requests run too)."""
        rid = self.submit(prompt, params or self.default_params())
        while True:
            deltas, _ = self.step()
            for delta in deltas:
                if delta.rid == rid:
                    yield delta
                    if delta.finished:
                        return

    # -- the step loop ------------------------------------------------------------------------------
    def step(self) -> tuple[list[Delta], list[Completion]]:
        """One scheduler step: cache ops, one engine step, sampling, detokenization."""
        with self._lock:
            start = time.perf_counter()
            plan = self.scheduler.schedule()
            self._apply(plan)
            deltas: list[Delta] = []
            if plan.step is not None:
                step = plan.step
                engine_start = time.perf_counter()
                out = self.engine.step(step)
                seconds = time.perf_counter() - engine_start
                self.stats.engine_s += seconds
                self.stats.steps += 1
                if step.kind == StepKind.prefill:
                    self.stats.prefill_steps += 1
                else:
                    self.stats.decode_steps += 1
                deltas = self._sample_and_commit(step, out)
                if self.speculation is not None and step.kind == StepKind.decode:
                    self.speculation.times.observe(len(step.rids), step.seq_len, seconds,
                                                   time.perf_counter() - start)
            finished = [self._complete(r) for r in self.scheduler.pop_finished()]
            self.stats.loop_s += time.perf_counter() - start
        return deltas, finished

    def _sample_and_commit(self, step: Step, out: StepOutput) -> list[Delta]:
        """Accepts each verifying row's path, samples every row's next token, commits, and
        drafts the next guesses from the heads' logits at each row's last accepted node."""
        sampled: dict[str, int] = {}
        accepted: dict[str, Accepted] = {}
        heads_at: dict[str, object] = {}  # rid → medusa logits [K, V] at its newest token
        policy = self.speculation
        if policy is not None and step.kind == StepKind.decode:
            policy.count_step(step.verifies, step.seq_len)
        for row, (rid, samples, tree) in enumerate(zip(step.rids, step.samples, step.row_trees)):
            if not samples:
                continue
            live = self._live[rid]
            node = 0
            if tree is not None:
                params, tokens, logits = live.sampler.params, list(step.tokens[row]), out.logits[row, :tree.size]
                path = (accept_greedy(tree, tokens, logits) if params.greedy
                        else accept_typical(tree, tokens, logits, params.temperature))
                accepted[rid], node = path, path.last_node
                policy.record(tree, path)
                live.accepted_tokens += len(path.nodes)
                if params.logprobs:
                    live.logprobs += [live.sampler.logprob(logits[tree.parents[n]], tokens[n]) for n in path.nodes]
            if step.kind == StepKind.decode:
                live.decode_steps += 1
            token, logprob = live.sampler.sample(out.logits[row, node])
            sampled[rid] = token
            if logprob is not None:
                live.logprobs.append(logprob)
            if out.medusa is not None:
                heads_at[rid] = out.medusa[row, node]
        deltas, stopped = [], set()
        for request, token in self.scheduler.commit(step, sampled, accepted):
            if request.rid in stopped:  # a stop string ended it earlier in this step's tokens
                continue
            delta = self._detokenize(request, token)
            deltas.append(delta)
            if delta.finished:
                stopped.add(request.rid)
        if policy is not None and heads_at:
            self._draft(policy, heads_at)
        return deltas

    def _draft(self, policy: SpeculationPolicy, heads_at: dict) -> None:
        decoding = [self.scheduler.requests[rid] for rid in self.scheduler.slots.decoding()]
        size = policy.choose(len(decoding))
        if size == 0:
            return
        tree = policy.prefix(size)
        for request in decoding:
            medusa = heads_at.get(request.rid)
            if medusa is not None and request.phase == Phase.decoding and request.params.speculative:
                request.draft = Draft(tree, tuple(tree.candidates(request.tokens[-1], medusa)[1:]))

    def _apply(self, plan: Plan) -> None:
        for op in plan.ops:
            if isinstance(op, CopySlot):
                if op.length:
                    self.engine.copy_slot(op.src, op.dst, op.length)
            elif isinstance(op, SaveBlock):
                self.engine.save_block(op.slot, op.index, op.block)
            elif isinstance(op, LoadBlock):
                self.engine.load_block(op.block, op.slot, op.index)
            elif isinstance(op, KeepPath):
                self.engine.keep_path(op.slot, op.start, op.nodes)

    def _detokenize(self, request: Request, token: int) -> Delta:
        live = self._live[request.rid]
        now = time.perf_counter()
        if live.first_token_s is None:
            live.first_token_s = now
        before = len(live.text)
        live.text += live.decoder.push(request.output)
        stops, stopped_by_string = request.params.stop, False
        if stops:  # search only where a stop string could newly complete
            start = max(0, before - max(map(len, stops)) + 1)
            stop_at = min((i for i in (live.text.find(s, start) for s in stops) if i >= 0), default=-1)
            if stop_at >= 0:
                live.text, stopped_by_string = live.text[:stop_at], True
                self.scheduler.finish(request.rid, "stop")
        if request.finish_reason is not None and not stopped_by_string:
            live.text += live.decoder.flush(request.output)  # text held back mid-character, if any
        return Delta(rid=request.rid, text=live.text[before:], token_id=token,
                     finished=request.finish_reason is not None, finish_reason=request.finish_reason)

    def _complete(self, request: Request) -> Completion:
        live = self._live.pop(request.rid)
        now = time.perf_counter()
        return Completion(rid=request.rid, prompt_token_ids=request.prompt, token_ids=list(request.output),
                          text=live.text, finish_reason=request.finish_reason or "abort",
                          logprobs=live.logprobs[:len(request.output)] if request.params.logprobs else None,
                          cached_tokens=request.cached_tokens, decode_steps=live.decode_steps,
                          accepted_tokens=live.accepted_tokens, arrival_s=live.arrival_s,
                          first_token_s=live.first_token_s or now, finish_s=now)


class AsyncLLM:
    """Async streaming over one LLM: a driver task runs steps in a worker thread while any request lives."""

    def __init__(self, llm: LLM):
        self.llm = llm
        self._queues: dict[str, asyncio.Queue] = {}
        self._driver: asyncio.Task | None = None

    async def stream(self, prompt: str | list[int], params: SamplingParams | None = None) -> AsyncIterator[Delta]:
        rid = self.llm.submit(prompt, params or self.llm.default_params())
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = queue
        if self._driver is None or self._driver.done():
            self._driver = asyncio.get_running_loop().create_task(self._drive())
        while True:
            delta = await queue.get()
            yield delta
            if delta.finished:
                self._queues.pop(rid, None)
                return

    async def _drive(self) -> None:
        loop = asyncio.get_running_loop()
        while self.llm.scheduler.has_work():
            deltas, _ = await loop.run_in_executor(None, self.llm.step)
            for delta in deltas:
                queue = self._queues.get(delta.rid)
                if queue is not None:
                    queue.put_nowait(delta)

"""``LLM``: generate text from an engine dir (Python API): the request API and the step loop.

Engines come from engines.py, request outputs (text, stop strings, completions) from
outputs.py, async streaming from async_llm.py."""
from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterator

import numpy as np

from ..contract.onnxruntime import CpuActivations
from .engine import StepOutput
from .engines import make_engine
from .outputs import Completion, Delta, RequestOutput
from .medusa import Accepted, Tree, accept_greedy, accept_typical
from .speculation import AcceptanceModel, SpeculationPolicy, StepTimes, calibrate
from .detokenize import Detokenizer
from .engine_dir import EngineDirError, load
from .prefix_cache import PrefixCache
from .sampling import Sampler, SamplingParams
from .scheduler import (Batching, CopySlot, Draft, KeepPath, LoadBlock, Phase, Plan, Request, SaveBlock, Scheduler, Step,
                        StepKind)


@dataclass
class RuntimeStats:
    steps: int = 0
    engine_s: float = 0.0       # inside Engine.step
    loop_s: float = 0.0         # whole step loop, engine included
    prefill_steps: int = 0
    decode_steps: int = 0


class LLM:
    """Loads an engine dir and generates with in-flight batching.

    >>> llm = LLM("build/tiny-code")
    >>> llm.generate(["def fibonacci(n):"], SamplingParams(max_tokens=32))[0].text
    """

    def __init__(self, engine_dir: str | Path, backend: str = "auto", threads: int = 0,
                 prefix_cache: bool | None = None, prefix_cache_blocks: int | None = None, block_size: int = 16,
                 batching: Batching = Batching.inflight, token_budget: int | None = None,
                 verify: bool = True, medusa_tree_size: int | None = None, multi_step: int | None = None):
        """``medusa_tree_size``: for engine dirs with Medusa heads, None picks the tree prefix per
        batch from measured step times and acceptance; an int pins it (0: no speculation).
        ``multi_step``: decode steps a batch of greedy requests runs back to back, each row fed
        its own argmax, before the scheduler, detokenizer and stop strings see the tokens (1:
        every step goes through them; None: the spec's runtime.multi_step). Greedy tokens are
        the same either way."""
        if multi_step is not None and (not isinstance(multi_step, int) or isinstance(multi_step, bool)
                                       or multi_step < 1):
            raise ValueError(f"multi_step must be an integer ≥ 1 (got {multi_step!r})")
        from tokenizers import Tokenizer

        self.engine_dir = load(Path(engine_dir), verify_hashes=verify)
        d = self.engine_dir
        use_prefix = d.runtime_defaults.get("prefix_cache", True) if prefix_cache is None else prefix_cache
        # By default the prefix store holds as many tokens as two full slots.
        blocks = (prefix_cache_blocks if prefix_cache_blocks is not None
                  else 2 * d.max_seq_len // block_size) if use_prefix else 0
        try:
            self.tokenizer = Tokenizer.from_file(str(d.path / "tokenizer.json"))
        except Exception as exc:  # noqa: BLE001  (the tokenizers library raises a bare Exception)
            raise EngineDirError(f"{d.path / 'tokenizer.json'}: not a loadable tokenizer "
                                 f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from None
        self.detokenizer = Detokenizer(self.tokenizer, d.vocab_size)
        self.engine = make_engine(d, backend, threads, blocks, block_size, verify)
        self.scheduler = Scheduler(
            capacity=d.max_batch_size, max_seq_len=d.max_seq_len, max_chunk=d.max_input_len,
            token_budget=token_budget, prefix_cache=PrefixCache(block_size, blocks) if use_prefix else None,
            eos_token_ids=d.eos_token_ids(), batching=batching)
        self.stats = RuntimeStats()
        self.speculation = self._speculation(medusa_tree_size)
        # Medusa engines verify the heads' guesses every step instead.
        self.multi_step = 1 if self.speculation is not None else multi_step or d.multi_step
        self._live: dict[str, RequestOutput] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()          # held for a whole step
        # Submissions and aborts wait here, under a lock held only for a moment, so a caller (an
        # event loop) never blocks behind an engine step; the next step takes them in.
        self._inbox_lock = threading.Lock()
        self._inbox: deque[RequestOutput] = deque()
        self._aborts: set[str] = set()
        self._rids: set[str] = set()           # every request not yet completed
        self._collect: dict[str, Completion | None] = {}   # rid → completion, for callers that wait
        self._streams: dict[str, deque[Delta]] = {}         # rid → deltas, for sync stream() callers

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

    @property
    def backend_label(self) -> str:
        """The backend as the CLI prints it: ONNX Runtime says when it quantizes activations."""
        if self.backend.startswith("onnxruntime") and self.engine_dir.cpu_activations == CpuActivations.int8:
            return f"{self.backend}, int8 activations"
        return self.backend

    def close(self) -> None:
        """Releases the engine (device memory; a tensor-parallel engine's rank processes)."""
        self.engine.close()

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
        """Queues one request without waiting for a running step; raises ValueError (and changes
        nothing) if it cannot run. The next step admits it."""
        tokens = self.tokens(prompt)
        self._check(tokens, params, rid or "")
        rid = rid or f"req-{next(self._ids)}"
        output = RequestOutput(Request(rid=rid, prompt=tokens, params=params), Sampler(params),
                               self.detokenizer.stream(), time.perf_counter())
        with self._inbox_lock:
            if rid in self._rids:
                raise ValueError(f"request id {rid!r} is already in use")
            self._rids.add(rid)
            self._inbox.append(output)
        return rid

    def abort(self, rid: str) -> None:
        """Ends a request at the next step (its KV slot is freed then); its completion, if anyone
        waits for it, has finish_reason "abort". Unknown or finished ids are ignored."""
        with self._inbox_lock:
            if rid in self._rids:
                self._aborts.add(rid)

    def has_work(self) -> bool:
        return bool(self._inbox) or self.scheduler.has_work()

    @property
    def inbox_size(self) -> int:
        return len(self._inbox)

    def queue_depth(self) -> int:
        """Requests waiting for a KV slot, including those submitted since the last step."""
        return len(self._inbox) + len(self.scheduler.waiting)

    def tokens(self, prompt: str | list[int]) -> list[int]:
        """The prompt's token ids; refuses text that is not UTF-8 and ids outside the vocabulary."""
        if isinstance(prompt, str):
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError("prompt: not valid UTF-8 text") from None
            return self.tokenizer.encode(prompt).ids
        tokens = list(prompt)
        vocab = self.engine_dir.vocab_size
        # numpy integers are ids too; bools and floats are mistakes to name, not ids.
        wrong = next((t for t in tokens if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer))), None)
        if wrong is not None:
            raise ValueError(f"prompt: token ids are integers, got {wrong!r} ({type(wrong).__name__})")
        tokens = [int(t) for t in tokens]
        bad = next((t for t in tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt: token id {bad} is outside the vocabulary [0, {vocab})")
        return tokens

    def generate(self, prompts: list[str] | str | list[list[int]], params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[Completion]:
        """Completions in prompt order. Every request is validated before any runs."""
        single = isinstance(prompts, str)
        prompts = [prompts] if single else list(prompts)
        params_list = params if isinstance(params, list) else [params or self.default_params()] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(params_list)} SamplingParams for {len(prompts)} prompts")
        token_lists = [self.tokens(p) for p in prompts]
        for index, (tokens, p) in enumerate(zip(token_lists, params_list)):
            self._check(tokens, p, f"prompt {index}")
        rids = [f"req-{next(self._ids)}" for _ in prompts]
        for rid in rids:
            self._collect[rid] = None
        for rid, tokens, p in zip(rids, token_lists, params_list):
            self.submit(tokens, p, rid=rid)
        # Steps run every request in flight; completions of other callers' requests stay theirs.
        while any(self._collect[rid] is None for rid in rids):
            self.step()
        return [self._collect.pop(rid) for rid in rids]

    def _check(self, tokens: list[int], params: SamplingParams, where: str) -> None:
        limit, where = self.engine_dir.max_seq_len, where or "prompt"
        if not tokens:
            raise ValueError(f"{where}: empty")
        if len(tokens) + params.max_tokens > limit:
            raise ValueError(f"{where}: {len(tokens)} tokens + max_tokens {params.max_tokens} exceeds "
                             f"max_seq_len {limit}")

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
        rid = f"req-{next(self._ids)}"
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
        """One scheduler step: cache ops, one engine step (or a greedy run of several, see
        ``multi_step``), sampling, detokenization."""
        with self._lock:
            start = time.perf_counter()
            self._take_inbox()
            plan = self.scheduler.schedule()
            self._apply(plan)
            deltas: list[Delta] = []
            step = plan.step
            run = self.scheduler.run_length(step, self.multi_step) if step is not None else 0
            if run > 1:
                deltas = self._greedy_run(step, run)
            elif step is not None:
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
            finished = [self._live.pop(r.rid).complete() for r in self.scheduler.pop_finished()]
            deltas = self._deliver(deltas, finished)
            self.stats.loop_s += time.perf_counter() - start
        return deltas, [c for c in finished if c.rid not in self._collect]

    def _take_inbox(self) -> None:
        """Admits what was submitted since the last step, then applies aborts."""
        if not self._inbox and not self._aborts:  # most steps; one arriving now waits for the next
            return
        with self._inbox_lock:
            arrived, self._inbox = list(self._inbox), deque()
            aborts, self._aborts = self._aborts, set()
        for output in arrived:
            self.scheduler.add(output.request)
            self._live[output.request.rid] = output
        for rid in aborts:
            if rid in self._live:
                self.scheduler.finish(rid, "abort")

    def _deliver(self, deltas: list[Delta], finished: list[Completion]) -> list[Delta]:
        """Each finishing request's last delta carries its completion (an aborted one, which made
        no token this step, gets an empty one); completions go to waiting generate() callers,
        deltas to sync stream() callers."""
        if not finished and not self._streams:  # most steps
            return deltas
        done = {c.rid: c for c in finished}
        out = [replace(d, completion=done[d.rid]) if d.finished and d.rid in done else d for d in deltas]
        closed = {d.rid for d in out if d.completion is not None}
        out += [Delta(rid=c.rid, text="", token_id=-1, finished=True, finish_reason=c.finish_reason, completion=c)
                for c in finished if c.rid not in closed]
        with self._inbox_lock:
            self._rids -= done.keys()
        for completion in finished:
            if completion.rid in self._collect:
                self._collect[completion.rid] = completion
        for delta in out:
            stream = self._streams.get(delta.rid)
            if stream is not None:
                stream.append(delta)
        return out

    def _sample_and_commit(self, step: Step, out: StepOutput) -> list[Delta]:
        """Accepts each verifying row's path, samples every row's next token, commits, and
        drafts the next guesses from the heads' logits at each row's last accepted node."""
        sampled: dict[str, int] = {}
        accepted: dict[str, Accepted] = {}
        heads_at: dict[str, object] = {}  # rid → medusa logits [K, V] at its newest token
        policy = self.speculation
        if policy is not None and step.kind == StepKind.decode:
            policy.count_step(step.verifies, step.seq_len)
        # Plain rows read logits row 0: those that take its argmax share one over the batch.
        plain, argmax = not step.trees and out.logits.shape[1] == 1, None
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
                if params.logprobs and params.top_logprobs:
                    live.top_logprobs += [live.sampler.alternatives(logits[tree.parents[n]], params.top_logprobs)
                                          for n in path.nodes]
            if step.kind == StepKind.decode:
                live.decode_steps += 1
            if plain and live.sampler.takes_argmax:
                if argmax is None:
                    argmax = out.logits[:, 0].argmax(-1).tolist()  # [B]
                token, logprob = argmax[row], None
            else:
                token, logprob = live.sampler.sample(out.logits[row, node])
            if logprob is not None and live.sampler.params.top_logprobs:
                live.top_logprobs.append(live.sampler.alternatives(out.logits[row, node],
                                                                   live.sampler.params.top_logprobs))
            sampled[rid] = token
            if logprob is not None:
                live.logprobs.append(logprob)
            if out.medusa is not None:
                heads_at[rid] = out.medusa[row, node]
        deltas, stopped = [], set()
        for request, token in self.scheduler.commit(step, sampled, accepted):
            if request.rid in stopped:  # a stop string ended it earlier in this step's tokens
                continue
            delta = self._live[request.rid].push(token, self.scheduler)
            deltas.append(delta)
            if delta.finished:
                stopped.add(request.rid)
        if policy is not None and heads_at:
            self._draft(policy, heads_at)
        return deltas

    def _greedy_run(self, step: Step, steps: int) -> list[Delta]:
        """Up to ``steps`` decode steps back to back (scheduler.run_length), each row fed its own
        argmax; ends early after a step where a row may have stopped (a stop or eos id), or when
        a request arrives for a free slot or an abort. Then commits and detokenizes the tokens."""
        engine_start = time.perf_counter()
        run = self.engine.greedy_run(step)
        stops = self.scheduler.stop_ids(step)
        produced: list[list[int]] = []  # [n][B]
        for _ in range(steps):
            tokens = run.advance()
            produced.append(tokens)
            if (stops and not stops.isdisjoint(tokens)) or (self._inbox and self.scheduler.slots.free) or self._aborts:
                break
        done = len(produced)
        self.stats.engine_s += time.perf_counter() - engine_start
        self.stats.steps += done
        self.stats.decode_steps += done
        deltas: list[Delta] = []

        def push(request: Request, token: int) -> None:
            deltas.append(self._live[request.rid].push(token, self.scheduler))

        taken = {rid: len(self.scheduler.requests[rid].output) for rid in step.rids}
        self.scheduler.commit_run(step, produced, push)
        for rid in step.rids:  # a row a stop string ended took fewer of the run's tokens
            self._live[rid].decode_steps += len(self._live[rid].request.output) - taken[rid]
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
                request.draft = Draft(tree, tuple(tree.candidates(request.last_token, medusa)[1:]))

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


"""``LLM``: generate text from an engine dir (Python API), a thin front over four parts:

- the input processor (runtime/input_processor.py): prompts to checked requests;
- the engine core (runtime/engine_core.py): schedule, run the engine, sample, commit;
- the output processor (runtime/output_processor.py): text, stop strings, deltas, completions;
- the engine loop (runtime/engine_loop.py): the one owner of steps, a thread that runs them
  while requests are open and hands each request's outputs to its own reader.

``generate`` and ``stream`` submit checked requests with their own readers (runtime/waiters.py)
and block on them, whoever else uses the LLM; async streaming is runtime/async_llm.py.
``submit`` + ``step``/``run_until_done`` is the polling API, for one caller that drives and
counts steps itself (tests, benchmarks): it gets the outputs of the requests it submitted so."""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

from ..checkpoint.errors import CheckpointError
from ..checkpoint.tokenizer import tokenizer_from
from ..plugins.onnxruntime.session import CpuActivations, Spinning
from .detokenize import Detokenizer
from .core.engine import Engine
from .engine_core import EngineCore, RuntimeStats
from .engine_dir import EngineDirError, load
from .engine_loop import EngineLoop, Sink
from .engine_factory import make_engine, resolve_backend
from .input_processor import InputProcessor, checked_multi_step
from .output_processor import OutputProcessor
from .outputs import Completion, Delta
from .backends.tensorrt.library import device_free_bytes
from .core.kv_budget import FreeMemory, RowMemory, check_block_size, kv_manager_for
from .core.sampling import SamplingParams
from .core.scheduler import Batching, Scheduler
from ..contract.speculation import Source
from .speculation.adaptive import SpeculationMode
from .speculation.speculation import Speculation, speculation_for
from .structured import CompilePool, ConstraintCompiler
from .waiters import CompletionWaiter, DeltaQueue

__all__ = ["LLM", "RuntimeStats"]


class LLM:
    """Loads an engine dir and generates with in-flight batching.

    >>> llm = LLM("build/tiny-code")
    >>> llm.generate(["def fibonacci(n):"], SamplingParams(max_tokens=32))[0].text
    """

    def __init__(self, engine_dir: str | Path, backend: str = "auto", threads: int = 0,
                 prefix_cache: bool | None = None, kv_cache_memory: int | str | float | None = None,
                 block_size: int | None = None, max_rows: int | None = None,
                 batching: Batching = Batching.inflight, token_budget: int | None = None,
                 verify: bool = True, medusa_tree_size: int | None = None, multi_step: int | None = None,
                 engine: Engine | None = None, spinning: Spinning = Spinning.always,
                 speculation: tuple[Source, ...] | None = None,
                 speculation_mode: SpeculationMode = SpeculationMode.adaptive,
                 draft_tree_width: int | None = None):
        """``speculation``: the draft sources requests speculate with by default (None: the engine
        dir's, from its spec's ``speculative`` section; (): none); a request's
        ``SamplingParams.speculation`` narrows it. ``speculation_mode``: adaptive verifies drafts
        where measured step times and acceptance say it pays (plain decoding elsewhere); always
        verifies every draft. ``medusa_tree_size``: for engine dirs with Medusa heads, None picks
        the tree prefix per batch from measured step times and acceptance; an int pins it (0: no
        Medusa trees). ``draft_tree_width``: for engine dirs with a draft head, the tokens its
        drafts offer at each depth of a greedy or seeded row's chain, a tree the policy prunes
        (None: runtime/speculation/draft_head_source.py's TREE_WIDTH; 1: chains only).
        ``multi_step``: decode steps a batch of greedy requests runs back to back, each row fed
        its own argmax, before the scheduler, detokenizer and stop strings see the tokens (1:
        every step goes through them; None: the spec's runtime.multi_step). Greedy tokens are
        the same either way. ``kv_cache_memory``: the KV budget (runtime/core/kv_manager.py):
        bytes, a size such as "1GiB", or a float in (0, 1], that share of the memory available
        now (None: the spec's runtime.kv_cache_memory, else enough for every slot to reach
        max_seq_len); ``block_size``: its blocks' tokens, a power of two (None: the spec's
        runtime.kv_block_size, else 16). ``max_rows``: the most requests running at once (vLLM's
        max_num_seqs), at most the engine's max_batch_size (None: that). ``engine``: run this Engine (made for this dir, with a
        prefix store of the budget's blocks) instead of the backend's; tests and benchmarks pass
        a configured one in. ``spinning``: whether the CPU engine's threads spin
        between ops (contract.onnxruntime.Spinning); a server, whose event loop shares the cores
        with the engine, runs them sleeping."""
        if multi_step is not None:
            checked_multi_step(multi_step)
        d = self.engine_dir = load(Path(engine_dir), verify_hashes=verify)
        if max_rows is not None and not 1 <= max_rows <= d.max_batch_size:
            raise ValueError(f"max_rows {max_rows}: valid: 1 to the engine's max_batch_size {d.max_batch_size}")
        use_prefix = d.runtime_defaults.get("prefix_cache", True) if prefix_cache is None else prefix_cache
        block_size = d.kv_block_size if block_size is None else check_block_size(block_size, d.max_seq_len)
        backend = engine.name if engine is not None else resolve_backend(d, backend)
        on_gpu = backend.startswith("tensorrt")
        # A share of memory on the TensorRT backend is of the GPU's free memory, not the host's, less
        # what loading the engine will take: measured before it loads, so its serialized size (its
        # weights and kernels) comes off (its activations' workspace is not counted).
        budget_given = kv_cache_memory is not None or d.kv_cache_memory is not None
        device_free = None
        if on_gpu and budget_given:
            engine_bytes = d.rank_file(0, "engine").stat().st_size
            device_free = FreeMemory(max(device_free_bytes() - engine_bytes, 0),
                                     f"free on the GPU less the {engine_bytes}-byte engine")
        # A paged TensorRT engine's rows draw the budget's blocks from one device pool; a slot one
        # reserves every row in full.
        paged = on_gpu and d.kv_cache.paged
        if paged and block_size != d.kv_cache.block_size:
            raise ValueError(f"block_size {block_size}: this TensorRT engine was built paged with blocks of "
                             f"{d.kv_cache.block_size} tokens (runtime.kv_block_size); pass that or None")
        rows = RowMemory.blocks if paged else RowMemory.reserved if on_gpu else RowMemory.pages
        kv = kv_manager_for(d, kv_cache_memory, block_size, use_prefix, rows, device_free=device_free)
        # The engine's prefix store (one block per budget block) or, paged, its pool.
        blocks = kv.num_blocks if use_prefix or paged else 0
        try:
            path = d.side_file("tokenizer.json")
            self.tokenizer = tokenizer_from(path.read_bytes(), str(path))
        except CheckpointError as exc:
            raise EngineDirError(str(exc)) from None
        # Constraints compile (cached) where a request is checked: the caller's thread, never a step.
        self.constraints = ConstraintCompiler(self.tokenizer, d.vocab_size, d.eos_token_ids(),
                                              max_tokens=d.max_seq_len)
        # What event loops compile through (AsyncLLM, the server): a few threads, bounded waits.
        self.compile_pool = CompilePool(self.constraints)
        engine = engine if engine is not None else make_engine(d, backend, threads, blocks, block_size, verify, spinning)
        scheduler = Scheduler(
            capacity=max_rows or d.max_batch_size, max_seq_len=d.max_seq_len, max_chunk=d.max_input_len,
            token_budget=token_budget, kv=kv,
            eos_token_ids=d.eos_token_ids(), batching=batching, paged=paged)
        multi_step = multi_step or d.multi_step
        try:
            speculation = speculation_for(d, engine, speculation, speculation_mode, medusa_tree_size, multi_step,
                                          threads, draft_tree_width)
        except BaseException:
            engine.close()
            raise
        self.inputs = InputProcessor(self.tokenizer, d, self.constraints,
                                     speculation.sources if speculation is not None else ())
        self.core = EngineCore(engine, scheduler, speculation, multi_step)
        self.outputs = OutputProcessor(Detokenizer(self.tokenizer, d.vocab_size), self.core.sampling)
        self.loop = EngineLoop(self.core, self.outputs, self.inputs)

    # -- the parts, for callers that read them ---------------------------------------------------
    @property
    def engine(self) -> Engine:
        return self.core.engine

    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    @property
    def speculation(self) -> Speculation | None:
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
        any running step has ended, ends the loop thread, and fails open requests; later
        submits and steps raise. Constraint compiles still queued or running are dropped first
        (their AsyncLLM groups end then, as the others do)."""
        try:
            self.compile_pool.close()
        finally:
            self.loop.close()

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
        """Queues one request for the polling API (its outputs come back from ``step`` and
        ``run_until_done``) without waiting for a running step; raises ValueError (and changes
        nothing) if it cannot run. ``rid``: the request's id (ValueError if an open request
        holds it); None: one the engine loop gives (``req-N``, never one an open request holds)."""
        return self.loop.submit([(rid, self.inputs.process(prompt, params), None)])[0]

    def abort(self, rid: str) -> None:
        """Ends a request at the next step (its KV slot is freed then); its completion has
        finish_reason "abort". Unknown or finished ids are ignored."""
        self.loop.abort(rid)

    def has_work(self) -> bool:
        return self.loop.has_work()

    def queue_depth(self) -> int:
        """Requests waiting for a KV slot, including those submitted since the last step."""
        return self.loop.queue_depth()

    def generate(self, prompts: list[str] | str | list[list[int]], params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[Completion]:
        """Completions in prompt order. Every request is validated before any runs; a step that
        fails meanwhile raises its error here."""
        single = isinstance(prompts, str)
        prompts = [prompts] if single else list(prompts)
        params_list = params if isinstance(params, list) else [params or self.default_params()] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(params_list)} SamplingParams for {len(prompts)} prompts")
        requests = [self.inputs.process(p, q, f"prompt {i}") for i, (p, q) in enumerate(zip(prompts, params_list))]
        waiter = CompletionWaiter(len(requests))
        rids = self.loop.submit([(None, request, Sink(waiter, i)) for i, request in enumerate(requests)])
        try:
            return waiter.wait()
        finally:  # interrupted (or failed): what still runs is aborted
            for rid, completion in zip(rids, waiter.done):
                if completion is None:
                    self.abort(rid)

    def run_until_done(self) -> list[Completion]:
        """Steps until nothing is queued or running: the completions of polled requests
        (``submit``) that finished meanwhile."""
        completions = []
        while self.has_work():
            completions += self.step()[1]
        return completions

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None) -> Iterator[Delta]:
        """Yields text pieces of one request as they are produced (one a token; other requests
        run too, their pieces go to their own readers). Leaving the loop early aborts it."""
        mine = DeltaQueue()
        [rid] = self.loop.submit([(None, self.inputs.process(prompt, params or self.default_params()), Sink(mine))])
        finished = False
        try:
            while not finished:
                for delta in mine.get():
                    finished = delta.finished
                    yield delta
        finally:
            if not finished:
                self.abort(rid)

    def step(self) -> tuple[list[Delta], list[Completion]]:
        """The polling API's step: one engine-core step (cache ops, one engine step or a greedy
        run of ``multi_step``, sampling, commit, detokenization), then the deltas and
        completions of ``submit``'s requests made since the last call. Requests of
        ``generate``/``stream``/``AsyncLLM`` go to their own readers, never here."""
        return self.loop.step()

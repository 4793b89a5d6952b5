"""The constraint compile pool (runtime/structured/compile_pool.py): bounded threads and wait,
a deadline counted from a compile's start, shared compiles, cache hits that skip the pool, a
close() that ends every waiter; and AsyncLLM.submit, which never compiles on the event loop, and
whose groups end when the LLM closes, compiling or not."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest
from tokenizers import Tokenizer

from conftest import TINY_CODE
from trtbuild.runtime.structured import (CompilePool, CompileTimeout, CompilerBusy, ConstraintCompiler, ConstraintError,
                                         JsonSchema, Regex)
from trtbuild.runtime.structured.compile_pool import CompilePoolClosed


class GatedCompiler(ConstraintCompiler):
    """A real compiler whose compiles of ``held`` constraints wait until ``gate`` opens (the
    pool's timing under control, without a schema that happens to be slow on this machine)."""

    def __init__(self, held: set):
        super().__init__(Tokenizer.from_file(str(TINY_CODE / "tokenizer.json")), 4096, (0,))
        self.held, self.gate = held, threading.Event()

    def _compile(self, constraint):
        if constraint in self.held:
            self.gate.wait(10)
        return super()._compile(constraint)


def test_the_pool_is_bounded_shares_compiles_and_skips_on_a_hit():
    slow, queued, refused = Regex("[0-9]+"), Regex("[a-z]+"), Regex("x+")
    compiler = GatedCompiler({slow})
    pool = CompilePool(compiler, workers=1, max_waiting=1)
    running = pool.submit(slow)
    waiting = pool.submit(queued)
    assert pool.submit(slow) is running and pool.pending == 2
    with pytest.raises(CompilerBusy, match=r"^constraint compiler busy: 1 compiling and 1 waiting; retry shortly$"):
        pool.submit(refused)
    compiler.gate.set()
    assert running.result.result(10).constraint == slow and waiting.result.result(10).constraint == queued
    assert compiler.compiled == 2
    for _ in range(100):   # the job leaves the pool just after its result is set
        if pool.pending == 0:
            break
        time.sleep(0.01)
    assert pool.pending == 0
    pool.workers, pool.max_waiting = 0, 0   # a hit never asks the pool for a thread

    async def hit():
        return await pool.compile(slow)
    assert asyncio.run(hit()).constraint == slow
    pool.close()


def test_the_deadline_counts_from_the_compile_start_not_the_queue():
    """One thread: the held compile overruns its 0.3 s; the one queued behind it waited longer
    than that in all, yet compiles within its own deadline."""
    held, behind = Regex("[0-9]+"), JsonSchema({"type": "object", "properties": {"a": {"type": "integer"}}})
    compiler = GatedCompiler({held})
    pool = CompilePool(compiler, workers=1, max_waiting=4, timeout_s=0.3)

    async def both():
        first = asyncio.ensure_future(pool.compile(held))
        second = asyncio.ensure_future(pool.compile(behind))
        await asyncio.sleep(0.5)
        compiler.gate.set()
        return await asyncio.gather(first, second, return_exceptions=True)

    start = time.monotonic()
    overran, compiled = asyncio.run(both())
    assert isinstance(overran, CompileTimeout) and str(overran) == "regex: took over 0.3 s to compile; simplify it"
    assert compiled.constraint == behind and time.monotonic() - start > 0.3
    assert compiler.cached(held) is not None   # the overrun compile finished in its thread and was kept
    pool.close()


def test_a_constraint_that_cannot_compile_reaches_its_waiter():
    pool = CompilePool(GatedCompiler(set()))
    with pytest.raises(ConstraintError, match=r"^regex: "):
        asyncio.run(pool.compile(Regex("((")))
    pool.close()


def test_close_ends_every_waiter_and_later_submits_refuse():
    """close() with one compile running (held) and one queued: both waiters raise
    CompilePoolClosed at once (the queued one's used to see a cancellation, the running one's
    to wait for its compile); later submits raise it too (one used to leave a job no thread
    would run, and the next submit of that constraint waited on it forever); the running
    compile still ends in its thread, cached."""
    held, queued, late = Regex("[0-9]+"), Regex("[a-z]+"), Regex("b+")
    compiler = GatedCompiler({held})
    pool = CompilePool(compiler, workers=1, max_waiting=1)

    async def close_while_pending():
        running = asyncio.ensure_future(pool.compile(held))
        waiting = asyncio.ensure_future(pool.compile(queued))
        await asyncio.wrap_future(pool.submit(held).started)   # the held one has its thread
        pool.close()
        return await asyncio.wait_for(asyncio.gather(running, waiting, return_exceptions=True), 5)

    ended = asyncio.run(close_while_pending())
    assert [(type(e), str(e)) for e in ended] == [(CompilePoolClosed, "the constraint compile pool is closed")] * 2
    for _ in range(2):
        with pytest.raises(CompilePoolClosed, match="^the constraint compile pool is closed$"):
            pool.submit(late)
    assert pool.pending == 0
    compiler.gate.set()
    for _ in range(500):
        if compiler.cached(held) is not None:
            break
        time.sleep(0.01)
    assert compiler.cached(held) is not None and compiler.cached(queued) is None   # the queued one never ran


@pytest.mark.slow
def test_llm_close_ends_every_async_group_whatever_its_state(tiny_engine):
    """LLM.close() while groups are compiling (one running, one queued behind it), queued for the
    engine (submitted during a step) and running (in that step): every read ends with
    EngineFailure "the LLM is closed", none hangs (the group whose compile was queued used to:
    the pool cancelled it and the CancelledError escaped), and a polled request's next step
    raises it."""
    from trtbuild.runtime.async_llm import AsyncLLM, EngineFailure
    from trtbuild.runtime.core.sampling import SamplingParams
    from trtbuild.runtime.llm import LLM

    llm = LLM(tiny_engine, backend="onnxruntime")
    compiler = GatedCompiler({Regex("[0-9]+")})
    llm.constraints = llm.inputs.constraints = compiler
    llm.compile_pool.close()
    llm.compile_pool = CompilePool(compiler, workers=1, max_waiting=1)
    engine, long = AsyncLLM(llm), SamplingParams(max_tokens=600, ignore_eos=True)
    entered, release = threading.Event(), threading.Event()
    on_token = llm.outputs.on_token

    def held_token(request, token):   # the next step waits here, holding the step lock
        entered.set()
        release.wait(30)
        return on_token(request, token)

    async def ending(group) -> str:
        try:
            async for _ in group:
                pass
        except EngineFailure as exc:
            return str(exc)
        return "ended without an error"

    async def run():
        running = engine.submit([("def f(x):", long)], ["running"])
        llm.submit("import os", long, rid="polled")
        await anext(running)
        llm.outputs.on_token = held_token
        assert await asyncio.to_thread(entered.wait, 30)
        queued = engine.submit([("class A:", long)], ["queued"])
        compiling = engine.submit([("x", SamplingParams(max_tokens=4, constraint=Regex("[0-9]+")))], ["compiling"])
        waiting = engine.submit([("x", SamplingParams(max_tokens=4, constraint=Regex("[a-z]+")))], ["waiting"])
        await asyncio.sleep(0.1)   # the compile task waits on its job
        closing = asyncio.ensure_future(asyncio.to_thread(llm.close))
        await asyncio.sleep(0.3)   # close() has dropped the compiles and waits for the step
        release.set()
        await asyncio.wait_for(closing, 30)
        return await asyncio.wait_for(asyncio.gather(*(ending(g) for g in (running, queued, compiling, waiting))), 10)

    try:
        ended = asyncio.run(run())
    finally:
        release.set()
        compiler.gate.set()
    assert ended == ["generation failed: RuntimeError: the LLM is closed"] * 4
    with pytest.raises(RuntimeError, match="^the LLM is closed$"):
        llm.step()
    assert llm.loop.open_rids() == set()


@pytest.mark.slow
def test_async_submit_never_compiles_on_the_event_loop(tiny_engine):
    """A constrained AsyncLLM request whose compile is held leaves the loop free: submit returns
    at once, a free request streams to its end meanwhile, and the constrained one runs once its
    constraint compiles; a bad constraint is raised by the first read, a full pool by submit."""
    from trtbuild.runtime.async_llm import AsyncLLM
    from trtbuild.runtime.core.sampling import SamplingParams
    from trtbuild.runtime.llm import LLM

    schema = JsonSchema({"type": "object", "required": ["n"], "properties": {"n": {"type": "integer"}},
                         "additionalProperties": False})
    with LLM(tiny_engine, backend="onnxruntime") as llm:
        compiler = GatedCompiler(set())
        llm.constraints = llm.inputs.constraints = compiler
        llm.compile_pool = CompilePool(compiler, workers=1, max_waiting=0)
        engine = AsyncLLM(llm)
        free = SamplingParams(max_tokens=8, ignore_eos=True)
        [expected] = llm.generate(["def f(x):"], SamplingParams(max_tokens=40, constraint=schema))  # compiled inline...
        compiler._cache.clear()   # ...so forgotten, and held: the async path compiles it again
        compiler.held.add(schema)

        async def run():
            group = engine.submit([("def f(x):", SamplingParams(max_tokens=40, constraint=schema))], ["held"])
            with pytest.raises(CompilerBusy):   # the one thread is busy and nothing may wait
                engine.submit([("x", SamplingParams(max_tokens=4, constraint=Regex("[0-9]+")))], ["busy"])
            streamed = [d async for d in engine.stream("class A:", free)]
            assert streamed[-1].finished and llm.compile_pool.pending == 1   # done while the compile was held
            compiler.gate.set()
            async with group:
                done = [delta async for _, delta in group]
            refused = engine.submit([("x", SamplingParams(max_tokens=4, constraint=Regex("((")))], ["bad"])
            with pytest.raises(ConstraintError, match=r"^regex: "):
                await anext(refused)
            return done[-1].completion

        completion = asyncio.run(run())
    assert completion.token_ids == expected.token_ids and completion.finish_reason == "stop"

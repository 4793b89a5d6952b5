"""The engine loop owns stepping (runtime/engine_loop.py): every front end reads its own requests'
outputs however many use one LLM, a failing step reaches every open request, close() ends the
loop thread, and a server request is checked once. The bundled model's engine dir, CPU."""
from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from trtbuild.runtime.async_llm import AsyncLLM, EngineFailure
from trtbuild.runtime.input_processor import InputProcessor
from trtbuild.runtime.llm import LLM
from trtbuild.runtime.core.sampling import SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = ["def fibonacci(n):\n", "import os\n", "class Stack:\n    def __init__(self):\n        self.",
           "    for i in range(len(", "# Copyright", "def __repr__(self):\n        return '<%s %r>' % (",
           "from collections import", "x"]
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)
LOOP_THREAD = "trtbuild-engine-loop"


@pytest.fixture(scope="module")
def llm(tiny_engine):
    with LLM(tiny_engine, backend="onnxruntime", threads=2) as llm:
        yield llm


def _loop_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == LOOP_THREAD]


def _until_no_loop_thread(seconds: float = 30) -> list[threading.Thread]:
    deadline = time.monotonic() + seconds
    while _loop_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    return _loop_threads()


async def _completion(engine: AsyncLLM, prompt: str, params: SamplingParams = GREEDY):
    deltas = [delta async for delta in engine.stream(prompt, params)]
    assert "".join(d.text for d in deltas) == deltas[-1].completion.text
    return deltas[-1].completion.token_ids


def test_generate_threads_and_two_async_llms_on_one_engine_each_get_their_own_tokens(llm):
    """generate() from two threads and streams of two AsyncLLMs at once: each request's tokens
    equal its solo run's (a caller that stepped the LLM used to take the async streams' deltas,
    and their ``async for`` waited forever)."""
    solo = {p: llm.generate([p], GREEDY)[0].token_ids for p in PROMPTS}
    results: dict[int, list] = {}

    def call(index: int, prompts: list[str]) -> None:
        results[index] = [c.token_ids for c in llm.generate(prompts, GREEDY)]

    threads = [threading.Thread(target=call, args=(i, PROMPTS[2 * i:2 * i + 2]), daemon=True) for i in range(2)]

    async def streams():
        first, second = AsyncLLM(llm), AsyncLLM(llm)
        for thread in threads:
            thread.start()
        engines = [first, second, first, second]
        return await asyncio.wait_for(asyncio.gather(*(_completion(e, p) for e, p in zip(engines, PROMPTS[4:]))),
                                      timeout=90)

    streamed = asyncio.run(streams())
    for thread in threads:
        thread.join(timeout=90)
    assert results == {0: [solo[p] for p in PROMPTS[:2]], 1: [solo[p] for p in PROMPTS[2:4]]}
    assert streamed == [solo[p] for p in PROMPTS[4:]]
    assert _until_no_loop_thread() == [] and not llm.has_work()  # idle: no thread is held


def test_one_failing_step_ends_every_request_it_ran_sync_and_async_and_frees_their_ids(tiny_engine):
    """The engine raises once, in a step that runs every open request: generate() and stream()
    in other threads raise that error, an async group an EngineFailure naming it, none hangs,
    their ids are free at once (no later step needed), and the LLM serves on."""
    llm = LLM(tiny_engine, backend="onnxruntime", threads=2)
    engine_step, all_in = llm.engine.step, threading.Event()

    def fails_once(step):
        all_in.wait(timeout=60)
        if len(llm.scheduler.requests) < 5:   # fails once every request below is in the core
            return engine_step(step)
        llm.engine.step = engine_step
        raise RuntimeError("device lost")

    llm.engine.step = fails_once
    checked, process = [], llm.inputs.process
    llm.inputs.process = lambda *args: checked.append(args) or process(*args)   # each request, just before its submit
    errors: dict[str, str] = {}
    long = SamplingParams(max_tokens=200, ignore_eos=True)   # none ends before the failing step

    def run(name: str, call) -> None:
        try:
            call()
        except RuntimeError as exc:
            errors[name] = f"{type(exc).__name__}: {exc}"

    async def grouped():
        group = AsyncLLM(llm).submit([(PROMPTS[3], long), (PROMPTS[4], long)], ["a-0", "a-1"])
        threads = [threading.Thread(target=run, args=("generate", lambda: llm.generate(PROMPTS[:2], long)),
                                    daemon=True),
                   threading.Thread(target=run, args=("stream", lambda: list(llm.stream(PROMPTS[2], long))),
                                    daemon=True)]
        for thread in threads:
            thread.start()
        while len(checked) < 5:
            await asyncio.sleep(0.01)
        await asyncio.sleep(1.0)  # their submits, a moment after their checks
        all_in.set()
        await asyncio.wait_for(run_async(group), timeout=60)
        for thread in threads:
            thread.join(timeout=60)

    async def run_async(group) -> None:
        try:
            async for _ in group:
                pass
        except EngineFailure as exc:
            errors["async"] = f"{type(exc).__name__}: {exc}"

    asyncio.run(grouped())
    assert errors == {"generate": "RuntimeError: device lost", "stream": "RuntimeError: device lost",
                      "async": "EngineFailure: generation failed: RuntimeError: device lost"}
    assert _until_no_loop_thread() == []
    # Free now, before any other step: the core, the output processor and the loop let go of them.
    assert llm.loop.open_rids() == set() and not llm.scheduler.requests and not llm.outputs.texts
    assert llm.submit(PROMPTS[3], GREEDY, rid="a-0") == "a-0"
    solo = LLM(tiny_engine, backend="onnxruntime")
    assert [(c.rid, c.token_ids) for c in llm.run_until_done()] == \
        [("a-0", solo.generate([PROMPTS[3]], GREEDY)[0].token_ids)]
    assert [c.token_ids for c in llm.generate(PROMPTS[:2], GREEDY)] == \
        [solo.generate([p], GREEDY)[0].token_ids for p in PROMPTS[:2]]
    assert llm.scheduler.slots.num_active == 0 and llm.loop.open_rids() == set()
    llm.close()


def test_close_ends_the_loop_thread_and_open_streams_and_later_submits_raise(tiny_engine):
    llm = LLM(tiny_engine, backend="onnxruntime", threads=2)
    stream = llm.stream(PROMPTS[0], SamplingParams(max_tokens=600, ignore_eos=True))
    assert not next(stream).finished and len(_loop_threads()) == 1
    llm.close()
    assert _loop_threads() == []  # close() joined it
    with pytest.raises(RuntimeError, match="the LLM is closed"):
        list(stream)
    with pytest.raises(RuntimeError, match="the LLM is closed"):
        llm.submit(PROMPTS[1], GREEDY)
    with pytest.raises(RuntimeError, match="the LLM is closed"):
        llm.generate([PROMPTS[1]], GREEDY)


def test_the_engine_loop_takes_only_requests_its_input_processor_checked(llm):
    with pytest.raises(TypeError, match="ValidRequests made by this LLM's input processor"):
        llm.loop.submit([("raw", ([5, 6], GREEDY), None)])
    other = InputProcessor(llm.tokenizer, llm.engine_dir)   # same rules, not this LLM's
    with pytest.raises(TypeError, match="ValidRequests made by this LLM's input processor"):
        llm.loop.submit([("foreign", other.process([5, 6], GREEDY), None)])
    valid = llm.inputs.process([5, 6], GREEDY)
    with pytest.raises(ValueError, match="request id 'twice' is already in use"):
        llm.loop.submit([("twice", valid, None), ("twice", valid, None)])  # all or none
    assert not llm.has_work()


def test_a_server_request_is_checked_once(llm, monkeypatch):
    """The server checks a body's prompts in a worker thread; the engine takes what it made
    without checking each token id again (it did, on the event loop)."""
    from trtbuild.runtime.server.app import create_app
    from trtbuild.runtime.server.inputs import Limits

    checks = []
    tokens = InputProcessor.tokens
    monkeypatch.setattr(InputProcessor, "tokens", lambda self, prompt: checks.append(prompt) or tokens(self, prompt))
    app = create_app(AsyncLLM(llm), "tiny", Limits(max_body_bytes=1 << 20, max_prompt_chars=100_000, max_queue=8,
                                                   body_timeout=5.0))
    prompt = llm.tokens(PROMPTS[0])
    expected = llm.generate([prompt], SamplingParams(max_tokens=5, ignore_eos=True))[0].text
    checks.clear()

    async def post():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            return await client.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "n": 2, "temperature": 0,
                                                               "max_tokens": 5, "ignore_eos": True})

    response = asyncio.run(asyncio.wait_for(post(), timeout=60))
    assert response.status_code == 200, response.text
    assert [c["text"] for c in response.json()["choices"]] == [expected, expected]
    assert checks == [prompt]  # once for the body, not again per choice at submission


def _fails_once_at(llm: LLM, rid: str) -> None:
    """The LLM's output processor raises once, at the step where request ``rid`` finishes (the
    core has already let go of it then)."""
    finish = llm.outputs.finish

    def failing(finished):
        if any(request.rid == rid for request, _ in finished):
            llm.outputs.finish = finish
            raise RuntimeError("output processor broke")
        return finish(finished)

    llm.outputs.finish = failing


def test_an_output_processor_failure_reaches_every_reader_it_touched_and_frees_their_ids(tiny_engine):
    """The output processor raises once, in the thread's step where a polled request finishes
    beside a generate() request: generate() raises it, the polling caller's next step raises it
    (its completion was lost: it used to vanish, run_until_done returning nothing), and both ids
    are free at once (they used to stay taken forever)."""
    llm = LLM(tiny_engine, backend="onnxruntime", threads=2)
    solo = {p: llm.generate([p], GREEDY)[0].token_ids for p in PROMPTS[:2]}
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    _fails_once_at(llm, "polled")
    llm.submit(PROMPTS[0], one, rid="polled")   # the thread, started by generate(), steps it too
    assert "output processor broke" in repr(_outcome(llm.generate, [PROMPTS[1]], GREEDY))
    assert llm.loop.open_rids() == set() and not llm.outputs.texts and not llm.scheduler.requests
    with pytest.raises(RuntimeError, match="^output processor broke$"):
        llm.run_until_done()
    assert llm.run_until_done() == []   # told once
    assert llm.submit(PROMPTS[0], one, rid="polled") == "polled"
    assert [(c.rid, c.token_ids) for c in llm.run_until_done()] == [("polled", solo[PROMPTS[0]][:1])]
    assert [c.token_ids for c in llm.generate(PROMPTS[:2], GREEDY)] == [solo[p] for p in PROMPTS[:2]]
    llm.close()


def test_an_output_processor_failure_raised_to_the_polling_caller_frees_the_ids(tiny_engine):
    llm = LLM(tiny_engine, backend="onnxruntime", threads=2)
    _fails_once_at(llm, "job")
    llm.submit(PROMPTS[0], GREEDY, rid="job")
    llm.submit(PROMPTS[1], GREEDY, rid="other")   # finishes in that step too: touched, ended
    with pytest.raises(RuntimeError, match="^output processor broke$"):
        llm.run_until_done()
    assert llm.loop.open_rids() == set() and not llm.has_work()
    llm.submit(PROMPTS[0], GREEDY, rid="job")   # was: ValueError, request id 'job' is already in use
    assert [c.rid for c in llm.run_until_done()] == ["job"]
    llm.close()


class _BrokenReader:
    """A reader whose ``put`` raises (at its first piece, or at a finished one); it records the
    failures it is told of."""

    def __init__(self, at_finish: bool):
        self.at_finish, self.puts, self.failures = at_finish, 0, []

    def put(self, index: int, pieces) -> None:
        self.puts += 1
        if pieces[-1].finished or not self.at_finish:
            raise RuntimeError("reader broke")

    def fail(self, error: Exception) -> None:
        self.failures.append(str(error))


@pytest.mark.parametrize("at_finish", [False, True], ids=["first-piece", "finished-piece"])
def test_a_reader_whose_put_raises_ends_only_its_own_requests(llm, at_finish):
    """Two requests of a broken reader and one of a generate() waiter run in the same steps and
    finish in the same one: the broken reader is told once and both its requests end (ids
    free); the waiter still gets its completion (it used to get the broken reader's error, or,
    its completion taken out before the put that raised, wait forever)."""
    from trtbuild.runtime.engine_loop import Sink
    from trtbuild.runtime.waiters import CompletionWaiter

    expected = llm.generate([PROMPTS[0]], GREEDY)[0].token_ids
    broken, waiter = _BrokenReader(at_finish), CompletionWaiter(1)
    request = llm.inputs.process(PROMPTS[0], GREEDY)
    llm.loop.submit([("broken-0", request, Sink(broken, 0)), ("broken-1", request, Sink(broken, 1)),
                     ("kept", request, Sink(waiter, 0))])
    assert [c.token_ids for c in _waited(waiter)] == [expected]
    assert broken.failures == ["reader broke"]   # told once, for both its requests
    if not at_finish:
        assert broken.puts == 1   # its other request's piece of that step was not put to it
    assert _until_no_loop_thread() == [] and llm.loop.open_rids() == set() and not llm.scheduler.requests


def test_a_request_the_core_refuses_ends_alone(llm, monkeypatch):
    """The core refuses one request of a step's arrivals: that reader gets the error, the request
    submitted with it runs to its end (it used to fail with it), and its id is free."""
    from trtbuild.runtime.engine_loop import Sink
    from trtbuild.runtime.waiters import CompletionWaiter

    expected = llm.generate([PROMPTS[1]], GREEDY)[0].token_ids
    add = llm.core.add

    def refuses_one(request, constraint=None):
        if request.rid == "refused":
            raise ValueError("request refused: no room")
        return add(request, constraint)

    monkeypatch.setattr(llm.core, "add", refuses_one)
    refused, kept = CompletionWaiter(1), CompletionWaiter(1)
    llm.loop.submit([("refused", llm.inputs.process(PROMPTS[0], GREEDY), Sink(refused)),
                     ("kept", llm.inputs.process(PROMPTS[1], GREEDY), Sink(kept))])   # arrive in one step
    assert repr(_waited(refused)) == "ValueError('request refused: no room')"
    assert [c.token_ids for c in _waited(kept)] == [expected]
    assert _until_no_loop_thread() == [] and llm.loop.open_rids() == set()


def test_generated_ids_never_take_a_callers_own(tiny_engine):
    """A polled request holds "req-0" and "req-1", the ids the engine would give first:
    generate(), stream() and an AsyncLLM stream still run (they used to raise "request id
    'req-0' is already in use"), and the polled ones keep theirs."""
    llm = LLM(tiny_engine, backend="onnxruntime", threads=2)
    solo = LLM(tiny_engine, backend="onnxruntime")
    expected = [solo.generate([p], GREEDY)[0].token_ids for p in PROMPTS[:3]]
    for rid in ("req-0", "req-1"):
        llm.submit(PROMPTS[0], GREEDY, rid=rid)
    assert llm.generate([PROMPTS[1]], GREEDY)[0].token_ids == expected[1]
    assert [d for d in llm.stream(PROMPTS[2], GREEDY)][-1].completion.token_ids == expected[2]

    async def streamed():
        return [d async for d in AsyncLLM(llm).stream(PROMPTS[1], GREEDY)]

    assert asyncio.run(asyncio.wait_for(streamed(), 60))[-1].completion.token_ids == expected[1]
    assert [(c.rid, c.token_ids) for c in llm.run_until_done()] == [("req-0", expected[0]), ("req-1", expected[0])]
    llm.close()


def _waited(waiter, seconds: float = 60):
    """What ``waiter.wait()`` returns or raises, failing the test if it is still waiting after ``seconds``."""
    done: list = []
    thread = threading.Thread(target=lambda: done.append(_outcome(waiter.wait)), daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "a reader was left waiting"
    return done[0]


def _outcome(fn, *args):
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001
        return exc


def test_a_late_abort_does_not_end_a_new_request_of_the_same_id(llm, monkeypatch):
    """An abort that arrives while its request finishes in the running step is spent with it."""
    step = llm.loop.core.step

    def step_then_abort(*args):
        finished = step(*args)
        if any(r.rid == "job" for r, _ in finished):
            llm.abort("job")   # arrives mid-step, as from another thread
        return finished

    monkeypatch.setattr(llm.loop.core, "step", step_then_abort)
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    llm.submit(PROMPTS[0], params, rid="job")
    first = llm.run_until_done()
    monkeypatch.setattr(llm.loop.core, "step", step)
    llm.submit(PROMPTS[0], params, rid="job")
    second = llm.run_until_done()
    assert [c.finish_reason for c in first + second] == ["length", "length"]
    assert second[0].token_ids == first[0].token_ids


def test_a_request_whose_constraint_is_not_compiled_is_refused_at_submit(llm):
    from dataclasses import replace

    from trtbuild.runtime.structured import Regex

    valid = llm.inputs.process([5, 6], GREEDY)
    with pytest.raises(TypeError, match="constraint must be its params.constraint, compiled"):
        llm.loop.submit([("bare", replace(valid, params=replace(GREEDY, constraint=Regex("a+"))), None)])
    assert not llm.has_work()

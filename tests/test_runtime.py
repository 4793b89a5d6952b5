"""The runtime on the bundled model's engine dir (ONNX Runtime backend): tokens equal transformers'."""
from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import time

import pytest

from trtbuild.runtime.engine_dir import EngineDirError, load
from trtbuild.runtime.async_llm import AsyncLLM
from trtbuild.runtime.llm import LLM
from trtbuild.runtime.core.sampling import SamplingParams

from conftest import TINY_CODE
from ort_greedy import transformers_greedy

pytestmark = pytest.mark.slow

PROMPTS = ["def fibonacci(n):\n", "import os\n", "class Stack:\n    def __init__(self):\n        self.",
           "    for i in range(len(", "# Copyright", "def __repr__(self):\n        return '<%s %r>' % (",
           "from collections import", "x"]
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_engine):
    return LLM(tiny_engine, backend="onnxruntime", threads=2)


@pytest.fixture(scope="module")
def reference(llm):
    ids = [llm.tokenizer.encode(p).ids for p in PROMPTS]
    return dict(zip(PROMPTS, transformers_greedy(TINY_CODE, ids, GREEDY.max_tokens)))


def test_single_request_matches_transformers(llm, reference):
    (out,) = llm.generate([PROMPTS[0]], GREEDY)
    assert out.token_ids == reference[PROMPTS[0]] and out.finish_reason == "length"
    assert out.text == llm.tokenizer.decode(out.token_ids)


def test_eight_prompts_of_different_lengths_in_one_batch(llm, reference):
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == [reference[p] for p in PROMPTS]


def test_requests_arriving_mid_decode_join_and_match(llm, reference):
    first = [llm.submit(p, GREEDY) for p in PROMPTS[:3]]
    for _ in range(3):
        llm.step()
    assert all(len(llm.scheduler.requests[r].output) > 1 for r in first)  # decoding, not done
    later = [llm.submit(p, GREEDY) for p in PROMPTS[3:]]
    done = {c.rid: c for c in llm.run_until_done()}
    assert [done[r].token_ids for r in first + later] == [reference[p] for p in PROMPTS]


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_prefix_cache_on_and_off_give_the_same_tokens(tiny_engine, prefix_cache):
    llm = LLM(tiny_engine, backend="onnxruntime", threads=2, prefix_cache=prefix_cache)
    shared = "import os\nimport sys\n\n\ndef main(argv):\n    parser = argparse.ArgumentParser()\n" * 2
    prompts = [shared + tail for tail in ("    return", "    if", "    parser.add_argument(")]
    first = llm.generate(prompts[:1], GREEDY)
    rest = llm.generate(prompts[1:], GREEDY)
    ids = [llm.tokenizer.encode(p).ids for p in prompts]
    assert [o.token_ids for o in first + rest] == transformers_greedy(TINY_CODE, ids, GREEDY.max_tokens)
    cached = [o.cached_tokens for o in rest]
    if prefix_cache:
        assert all(c >= 32 for c in cached) and llm.scheduler.kv.stats.hits >= 4
    else:
        assert cached == [0, 0]


def test_sampling_is_reproducible_with_a_seed_and_stops_on_strings(llm):
    params = SamplingParams(max_tokens=16, temperature=0.8, top_k=50, top_p=0.95, seed=7, ignore_eos=True)
    a, b = llm.generate([PROMPTS[0], PROMPTS[0]], [params, params])
    assert a.token_ids == b.token_ids
    full = llm.generate([PROMPTS[2]], GREEDY)[0].text
    stop = full[len(full) // 2: len(full) // 2 + 2]
    (cut,) = llm.generate([PROMPTS[2]], SamplingParams(max_tokens=24, stop=(stop,), ignore_eos=True))
    assert cut.finish_reason == "stop" and stop not in cut.text and full.startswith(cut.text)


def _run(llm, prompts, params) -> tuple[list, int]:
    """Completions in prompt order, and how many LLM steps it took."""
    rids = [llm.submit(p, q) for p, q in zip(prompts, params)]
    done, steps = {}, 0
    while llm.has_work():
        done.update((c.rid, c) for c in llm.step()[1])
        steps += 1
    return [done[r] for r in rids], steps


def test_multi_step_runs_end_requests_where_single_steps_do(tiny_engine, llm):
    single = LLM(tiny_engine, backend="onnxruntime", threads=2, multi_step=1)
    base, _ = _run(single, PROMPTS[:3], [SamplingParams(max_tokens=40, ignore_eos=True)] * 3)
    text = base[1].text
    # Endings inside a run: a stop id, a stop string, max_tokens (eos on: the model's own ending).
    params = [SamplingParams(max_tokens=40, stop_token_ids=(base[0].token_ids[13],), ignore_eos=True),
              SamplingParams(max_tokens=40, stop=(text[len(text) // 2:len(text) // 2 + 3],), ignore_eos=True),
              SamplingParams(max_tokens=11)]
    one, single_steps = _run(single, PROMPTS[:3], params)
    many, multi_steps = _run(llm, PROMPTS[:3], params)
    def ending(c):
        return c.token_ids, c.text, c.finish_reason, c.decode_steps

    assert [ending(c) for c in many] == [ending(c) for c in one]
    assert [c.finish_reason for c in one] == ["stop", "stop", "length"] and len(one[0].token_ids) <= 14
    assert multi_steps * 2 < single_steps  # the runs happened


def test_multi_step_streams_one_piece_per_token(llm, reference):
    pieces = list(llm.stream(PROMPTS[3], GREEDY))
    assert [p.token_id for p in pieces] == reference[PROMPTS[3]]
    assert "".join(p.text for p in pieces) == llm.tokenizer.decode(reference[PROMPTS[3]])


def test_multi_step_on_the_rank_graph_matches_transformers(tiny_engine, reference):
    from trtbuild.runtime.backends.onnxruntime.engine import OnnxRuntimeEngine

    engine = OnnxRuntimeEngine(load(tiny_engine), threads=2, use_decode_graph=False)
    llm = LLM(tiny_engine, backend="onnxruntime", prefix_cache=False, engine=engine)
    outs, _ = _run(llm, PROMPTS[:3], [GREEDY] * 3)
    assert [o.token_ids for o in outs] == [reference[p] for p in PROMPTS[:3]]


def test_an_arrival_ends_a_run_after_the_current_step(tiny_engine, reference):
    llm = LLM(tiny_engine, backend="onnxruntime", threads=2, prefix_cache=False)
    first = llm.submit(PROMPTS[0], GREEDY)
    llm.step()  # the prompt: its first token
    make_run, later = llm.engine.greedy_run, []

    class Arrival:  # a request arrives while the run's first step is running
        def __init__(self, step):
            self.run = make_run(step)

        def advance(self):
            tokens = self.run.advance()
            if not later:
                later.append(llm.submit(PROMPTS[1], GREEDY))
            return tokens

    llm.engine.greedy_run = Arrival
    llm.step()
    assert len(llm.scheduler.requests[first].output) == 2 and llm.stats.decode_steps == 1
    done = {c.rid: c for c in llm.run_until_done()}
    assert done[first].token_ids == reference[PROMPTS[0]] and done[later[0]].token_ids == reference[PROMPTS[1]]


def test_a_default_onnxruntime_session_still_opens_beside_the_runtime(llm, tiny_engine):
    """The runtime keeps its threads per session (builder/emit/cpu_step_model.py): ONNX Runtime's
    process-wide pool would make every other session in the process fail unless it opted in."""
    import onnxruntime as ort

    llm.generate([PROMPTS[0]], GREEDY)
    session = ort.InferenceSession(str(tiny_engine / "rank0.onnx"), providers=["CPUExecutionProvider"])
    assert session.get_outputs()[0].name == "logits"


def test_logprobs_equal_transformers_log_softmax(llm):
    import torch
    from transformers import AutoModelForCausalLM

    (out,) = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=6, logprobs=True, top_logprobs=3, ignore_eos=True))
    model = AutoModelForCausalLM.from_pretrained(TINY_CODE, dtype=torch.float32).eval()
    ids = torch.tensor([out.prompt_token_ids + out.token_ids])
    with torch.no_grad():
        log_probs = torch.log_softmax(model(input_ids=ids).logits[0].double(), dim=-1)  # [T, V]
    start = len(out.prompt_token_ids) - 1
    expected = [float(log_probs[start + i, token]) for i, token in enumerate(out.token_ids)]
    assert len(out.logprobs) == 6
    assert max(abs(a - b) for a, b in zip(out.logprobs, expected)) < 1e-3, (out.logprobs, expected)
    for i, alternatives in enumerate(out.top_logprobs):  # the 3 likeliest, as transformers ranks them
        top = torch.topk(log_probs[start + i], 3)
        assert [t for t, _ in alternatives] == top.indices.tolist()
        assert max(abs(lp - float(v)) for (_, lp), v in zip(alternatives, top.values)) < 1e-3


def test_streaming_sync_and_async_give_the_final_text(llm):
    (whole,) = llm.generate([PROMPTS[4]], GREEDY)
    pieces = list(llm.stream(PROMPTS[4], GREEDY))
    assert "".join(p.text for p in pieces) == whole.text and pieces[-1].finished

    async def collect():
        stream = AsyncLLM(llm)
        return await asyncio.gather(*(_join(stream.stream(p, GREEDY)) for p in (PROMPTS[4], PROMPTS[5])))

    texts = asyncio.run(collect())
    assert texts[0] == whole.text and texts[1] == llm.generate([PROMPTS[5]], GREEDY)[0].text


def test_async_streams_get_one_delta_per_step_of_a_greedy_run(llm):
    """A multi-step greedy run commits several tokens in one engine-core step: an async stream
    (the server's) gets them as one piece, whose text is theirs and whose token id the newest."""
    (whole,) = llm.generate([PROMPTS[4]], GREEDY)

    async def collect():
        return [delta async for delta in AsyncLLM(llm).stream(PROMPTS[4], GREEDY)]

    deltas = asyncio.run(collect())
    assert llm.multi_step > 1
    steps = 1 + -(-(GREEDY.max_tokens - 1) // llm.multi_step)  # the prefill's token, then full runs
    assert len(deltas) == steps, [d.text for d in deltas]
    assert "".join(d.text for d in deltas) == whole.text
    assert deltas[-1].finished and deltas[-1].completion.token_ids == whole.token_ids
    assert deltas[-1].token_id == whole.token_ids[-1]


def test_a_request_group_streams_its_choices_by_index_and_closing_it_aborts_the_rest(llm):
    """A server request's choices are one group: each delta comes with its request's index, the
    texts join to generate()'s, and a group closed early aborts what still runs."""
    expected = [c.text for c in llm.generate([PROMPTS[4], PROMPTS[5]], GREEDY)]
    short = SamplingParams(max_tokens=3, ignore_eos=True)
    long = SamplingParams(max_tokens=600, ignore_eos=True)

    async def run():
        engine = AsyncLLM(llm)
        texts = ["", ""]
        async with engine.submit([(PROMPTS[4], GREEDY), (PROMPTS[5], GREEDY)], ["g-0", "g-1"]) as group:
            async for index, delta in group:
                texts[index] += delta.text
        finished, steps = [], llm.stats.steps
        async with engine.submit([(PROMPTS[0], short), (PROMPTS[1], long)], ["h-0", "h-1"]) as group:
            async for index, delta in group:
                if delta.finished:
                    finished.append((index, delta.finish_reason))
                    break   # leave with h-1 still decoding
        deadline = time.monotonic() + 60
        while llm.has_work() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return texts, finished, llm.stats.steps - steps

    texts, finished, steps = asyncio.run(run())
    assert texts == expected
    assert finished == [(0, "length")]
    assert not llm.has_work() and llm.scheduler.slots.num_active == 0
    assert steps < 100  # h-1 was aborted: running out its 600 tokens takes 600 steps


def test_a_group_with_a_refused_job_submits_none_of_it(llm):
    async def run():
        with pytest.raises(ValueError, match="max_tokens"):
            AsyncLLM(llm).submit([(PROMPTS[0], GREEDY), (PROMPTS[1], SamplingParams(max_tokens=10**6))],
                                 ["r-0", "r-1"])

    asyncio.run(run())
    assert not llm.has_work() and llm.run_until_done() == []  # every job is checked before any is submitted


async def _join(stream) -> str:
    return "".join([delta.text async for delta in stream])


def test_bad_requests_are_refused_without_disturbing_others(llm, reference):
    with pytest.raises(ValueError, match="prompt 1: empty"):
        llm.generate([PROMPTS[0], ""], GREEDY)
    with pytest.raises(ValueError, match=r"exceeds max_seq_len 1024"):
        llm.generate([PROMPTS[0]], SamplingParams(max_tokens=1024))
    with pytest.raises(ValueError, match="top_p must be in"):
        SamplingParams(top_p=0)
    rid = llm.submit(PROMPTS[0], GREEDY)
    with pytest.raises(ValueError, match="5000 exceeds max_seq_len 1024"):
        llm.submit(PROMPTS[1], SamplingParams(max_tokens=5000))
    (done,) = llm.run_until_done()
    assert done.rid == rid and done.token_ids == reference[PROMPTS[0]]


def test_engine_dir_is_verified_before_use(tiny_engine, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(tiny_engine, copy)
    with open(copy / "rank0.onnx.data", "r+b") as handle:
        handle.seek(100)
        handle.write(b"\x01\x02\x03")
    with pytest.raises(EngineDirError, match="rank0.onnx.data: sha256 differs from the manifest"):
        load(copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["schema_version"] = 99
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(EngineDirError, match="schema_version 99, this runtime reads 8"):
        load(copy, verify_hashes=False)


def test_cli_run_and_bench(tiny_engine):
    run = subprocess.run([sys.executable, "-m", "trtbuild.cli", "run", str(tiny_engine), "--prompt",
                          "def fibonacci(n):", "--max-tokens", "12", "--backend", "onnxruntime"],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("def fibonacci(n):") and "backend onnxruntime" in run.stderr
    bad = subprocess.run([sys.executable, "-m", "trtbuild.cli", "run", str(tiny_engine), "--prompt", "x",
                          "--max-tokens", "4096"], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.startswith("error: prompt 0:") and "Traceback" not in bad.stderr
    bench = subprocess.run([sys.executable, "-m", "trtbuild.cli", "bench", str(tiny_engine), "--workload",
                            "uniform", "--json", "--backend", "onnxruntime"], capture_output=True, text=True)
    assert bench.returncode == 0, bench.stderr
    figures = json.loads(bench.stdout)
    assert figures["requests"] == 16 and figures["output_tokens_per_s"] > 0 and figures["ttft_ms_p99"] > 0


def test_cli_multi_step_gives_the_same_tokens_and_refuses_zero(tiny_engine):
    from trtbuild.builder.spec.document import RuntimeSection

    def cli(*extra):
        return subprocess.run([sys.executable, "-m", "trtbuild.cli", "run", str(tiny_engine), "--prompt",
                               "import os\n", "--max-tokens", "20", "--backend", "onnxruntime", "--json", *extra],
                              capture_output=True, text=True)

    default, single = cli(), cli("--multi-step", "1")
    assert default.returncode == 0 and single.returncode == 0, default.stderr + single.stderr
    assert json.loads(default.stdout)["token_ids"] == json.loads(single.stdout)["token_ids"]
    zero = cli("--multi-step", "0")
    assert zero.returncode == 2 and "--multi-step" in zero.stderr and "Traceback" not in zero.stderr
    with pytest.raises(ValueError, match="multi_step must be an integer"):
        LLM(tiny_engine, backend="onnxruntime", multi_step=0)
    # Unset, the spec's runtime.multi_step (the bundled spec leaves it at its default).
    assert LLM(tiny_engine, backend="onnxruntime").multi_step == RuntimeSection().multi_step == 8


def test_concurrent_generate_calls_each_get_their_completions(tiny_engine):
    """Each step runs every request in flight; a caller's completions are kept for it, not
    dropped by the other caller's step (they were, before completions were collected per caller)."""
    import threading

    llm = LLM(tiny_engine, backend="onnxruntime")
    alone = [c.token_ids for c in llm.generate(PROMPTS[:4], GREEDY)]
    results: dict[int, list] = {}

    def call(index: int, prompts: list[str]) -> None:
        results[index] = [c.token_ids for c in llm.generate(prompts, GREEDY)]

    threads = [threading.Thread(target=call, args=(0, PROMPTS[:2])), threading.Thread(target=call, args=(1, PROMPTS[2:4]))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert results[0] + results[1] == alone


def test_abort_frees_the_slot_at_the_next_step(tiny_engine):
    llm = LLM(tiny_engine, backend="onnxruntime")
    params = SamplingParams(max_tokens=500, ignore_eos=True)
    stream = llm.stream(PROMPTS[0], params)
    first = [next(stream) for _ in range(3)]
    assert llm.scheduler.slots.num_active == 1 and not first[-1].finished
    stream.close()  # the caller leaves: the request is aborted
    llm.step()
    assert llm.scheduler.slots.num_active == 0 and not llm.has_work()
    rid = llm.submit(PROMPTS[1], params)
    llm.step()
    llm.abort(rid)
    deltas, finished = llm.step()
    assert finished[0].rid == rid and finished[0].finish_reason == "abort" and deltas[-1].completion is finished[0]


def test_async_submit_does_not_wait_for_a_step_and_failures_end_streams(tiny_engine):
    import threading

    llm = LLM(tiny_engine, backend="onnxruntime")
    engine_step = llm.engine.step

    def slow_step(step):
        time.sleep(1.0)
        return engine_step(step)

    llm.engine.step = slow_step
    llm.submit(PROMPTS[0], SamplingParams(max_tokens=2))
    stepping = threading.Thread(target=llm.step)
    stepping.start()
    time.sleep(0.2)  # the step now holds the lock for a second
    start = time.monotonic()
    llm.submit(PROMPTS[1], SamplingParams(max_tokens=2))
    assert time.monotonic() - start < 0.2
    stepping.join()

    def broken_step(step):
        raise RuntimeError("device lost")

    llm.engine.step = broken_step

    async def consume():
        return [d async for d in AsyncLLM(llm).stream(PROMPTS[2], SamplingParams(max_tokens=4))]

    from trtbuild.runtime.async_llm import EngineFailure

    with pytest.raises(EngineFailure, match="device lost"):
        asyncio.run(asyncio.wait_for(consume(), timeout=30))


def test_close_waits_for_the_running_step_and_later_steps_refuse(tiny_engine):
    import threading

    llm = LLM(tiny_engine, backend="onnxruntime")
    events = []
    engine_step, engine_close = llm.engine.step, llm.engine.close

    def slow_step(step):
        events.append("step begins")
        time.sleep(0.5)
        out = engine_step(step)
        events.append("step ends")
        return out

    def close():
        events.append("engine freed")
        engine_close()

    llm.engine.step, llm.engine.close = slow_step, close
    llm.submit(PROMPTS[0], SamplingParams(max_tokens=2))
    stepping = threading.Thread(target=llm.step)
    stepping.start()
    while not events:
        time.sleep(0.01)
    llm.close()  # what the server does when its grace period ends
    stepping.join()
    assert events == ["step begins", "step ends", "engine freed"]
    with pytest.raises(RuntimeError, match="the LLM is closed"):
        llm.step()
    llm.close()  # twice is fine
    assert events.count("engine freed") == 1

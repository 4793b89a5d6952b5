"""trtbuild serve on 127.0.0.1 (ephemeral port), driven by the official openai client: text equal
to LLM.generate, streaming, stops, seeds, n, logprobs, usage, every error code, disconnects
that free their slot, the bounded queue, SIGTERM draining. Traffic stays on loopback and every
loop is bounded."""
from __future__ import annotations

import json
import re
import signal
import socket
import threading
import time

import httpx
import pytest

from serving import KEY, served

pytestmark = pytest.mark.slow



@pytest.fixture(scope="module")
def reference(tiny_engine):
    from trtbuild.runtime.llm import LLM

    return LLM(tiny_engine, backend="onnxruntime")


def _metric(server, name: str) -> float:
    """A sample of /metrics by its name and labels; 0 for a counter not yet incremented."""
    text = httpx.get(f"{server}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    line = next((l for l in text.splitlines() if l.startswith(name + " ")), None)
    return float(line.split()[-1]) if line else 0.0


def _running(server) -> float:
    return _metric(server, "trtbuild:num_requests_running")


def test_completion_text_equals_generate_streamed_or_not(client, reference):
    from trtbuild.runtime.core.sampling import SamplingParams

    expected = reference.generate(["def fibonacci(n):"], SamplingParams(max_tokens=24, ignore_eos=True))[0]
    plain = client.completions.create(model="tiny", prompt="def fibonacci(n):", max_tokens=24, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert plain.choices[0].text == expected.text and plain.choices[0].finish_reason == "length"
    assert plain.usage.prompt_tokens == len(expected.prompt_token_ids) and plain.usage.completion_tokens == 24
    chunks = list(client.completions.create(model="tiny", prompt="def fibonacci(n):", max_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
    assert chunks[-1].usage.completion_tokens == 24 and chunks[-1].usage.total_tokens == 24 + len(expected.prompt_token_ids)


def test_a_streamed_request_of_several_prompts_streams_each_choice_by_its_index(client):
    """The choices of one request share a stream: each chunk names its choice, and each choice's
    pieces join to the text the same request gets unstreamed."""
    prompts = ["def fibonacci(n):", "import os\n", "class Stack:"]
    whole = client.completions.create(model="tiny", prompt=prompts, max_tokens=12, temperature=0)
    texts, finishes = ["", "", ""], [None, None, None]
    for chunk in client.completions.create(model="tiny", prompt=prompts, max_tokens=12, temperature=0, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            finishes[choice.index] = choice.finish_reason or finishes[choice.index]
    assert texts == [c.text for c in sorted(whole.choices, key=lambda c: c.index)]
    assert finishes == [c.finish_reason for c in sorted(whole.choices, key=lambda c: c.index)]


def test_metrics_count_engine_steps_and_their_time(server, client):
    """The engine's own totals (steps, seconds inside steps and inside whole core steps) on
    /metrics: what tells a user whether the engine or the loop around it is the bottleneck."""
    before = [_metric(server, name) for name in
              ("trtbuild:engine_steps", "trtbuild:engine_busy_seconds", "trtbuild:engine_loop_seconds")]
    client.completions.create(model="tiny", prompt="def f(x):", max_tokens=8, temperature=1.0,
                              extra_body={"ignore_eos": True})
    steps, busy, loop = (after - b for after, b in zip(
        [_metric(server, name) for name in
         ("trtbuild:engine_steps", "trtbuild:engine_busy_seconds", "trtbuild:engine_loop_seconds")], before))
    assert steps == 8  # sampled (no greedy run): a prefill with the first token, then 7 decode steps
    assert 0 < busy < loop


def test_chat_stop_seed_n_and_logprobs(client, reference):
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "def add(a, b):"}],
                                          max_tokens=16, temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens <= 16
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "def add(a, b):"}], max_tokens=16, temperature=0,
        stream=True) if c.choices)
    assert streamed == chat.choices[0].message.content
    full = client.completions.create(model="tiny", prompt="import os\n", max_tokens=24, temperature=0).choices[0].text
    stop = full[len(full) // 2: len(full) // 2 + 2]
    cut = client.completions.create(model="tiny", prompt="import os\n", max_tokens=24, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and full.startswith(cut.choices[0].text) and stop not in cut.choices[0].text
    seeded = [client.completions.create(model="tiny", prompt="class A:", max_tokens=12, temperature=0.9, seed=5,
                                        n=2).choices for _ in range(2)]
    assert [c.text for c in seeded[0]] == [c.text for c in seeded[1]] and len(seeded[0]) == 2
    with_lp = client.completions.create(model="tiny", prompt="x = ", max_tokens=5, temperature=0, logprobs=2)
    logprobs = with_lp.choices[0].logprobs
    assert len(logprobs.token_logprobs) == with_lp.usage.completion_tokens
    for token, lp, alternatives in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert len(alternatives) == 2 and max(alternatives.values()) == pytest.approx(lp) and lp <= 0  # greedy: the top one
    chat_lp = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x = "}], max_tokens=3,
                                             temperature=0, logprobs=True, top_logprobs=3)
    assert all(len(entry.top_logprobs) == 3 for entry in chat_lp.choices[0].logprobs.content)
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_errors_are_openai_shaped(server, client):
    import openai

    with pytest.raises(openai.NotFoundError, match="model 'gpt-4' does not exist"):
        client.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="x", max_tokens=5000)
    assert info.value.body["param"] == "max_tokens" and info.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model="tiny", prompt="x", max_tokens=2, temperature=-1)
    bad_json = httpx.post(f"{server}/v1/completions", content=b"{not json", headers={
        "Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert bad_json.status_code == 400 and bad_json.json()["error"]["code"] == "invalid_json"
    unknown = httpx.post(f"{server}/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                         json={"model": "tiny", "prompt": "x", "max_tokens": 2, "user": "u", "frequency_penalty": 0})
    assert unknown.status_code == 200  # unknown fields ignored, as the reference server does
    assert httpx.get(f"{server}/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(f"{server}/v1/models").status_code == 401
    assert httpx.get(f"{server}/health").status_code == 200  # open without a key


def _aborted(server) -> float:
    return _metric(server, 'trtbuild:request_success_total{finished_reason="abort"}')


def test_a_disconnect_frees_the_slot(server):
    headers = {"Authorization": f"Bearer {KEY}"}
    # 900 tokens take ≥ 0.3 s on 2 cores: both clients leave long before the last one, and the
    # abort count shows their slots were freed by the disconnect, not by the last token.
    body = {"model": "tiny", "prompt": "def f(x):", "max_tokens": 900, "ignore_eos": True}
    aborted, steps = _aborted(server), _metric(server, "trtbuild:engine_steps")
    with httpx.Client(timeout=30) as http:  # streaming: read two chunks, then hang up
        with http.stream("POST", f"{server}/v1/completions", json={**body, "stream": True}, headers=headers) as response:
            chunks = response.iter_lines()
            assert next(chunks).startswith("data: ") and _running(server) == 1
    with pytest.raises(httpx.ReadTimeout):  # not streaming: give up waiting for the answer
        httpx.post(f"{server}/v1/completions", json=body, headers=headers, timeout=httpx.Timeout(30, read=0.1))
    for _ in range(2):
        deadline = time.monotonic() + 10
        while _running(server) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _running(server) == 0
        time.sleep(0.5)  # still 0: nothing came back
    assert _aborted(server) == aborted + 2  # both ended by the disconnect, not by running out of tokens
    # ... and the engine stopped generating for them: either one run to its 900th token takes 900 steps.
    assert _metric(server, "trtbuild:engine_steps") - steps < 900


def test_bounded_queue_and_sigterm_drain(tiny_engine, tmp_path):
    with served(tiny_engine, tmp_path / "serve.log", "--max-queue", "2", "--grace", "20") as running:
        proc, base = running.proc, running.base
        body = {"model": "tiny", "prompt": "def f(x):", "max_tokens": 200, "ignore_eos": True}
        results = []
        threads = [threading.Thread(target=lambda: results.append(httpx.post(f"{base}/v1/completions", json=body,
                                                                             timeout=120)))
                   for _ in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        codes = sorted(r.status_code for r in results)
        assert codes.count(429) >= 1 and codes.count(200) >= 2, codes
        refused = next(r for r in results if r.status_code == 429)
        assert refused.headers["Retry-After"] == "1" and refused.json()["error"]["code"] == "queue_full"
        inflight, long = [], {**body, "max_tokens": 900}  # ~1.5 s here: still running when SIGTERM comes
        worker = threading.Thread(target=lambda: inflight.append(httpx.post(f"{base}/v1/completions", json=long,
                                                                            timeout=120)))
        worker.start()
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        late = httpx.post(f"{base}/v1/completions", json=body, timeout=10)
        assert late.status_code == 503 and late.json()["error"]["code"] == "draining"
        worker.join(timeout=60)
        assert inflight[0].status_code == 200 and inflight[0].json()["usage"]["completion_tokens"] == 900
        assert proc.wait(timeout=30) == 0


def _events(server, path: str, body: dict) -> list[dict]:
    """A streamed request's data events (every one but [DONE]), parsed."""
    events = []
    with httpx.stream("POST", f"{server}{path}", json={**body, "stream": True}, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line.removeprefix("data: ")))
    return events


def test_streamed_logprobs_equal_the_unstreamed_ones_in_both_apis(server, client):
    """Each chunk carries its tokens' logprobs; joined they are the unstreamed response's, with
    text_offset filled (where each token's text begins) and chat's raw bytes."""
    body = {"model": "tiny", "prompt": "x = ", "max_tokens": 12, "temperature": 0, "logprobs": 2}
    whole = client.completions.create(**body).choices[0]
    joined = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for event in _events(server, "/v1/completions", body):
        for name in joined:
            joined[name] += event["choices"][0]["logprobs"][name]
    assert joined == whole.logprobs.model_dump() and len(joined["tokens"]) == 12
    assert joined["text_offset"] == [len("".join(joined["tokens"][:i])) for i in range(12)]  # ASCII: 1 char a byte
    assert "".join(joined["tokens"]) == whole.text

    chat = {"model": "tiny", "messages": [{"role": "user", "content": "x = "}], "max_tokens": 12, "temperature": 0,
            "logprobs": True, "top_logprobs": 2}
    whole = client.chat.completions.create(**chat).choices[0]
    content = [entry for event in _events(server, "/v1/chat/completions", chat)
               for entry in (event["choices"][0]["logprobs"] or {"content": []})["content"]]
    assert content == [entry.model_dump() for entry in whole.logprobs.content] and len(content) == 12
    assert bytes(b for entry in content for b in entry["bytes"]).decode() == whole.message.content
    assert all(len(entry["top_logprobs"]) == 2 and "bytes" in entry["top_logprobs"][0] for entry in content)


def test_response_ids_are_openai_shaped_and_never_repeat(server, client):
    """cmpl-/chatcmpl- and a uuid4's hex: a per-process counter would repeat after a restart."""
    ids = [client.completions.create(model="tiny", prompt="x", max_tokens=1).id for _ in range(2)]
    ids.append(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                              max_tokens=1).id)
    stream_ids = {event["id"] for event in _events(server, "/v1/completions", {"model": "tiny", "prompt": "x",
                                                                                "max_tokens": 3})}
    assert all(re.fullmatch(r"cmpl-[0-9a-f]{32}", i) for i in ids[:2]), ids
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{32}", ids[2]) and len(set(ids)) == 3, ids
    assert len(stream_ids) == 1 and re.fullmatch(r"cmpl-[0-9a-f]{32}", stream_ids.pop())


CALL = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": "{}"}}


@pytest.mark.parametrize("extra, messages, param", [
    ({"top_logprobs": 2}, [{"role": "user", "content": "x"}], "top_logprobs"),
    ({}, [{"role": "user", "content": "x", "tool_calls": [CALL]}], "messages.0.tool_calls"),
    ({}, [{"role": "user", "content": "x"}, {"role": "tool", "content": "4"}], "messages.1.tool_call_id"),
    ({}, [{"role": "user", "content": "x", "tool_call_id": "call_1"}], "messages.0.tool_call_id"),
    ({}, [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [{"id": "c", "type": "function"}]}],
     "messages.1.tool_calls.0.function"),
])
def test_fields_the_server_would_drop_are_refused_by_name(server, extra, messages, param):
    response = httpx.post(f"{server}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                          json={"model": "tiny", "max_tokens": 2, "messages": messages, **extra})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"].startswith(param + ":"), error


def test_neutral_tool_and_logprob_fields_are_accepted(server):
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y", "tool_calls": []},
                {"role": "user", "content": "z", "tool_calls": None}]
    response = httpx.post(f"{server}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                          json={"model": "tiny", "max_tokens": 2, "messages": messages, "top_logprobs": 0})
    assert response.status_code == 200, response.text
    assert "logprobs" not in response.json()["choices"][0]


def test_requests_that_finished_before_the_client_left_count_as_finished(server, reference):
    """A non-streaming request of two prompts: one ends at its first token (a stop id), the
    other runs 900; the client leaves in between. One abort, one stop, not two aborts."""
    from trtbuild.runtime.core.sampling import SamplingParams

    quick, slow = "x = ", "def f(x):"
    stop_id = reference.generate([quick], SamplingParams(max_tokens=1))[0].token_ids[0]
    assert stop_id not in reference.generate([slow], SamplingParams(max_tokens=900, ignore_eos=True))[0].token_ids
    stops, aborted = _metric(server, 'trtbuild:request_success_total{finished_reason="stop"}'), _aborted(server)
    steps = _metric(server, "trtbuild:engine_steps")
    data = json.dumps({"model": "tiny", "prompt": [quick, slow], "max_tokens": 900, "ignore_eos": True,
                       "temperature": 0, "stop_token_ids": [stop_id]}).encode()
    with socket.create_connection(("127.0.0.1", int(server.rsplit(":", 1)[1]))) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
        deadline = time.monotonic() + 20  # the quick one done (a few steps in), the slow one running
        while not (_metric(server, "trtbuild:engine_steps") - steps >= 3 and _running(server) == 1):
            assert time.monotonic() < deadline
            time.sleep(0.02)
    deadline = time.monotonic() + 10
    while _running(server) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)  # the response's metrics are counted as it ends
    assert _aborted(server) - aborted == 1
    assert _metric(server, 'trtbuild:request_success_total{finished_reason="stop"}') - stops == 1

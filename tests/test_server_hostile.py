"""trtbuild serve under hostile clients, over loopback: large bodies and prompts off the event
loop, --max-queue under a burst, strict field types, OpenAI-shaped errors everywhere, auth edge
cases, half-open connections, and signals. Each server binds 127.0.0.1 port 0 and is stopped."""
from __future__ import annotations

import hashlib
import json
import shutil
import signal
import socket
import threading
import time

import httpx
import pytest

from serving import served

pytestmark = pytest.mark.slow

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
# Valid Jinja that fails on any conversation (a method called with a wrong argument), and that
# refuses a system message itself, as Hugging Face templates do with raise_exception.
BROKEN_TEMPLATE = ("{% if messages[0].role == 'system' %}{{ raise_exception('no system messages') }}{% endif %}"
                   "{% for m in messages %}{{ m.content.upper(1) }}{% endfor %}")


@pytest.fixture(scope="module")
def broken_template_engine(tiny_engine, tmp_path_factory):
    """The tiny engine dir with a chat template that fails to render (manifest hashes updated)."""
    path = tmp_path_factory.mktemp("engines") / "tiny-broken-template"
    shutil.copytree(tiny_engine, path)
    config = path / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "chat_template": BROKEN_TEMPLATE}))
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"]["tokenizer_config.json"] = {"sha256": hashlib.sha256(config.read_bytes()).hexdigest(),
                                                  "bytes": config.stat().st_size}
    (path / "manifest.json").write_text(json.dumps(manifest))
    return path


@pytest.fixture(scope="module")
def server(broken_template_engine, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "serve.log"
    with served(broken_template_engine, log, "--max-queue", "3", "--max-prompt-chars", "1000000",
                "--max-body-bytes", "1500000", "--header-timeout", "1", "--body-timeout", "2", api_key=KEY) as running:
        yield running
    assert "Traceback" not in log.read_text()


def _metric(base: str, name: str) -> float:
    text = httpx.get(f"{base}/metrics", headers=AUTH).text
    line = next((l for l in text.splitlines() if l.startswith(name + " ")), None)
    return float(line.split()[-1]) if line else 0.0


def _wait_idle(base: str) -> None:
    deadline = time.monotonic() + 20
    while _metric(base, "trtbuild:num_requests_running") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _metric(base, "trtbuild:num_requests_running") == 0


def _raw_request(port: int, body: dict, path: str = "/v1/completions") -> socket.socket:
    """A request sent on a raw socket that is not read: the response waits in the socket."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def _status(sock: socket.socket) -> int:
    sock.settimeout(30)
    head = b""
    while b"\r\n" not in head:
        head += sock.recv(64)
    return int(head.split()[1])


def test_health_and_streams_answer_while_a_large_prompt_is_tokenized(server):
    long_prompt = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n" * 12000  # ~980 kB: over 1 s to tokenize
    gaps, big, health = [], [], []

    def stream():  # another client's stream: its tokens must keep coming
        body = {"model": "tiny", "prompt": "def f(x):", "max_tokens": 600, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server.base}/v1/completions", json=body, headers=AUTH, timeout=60) as response:
            last = None
            for line in response.iter_lines():
                now = time.monotonic()
                if line.startswith("data: ") and last is not None:
                    gaps.append((last, now))
                last = now

    def large():
        started = time.monotonic()
        big.append(httpx.post(f"{server.base}/v1/completions", headers=AUTH, timeout=120,
                              json={"model": "tiny", "prompt": long_prompt, "max_tokens": 4}))
        big.append((started, time.monotonic()))

    streamer = threading.Thread(target=stream)
    streamer.start()
    time.sleep(0.3)
    sender = threading.Thread(target=large)
    sender.start()
    while sender.is_alive():
        started = time.monotonic()
        assert httpx.get(f"{server.base}/health", timeout=5).status_code == 200
        health.append(time.monotonic() - started)
        time.sleep(0.05)
    streamer.join(timeout=60)
    response, (began, ended) = big
    # The prompt was tokenized (its token count is in the message) and that took long enough to matter.
    assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"
    assert ended - began > 1.0, ended - began
    # Within 0.5 s, or well inside the tokenization on a machine loaded enough to stretch both
    # (blocking the loop, /health waited out the whole tokenization: 1.62 s of a 1.7 s request).
    bound = max(0.5, 0.4 * (ended - began))
    assert len(health) >= 5 and max(health) < bound, (health, bound)
    during = [b - a for a, b in gaps if a < ended and b > began]
    assert during and max(during) < bound, (max(during), bound)


def test_size_limits_refuse_before_any_work(server):
    too_big = b'{"model": "tiny", "prompt": "' + b"x" * 1_500_000 + b'"}'
    response = httpx.post(f"{server.base}/v1/completions", content=too_big, headers=AUTH, timeout=30)
    assert response.status_code == 413 and response.json()["error"]["code"] == "body_too_large"
    started = time.monotonic()
    response = httpx.post(f"{server.base}/v1/completions", headers=AUTH, timeout=30,
                          json={"model": "tiny", "prompt": "y" * 1_000_001})
    assert response.status_code == 400 and response.json()["error"]["code"] == "prompt_too_long"
    assert time.monotonic() - started < 1.0   # refused by its length: a 1 MB prompt takes seconds to tokenize
    response = httpx.post(f"{server.base}/v1/chat/completions", headers=AUTH, timeout=30,
                          json={"model": "tiny", "messages": [{"role": "user", "content": "y" * 600_000}] * 2})
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages"


def test_max_queue_holds_for_a_burst_and_refuses_what_can_never_fit(server):
    long = {"model": "tiny", "prompt": "def f(x):", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    holders, burst = [], []
    try:
        for running in range(1, 9):   # every KV slot busy for seconds, one at a time (the queue holds 3)
            holders.append(_raw_request(server.port, long))
            assert _status(holders[-1]) == 200
            deadline = time.monotonic() + 10
            while _metric(server.base, "trtbuild:num_requests_running") < running and time.monotonic() < deadline:
                time.sleep(0.02)
        assert _metric(server.base, "trtbuild:kv_slot_usage_perc") == 1.0
        burst = [_raw_request(server.port, {**long, "max_tokens": 8}) for _ in range(6)]  # all at once
        codes = sorted(_status(s) for s in burst)
        assert codes == [200, 200, 200, 429, 429, 429], codes   # --max-queue 3: three wait, three are refused
        assert _metric(server.base, "trtbuild:num_requests_waiting") == 3
    finally:
        for sock in holders + burst:
            sock.close()
    _wait_idle(server.base)
    for body in ({"prompt": ["a", "b", "c", "d"]}, {"prompt": "a", "n": 4}):
        response = httpx.post(f"{server.base}/v1/completions", headers=AUTH,
                              json={"model": "tiny", "max_tokens": 2, **body})
        assert response.status_code == 400, response.text   # not a 429 it could never pass
        assert response.json()["error"]["code"] == "too_many_requests_in_one"


@pytest.mark.parametrize("field, value", [
    ("temperature", "0.5"), ("top_p", "1"), ("max_tokens", "10"), ("max_tokens", 10.0), ("ignore_eos", "yes"),
    ("stream", 1), ("seed", -1), ("seed", True), ("stop_token_ids", [4096]), ("stop_token_ids", list(range(65))),
    ("stop_token_ids", ["1"]), ("n", "2"), ("logprobs", True), ("echo", True), ("frequency_penalty", 0.5),
    ("logit_bias", {"1": 5}), ("best_of", 2), ("suffix", "x"), ("prompt", []), ("prompt", [[]]), ("prompt", ""),
    ("prompt", [1, "a"]), ("stop", ["x" * 300]), ("top_k", -2),
    ("stream_options", {"include_usage": True}),   # without stream: true it would be dropped
])
def test_fields_are_strictly_typed_and_ranged(server, field, value):
    body = {"model": "tiny", "prompt": "x = ", "max_tokens": 2, field: value}
    response = httpx.post(f"{server.base}/v1/completions", headers=AUTH, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"].split(".")[0] == field and field in error["message"], error


def test_neutral_openai_fields_and_exact_types_are_accepted(server):
    body = {"model": "tiny", "prompt": "x = ", "max_tokens": 2, "temperature": 1, "top_p": 0.5, "seed": 0, "echo": False,
            "frequency_penalty": 0, "presence_penalty": 0.0, "logit_bias": {}, "best_of": 1, "user": "u",
            "stop_token_ids": [4095], "unknown_field": {"a": 1}}
    response = httpx.post(f"{server.base}/v1/completions", headers=AUTH, json=body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] <= 2
    chat = httpx.post(f"{server.base}/v1/chat/completions", headers=AUTH, json={
        "model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]})
    assert chat.status_code == 400 and chat.json()["error"]["param"].startswith("messages.0.content")


def test_top_k_minus_one_is_off_as_vllm_reads_it(server):
    body = {"model": "tiny", "prompt": "def f(x):", "max_tokens": 12, "temperature": 1.0, "seed": 5}
    answers = [httpx.post(f"{server.base}/v1/completions", headers=AUTH, json={**body, "top_k": k}) for k in (-1, 0)]
    assert [a.status_code for a in answers] == [200, 200], answers[0].text
    assert answers[0].json()["choices"][0]["text"] == answers[1].json()["choices"][0]["text"]


def test_a_body_nested_too_deep_says_the_limit(server):
    """A schema 100 properties deep (over 200 levels of objects in the body) is over the JSON parser's depth:
    the 400 says so, not that the body is not JSON."""
    schema: dict = {"type": "string"}
    for _ in range(100):
        schema = {"type": "object", "properties": {"a": schema}}
    body = {"model": "tiny", "prompt": "x", "max_tokens": 2, "structured_outputs": {"json": schema}}
    error = _openai_shaped(httpx.post(f"{server.base}/v1/completions", headers=AUTH, json=body), 400)
    assert error["code"] == "body_too_deep" and error["message"] == (
        "the body nests objects and arrays over 200 levels below its top level (this server's JSON parser's limit)")


def _openai_shaped(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def test_every_error_is_openai_shaped(server):
    base = server.base
    assert _openai_shaped(httpx.get(f"{base}/v1/nothing", headers=AUTH), 404)["code"] == "unknown_route"
    wrong_method = httpx.get(f"{base}/v1/completions", headers=AUTH)
    assert _openai_shaped(wrong_method, 405)["code"] == "method_not_allowed" and wrong_method.headers["allow"] == "POST"
    assert _openai_shaped(httpx.delete(f"{base}/health"), 405)["type"] == "invalid_request_error"
    unparseable = httpx.post(f"{base}/v1/completions", headers=AUTH, content=b"\xff\xfe{")
    assert _openai_shaped(unparseable, 400)["code"] == "invalid_json"
    assert _openai_shaped(httpx.post(f"{base}/v1/completions", headers=AUTH, json=[1]), 400)["param"] is None
    assert _openai_shaped(httpx.post(f"{base}/v1/completions", headers=AUTH, json={"model": "gpt-4", "prompt": "x"}),
                          404)["code"] == "model_not_found"
    # The engine dir's template fails: the server's fault (500); the template refusing the messages: the client's.
    chat = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    failed = _openai_shaped(httpx.post(f"{base}/v1/chat/completions", headers=AUTH, json=chat), 500)
    assert failed["type"] == "server_error" and failed["code"] == "chat_template_failed"
    refused = {**chat, "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]}
    assert "no system messages" in _openai_shaped(httpx.post(f"{base}/v1/chat/completions", headers=AUTH,
                                                             json=refused), 400)["message"]


def test_auth_scheme_is_case_insensitive_and_401_says_how(server):
    for header in (f"bearer {KEY}", f"BEARER {KEY}", f"Bearer  {KEY}"):
        assert httpx.get(f"{server.base}/v1/models", headers={"Authorization": header}).status_code == 200, header
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"}, {"Authorization": KEY}):
        response = httpx.get(f"{server.base}/v1/models", headers=headers)
        assert _openai_shaped(response, 401)["code"] == "invalid_api_key"
        assert response.headers["www-authenticate"].startswith("Bearer")


def test_half_open_connections_are_closed(server):
    for sent in (b"", b"GET /health HTTP/1.1\r\nHost: x\r\n"):   # nothing, or a head never finished
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(sent)
            sock.settimeout(10)
            started = time.monotonic()
            assert sock.recv(100) == b""          # closed by the server (--header-timeout 1)
            assert time.monotonic() - started < 3


def test_a_body_that_trickles_in_gets_408_and_the_connection_closes(server):
    """A client declaring 1000 bytes and sending one every 0.2 s would hold its connection for
    minutes; --body-timeout 2 gives it two seconds (a body of up to a MB gets one MB's worth)."""
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{{").encode()
    received, closed = b"", False
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(head)
        sock.settimeout(0.2)
        deadline = time.monotonic() + 8
        while not closed and time.monotonic() < deadline:
            try:
                data = sock.recv(4096)
            except socket.timeout:
                _send_quietly(sock, b" ")   # one byte every 0.2 s: never idle, never done
                continue
            except OSError:                 # reset by the server
                data = b""
            received += data
            closed = not data
    assert received.startswith(b"HTTP/1.1 408"), received[:300]
    head, _, body = received.partition(b"\r\n\r\n")
    assert b"connection: close" in head.lower() and json.loads(body)["error"]["code"] == "body_timeout"
    assert closed   # the server closed the connection
    assert httpx.get(f"{server.base}/health").status_code == 200


def _send_quietly(sock: socket.socket, data: bytes) -> None:
    """Sends unless the server has closed the connection (the next recv says so)."""
    try:
        sock.sendall(data)
    except OSError:
        pass


def _stream_lines(base: str, body: dict, lines: list) -> None:
    try:
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line:
                    lines.append(line)
    except httpx.HTTPError as exc:
        lines.append(f"closed: {type(exc).__name__}")


def test_grace_end_sends_an_error_event_then_exits_cleanly(tiny_engine, tmp_path):
    body = {"model": "tiny", "prompt": "def f(x):", "max_tokens": 1000, "ignore_eos": True}
    streamed, plain = [], []
    with served(tiny_engine, tmp_path / "serve.log", "--grace", "0.5") as running:
        clients = [threading.Thread(target=_stream_lines, args=(running.base, {**body, "stream": True}, streamed)),
                   threading.Thread(target=_stream_lines, args=(running.base, body, plain))]
        for client in clients:
            client.start()
        deadline = time.monotonic() + 20   # both running before the signal (a later one would get 503 draining)
        while _metric(running.base, "trtbuild:num_requests_running") < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        running.proc.send_signal(signal.SIGTERM)
        for client in clients:
            client.join(timeout=30)
        assert running.proc.wait(timeout=15) == 0
        log = running.log_text()
    assert json.loads(streamed[-2].removeprefix("data: "))["error"]["code"] == "shutdown", streamed[-3:]
    assert streamed[-1] == "data: [DONE]" and streamed.count("data: [DONE]") == 1   # the stream's end, after the error
    assert json.loads(plain[-1])["error"]["code"] == "shutdown", plain
    assert "Traceback" not in log and "ERROR" not in log, log


@pytest.mark.parametrize("second", [signal.SIGTERM, signal.SIGINT])
def test_a_second_signal_exits_at_once(tiny_engine, tmp_path, second):
    with served(tiny_engine, tmp_path / "serve.log", "--grace", "60") as running:
        body = {"model": "tiny", "prompt": "def f(x):", "max_tokens": 1000, "ignore_eos": True, "stream": True}
        streamed = []
        client = threading.Thread(target=_stream_lines, args=(running.base, body, streamed))
        client.start()
        deadline = time.monotonic() + 20
        while not streamed and time.monotonic() < deadline:
            time.sleep(0.02)
        running.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        assert running.proc.poll() is None   # draining: the stream may take its 60 s
        started = time.monotonic()
        running.proc.send_signal(second)
        assert running.proc.wait(timeout=10) == 0
        assert time.monotonic() - started < 3   # not the 60 s grace (here ~0.5 s)
        client.join(timeout=10)
        log = running.log_text()
    assert streamed[-1] == "data: [DONE]" and streamed.count("data: [DONE]") == 1
    assert json.loads(streamed[-2].removeprefix("data: "))["error"]["code"] == "shutdown", streamed[-3:]
    assert "Traceback" not in log and "ERROR" not in log, log

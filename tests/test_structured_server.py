"""Structured outputs through trtbuild serve: response_format and the structured_outputs
extension, with the openai client (stream and not), a 400 naming the field for each bad
constraint, and compiling that never holds up the event loop."""
from __future__ import annotations

import json
import re
import threading

import httpx
import jsonschema
import pytest

from serving import KEY, served
from test_structured import REGEX, SCHEMA

pytestmark = pytest.mark.slow

AUTH = {"Authorization": f"Bearer {KEY}"}
# ~2 s to compile on a loaded 2-core machine: llguidance builds a lexer over 60k alternatives.
SLOW_SCHEMA = {"enum": [f"value-{i}-{i * 7919 % 10007}" for i in range(60_000)]}


def test_response_format_round_trip(client):
    response_format = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True}}
    messages = [{"role": "user", "content": "Describe a pet as JSON."}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=80, temperature=0,
                                           response_format=response_format)
    jsonschema.validate(json.loads(whole.choices[0].message.content), SCHEMA)
    assert whole.choices[0].finish_reason == "stop"
    pieces = client.chat.completions.create(model="tiny", messages=messages, max_tokens=80, temperature=0,
                                            response_format=response_format, stream=True)
    chunks = list(pieces)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "stop"
    sampled = client.chat.completions.create(model="tiny", messages=messages, max_tokens=120, temperature=1.0,
                                             seed=5, n=6, response_format=response_format)
    for choice in sampled.choices:
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_structured_outputs_extension_equals_the_python_api(client, tiny_engine):
    from trtbuild.runtime.llm import LLM
    from trtbuild.runtime.core.sampling import SamplingParams
    from trtbuild.runtime.structured import Choice, JsonObject, Regex

    llm = LLM(tiny_engine, backend="onnxruntime")
    for field, constraint in [({"structured_outputs": {"regex": REGEX}}, Regex(REGEX)),
                              ({"structured_outputs": {"choice": ["yes", "no"]}}, Choice(("yes", "no"))),
                              ({"response_format": {"type": "json_object"}}, JsonObject())]:
        served = client.completions.create(model="tiny", prompt="def f(x):", max_tokens=20, temperature=0,
                                           extra_body=field).choices[0]
        [expected] = llm.generate(["def f(x):"], SamplingParams(max_tokens=20, constraint=constraint))
        assert (served.text, served.finish_reason) == (expected.text, expected.finish_reason)
    assert re.fullmatch(REGEX, client.completions.create(
        model="tiny", prompt="x", max_tokens=20, temperature=0, extra_body={"structured_outputs": {"regex": REGEX}}
    ).choices[0].text)


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"structured_outputs": {"regex": "(("}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "root ::= missing"}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "structured_outputs"),
    ({"guided_json": {"type": "object"}}, "guided_json"),      # vLLM's old fields: never silently unconstrained
    ({"guided_regex": "a+"}, "guided_regex"),
])
def test_bad_constraints_are_400_naming_the_field(server, extra, param):
    response = httpx.post(f"{server}/v1/chat/completions", headers=AUTH, timeout=30,
                          json={"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}], **extra})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"].startswith(param + ":"), error


def test_a_slow_compile_holds_up_nothing(server):
    """/health answers while a 60k-value enum compiles in a worker thread."""
    done = {}

    def slow():
        done["response"] = httpx.post(f"{server}/v1/completions", headers=AUTH, timeout=60, json={
            "model": "tiny", "prompt": "x", "max_tokens": 40, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "big", "schema": SLOW_SCHEMA}}})

    worker = threading.Thread(target=slow)
    worker.start()
    try:
        health = httpx.get(f"{server}/health", timeout=30)
        quick = httpx.post(f"{server}/v1/completions", headers=AUTH, timeout=30,
                           json={"model": "tiny", "prompt": "x", "max_tokens": 4, "temperature": 0})
        assert health.status_code == 200 and quick.status_code == 200
        assert worker.is_alive()   # both answered while the big schema was still compiling
    finally:
        worker.join(60)
    assert done["response"].status_code == 200
    assert json.loads(done["response"].json()["choices"][0]["text"]) in SLOW_SCHEMA["enum"]


def test_compile_timeout_is_a_400(tiny_engine, tmp_path):
    with served(tiny_engine, tmp_path / "serve.log", "--compile-timeout", "0.05", api_key=KEY) as running:
        response = httpx.post(f"{running.base}/v1/completions", headers=AUTH, timeout=60, json={
            "model": "tiny", "prompt": "x", "max_tokens": 4,
            "structured_outputs": {"json": SLOW_SCHEMA}})
        assert response.status_code == 400, response.text
        assert response.json()["error"] == {
            "message": "structured_outputs.json: took over 0.05 s to compile; simplify it", "type": "invalid_request_error",
            "param": "structured_outputs.json", "code": "constraint_too_complex"}
        assert httpx.get(f"{running.base}/health", timeout=30).status_code == 200

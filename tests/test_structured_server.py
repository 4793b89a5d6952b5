"""Structured outputs through trtbuild serve: response_format and the structured_outputs
extension, with the openai client (stream and not), a 400 naming the field for each bad
constraint, and compiling that never holds up the event loop, in a bounded pool."""
from __future__ import annotations

import json
import re
import threading
from concurrent.futures import ThreadPoolExecutor

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


SELF = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
CYCLE = {"$defs": {"a": {"type": "object", "properties": {"b": {"$ref": "#/$defs/b"}}, "required": ["b"]},
                   "b": {"type": "object", "properties": {"a": {"$ref": "#/$defs/a"}}, "required": ["a"]}},
         "$ref": "#/$defs/a"}


@pytest.mark.parametrize("extra, param, kind", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SELF}}},
     "response_format.json_schema.schema", "json schema"),
    ({"structured_outputs": {"json": CYCLE}}, "structured_outputs.json", "json schema"),
    ({"structured_outputs": {"grammar": 'start: ("a" start)'}}, "structured_outputs.grammar", "grammar"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": SELF}}], "tool_choice": "required"},
     "tools", "json schema"),
], ids=["self-recursive", "ref-cycle", "grammar", "tool"])
def test_constraints_no_finite_text_matches_are_400(server, extra, param, kind):
    """A constraint whose every text is infinite is refused when it compiles, saying why, rather
    than generating until llguidance gives up mid-answer."""
    response = httpx.post(f"{server}/v1/chat/completions", headers=AUTH, timeout=30,
                          json={"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}], **extra})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert error["message"].startswith(f"{param}: {kind}: no text of under 1024 tokens (the engine's max_seq_len) "
                                       "matches it: it forces at least "), error


def _slow_schema(variant: int) -> dict:
    """SLOW_SCHEMA's size, its values different per variant (a compile each: no cache hit, no sharing)."""
    return {"enum": [f"value-{i}-{(i * 7919 + variant) % 10007}" for i in range(60_000)]}


def test_slow_compiles_hold_up_nothing(server):
    """/health and a free request answer while three 60k-value enums compile in the pool's two
    threads (the third waiting for one); each then gets its own constrained answer."""
    done = {}

    def slow(variant):
        done[variant] = httpx.post(f"{server}/v1/completions", headers=AUTH, timeout=90, json={
            "model": "tiny", "prompt": "x", "max_tokens": 40, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "big", "schema": _slow_schema(variant)}}})

    workers = [threading.Thread(target=slow, args=(variant,)) for variant in range(1, 4)]
    for worker in workers:
        worker.start()
    try:
        health = httpx.get(f"{server}/health", timeout=30)
        quick = httpx.post(f"{server}/v1/completions", headers=AUTH, timeout=30,
                           json={"model": "tiny", "prompt": "x", "max_tokens": 4, "temperature": 0})
        assert health.status_code == 200 and quick.status_code == 200
        assert any(worker.is_alive() for worker in workers)   # both answered while the big schemas compiled
    finally:
        for worker in workers:
            worker.join(90)
    for variant in range(1, 4):
        assert done[variant].status_code == 200, done[variant].text
        assert json.loads(done[variant].json()["choices"][0]["text"]) in _slow_schema(variant)["enum"]


def test_a_full_compile_pool_is_a_503(tiny_engine, tmp_path):
    """One compile thread and no wait: of eight new schemas sent at once (each ~0.5 s to compile),
    those that find the thread held get 503 and Retry-After, the rest their answer; a cached
    constraint never needs the thread."""
    body = {"model": "tiny", "prompt": "x", "max_tokens": 30, "temperature": 0}
    with served(tiny_engine, tmp_path / "serve.log", "--compile-workers", "1", "--compile-waiting", "0",
                api_key=KEY) as running:
        cached = {**body, "structured_outputs": {"regex": "[0-9]{2}"}}
        assert httpx.post(f"{running.base}/v1/completions", headers=AUTH, timeout=60, json=cached).status_code == 200
        with ThreadPoolExecutor(8) as senders:
            responses = list(senders.map(lambda variant: httpx.post(
                f"{running.base}/v1/completions", headers=AUTH, timeout=90,
                json={**body, "structured_outputs": {"json": _slow_schema(variant)}}), range(8)))
        assert httpx.post(f"{running.base}/v1/completions", headers=AUTH, timeout=60, json=cached).status_code == 200
        metrics = httpx.get(f"{running.base}/metrics", headers=AUTH, timeout=30).text
    busy = [r for r in responses if r.status_code == 503]
    assert f"trtbuild:constraint_compiles_refused {float(len(busy))}" in metrics
    assert "trtbuild:constraint_compiles_pending 0.0" in metrics
    answered = [(variant, r) for variant, r in enumerate(responses) if r.status_code == 200]
    assert len(busy) + len(answered) == 8 and busy and answered, [r.text for r in responses]
    for response in busy:
        assert response.headers["retry-after"] == "1"
        assert response.json()["error"] == {
            "message": "structured_outputs.json: constraint compiler busy: 1 compiling and 0 waiting; retry shortly",
            "type": "server_error", "param": "structured_outputs.json", "code": "constraint_compiler_busy"}
    for variant, response in answered:
        assert json.loads(response.json()["choices"][0]["text"]) in _slow_schema(variant)["enum"]


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


TOOLS = [{"type": "function", "function": {
             "name": "get_weather", "description": "The weather in a city.",
             "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                            "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}}}}},
         {"type": "function", "function": {
             "name": "add", "description": "The sum of two integers.",
             "parameters": {"type": "object", "additionalProperties": False, "required": ["a", "b"],
                            "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "b": {"type": "integer", "minimum": 0, "maximum": 999}}}}}]
PARAMETERS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}


def _checked_call(message) -> tuple[str, dict]:
    """The one call's name and arguments, the arguments validated against that tool's schema."""
    assert message.content is None and len(message.tool_calls) == 1
    [call] = message.tool_calls
    assert call.type == "function" and re.fullmatch(r"call_[0-9a-f]{24}", call.id)
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, PARAMETERS[call.function.name])
    return call.function.name, arguments


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "add"}}],
                         ids=["required", "named"])
def test_tool_calls_whole_and_streamed(client, tool_choice):
    """The answer is a call of one of the tools (the named one when named) whose arguments
    validate; streamed, the openai client joins the deltas into the same call; sampled calls validate too."""
    messages = [{"role": "user", "content": "What is 2 plus 3?"}]
    ask = dict(model="tiny", messages=messages, tools=TOOLS, tool_choice=tool_choice, max_tokens=60, temperature=0)
    whole = client.chat.completions.create(**ask).choices[0]
    assert whole.finish_reason == "tool_calls"
    name, arguments = _checked_call(whole.message)
    assert name == "add" or tool_choice == "required"
    with client.chat.completions.stream(**ask) as stream:
        streamed = stream.get_final_completion().choices[0]
    assert streamed.finish_reason == "tool_calls" and _checked_call(streamed.message) == (name, arguments)
    sampled = client.chat.completions.create(**{**ask, "temperature": 1.0, "seed": 3, "n": 4})
    for choice in sampled.choices:
        assert choice.finish_reason == "tool_calls" and _checked_call(choice.message)[0] in PARAMETERS


@pytest.mark.parametrize("cut, finish", [({"stop": ['"b"']}, "stop"), ({"max_tokens": 12}, "length")],
                         ids=["stop-string", "max-tokens"])
def test_a_cut_call_is_content_streamed_as_whole(client, cut, finish):
    """A call cut by a stop string or max_tokens is no call: its text comes back as content with
    that finish_reason, and a stream says exactly that (no tool_calls deltas of a broken call)."""
    ask = dict(model="tiny", messages=[{"role": "user", "content": "What is 2 plus 3?"}], tools=TOOLS,
               tool_choice={"type": "function", "function": {"name": "add"}}, temperature=0, **{"max_tokens": 60, **cut})
    whole = client.chat.completions.create(**ask).choices[0]
    assert whole.finish_reason == finish and whole.message.tool_calls is None
    assert whole.message.content.startswith('{"name": "add", "arguments": {') and '"b"' not in whole.message.content
    chunks = [chunk.choices[0] for chunk in client.chat.completions.create(**ask, stream=True) if chunk.choices]
    assert not any(c.delta.tool_calls for c in chunks)
    assert "".join(c.delta.content or "" for c in chunks) == whole.message.content
    assert [c.finish_reason for c in chunks if c.finish_reason] == [finish]


def test_tool_choice_none_ignores_the_tools_and_bad_tools_are_400(server, client):
    messages = [{"role": "user", "content": "x"}]
    free = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, tool_choice="none",
                                          max_tokens=8, temperature=0).choices[0]
    plain = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0).choices[0]
    assert (free.message.content, free.message.tool_calls) == (plain.message.content, None)
    for extra, param in [({"tools": TOOLS}, "tool_choice"),
                         ({"tools": [{"type": "function", "function": {"description": "no name"}}],
                           "tool_choice": "required"}, "tools.0.function.name"),
                         ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "mul"}}},
                          "tool_choice.function.name"),
                         ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
                             "type": "object", "properties": {"a": {"type": "nonsense"}}}}}], "tool_choice": "required"},
                          "tools.0.function.parameters")]:
        response = httpx.post(f"{server}/v1/chat/completions", headers=AUTH, timeout=30,
                              json={"model": "tiny", "max_tokens": 4, "messages": messages, **extra})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and error["message"].startswith(param + ":"), error
    completion = httpx.post(f"{server}/v1/completions", headers=AUTH, timeout=30,
                            json={"model": "tiny", "prompt": "x", "max_tokens": 4, "tools": TOOLS})
    assert completion.status_code == 400 and completion.json()["error"]["param"] == "tools"


def test_a_call_and_its_result_go_back_in_messages(client):
    """The agent loop: the answer's call and the tool's result sent back, then a free answer
    (tool_choice "none") or another call."""
    messages = [{"role": "user", "content": "What is 2 plus 3?"}]
    ask = dict(model="tiny", tools=TOOLS, max_tokens=60, temperature=0)
    [call] = client.chat.completions.create(messages=messages, tool_choice="required", **ask).choices[0].message.tool_calls
    messages += [{"role": "assistant", "content": None, "tool_calls": [
                     {"id": call.id, "type": "function",
                      "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
                 {"role": "tool", "tool_call_id": call.id, "content": "5"}]
    answer = client.chat.completions.create(messages=messages, tool_choice="none", **ask).choices[0]
    assert answer.message.tool_calls is None and answer.message.content
    again = client.chat.completions.create(messages=messages, tool_choice="required", **ask).choices[0]
    assert again.finish_reason == "tool_calls" and _checked_call(again.message)[0] in PARAMETERS

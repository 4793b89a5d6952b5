"""Structured output and tool calls under speculation, served: a draft that runs past the
grammar's end is cut there, for every draft source, streamed and not.

The shape that shows it is any chat history after a tool call: the prompt holds the JSON the
model is about to write again, then the end-of-turn token, so prompt lookup drafts the JSON's
rest, the end-of-turn token and what followed it. The engine here is the bundled model with its
Medusa heads, prompt lookup and suffix drafting, a draft head (random weights: its drafts are
masked and cut like any other), and a chat template that ends every turn with
eos (as SmolLM2's ends it with <|im_end|>); it is served verifying every draft it gets."""
from __future__ import annotations

import json
import shutil

import httpx
import jsonschema
import pytest

from conftest import REPO, TINY_CODE
from serving import KEY, served
from test_draft_head_build import make_draft_dir

pytestmark = pytest.mark.slow

AUTH = {"Authorization": f"Bearer {KEY}"}
TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}{{ eos_token }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
SOURCES = [["prompt_lookup"], ["suffix"], ["medusa"], ["draft_head"], []]
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"enum": ["Paris", "Oslo"]}, "unit": {"enum": ["celsius", "kelvin"]}}}
ANSWER = '{"city": "Paris", "unit": "celsius"}'
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    import subprocess
    import sys

    import yaml

    work = tmp_path_factory.mktemp("structured-speculation")
    checkpoint = work / "tiny-code"
    shutil.copytree(TINY_CODE, checkpoint)
    config = json.loads((checkpoint / "tokenizer_config.json").read_text())
    (checkpoint / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    spec = yaml.safe_load((REPO / "specs" / "tiny-code-medusa.yaml").read_text())
    spec["model"]["checkpoint"] = str(checkpoint)
    spec["speculative"].update(medusa={**spec["speculative"]["medusa"], "heads": str(checkpoint / "medusa")},
                               prompt_lookup={}, suffix={},
                               draft_head={"path": str(make_draft_dir(work / "draft")), "num_tokens": 4})
    (work / "spec.yaml").write_text(yaml.safe_dump(spec))
    proc = subprocess.run([sys.executable, "-m", "trtbuild.cli", "build", str(work / "spec.yaml"), "-o",
                           str(work / "engine")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return work / "engine"


@pytest.fixture(scope="module")
def server(engine, tmp_path_factory):
    with served(engine, tmp_path_factory.mktemp("logs") / "serve.log", "--speculation-mode", "always",
                api_key=KEY) as running:
        yield running.base


def _answer(server: str, route: str, body: dict, stream: bool) -> tuple[dict, str, dict]:
    """(the choice's message or text as {"content", "tool_calls"}, its finish_reason, usage), from a
    whole answer or a joined stream."""
    if not stream:
        response = httpx.post(f"{server}/v1/{route}", headers=AUTH, json=body, timeout=120)
        assert response.status_code == 200, response.text
        answer = response.json()
        [choice] = answer["choices"]
        message = choice["message"] if "message" in choice else {"content": choice["text"]}
        return {"content": message.get("content"), "tool_calls": message.get("tool_calls")}, \
            choice["finish_reason"], answer["usage"]
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    content, calls, finish, used = "", None, None, None
    with httpx.stream("POST", f"{server}/v1/{route}", headers=AUTH, json=body, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            used = chunk.get("usage") or used
            for choice in chunk["choices"]:
                delta = choice.get("delta", {"content": choice.get("text")})
                content += delta.get("content") or ""
                for call in delta.get("tool_calls") or []:
                    calls = calls or [{"id": call["id"], "type": call["type"],
                                       "function": {"name": call["function"]["name"], "arguments": ""}}]
                    calls[0]["function"]["arguments"] += call["function"]["arguments"]
                finish = choice["finish_reason"] or finish
    return {"content": content or None, "tool_calls": calls}, finish, used


def _accounted(used: dict, speculation: list[str]) -> None:
    accepted = used["completion_tokens_details"]["accepted_prediction_tokens"]
    assert accepted <= used["completion_tokens"] and (accepted == 0 or speculation)


@pytest.mark.parametrize("stop", [None, "Paris"], ids=["no-stop", "stop-string"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("speculation", SOURCES, ids=lambda s: "+".join(s) or "none")
def test_json_whose_draft_runs_past_its_end(server, speculation, stream, stop):
    """The completions case: the prompt holds the answer twice, each time followed by eos. A
    stop string inside a verified draft ends the answer there, and the draft tokens after it
    count as accepted nowhere (usage: never more accepted than completion tokens)."""
    body = {"model": "tiny", "prompt": f"{ANSWER}<|endoftext|>\n" * 2, "max_tokens": 40, "temperature": 0,
            "speculation": speculation, "stop": stop,
            "response_format": {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER}}}
    message, finish, used = _answer(server, "completions", body, stream)
    assert (message["content"], finish) == (ANSWER if stop is None else '{"city": "', "stop")
    _accounted(used, speculation)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("speculation", SOURCES, ids=lambda s: "+".join(s) or "none")
def test_agent_loop_call_whose_draft_runs_past_its_end(server, speculation, stream):
    """The agent loop: the history holds the call just made, its result, and the same question."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ANSWER}}
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "21"},
                {"role": "user", "content": "Weather in Paris?"}]
    body = {"model": "tiny", "messages": messages, "tools": TOOLS, "tool_choice": "required", "max_tokens": 60,
            "temperature": 0, "speculation": speculation}
    message, finish, used = _answer(server, "chat/completions", body, stream)
    assert finish == "tool_calls" and message["content"] is None, (message, finish)
    [made] = message["tool_calls"]
    assert made["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(made["function"]["arguments"]), WEATHER)
    _accounted(used, speculation)

"""Function tools (runtime/server/tools.py, tool_calls.py): what tools and tool_choice ask for,
the call's grammar (references inside a tool's parameters still resolve), and a call's text
turned into OpenAI's tool_calls, whole and streamed (only a whole call is one)."""
from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer

from conftest import TINY_CODE
from trtbuild.runtime.server.protocol import ApiError, ChatRequest
from trtbuild.runtime.server.tool_calls import ToolCallStream, tool_call
from trtbuild.runtime.server.tools import tool_calling
from trtbuild.runtime.structured import ConstraintCompiler

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}}}}}
MOVE = {"type": "function", "function": {
    "name": "move", "parameters": {"type": "object", "required": ["to"], "additionalProperties": False,
                                   "properties": {"to": {"$ref": "#/$defs/Point"}},
                                   "$defs": {"Point": {"type": "object", "required": ["x"], "additionalProperties": False,
                                                       "properties": {"x": {"type": "integer"}}}}}}}


def _calling(tools, tool_choice):
    body = ChatRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": tools,
                                       "tool_choice": tool_choice})
    return tool_calling(body.tools, body.tool_choice)


def _accepts(constraint, text: str) -> bool:
    """Whether the compiled constraint takes ``text`` whole (each token allowed, then ended)."""
    tokenizer = Tokenizer.from_file(str(TINY_CODE / "tokenizer.json"))
    matcher = ConstraintCompiler(tokenizer, 4096, (0,)).compile(constraint).matcher()
    ended = False
    for token in tokenizer.encode(text).ids:
        if not matcher.allowed()[token]:
            return False
        ended = matcher.advance(token)
    return ended


def test_required_and_named_choices_constrain_to_calls():
    required = _calling([WEATHER, MOVE], "required")
    assert required.callable == ("get_weather", "move")
    assert _accepts(required.constraint, '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}')
    assert _accepts(required.constraint, '{"name": "move", "arguments": {"to": {"x": 3}}}')   # $defs moved, still resolve
    assert not _accepts(required.constraint, '{"name": "move", "arguments": {"to": {"x": "3"}}}')
    named = _calling([WEATHER, MOVE], {"type": "function", "function": {"name": "move"}})
    assert named.callable == ("move",)
    assert not _accepts(named.constraint, '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}')
    assert named.system_line().startswith('Call this function, answering with only a JSON object {"name": ')
    assert "- move: no description; arguments: {" in named.system_line()
    bare = _calling([{"type": "function", "function": {"name": "now"}}], "required")
    assert _accepts(bare.constraint, '{"name": "now", "arguments": {}}')
    assert _calling([WEATHER], "none") is None and _calling(None, None) is None


@pytest.mark.parametrize("tools, tool_choice, param, message", [
    ([WEATHER], None, "tool_choice", 'tool_choice: "auto" (the default with tools) is not supported'),
    ([WEATHER], "auto", "tool_choice", 'tool_choice: "auto" (the default with tools) is not supported'),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice.function.name",
     "tool_choice.function.name: 'nope' is not one of the tools (get_weather)"),
    (None, "required", "tool_choice", "tool_choice: needs tools"),
    ([WEATHER, WEATHER], "required", "tools.1.function.name",
     "tools.1.function.name: 'get_weather' is also tools.0's; function names must differ"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}], "required",
     "tools.0.function.parameters", 'tools.0.function.parameters: the arguments are a JSON object: type must be "object"'),
    ([{"type": "function", "function": {"name": "f", "parameters": {"properties": {"a": {"type": "nonsense"}}}}}],
     "required", "tools.0.function.parameters", "tools.0.function.parameters: not a valid JSON Schema: "),
])
def test_bad_tools_are_refused_naming_the_field(tools, tool_choice, param, message):
    with pytest.raises(ApiError) as caught:
        _calling(tools, tool_choice)
    assert caught.value.status == 400 and caught.value.param == param and caught.value.message.startswith(message)


CALL = '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}'


def test_a_whole_call_becomes_tool_calls():
    message, finish = tool_call(CALL, "stop")
    assert finish == "tool_calls" and message["content"] is None
    [call] = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "c"}'}
    assert tool_call(CALL[:30], "length") == ({"role": "assistant", "content": CALL[:30]}, "length")


@pytest.mark.parametrize("size", [1, 3, 7, len(CALL)])
def test_a_streamed_call_joins_to_the_whole_one(size):
    stream = ToolCallStream()
    deltas = [d for start in range(0, len(CALL), size) for d in stream.feed(CALL[start:start + size])]
    last, finish = stream.finish("stop")
    calls = [d["tool_calls"][0] for d in deltas + last]
    assert finish == "tool_calls" and calls[0]["id"] == stream.id and calls[0]["function"]["name"] == "get_weather"
    assert all(c["index"] == 0 for c in calls) and all("id" not in c for c in calls[1:])
    arguments = "".join(c["function"]["arguments"] for c in calls)
    assert arguments == json.dumps({"city": "Oslo", "unit": "c"})


@pytest.mark.parametrize("finish_reason", ["stop", "length"])
def test_only_a_whole_call_is_a_call_streamed_exactly_as_whole(finish_reason):
    """Whatever ended the answer (its grammar, max_tokens, a stop string: each says "stop" or
    "length"), it is a call only when its text is the whole call; a cut one is content with its
    finish_reason. Streamed in any pieces, the answer is the same."""
    for cut in range(len(CALL) + 1):
        text = CALL[:cut]
        message, finish = tool_call(text, finish_reason)
        if cut == len(CALL):
            assert finish == "tool_calls" and json.loads(message["tool_calls"][0]["function"]["arguments"])
        else:
            assert (message, finish) == ({"role": "assistant", "content": text}, finish_reason)
        for size in (1, 5, len(CALL)):
            stream = ToolCallStream()
            deltas = [d for start in range(0, len(text), size) for d in stream.feed(text[start:start + size])]
            last, streamed_finish = stream.finish(finish_reason)
            content = "".join(d.get("content", "") for d in deltas + last)
            calls = [c for d in deltas + last for c in d.get("tool_calls", [])]
            assert streamed_finish == finish
            if finish == "tool_calls":
                assert not content and [c["function"] for c in calls] == [message["tool_calls"][0]["function"]]
            else:
                assert content == text and not calls


def test_a_stream_cut_before_its_call_began_is_content():
    stream = ToolCallStream()
    assert stream.feed('{"na') == []
    assert stream.finish("length") == ([{"content": '{"na'}], "length")


def test_a_template_that_reads_tools_gets_them():
    from trtbuild.runtime.server.chat import DEFAULT_TEMPLATE, ChatTemplate

    reads = ChatTemplate("{% if tools %}[{% for t in tools %}{{ t.function.name }} {% endfor %}]{% endif %}"
                         "{% for m in messages %}{{ m.content }}{% endfor %}")
    messages = [{"role": "user", "content": "hi"}]
    assert reads.takes_tools and reads.render(messages, [WEATHER, MOVE]) == "[get_weather move ]hi"
    assert reads.render(messages) == "hi"
    assert not ChatTemplate(DEFAULT_TEMPLATE).takes_tools


def test_calls_and_results_in_messages_reach_the_template():
    """A template without tools sees a call as the JSON the grammar makes the model write; one
    that reads tools gets tool_calls (arguments parsed) and the result's tool_call_id."""
    from trtbuild.runtime.server.chat import DEFAULT_TEMPLATE, ChatTemplate
    from trtbuild.runtime.server.tool_messages import template_messages

    body = ChatRequest.model_validate({"model": "m", "messages": [
        {"role": "user", "content": "2 + 3?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
        {"role": "tool", "content": "5", "tool_call_id": "call_1"}]})
    assert body.unsupported() is None
    plain = ChatTemplate(DEFAULT_TEMPLATE).render(template_messages(body.messages, takes_tools=False))
    assert plain == ('<|user|>\n2 + 3?\n<|assistant|>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n'
                     '<|tool|>\n5\n<|assistant|>\n')
    reads = template_messages(body.messages, takes_tools=True)
    assert reads[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]}
    assert reads[2] == {"role": "tool", "content": "5", "tool_call_id": "call_1"}

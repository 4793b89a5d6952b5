"""A constrained tool call's text → OpenAI's ``tool_calls``, whole or streamed.

The grammar (runtime/server/tools.py) makes the text ``{"name": "<name>", "arguments": <JSON>}``
in that key order; ``arguments`` goes out as the exact JSON text the model wrote. An answer is
a call only when its text is one whole call, complete JSON, whatever ended it: one cut short
(max_tokens, a stop string, a grammar that failed) is no call, and its text comes back as
``content`` with its finish_reason, as OpenAI's own truncated answers do. Streamed, the call is
held back until the answer ends (only then is it known to be whole), so a stream says exactly
what the whole answer says."""
from __future__ import annotations

import json
import re
import uuid

# The call's opening up to its arguments' first character (whitespace tolerated, though the
# grammar writes none but the blank after the colon).
HEAD = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*(?=\S)')


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def whole_call(text: str) -> dict | None:
    """The call's ``function`` (its name and arguments' JSON text) when ``text`` is one whole
    call; None for anything else (cut short, not a call)."""
    try:
        call = json.loads(text)
    except json.JSONDecodeError:
        return None
    head = HEAD.match(text)
    if (head is None or not isinstance(call, dict) or list(call) != ["name", "arguments"]
            or not isinstance(call["name"], str) or not isinstance(call["arguments"], dict)):
        return None
    # What follows the head, less the call's closing brace: the arguments as the model wrote them.
    return {"name": call["name"], "arguments": text[head.end():].rstrip()[:-1].rstrip()}


def tool_call(text: str, finish_reason: str, id_: str | None = None) -> tuple[dict, str]:
    """The assistant message and finish_reason for a whole answer."""
    function = whole_call(text)
    if function is None:
        return {"role": "assistant", "content": text}, finish_reason
    return {"role": "assistant", "content": None,
            "tool_calls": [{"id": id_ or call_id(), "type": "function", "function": function}]}, "tool_calls"


class ToolCallStream:
    """One choice's streamed answer: ``feed`` each delta's text (nothing goes out yet),
    ``finish`` at the end: the chunk deltas to send, as ``tool_call`` reads the whole text
    (one ``{"tool_calls": [...]}`` delta with the whole call, or the text as ``content``)."""

    def __init__(self):
        self.text = ""
        self.id = call_id()

    def feed(self, text: str) -> list[dict]:
        self.text += text
        return []

    def finish(self, finish_reason: str) -> tuple[list[dict], str]:
        """The last deltas and the choice's finish_reason ("tool_calls" for a whole call)."""
        message, finish = tool_call(self.text, finish_reason, self.id)
        if message["content"] is not None:
            return ([{"content": message["content"]}] if message["content"] else []), finish
        return [{"tool_calls": [{"index": 0, **message["tool_calls"][0]}]}], finish

"""A constrained tool call's text → OpenAI's ``tool_calls``, whole or streamed.

The grammar (runtime/server/tools.py) makes the text ``{"name": "<name>", "arguments": <JSON>}``
in that key order; ``arguments`` goes out as the exact JSON text the model wrote. A call cut
short (``length``, or an abort) is no call: its text comes back as ``content`` with that
finish_reason, as OpenAI's own truncated answers do."""
from __future__ import annotations

import json
import re
import uuid

# The call's opening up to its arguments' first character (whitespace tolerated, though the
# grammar writes none but the blank after the colon).
HEAD = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*(?=\S)')


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call(text: str, finish_reason: str) -> tuple[dict, str]:
    """The assistant message and finish_reason for a whole answer."""
    head = HEAD.match(text)
    if finish_reason != "stop" or head is None:
        return {"role": "assistant", "content": text}, finish_reason
    function = {"name": json.loads(head.group(1)), "arguments": _arguments(text, head.end())}
    return {"role": "assistant", "content": None,
            "tool_calls": [{"id": call_id(), "type": "function", "function": function}]}, "tool_calls"


def _arguments(text: str, start: int) -> str:
    """The arguments' JSON text: what follows the head, less the call's closing brace."""
    return text[start:].rstrip()[:-1].rstrip()


class ToolCallStream:
    """One choice's streamed call: ``feed`` each delta's text, ``finish`` at the end; each gives
    the chunk deltas to send (``{"tool_calls": [...]}`` pieces the openai client joins: the id,
    type and name first, then the arguments text in order)."""

    def __init__(self):
        self.text, self.sent = "", None   # sent: the index in text up to which arguments went out
        self.id = call_id()

    def feed(self, text: str) -> list[dict]:
        self.text += text
        deltas = []
        if self.sent is None:
            head = HEAD.match(self.text)
            if head is None:
                return []
            self.sent = head.end()
            deltas.append(self._delta({"name": json.loads(head.group(1)), "arguments": ""}, opening=True))
        # Hold back the last non-blank character: it may be the call's closing brace.
        end = len(self.text.rstrip()) - 1
        if end > self.sent:
            deltas.append(self._delta({"arguments": self.text[self.sent:end]}))
            self.sent = end
        return deltas

    def finish(self, finish_reason: str) -> tuple[list[dict], str]:
        """The last deltas and the choice's finish_reason ("tool_calls" for a whole call)."""
        if self.sent is None:   # no call began: what came is plain content
            return ([{"content": self.text}] if self.text else []), finish_reason
        if finish_reason != "stop":   # cut short: the arguments so far, as they are
            rest = self.text[self.sent:]
            return ([self._delta({"arguments": rest})] if rest else []), finish_reason
        arguments_end = self.sent + len(_arguments(self.text[self.sent:], 0))
        rest = self.text[self.sent:arguments_end]
        return ([self._delta({"arguments": rest})] if rest else []), "tool_calls"

    def _delta(self, function: dict, opening: bool = False) -> dict:
        call = {"index": 0, "id": self.id, "type": "function", "function": function} if opening else \
            {"index": 0, "function": function}
        return {"tool_calls": [call]}

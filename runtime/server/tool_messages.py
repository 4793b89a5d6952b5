"""Chat messages → what the chat template renders, tool calls and their results included.

A template that reads ``tools`` (Hugging Face's tool-use templates) gets an assistant's calls
as ``tool_calls`` with ``arguments`` parsed to an object (the Hugging Face convention; left as
text if it is not JSON) and tool messages with their ``tool_call_id``. Any other template (the
default, SmolLM2's) sees an assistant's calls as its content, each call's JSON on a line, the
same text the server's tool-call grammar makes the model write, and a tool message as a
message of role "tool" with the result as content."""
from __future__ import annotations

import json

from .protocol import ChatMessage


def template_messages(messages: list[ChatMessage], takes_tools: bool) -> list[dict]:
    return [_message(message, takes_tools) for message in messages]


def _message(message: ChatMessage, takes_tools: bool) -> dict:
    content = message.text()
    if message.role == "tool" and takes_tools:
        return {"role": "tool", "content": content, "tool_call_id": message.tool_call_id}
    if not message.tool_calls:
        return {"role": message.role, "content": content}
    if takes_tools:
        calls = [{"id": call.id, "type": "function",
                  "function": {"name": call.function.name, "arguments": _parsed(call.function.arguments)}}
                 for call in message.tool_calls]
        return {"role": "assistant", "content": content, "tool_calls": calls}
    lines = [f'{{"name": {json.dumps(call.function.name)}, "arguments": {call.function.arguments}}}'
             for call in message.tool_calls]
    return {"role": "assistant", "content": "\n".join(([content] if content else []) + lines)}


def _parsed(arguments: str):
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments

"""Logprob entries (``runtime.outputs.TokenLogprob``, made by the output processor off the event
loop) in the OpenAI shapes, for a stream chunk's tokens or a whole completion's alike:
completions' parallel lists with ``text_offset``, chat's per-token objects with the raw ``bytes``."""
from __future__ import annotations

from ..outputs import TokenLogprob


def token_text(raw: bytes) -> str:
    """The token as text; one that is not UTF-8 on its own (a piece of a character split across
    tokens) as ``bytes:\\xe6\\x97``, as OpenAI names such tokens, instead of a lossy U+FFFD."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{byte:02x}" for byte in raw)


def completion_logprobs(entries: list[TokenLogprob] | tuple[TokenLogprob, ...], alternatives: bool) -> dict:
    """``/v1/completions``' ``logprobs``: ``text_offset`` counts characters of the choice's text."""
    return {"tokens": [token_text(e.token) for e in entries], "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{token_text(raw): logprob for _, raw, logprob in e.top} for e in entries]
            if alternatives else None,
            "text_offset": [e.text_offset for e in entries]}


def chat_logprobs(entries: list[TokenLogprob] | tuple[TokenLogprob, ...]) -> dict:
    """``/v1/chat/completions``' ``logprobs``: ``bytes`` are the token's own, so the bytes of a
    character split across tokens join back to it."""
    return {"content": [{**_chat_entry(e.token, e.logprob),
                         "top_logprobs": [_chat_entry(raw, logprob) for _, raw, logprob in e.top]} for e in entries]}


def _chat_entry(raw: bytes, logprob: float) -> dict:
    return {"token": token_text(raw), "logprob": logprob, "bytes": list(raw)}

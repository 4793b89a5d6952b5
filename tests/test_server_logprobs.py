"""Logprob entries in the OpenAI shapes, for characters split across tokens (the bundled model
never samples one, so its tokens come from the tokenizer here): chat's ``bytes`` join back to
the text and no token string is a lossy U+FFFD."""
from __future__ import annotations

from tokenizers import Tokenizer

from trtbuild.runtime.detokenize import Detokenizer
from trtbuild.runtime.outputs import TokenLogprob
from trtbuild.runtime.server.logprobs import chat_logprobs, completion_logprobs, token_text

from conftest import TINY_CODE

TEXT = "s = '日本 ü'"


def _entries() -> list[TokenLogprob]:
    tokenizer = Tokenizer.from_file(str(TINY_CODE / "tokenizer.json"))
    detokenizer = Detokenizer(tokenizer, 4096)
    ids = tokenizer.encode(TEXT).ids
    offsets = [len(tokenizer.decode(ids[:i]).rstrip("\ufffd")) for i in range(len(ids))]
    return [TokenLogprob(t, detokenizer.token_bytes(t), -0.5 * i, offsets[i], ((t, detokenizer.token_bytes(t), -0.5 * i),))
            for i, t in enumerate(ids)]


def test_token_text_names_a_split_character_by_its_bytes():
    assert token_text(" ü".encode()) == " ü"
    assert token_text("日".encode()[:2]) == "bytes:\\xe6\\x97" and token_text(b"") == ""


def test_chat_bytes_recover_a_character_split_across_tokens():
    content = chat_logprobs(_entries())["content"]
    assert bytes(b for entry in content for b in entry["bytes"]).decode("utf-8") == TEXT
    assert not any("\ufffd" in entry["token"] for entry in content)
    split = [entry for entry in content if entry["token"].startswith("bytes:")]
    assert split and all(entry["token"] == "bytes:" + "".join(f"\\x{b:02x}" for b in entry["bytes"]) for entry in split)
    assert [entry["top_logprobs"] for entry in content] == [
        [{"token": entry["token"], "logprob": entry["logprob"], "bytes": entry["bytes"]}] for entry in content]


def test_completion_logprobs_are_parallel_lists_with_text_offsets():
    entries = _entries()
    logprobs = completion_logprobs(entries, alternatives=True)
    assert logprobs["token_logprobs"] == [-0.5 * i for i in range(len(entries))]
    assert logprobs["text_offset"] == [e.text_offset for e in entries] and logprobs["text_offset"][:3] == [0, 1, 3]
    assert logprobs["top_logprobs"] == [{token: lp} for token, lp in zip(logprobs["tokens"], logprobs["token_logprobs"])]
    assert completion_logprobs(entries, alternatives=False)["top_logprobs"] is None

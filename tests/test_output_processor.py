"""The output processor without an engine: streamed pieces hold back what could begin a stop
string, join to exactly the final text, and a stop ends the text where it starts."""
from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from trtbuild.runtime.detokenize import Detokenizer
from trtbuild.runtime.engine_core import Sampling
from trtbuild.runtime.output_processor import RequestText, held_back
from trtbuild.runtime.core.sampling import Sampler, SamplingParams
from trtbuild.runtime.core.scheduler import Request

from conftest import TINY_CODE


@pytest.mark.parametrize("text, stops, expected", [
    ("x = 1\n#", ("# end",), 1),
    ("x = 1\n# e", ("# end",), 3),
    ("x = 1\n# x", ("# end",), 0),
    ("abab", ("abc", "bab!"), 3),       # the longest start of any stop string
    ("xa", ("ab",), 1),
    ("ab", ("ab",), 0),                 # a whole stop is found, not held: only its proper starts are
    ("", ("ab",), 0),
])
def test_held_back_is_the_longest_tail_that_begins_a_stop(text, stops, expected):
    assert held_back(text, stops) == expected


def _stream(text: str, stops: tuple[str, ...], max_tokens: int = 64, logprobs: bool = False,
            deltas: list | None = None) -> tuple[list[str], RequestText, Request]:
    tokenizer = Tokenizer.from_file(str(TINY_CODE / "tokenizer.json"))
    params = SamplingParams(max_tokens=max_tokens, stop=stops, logprobs=logprobs, top_logprobs=2 if logprobs else 0)
    request, detokenizer = Request("r", [1], params), Detokenizer(tokenizer, 4096)
    out, sampling = RequestText(detokenizer.stream(), arrival_s=0.0), Sampling(Sampler(params))
    pieces = []
    for position, token in enumerate(tokenizer.encode(text).ids):
        request.output.append(token)
        if logprobs:  # what sampling records before the commit: the token's logprob and alternatives
            sampling.logprobs.append(-0.25 * position)
            sampling.top_logprobs.append(((token, -0.25 * position), (0, -9.0)))
        if len(request.output) == max_tokens:
            request.finish_reason = "length"
        delta, stopped = out.push(request, token, sampling, detokenizer)
        pieces.append(delta.text)
        if deltas is not None:
            deltas.append(delta)
        if stopped or delta.finished:
            break
    return pieces, out, request


def test_a_stop_across_tokens_is_never_streamed():
    pieces, out, request = _stream("x = 1\n# end of it\ny = 2\n", ("# end",))
    assert out.text == "x = 1\n" and "".join(pieces) == "x = 1\n"
    assert not any("#" in p for p in pieces)


def test_held_back_text_comes_out_when_it_cannot_begin_a_stop_or_the_request_ends():
    pieces, out, _ = _stream("a # b # e", ("# end",))  # never completes: ends at the last token
    assert "".join(pieces) == "a # b " and out.text == "a # b # e"  # "# e" could still begin "# end"...
    pieces, out, request = _stream("a # b # e", ("# end",), max_tokens=len(
        Tokenizer.from_file(str(TINY_CODE / "tokenizer.json")).encode("a # b # e").ids))
    assert "".join(pieces) == out.text == "a # b # e"  # ...until the request ends: all of it


def test_logprob_entries_carry_each_tokens_bytes_and_text_offset():
    """A character split across tokens: each token's entry has its own bytes (no U+FFFD), the
    bytes join to the text's UTF-8, and each offset is where the token's text begins."""
    text = "s = '日本語 ü ✓'\n"
    deltas = []
    _, out, request = _stream(text, (), max_tokens=len(Tokenizer.from_file(str(TINY_CODE / "tokenizer.json")).encode(
        text).ids), logprobs=True, deltas=deltas)
    entries = [entry for delta in deltas for entry in delta.logprobs]
    assert [e.token_id for e in entries] == request.output and out.text == text
    assert b"".join(e.token for e in entries) == text.encode("utf-8")
    assert any(e.token.decode("utf-8", "replace") != e.token.decode("utf-8", "ignore") for e in entries)  # a split one
    assert [e.logprob for e in entries] == [-0.25 * i for i in range(len(entries))]
    assert [e.top for e in entries] == [((e.token_id, e.token, e.logprob), (0, b"", -9.0)) for e in entries]
    offsets, seen = [], ""
    for delta in deltas:  # no stops: a piece is the text its token completed
        offsets.append(len(seen))
        seen += delta.text
    assert [e.text_offset for e in entries] == offsets
    assert all(not delta.logprobs for delta in _collect_deltas(text))  # none asked for: none made


def _collect_deltas(text: str) -> list:
    deltas = []
    _stream(text, (), deltas=deltas)
    return deltas

"""The output processor without an engine: streamed pieces hold back what could begin a stop
string, join to exactly the final text, and a stop ends the text where it starts."""
from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from trtbuild.runtime.detokenize import Detokenizer
from trtbuild.runtime.output_processor import RequestText, held_back
from trtbuild.runtime.sampling import SamplingParams
from trtbuild.runtime.scheduler import Request

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


def _stream(text: str, stops: tuple[str, ...], max_tokens: int = 64) -> tuple[list[str], RequestText, Request]:
    tokenizer = Tokenizer.from_file(str(TINY_CODE / "tokenizer.json"))
    request = Request("r", [1], SamplingParams(max_tokens=max_tokens, stop=stops))
    out = RequestText(Detokenizer(tokenizer, 4096).stream(), arrival_s=0.0)
    pieces = []
    for token in tokenizer.encode(text).ids:
        request.output.append(token)
        if len(request.output) == max_tokens:
            request.finish_reason = "length"
        delta, stopped = out.push(request, token)
        pieces.append(delta.text)
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

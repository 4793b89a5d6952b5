"""The speculation benchmark's workload prompts: 8 distinct ones per workload for both model kinds,
raw prompts that fit the bundled model and end where it continues."""
from __future__ import annotations

import sys

import pytest
from tokenizers import Tokenizer

from conftest import REPO, TINY_CODE

sys.path.insert(0, str(REPO / "benchmarks"))
from speculation_texts import RECORDS  # noqa: E402
from speculation_workloads import EDITS, WORKLOADS, prompts  # noqa: E402


@pytest.mark.parametrize("workload", WORKLOADS)
def test_eight_distinct_prompts_for_both_kinds(workload):
    raw, chat = prompts(workload, chat=False), prompts(workload, chat=True)
    assert len(raw) == len(set(raw)) == 8
    assert all(isinstance(p, str) and p and not p.endswith("\n") for p in raw)
    assert len(chat) == 8
    assert all(len(m) == 1 and set(m[0]) == {"role", "content"} and m[0]["role"] == "user" for m in chat)
    assert len({m[0]["content"] for m in chat}) == 8


def test_raw_prompts_fit_the_bundled_model():
    """A code_edit prompt and its rewritten function (about as long) fit the 1024-token context."""
    tokenizer = Tokenizer.from_file(str(TINY_CODE / "tokenizer.json"))
    lengths = [len(tokenizer.encode(p).ids) for w in WORKLOADS for p in prompts(w, chat=False)]
    assert max(lengths) <= 512


def test_code_edit_prompts_carry_the_real_function():
    raw, chat = prompts("code_edit", chat=False)[0], prompts("code_edit", chat=True)[0][0]["content"]
    assert EDITS[0][:2] == ("textwrap", "dedent")
    assert raw.startswith("def dedent(text):\n") and raw.endswith("renamed to `common_prefix`:\ndef dedent(text):")
    assert "    margin = None\n" in raw and "    margin = None\n" in chat
    # parse_qs's signature spans two lines: the raw prompt ends after the whole of it
    assert prompts("code_edit", chat=False)[6].endswith("separator='&'):")


def test_json_records_hold_their_values_verbatim():
    for text, filled in RECORDS:
        for key, value in filled.items():
            assert value in text, (key, value)
    assert prompts("json", chat=False)[0].endswith("keys: invoice_number, seller, buyer, date, total, due_date.\n"
                                                   "record = {")


def test_unknown_workload_is_refused():
    with pytest.raises(ValueError, match="workload 'chat': valid code_edit, extract, json, free_chat"):
        prompts("chat", chat=True)

"""The rank protocol (runtime/parallel/protocol.py): every message rank 0 sends survives encode →
decode exactly, and a malformed one is refused in one line naming the receiving rank."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from trtbuild.runtime.speculation.medusa import Tree
from trtbuild.runtime.parallel.protocol import (HEADER_WORDS, MAGIC, MAX_PAYLOAD_WORDS, VERSION, MessageKind,
                                            RankProtocolError, Stop, decode, encode)
from trtbuild.runtime.core.step import CopySlot, KeepPath, LoadBlock, SaveBlock, Step, StepKind

RUNTIME = Path(__file__).resolve().parents[1] / "runtime"

PREFILL = Step(StepKind.prefill, 0, ("req-1", "req-2"), ((1, 2, 3, 4), (5, 6)), (0, 16), (True, False))
DECODE = Step(StepKind.decode, 3, ("a",), ((42,),), (17,), (True,), draft_heads=False)
VERIFY = Step(StepKind.decode, 1, ("plain", "tree-ü"), ((7,), (9, 10, 11, 12)), (30, 31), (True, True),
              trees=(None, Tree(((0,), (1,), (0, 0)))))
EMPTY = Step(StepKind.decode, 0, (), (), (), ())
MESSAGES = [PREFILL, DECODE, VERIFY, EMPTY, CopySlot(1, 4, 33), KeepPath(2, 40, (3, 5)), KeepPath(0, 0, ()),
            SaveBlock(1, 2, 7), LoadBlock(7, 3, 0), Stop()]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips_exactly(message):
    header, payload = encode(message)
    assert header.dtype == payload.dtype == np.int64 and header.shape == (HEADER_WORDS,)
    assert decode(header, payload, rank=1) == message


def test_a_step_is_plain_words():
    header, payload = encode(DECODE)
    # kind decode, first_slot, rows, draft_heads, has_trees; the row; rid "a"; its token
    assert header.tolist() == [MAGIC, VERSION, MessageKind.step, 12]
    assert payload.tolist() == [1, 3, 1, 0, 0, 1, 1, 17, 1, -1, ord("a"), 42]


def _refusal(header, payload, rank: int = 2) -> str:
    with pytest.raises(RankProtocolError) as caught:
        decode(np.asarray(header, np.int64), np.asarray(payload, np.int64), rank)
    text = str(caught.value)
    assert "\n" not in text
    return text


def _header(kind=MessageKind.step, length=0, magic=MAGIC, version=VERSION):
    return [magic, version, int(kind), length]


@pytest.mark.parametrize("header, message", [
    ([0, 0, 0, 0], "rank 2 refused a message from rank 0: header magic 0x0, not 0x74727462726b"),
    (_header(version=2), "rank 2 refused a message from rank 0: protocol version 2; this rank speaks 1"),
    (_header(kind=9), "rank 2 refused a message from rank 0: unknown message kind 9 (known: 0 stop, 1 step, "
                      "2 copy_slot, 3 keep_path, 4 save_block, 5 load_block)"),
    (_header(length=MAX_PAYLOAD_WORDS + 1),
     f"rank 2 refused a message from rank 0: step payload of {MAX_PAYLOAD_WORDS + 1} words (0 to {MAX_PAYLOAD_WORDS})"),
    (_header(length=-1), f"rank 2 refused a message from rank 0: step payload of -1 words (0 to {MAX_PAYLOAD_WORDS})"),
    # fixed-size kinds: a header cannot make a rank allocate for more
    (_header(kind=MessageKind.stop, length=2**20), "rank 2 refused a message from rank 0: stop payload of 1048576 words (0 to 0)"),
    (_header(kind=MessageKind.copy_slot, length=4), "rank 2 refused a message from rank 0: copy_slot payload of 4 words (0 to 3)"),
    ([MAGIC, VERSION, 1], "rank 2 refused a message from rank 0: header of shape (3,) int64, not (4,) int64"),
])
def test_a_bad_header_is_refused_by_name(header, message):
    assert _refusal(header, []) == message


def test_garbage_headers_are_refused_never_run():
    rng = np.random.default_rng(0)
    for _ in range(200):
        header = rng.integers(-2**62, 2**62, HEADER_WORDS)
        assert _refusal(header, []).startswith("rank 2 refused a message from rank 0: ")


def test_a_payload_the_header_does_not_describe_is_refused():
    header, payload = encode(PREFILL)
    assert _refusal(header, payload[:-3]) == (f"rank 2 refused a message from rank 0: payload of shape "
                                              f"({payload.size - 3},) int64; the header says ({payload.size},) int64")


def _relabelled(payload, kind=MessageKind.step):
    return _header(kind, len(payload)), payload


@pytest.mark.parametrize("message", MESSAGES[:-1], ids=lambda m: type(m).__name__)
def test_every_truncation_is_refused(message):
    _, payload = encode(message)
    kind = int(encode(message)[0][2])
    for cut in range(payload.size):
        text = _refusal(*_relabelled(payload[:cut], kind))
        assert re.match(r"rank 2 refused a message from rank 0: \w+: ", text), text


@pytest.mark.parametrize("edit, message", [
    (lambda p: p + [0], "step: 1 words after the message"),
    (lambda p: [2, *p[1:]], "step: step kind 2 (0 to 1)"),
    (lambda p: [*p[:2], -1, *p[3:]], "step: rows -1 is negative"),
    (lambda p: [*p[:3], 2, *p[4:]], "step: draft_heads 2 (0 to 1)"),
    (lambda p: [*p[:9], -2, *p[10:]], "step: row 0: rid bytes 1, tokens 1, start 17, sample 1, tree choices -2"),
    (lambda p: [*p[:9], 0, *p[10:]], "step: row 0 has a tree in a step without trees"),
    (lambda p: [*p[:10], 300, *p[11:]], "step: row 0's rid holds a word that is not a byte"),
    (lambda p: [*p[:10], 0xFF, *p[11:]], "step: row 0's rid is not UTF-8"),
])
def test_a_malformed_step_is_refused_by_name(edit, message):
    payload = edit(encode(DECODE)[1].tolist())
    assert _refusal(*_relabelled(payload)) == f"rank 2 refused a message from rank 0: {message}"


def test_a_tree_out_of_order_is_refused():
    payload = encode(VERIFY)[1].tolist()
    payload[-7:] = [1, 0, 1, 1, 3, 0, 0]  # the third choice says 3 ranks, 2 follow
    assert "step: payload ends inside tree path" in _refusal(*_relabelled(payload))
    payload = encode(VERIFY)[1].tolist()
    payload[-7:] = [2, 0, 0, 1, 0, 1, 1]  # (0, 0) before its parent (0,)
    assert _refusal(*_relabelled(payload)) == ("rank 2 refused a message from rank 0: step: tree choice [0, 0] "
                                               "comes before its parent [0]")


def test_no_pickle_on_the_rank_path():
    """Rank messages, NCCL ids and stage hand-offs go as tensors: no object collective anywhere."""
    for path in RUNTIME.rglob("*.py"):
        text = path.read_text()
        for name in ("broadcast_object_list", "send_object_list", "recv_object_list", "all_gather_object",
                     "import pickle"):
            assert name not in text, f"{path.name} uses {name}"

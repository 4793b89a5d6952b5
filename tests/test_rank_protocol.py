"""The rank protocol (runtime/parallel/protocol.py): every message rank 0 sends survives encode →
decode exactly, and a malformed one is refused in one line naming the receiving rank."""
from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from trtbuild.runtime.core.tree import Tree
from trtbuild.runtime.parallel.protocol import (HEADER_WORDS, MAGIC, MAX_KEEP_NODES, MAX_PAYLOAD_WORDS, VERSION, MessageKind,
                                            PagedLimits, RankProtocolError, Stop, decode, encode)
from trtbuild.runtime.core.step import (CopySlot, Discard, KeepPath, KeepPathInBlocks, LoadBlock, SaveBlock, Step,
                                        StepKind)

RUNTIME = Path(__file__).resolve().parents[1] / "runtime"

PREFILL = Step(StepKind.prefill, 0, ("req-1", "req-2"), ((1, 2, 3, 4), (5, 6)), (0, 16), (True, False))
DECODE = Step(StepKind.decode, 3, ("a",), ((42,),), (17,), (True,), draft_heads=False)
VERIFY = Step(StepKind.decode, 1, ("plain", "tree-ü"), ((7,), (9, 10, 11, 12)), (30, 31), (True, True),
              trees=(None, Tree(((0,), (1,), (0, 0)))))
EMPTY = Step(StepKind.decode, 0, (), (), (), ())
# A paged engine's rows: rank 0's block ids (two rows sharing their prefix's first block).
PAGED = replace(VERIFY, block_tables=((4, 0), (4, 2, 9)))
KEEP_IN_BLOCKS = KeepPathInBlocks((4, 2, 9), 31, (1, 3))
MESSAGES = [PREFILL, DECODE, VERIFY, EMPTY, PAGED, CopySlot(1, 4, 33), KeepPath(2, 40, (3, 5)), KeepPath(0, 0, ()),
            SaveBlock(1, 2, 7), LoadBlock(7, 3, 0), KEEP_IN_BLOCKS, KeepPathInBlocks((), 0, ()),
            Discard((5, 6, 8), (3,)), Discard((), ()), Stop()]
LIMITS = PagedLimits(block_size=16, max_blocks=4, num_blocks=10)  # max_seq_len 64, a pool of 10 blocks


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips_exactly(message):
    header, payload = encode(message)
    assert header.dtype == payload.dtype == np.int64 and header.shape == (HEADER_WORDS,)
    assert decode(header, payload, rank=1) == message


def test_a_step_is_plain_words():
    header, payload = encode(DECODE)
    # kind decode, first_slot, rows, draft_heads, has_trees, has_tables; the row; rid "a"; its token
    assert header.tolist() == [MAGIC, VERSION, MessageKind.step, 14]
    assert payload.tolist() == [1, 3, 1, 0, 0, 0, 1, 1, 17, 1, -1, 0, ord("a"), 42]


def test_a_paged_step_carries_each_rows_block_ids():
    header, payload = encode(replace(DECODE, block_tables=((5, 0, 7),)))
    # has_tables 1; the row's last word: 3 table blocks; after its token, the block ids
    assert header.tolist() == [MAGIC, VERSION, MessageKind.step, 17]
    assert payload.tolist() == [1, 3, 1, 0, 0, 1, 1, 1, 17, 1, -1, 3, ord("a"), 42, 5, 0, 7]
    header, payload = encode(KEEP_IN_BLOCKS)
    # start, 3 blocks and their ids, 2 nodes and theirs
    assert header.tolist() == [MAGIC, VERSION, MessageKind.keep_path_in_blocks, 8]
    assert payload.tolist() == [31, 3, 4, 2, 9, 2, 1, 3]


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
    (_header(version=1), "rank 2 refused a message from rank 0: protocol version 1; this rank speaks 2"),
    (_header(kind=9), "rank 2 refused a message from rank 0: unknown message kind 9 (known: 0 stop, 1 step, "
                      "2 copy_slot, 3 keep_path, 4 save_block, 5 load_block, 6 keep_path_in_blocks, 7 discard)"),
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
    (lambda p: [*p[:10], -2, *p[11:]], "step: row 0: rid bytes 1, tokens 1, start 17, sample 1, tree choices -2, "
                                       "table blocks 0"),
    (lambda p: [*p[:10], 0, *p[11:]], "step: row 0 has a tree in a step without trees"),
    (lambda p: [*p[:11], 1, *p[12:], 5], "step: row 0 has a block table in a step without tables"),
    (lambda p: [*p[:5], 2, *p[6:]], "step: has_tables 2 (0 to 1)"),
    (lambda p: [*p[:12], 300, *p[13:]], "step: row 0's rid holds a word that is not a byte"),
    (lambda p: [*p[:12], 0xFF, *p[13:]], "step: row 0's rid is not UTF-8"),
])
def test_a_malformed_step_is_refused_by_name(edit, message):
    payload = edit(encode(DECODE)[1].tolist())
    assert _refusal(*_relabelled(payload)) == f"rank 2 refused a message from rank 0: {message}"


# DECODE's payload (test_a_step_is_plain_words): header words 0-5, its row 6-11, rid 12, token 13.
@pytest.mark.parametrize("edit, message", [
    # has_trees 1 with no tree on any row: encode never sends it (a step that verifies nothing has no trees)
    (lambda p: [*p[:4], 1, *p[5:]], "step: has_trees 1 but no row has a tree"),
    (lambda p: [0, 0, 0, 1, 1, 0], "step: has_trees 1 but no row has a tree"),
    (lambda p: [0, 0, 0, 1, 0, 1], "step: has_tables 1 in a step of no rows"),
    (lambda p: [*p[:-1], -5], "step: row 0 has token id -5 (token ids are ≥ 0)"),
    (lambda p: [*p[:7], 0, *p[8:13]], "step: row 0 has no tokens (each row has at least one)"),  # its token dropped
    # a block table of a negative id
    (lambda p: [*p[:5], 1, *p[6:11], 2, *p[12:], 3, -1], "step: row 0's block table holds block -1 (block ids are ≥ 0)"),
])
def test_a_step_encode_never_makes_is_refused(edit, message):
    payload = edit(encode(DECODE)[1].tolist())
    assert _refusal(*_relabelled(payload)) == f"rank 2 refused a message from rank 0: {message}"


# VERIFY's payload: header words 0-5; rows at 6-11 ("plain", 1 token, -1) and 12-17 ("tree-ü", 4 tokens,
# 3 choices); rid bytes 18-29; tokens 30-34; the tree's choices 35-41.
@pytest.mark.parametrize("edit, message", [
    # the tree row's 4 tokens say 3 (or 5): its tree has the root and 3 choices
    (lambda p: [*p[:13], 3, *p[14:32], *p[33:]], "step: row 1 has 3 tokens for a tree of 4 nodes "
                                                  "(its root and 3 choices, one token each)"),
    (lambda p: [*p[:13], 5, *p[14:34], 13, *p[34:]], "step: row 1 has 5 tokens for a tree of 4 nodes "
                                                      "(its root and 3 choices, one token each)"),
    (lambda p: [*p[:30], -1, *p[31:]], "step: row 0 has token id -1 (token ids are ≥ 0)"),
    (lambda p: [0, *p[1:]], "step: a prefill step with trees (only a decode step verifies)"),
])
def test_a_tree_step_encode_never_makes_is_refused(edit, message):
    payload = edit(encode(VERIFY)[1].tolist())
    assert _refusal(*_relabelled(payload)) == f"rank 2 refused a message from rank 0: {message}"


@pytest.mark.parametrize("message, problem", [
    (KeepPath(0, 3, (1, -2)), "node 1 -2 is negative"),
    (CopySlot(0, -1, 3), "dst -1 is negative"),
    (LoadBlock(-1, 0, 0), "block -1 is negative"),
    (Discard((2, -1), ()), "slot -1 is negative"),
    (Discard((), (4, -3)), "block -3 is negative"),
])
def test_rank_0_refuses_to_send_a_negative_index(message, problem):
    with pytest.raises(ValueError, match=f"rank 0 cannot send {type(message).__name__}: {problem}"):
        encode(message)


@pytest.mark.parametrize("step, problem", [
    (replace(DECODE, trees=(None,)), "trees on no row (a step that verifies nothing has none)"),
    (replace(DECODE, tokens=((-3,),)), "row 0 has token id -3 (token ids are ≥ 0)"),
    (replace(VERIFY, tokens=((7,), (9, 10))), "row 1 has 2 tokens for a tree of 4 nodes (its root and 3 choices, "
                                               "one token each)"),
    (replace(VERIFY, kind=StepKind.prefill), "a prefill step with trees (only a decode step verifies)"),
    (replace(DECODE, tokens=((),)), "row 0 has no tokens (each row has at least one)"),
    (replace(DECODE, starts=(1, 2)), "1 rids, 1 token rows, 2 starts, 1 samples; one of each per row"),
    (replace(PAGED, block_tables=((4, 0),)), "1 block tables for 2 rows (one per row, or none)"),
])
def test_rank_0_refuses_to_send_a_step_no_rank_accepts(step, problem):
    with pytest.raises(ValueError, match=re.escape(f"rank 0 cannot send Step: {problem}")):
        encode(step)


# Hostile block ids: a rank copies K/V through them (runtime/core/paged_pools.py), so each is refused
# on receipt, in one line, before any copy; rank 0 refuses to send them too.
@pytest.mark.parametrize("message, problem", [
    (replace(PAGED, block_tables=((4, -1), (4, 2, 9))), "step: row 0's block table holds block -1 (block ids are ≥ 0)"),
    (replace(PAGED, block_tables=((4, 0), (1, 2, 3, 5, 6))),
     "step: row 1's block table has 5 blocks; the engine's widest is 4 (max_seq_len / block_size)"),
    (KeepPathInBlocks((4, -2), 3, (1,)), "keep_path_in_blocks: block -2 is negative (block ids are ≥ 0)"),
    (KeepPathInBlocks((4,), -1, (1,)), "keep_path_in_blocks: start -1 is negative"),
    # two blocks hold positions 0-31: node 3 from start 29 is position 32
    (KeepPathInBlocks((4, 2), 29, (1, 3)),
     "keep_path_in_blocks: position 32 (start 29 + node 3) is outside its 32 positions' blocks"),
    (KeepPathInBlocks((4, 2), 3, (1, 1)), "keep_path_in_blocks: node 1 is 1 (node i of a kept path is at least i + 1)"),
    (KeepPathInBlocks((1, 2, 3, 4, 5), 0, (1,)),
     "keep_path_in_blocks: 5 blocks; the engine's widest row is 4 (max_seq_len / block_size)"),
    # ids past the pool's last block: a rank would copy or gather beyond its pools
    (replace(PAGED, block_tables=((4, 0), (4, 10, 9))),
     "step: row 1's block table holds block 10; the pool holds blocks 0 to 9"),
    (KeepPathInBlocks((4, 1_000_000), 3, (1,)),
     "keep_path_in_blocks: block 1000000 is outside the pool (blocks 0 to 9)"),
])
def test_block_ids_outside_the_engines_pool_are_refused(message, problem):
    kind = "Step" if isinstance(message, Step) else "KeepPathInBlocks"
    with pytest.raises(ValueError, match=re.escape(f"rank 0 cannot send {kind}: {problem.split(': ', 1)[1]}")):
        encode(message, LIMITS)
    words = _words_of(message)
    with pytest.raises(RankProtocolError) as caught:
        decode(*words, rank=3, limits=LIMITS)
    assert str(caught.value) == f"rank 3 refused a message from rank 0: {problem}"


def _words_of(message) -> tuple[np.ndarray, np.ndarray]:
    """``message`` as rank 0 would put it on the wire if it did not check it (a hostile peer's)."""
    from trtbuild.runtime.parallel import protocol

    unchecked = protocol.message_problem
    protocol.message_problem = lambda *_: None
    try:
        return encode(message)
    finally:
        protocol.message_problem = unchecked


def test_block_ids_within_the_engines_pool_round_trip():
    for message in (PAGED, KEEP_IN_BLOCKS, KeepPathInBlocks((4, 2), 28, (1, 3))):
        assert decode(*encode(message, LIMITS), rank=1, limits=LIMITS) == message


def test_rank_0_refuses_to_send_more_than_a_rank_receives():
    with pytest.raises(ValueError, match=re.escape(f"rank 0 cannot send KeepPath: {3 + MAX_KEEP_NODES + 1} words; "
                                                   f"a rank receives at most {3 + MAX_KEEP_NODES}")):
        encode(KeepPath(0, 0, (1,) * (MAX_KEEP_NODES + 1)))


def _well_formed(message) -> bool:
    """The messages rank 0 sends, written out independently of the protocol's own checks."""
    if isinstance(message, Discard):
        return all(i >= 0 for i in (*message.slots, *message.blocks))
    if isinstance(message, KeepPathInBlocks):
        return (message.start >= 0 and all(b >= 0 for b in message.blocks)
                and all(node >= i + 1 for i, node in enumerate(message.nodes)))
    if not isinstance(message, Step):
        return all(value >= 0 for value in (list(vars(message).values()) if not isinstance(message, KeepPath)
                                            else [message.slot, message.start, *message.nodes]))
    trees, tables = message.trees, message.block_tables
    return (message.first_slot >= 0 and all(s >= 0 for s in message.starts)
            and (not tables or (len(tables) == len(message.rids) and all(b >= 0 for t in tables for b in t)))
            and all(tokens and min(tokens) >= 0 for tokens in message.tokens)
            and (not trees or (message.kind == StepKind.decode and any(t is not None for t in trees)
                               and all(t is None or t.size == len(tokens)
                                       for t, tokens in zip(trees, message.tokens)))))


def _mutants(payload: list[int], rng, count: int):
    """Payloads one to three edits away from ``payload``: a word set to a boundary or random value,
    a word dropped, or a word inserted."""
    values = [-2, -1, 0, 1, 2, 3, 4, 5, 255, 256, 2**40, -2**40]
    for _ in range(count):
        words = list(payload)
        for _ in range(rng.integers(1, 4)):
            at = int(rng.integers(0, len(words) + 1))
            value = int(rng.choice(values)) if rng.random() < 0.8 else int(rng.integers(-2**62, 2**62))
            edit = rng.integers(0, 4)
            if edit <= 1 and at < len(words):
                words[at] = value
            elif edit == 2 and at < len(words):
                del words[at]
            else:
                words.insert(at, value)
        yield words


@pytest.mark.parametrize("message", MESSAGES[:-1], ids=lambda m: type(m).__name__)
def test_decode_accepts_exactly_what_encode_makes(message):
    """Fuzz: every edit of a message is refused in one line, or is a well-formed message whose
    encoding is exactly the words received (no second spelling of a message, none rank 0 never sends)."""
    header, payload = encode(message)
    kind = MessageKind(int(header[2]))
    rng = np.random.default_rng(int(kind) * 7 + len(payload))
    accepted = 0
    for words in _mutants(payload.tolist(), rng, 1500):
        try:
            decoded = decode(*(np.asarray(w, np.int64) for w in _relabelled(words, kind)), rank=2)
        except RankProtocolError as refused:
            assert str(refused).startswith("rank 2 refused a message from rank 0: ") and "\n" not in str(refused)
            continue
        accepted += 1
        assert _well_formed(decoded), (words, decoded)
        again_header, again = encode(decoded)
        assert again_header.tolist() == _relabelled(words, kind)[0] and again.tolist() == words
    assert accepted > 0  # the fuzz reaches past the parser: some edits are other valid messages


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

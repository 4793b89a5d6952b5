"""Slot table and prefix hashes: exact slot ids and moves (the prefix cache's block ids and
eviction order: tests/test_kv_manager.py)."""
from __future__ import annotations

import pytest

from trtbuild.runtime.core.kv_manager import block_hashes
from trtbuild.runtime.core.slots import Move, SlotTable


def test_admission_fills_slots_in_order_and_refuses_when_full():
    table = SlotTable(3)
    assert [table.admit(r) for r in "abc"] == [0, 1, 2]
    assert table.free == 0 and table.prefilling() == ["a", "b", "c"] and table.decoding() == []
    with pytest.raises(RuntimeError, match="no free KV slot"):
        table.admit("d")


def test_promotion_keeps_decoding_slots_first_swapping_through_scratch():
    table = SlotTable(4)
    for r in "abc":
        table.admit(r)
    assert table.promote("a") == []                    # already at the first prefilling slot
    assert table.promote("c") == [Move(2, 4, "c"), Move(1, 2, "b"), Move(4, 1, "c")]  # swap c(2) with b(1) via scratch 4
    assert table.decoding() == ["a", "c"] and table.prefilling() == ["b"]
    assert (table.slot_of("c"), table.slot_of("b")) == (1, 2)


def test_release_compacts_both_groups():
    table = SlotTable(5)
    for r in "abcde":
        table.admit(r)
    for r in "abc":
        table.promote(r)                               # decoding a b c | prefilling d e
    assert table.release("a") == [Move(2, 0, "c"), Move(4, 2, "e")]  # c fills a's hole; e moves down to c's old slot
    assert table.decoding() == ["c", "b"] and table.prefilling() == ["e", "d"]
    assert table.num_decoding == 2 and table.num_active == 4
    assert table.release("d") == []  # d holds the last slot: nothing moves
    assert table.release("c") == [Move(1, 0, "b"), Move(2, 1, "e")]
    assert table.decoding() == ["b"] and table.prefilling() == ["e"]
    assert [table.slot_of("b"), table.slot_of("e")] == [0, 1]


def test_release_of_prefilling_request_moves_the_last_slot_into_its_place():
    table = SlotTable(4)
    for r in "abcd":
        table.admit(r)
    table.promote("a")
    assert table.release("b") == [Move(3, 1, "d")]
    assert table.prefilling() == ["d", "c"] and table.slot_of("d") == 1


def test_block_hashes_chain_over_the_whole_prefix():
    a = block_hashes([1, 2, 3, 4, 5, 6, 7], 2)
    b = block_hashes([9, 2, 3, 4], 2)
    assert len(a) == 3 and len(b) == 2
    assert a[1] != b[1]  # same block tokens, different prefix

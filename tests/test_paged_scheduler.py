"""The scheduler for a paged engine (one pool of the budget's blocks, read through block tables):
exact block ids in steps and cache operations, no engine."""
from __future__ import annotations

from trtbuild.runtime.core.kv_manager import KVManager
from trtbuild.runtime.core.sampling import SamplingParams
from trtbuild.runtime.core.scheduler import Draft, Request, Scheduler
from trtbuild.runtime.core.step import KeepPathInBlocks, StepKind
from trtbuild.runtime.core.tree import Accepted, Tree


def paged(capacity: int, blocks: int, block_size: int, **kw) -> Scheduler:
    return Scheduler(capacity=capacity, max_seq_len=32, max_chunk=8, kv=KVManager(blocks, block_size, shared=True), paged=True, **kw)


def test_prefix_blocks_are_shared_by_reference_not_copied():
    s = paged(capacity=2, blocks=16, block_size=2)
    s.add(Request("A", [1, 2, 3, 4, 5], SamplingParams(max_tokens=1)))
    step = s.schedule().step
    assert step.block_tables == ((0, 1, 2),)
    s.commit(step, {"A": 42})
    s.pop_finished()
    s.add(Request("B", [1, 2, 3, 4, 6], SamplingParams(max_tokens=1)))
    plan = s.schedule()
    # A's two full prompt blocks were cached where they are (its blocks 0 and 1); its block 2 went
    # back to the free list. B's table starts with them: no copy, no discard, one reference each.
    assert plan.ops == []
    assert plan.step.tokens == ((6,),) and plan.step.starts == (4,)
    assert plan.step.block_tables == ((0, 1, 3),)
    assert s.requests["B"].cached_tokens == 4
    assert s.kv.cached_blocks() == [0, 1] and s.kv.ref_count(0) == s.kv.ref_count(1) == 1
    assert s.kv.num_free == 13  # 16 blocks: 0 and 1 shared, 3 B's own


def test_rows_that_change_slots_move_no_kv_and_keep_their_tables():
    s = paged(capacity=3, blocks=32, block_size=4, token_budget=16)
    for rid, n in (("a", 3), ("b", 9), ("c", 5)):
        s.add(Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=6)))
    step = s.schedule().step
    assert step.kind == StepKind.prefill and step.rids == ("a", "b", "c")
    # Rows padded to the step's 8 tokens hold blocks for them: a took 0 at admission, then 5.
    assert step.block_tables == ((0, 5), (1, 2), (3, 4))
    s.commit(step, {"a": 7, "c": 8})                  # a and c decode now, b has a chunk left
    plan = s.schedule()
    assert s.slots.slot_of("c") == 1 and s.slots.slot_of("b") == 2  # c moved past b: no copy
    assert plan.ops == []                             # c's full prompt block 3 is cached in place
    assert s.kv.cached_blocks() == [3]
    assert plan.step.rids == ("a", "c") and plan.step.block_tables == ((0, 5), (3, 4))
    s.commit(plan.step, {"a": 9, "c": 9})
    s.finish("a", "abort")
    plan = s.schedule()
    assert plan.ops == [] and s.slots.slot_of("b") == 1
    assert plan.step.rids == ("b",) and plan.step.block_tables == ((1, 2, 6),)


def test_accepted_path_moves_inside_the_rows_blocks():
    tree = Tree(((0,), (1,), (1, 0)))
    s = paged(capacity=2, blocks=8, block_size=2)
    s.add(Request("a", [5, 6, 7], SamplingParams(max_tokens=10)))
    step = s.schedule().step
    assert step.block_tables == ((0, 1),)
    s.commit(step, {"a": 1})
    s.requests["a"].draft = Draft(tree, (11, 12, 13))
    plan = s.schedule()
    assert plan.ops == [] and s.kv.cached_blocks() == [0]  # the prompt's full block, cached in place
    step = plan.step
    assert step.verifies and step.block_tables == ((0, 1, 2, 3),)  # positions 3-6 written
    s.commit(step, {"a": 20}, {"a": Accepted((2, 3), (12, 13))})
    plan = s.schedule()
    assert plan.ops == [KeepPathInBlocks(blocks=(0, 1, 2, 3), start=3, nodes=(2, 3))]
    assert plan.step.starts == (6,) and plan.step.block_tables == ((0, 1, 2, 3),)


def test_preempted_request_resumes_with_new_blocks_and_its_tokens():
    s = Scheduler(capacity=2, max_seq_len=32, max_chunk=8, kv=KVManager(4, 2, prefix_caching=False, shared=True), paged=True)
    s.add(Request("old", [1, 2, 3], SamplingParams(max_tokens=4)))
    s.add(Request("new", [4, 5, 6], SamplingParams(max_tokens=4)))
    seen = []
    while s.has_work():
        plan = s.schedule()
        step = plan.step
        assert plan.ops == []
        seen.append((step.kind.value, step.rids, step.starts, step.block_tables, step.tokens))
        s.commit(step, {rid: 9 for rid, sample in zip(step.rids, step.samples) if sample})
        s.pop_finished()
    assert seen == [
        ("prefill", ("old", "new"), (0, 0), ((0, 1), (2, 3)), ((1, 2, 3), (4, 5, 6))),
        ("decode", ("old", "new"), (3, 3), ((0, 1), (2, 3)), ((9,), (9,))),
        # old's position 4 needs a third block: the newest request gives its two back
        ("decode", ("old",), (4,), ((0, 1, 2),), ((9,),)),
        ("decode", ("old",), (5,), ((0, 1, 2),), ((9,),)),
        # new recomputes its prompt and its output so far in blocks old freed
        ("prefill", ("new",), (0,), ((3, 0),), ((4, 5, 6, 9),)),
        ("decode", ("new",), (4,), ((3, 0, 1),), ((9,),)),
        ("decode", ("new",), (5,), ((3, 0, 1),), ((9,),)),
    ]
    assert s.kv.stats.preemptions == 1


# -- the KV manager sharing blocks by reference -------------------------------------------------

def test_shared_blocks_are_counted_once_kept_while_referenced_and_evicted_lru_when_not():
    kv = KVManager(6, 2, shared=True)
    kv.grow("a", 5)                                   # a: [0, 1, 2]
    assert kv.save("a", [1, 2, 3, 4, 5]) == []        # nothing to copy: 0 and 1 cached in place
    assert kv.cached_blocks() == [0, 1] and kv.ref_count(0) == 1 and kv.num_free == 3
    hit = kv.match([1, 2, 3, 4, 9])
    assert hit == [0, 1] and kv.fits("b", hit, 6)     # b needs one block of its own: 3 are free
    kv.hit("b", [1, 2, 3, 4, 9], hit)
    kv.grow("b", 6)
    assert kv.row("b") == [0, 1, 3] and kv.ref_count(0) == 2 and kv.num_free == 2
    kv.release("a")                                   # a's own block 2 is free; 0 and 1 stay, b uses them
    assert kv.num_free == 3 and kv.cached_blocks() == [0, 1]
    # b needs 6 more blocks: 3 free and no unreferenced cached one; referenced blocks are never taken
    assert kv.reclaimable(evict_used=True) == 3 and not kv.grow("b", 18)
    assert kv.row("b") == [0, 1, 3]
    kv.release("b")
    assert kv.row("b") == [] and kv.ref_count(0) == 0 and kv.num_free == 4  # 3 back; 0, 1 cached, unused
    kv.grow("c", 12)                                  # 6 blocks: the 4 free, then 0 and 1, LRU first
    assert kv.row("c") == [4, 5, 2, 3, 0, 1] and kv.cached_blocks() == [] and kv.stats.evictions == 2


def test_a_prefix_cached_by_another_row_first_stays_its_and_the_chain_goes_on():
    kv = KVManager(8, 2, shared=True)
    kv.grow("a", 4)
    kv.grow("b", 6)                                   # a: [0, 1]; b: [2, 3, 4], same first block
    kv.save("a", [1, 2, 3, 4])                        # a caches [1, 2] → 0 and [1, 2, 3, 4] → 1
    kv.save("b", [1, 2, 7, 8, 9, 9])                  # b's first block is cached as 0 already
    assert kv.cached_blocks() == [0, 1, 3, 4] and kv.ref_count(2) == 0
    assert kv.match([1, 2, 7, 8, 9, 9, 5]) == [0, 3, 4]  # a's copy, then b's chain
    kv.release("b")
    assert kv.num_free == 4 and kv.cached_blocks() == [0, 1, 3, 4]  # b's uncached copy freed, its cached ones stay
    assert kv.grow("c", 8) and kv.row("c") == [5, 6, 7, 2]

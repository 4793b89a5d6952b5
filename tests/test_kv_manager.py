"""KV manager and the scheduler on a block budget: exact block ids, reference counts, eviction
order, preemption and resume order, refusals (no engine)."""
from __future__ import annotations

import re

import numpy as np
import pytest

from trtbuild.runtime.core import kv_budget
from trtbuild.contract.kv_budget import parse_kv_cache_memory
from trtbuild.runtime.core.kv_budget import RowMemory, kv_manager_for
from trtbuild.runtime.core.kv_manager import KVManager
from trtbuild.runtime.core.sampling import SamplingParams
from trtbuild.runtime.core.scheduler import Draft, Request, Scheduler
from trtbuild.runtime.core.step import Discard, LoadBlock, StepKind
from trtbuild.runtime.core.tree import Tree


def test_rows_take_blocks_as_they_grow_and_give_them_back():
    kv = KVManager(6, 4, prefix_caching=False)
    assert kv.grow("a", 5) and kv.row("a") == [0, 1]
    assert kv.grow("a", 8) and kv.row("a") == [0, 1]        # 8 positions: still two blocks
    assert kv.grow("a", 9) and kv.row("a") == [0, 1, 2]
    assert not kv.grow("b", 16) and kv.row("b") == []       # 4 blocks, 3 free: takes nothing
    assert kv.grow("b", 12) and kv.row("b") == [3, 4, 5] and kv.num_free == 0
    kv.release("a")
    assert kv.num_free == 3 and kv.row("a") == []
    assert kv.grow("b", 16) and kv.row("b") == [3, 4, 5, 0]  # freed blocks are reused in order


def test_cached_blocks_are_reference_counted_and_kept_when_unused():
    kv = KVManager(8, 2)
    assert kv.save("a", [1, 1, 2, 2, 3]) == [(0, 0), (1, 1)]  # full blocks only
    assert kv.save("b", [1, 1, 2, 2, 4, 4]) == [(2, 2)]        # shares blocks 0 and 1
    assert [kv.ref_count(b) for b in (0, 1, 2)] == [2, 2, 1]
    kv.release("a")
    assert [kv.ref_count(b) for b in (0, 1, 2)] == [1, 1, 1]
    kv.release("b")
    assert [kv.ref_count(b) for b in (0, 1, 2)] == [0, 0, 0] and kv.num_cached == 3  # kept for later hits
    hit = kv.match([1, 1, 2, 2, 9])
    assert hit == [0, 1]
    kv.hit("c", [1, 1, 2, 2, 9], hit)
    assert kv.uses("c") == [0, 1] and kv.ref_count(0) == 1
    assert (kv.stats.hits, kv.stats.misses) == (2, 0)


def test_match_leaves_the_last_prompt_token_to_compute():
    kv = KVManager(8, 2)
    kv.save("a", [1, 2, 3, 4, 5])
    assert kv.match([1, 2, 3, 4, 9]) == [0, 1]
    assert kv.match([1, 2, 3, 4]) == [0]            # block 1 would leave nothing to compute
    assert kv.match([1, 2, 7, 7, 7]) == [0]
    assert kv.match([5, 5, 5]) == []
    kv.hit("b", [1, 2, 7, 7, 7], [0])
    assert (kv.stats.hits, kv.stats.misses) == (1, 1)


def test_unused_blocks_are_evicted_least_recently_used_first():
    kv = KVManager(3, 2)
    kv.save("a", [1, 1, 2, 2])
    kv.save("b", [1, 1, 2, 2, 3, 3])
    kv.release("a")
    kv.release("b")                                    # unused, least recent first: 0, 1, 2
    kv.hit("c", [1, 1, 9], kv.match([1, 1, 9]))        # block 0 used again
    kv.release("c")                                    # LRU order now 1, 2, 0
    assert kv.cached_blocks() == [1, 2, 0]
    assert kv.save("d", [7, 7, 8, 8]) == [(0, 1), (1, 2)]  # evicts block 1, then block 2
    assert kv.stats.evictions == 2 and kv.take_dropped() == [1, 2] and kv.take_dropped() == []
    assert kv.match([1, 1, 2, 2, 3, 3, 0]) == [0]      # its second block is gone
    assert kv.match([7, 7, 8, 8, 0]) == [1, 2]


def test_a_save_never_evicts_blocks_in_use():
    kv = KVManager(2, 1)
    assert kv.save("a", [1, 2, 3, 4]) == [(0, 0), (1, 1)]  # no room for a third: stops
    assert kv.num_cached == 2 and kv.stats.evictions == 0


def test_rows_take_free_then_unused_then_used_cached_blocks():
    kv = KVManager(4, 2)
    kv.save("a", [1, 1, 2, 2])       # blocks 0, 1: used by a
    kv.save("b", [5, 5])             # block 2
    kv.release("b")                  # block 2 unused; block 3 free
    assert not kv.grow("r", 6, evict_used=False) and kv.row("r") == []  # 3 blocks; free + unused = 2
    assert kv.grow("r", 4, evict_used=False) and kv.row("r") == [3, 2] and kv.take_dropped() == [2]
    assert kv.grow("r", 6) and kv.row("r") == [3, 2, 0]  # a's row has its own copy: block 0 can go
    assert kv.uses("a") == [1] and kv.take_dropped() == [0] and kv.match([1, 1, 2, 2, 0]) == []


def test_block_size_must_be_a_power_of_two():
    with pytest.raises(ValueError, match=re.escape("block_size 12: must be a power of two ≥ 1")):
        KVManager(4, 12)


@pytest.mark.parametrize("value, parsed", [(1 << 30, 1 << 30), ("1GiB", 1 << 30), ("512 MiB", 512 << 20),
                                           ("2GB", 2 * 10 ** 9), (0.5, 0.5), (1.0, 1.0)])
def test_kv_cache_memory_forms(value, parsed):
    assert parse_kv_cache_memory(value) == parsed


@pytest.mark.parametrize("value", [0, -1, 1.5, 0.0, "lots", "1 parsec", True])
def test_kv_cache_memory_refusals_say_what_is_valid(value):
    with pytest.raises(ValueError, match=r"is not (a KV budget|a share in \(0, 1\]); give bytes as an integer"):
        parse_kv_cache_memory(value)


# -- the scheduler on a budget ------------------------------------------------------------------
def _run(s: Scheduler, log: list | None = None, limit: int = 200) -> dict[str, Request]:
    """Steps until done, every sampled token 100 × (row letter) + its index; the finished requests."""
    done = {}
    for _ in range(limit):
        if not s.has_work():
            return done
        plan = s.schedule()
        step = plan.step
        if log is not None:
            log.append((plan.ops, step.kind.value, step.rids, step.tokens, step.starts, step.samples))
        sampled = {rid: 100 * (ord(rid[0]) - 64) + len(s.requests[rid].output)
                   for rid, samples in zip(step.rids, step.samples) if samples}
        s.commit(step, sampled)
        done.update({r.rid: r for r in s.pop_finished()})
    raise AssertionError("the scheduler did not finish")


def test_budget_exhausted_preempts_the_newest_which_resumes_by_recomputing():
    kv = KVManager(6, 2, prefix_caching=False)   # 12 positions for three requests of 8
    s = Scheduler(capacity=3, max_seq_len=16, max_chunk=8, token_budget=12, kv=kv)
    for i, rid in enumerate("ABC"):
        s.add(Request(rid, [10 * i + 1, 10 * i + 2, 10 * i + 3, 10 * i + 4], SamplingParams(max_tokens=4)))
    log = []
    done = _run(s, log)
    steps = [entry[1:] for entry in log]
    assert steps == [
        ("prefill", ("A", "B", "C"), ((1, 2, 3, 4), (11, 12, 13, 14), (21, 22, 23, 24)), (0, 0, 0), (True,) * 3),
        ("decode", ("A", "B"), ((100,), (200,)), (4, 4), (True, True)),   # A grows: C (newest) preempted
        ("decode", ("A", "B"), ((101,), (201,)), (5, 5), (True, True)),
        ("decode", ("A",), ((102,),), (6,), (True,)),                     # A grows: B preempted
        # B resumes first: its prompt and output but the last token, sampling nothing; C's padded row
        ("prefill", ("B", "C"), ((11, 12, 13, 14, 200, 201), (21, 22, 23, 24)), (0, 0), (False, False)),
        ("decode", ("B",), ((202,),), (6,), (True,)),                     # B grows: C preempted again
        ("prefill", ("C",), ((21, 22, 23, 24),), (0,), (False,)),
        ("decode", ("C",), ((300,),), (4,), (True,)),
        ("decode", ("C",), ((301,),), (5,), (True,)),
        ("decode", ("C",), ((302,),), (6,), (True,))]
    assert log[1][0] == [Discard((2,), ())]    # the preempted row's pages go back
    assert {rid: (r.output, r.preemptions) for rid, r in done.items()} == {
        "A": ([100, 101, 102, 103], 0), "B": ([200, 201, 202, 203], 1), "C": ([300, 301, 302, 303], 2)}
    assert kv.stats.preemptions == 3 and kv.num_free == 6


def test_many_requests_on_a_small_budget_all_finish_and_the_oldest_is_never_preempted():
    rng = np.random.default_rng(0)
    kv = KVManager(20, 4, prefix_caching=True)
    s = Scheduler(capacity=8, max_seq_len=64, max_chunk=16, token_budget=32, kv=kv)
    for i in range(24):
        prompt = rng.integers(1, 50, size=int(rng.integers(1, 30))).tolist()
        s.add(Request(f"r{i:02d}", prompt, SamplingParams(max_tokens=int(rng.integers(1, 40)), ignore_eos=True)))
    done = _run(s, limit=5000)
    assert sorted(done) == [f"r{i:02d}" for i in range(24)]
    assert all(len(r.output) == r.params.max_tokens for r in done.values())
    assert done["r00"].preemptions == 0 and kv.stats.preemptions > 0
    assert kv.num_used == kv.num_cached


def test_a_draft_is_dropped_rather_than_preempting_anyone():
    kv = KVManager(4, 2, prefix_caching=False)
    s = Scheduler(capacity=2, max_seq_len=16, max_chunk=8, kv=kv)
    s.add(Request("A", [1, 2, 3], SamplingParams(max_tokens=4)))
    s.add(Request("B", [4, 5, 6], SamplingParams(max_tokens=2)))
    s.commit(s.schedule().step, {"A": 7, "B": 8})            # rows of 3: two blocks each, none free
    s.requests["A"].draft = Draft(Tree(((0,), (0, 0))), (9, 9))
    step = s.schedule().step                                   # writes 3..5: A would need a third block
    assert step.kind == StepKind.decode and not step.verifies and step.rids == ("A", "B")
    assert kv.stats.preemptions == 0
    s.commit(step, {"A": 10, "B": 11})                         # B done: its blocks free
    s.pop_finished()
    s.requests["A"].draft = Draft(Tree(((0,), (0, 0))), (9, 9))
    step = s.schedule().step
    assert step.verifies and step.tokens == ((10, 9, 9),) and kv.row("A") == [0, 1, 2, 3]  # writes 4..6


def test_a_request_that_can_never_fit_is_refused_at_submit():
    s = Scheduler(capacity=4, max_seq_len=64, max_chunk=8, kv=KVManager(4, 4))
    s.add(Request("ok", [1] * 10, SamplingParams(max_tokens=6)))       # 16 tokens: 4 blocks, the whole budget
    with pytest.raises(ValueError) as refused:
        s.add(Request("big", [1] * 10, SamplingParams(max_tokens=8)))
    assert str(refused.value) == ("request big: prompt of 10 tokens + max_tokens 8 = 18 needs 5 KV blocks of 4 "
                                  "tokens; the KV budget (kv_cache_memory) holds 4")
    assert list(s.requests) == ["ok"]
    with pytest.raises(ValueError, match=re.escape("= 66 exceeds the engine's max_seq_len 64")):
        s.add(Request("long", [1] * 60, SamplingParams(max_tokens=6)))


def test_a_lone_request_filling_the_budget_runs_to_its_end():
    kv = KVManager(4, 4)                                       # with its prompt cached, rows evict the cache
    s = Scheduler(capacity=2, max_seq_len=64, max_chunk=8, kv=kv)
    s.add(Request("A", list(range(1, 11)), SamplingParams(max_tokens=6)))
    done = _run(s)
    assert done["A"].output == [100, 101, 102, 103, 104, 105] and kv.stats.preemptions == 0


def test_multi_step_runs_stop_at_the_blocks_a_row_can_hold():
    kv = KVManager(5, 4, prefix_caching=False)
    s = Scheduler(capacity=2, max_seq_len=64, max_chunk=8, kv=kv)
    s.add(Request("A", [1, 2, 3], SamplingParams(max_tokens=9)))
    s.add(Request("B", [4, 5, 6, 7, 8], SamplingParams(max_tokens=7)))
    s.commit(s.schedule().step, {"A": 9, "B": 9})             # rows A [0], B [1, 2]; 3 and 4 free
    step = s.schedule().step
    assert step.starts == (3, 5)
    # 6 steps by max_tokens; A takes blocks 3, 4 for positions 3..8, B holds positions up to 7: 3 steps
    assert s.run_length(step, 16) == 3 and kv.row("A") == [0, 3, 4] and kv.row("B") == [1, 2]


def test_a_lone_request_may_evict_the_blocks_it_hit_once_loaded():
    kv = KVManager(4, 2)
    s = Scheduler(capacity=2, max_seq_len=16, max_chunk=8, kv=kv)
    kv.save("old", [1, 1, 2, 2])
    kv.release("old")                        # blocks 0, 1 cached and unused; 2, 3 free
    s.add(Request("A", [1, 1, 2, 2, 3, 3], SamplingParams(max_tokens=1)))
    plan = s.schedule()                      # hits 0, 1; its row needs 3 blocks: 2, 3 and the LRU cached one
    assert plan.ops == [LoadBlock(0, 0, 0), LoadBlock(1, 0, 1), Discard((), (0,))]
    assert plan.step.tokens == ((3, 3),) and plan.step.starts == (4,) and kv.row("A") == [2, 3, 0]
    assert kv.uses("A") == [1] and kv.cached_blocks() == [1]


class _Dir:
    """The engine-dir fields the budget reads: 2 layers, 2 KV heads of 8, float32 (256 bytes a token)."""
    num_kv_heads, head_dim, dtype, max_batch_size, max_seq_len = 2, 8, "float32", 4, 64

    def __init__(self, runtime=None):
        self.runtime_defaults = runtime or {}

    @property
    def kv_cache_memory(self):  # as EngineDir reads the spec's runtime.kv_cache_memory
        value = self.runtime_defaults.get("kv_cache_memory")
        return None if value is None else parse_kv_cache_memory(value)

    def rank_layers(self, rank):
        return range(2)


def test_budget_in_blocks_from_bytes_share_spec_or_default(monkeypatch):
    monkeypatch.setattr(kv_budget, "available_memory", lambda: 100_000)
    block = 16 * 256
    assert kv_manager_for(_Dir(), 10 * block + 5, 16, True, RowMemory.pages).num_blocks == 10
    assert kv_manager_for(_Dir(), 0.5, 16, True, RowMemory.pages).num_blocks == 50_000 // block
    assert kv_manager_for(_Dir({"kv_cache_memory": "16KiB"}), None, 16, True, RowMemory.pages).num_blocks == 4
    assert kv_manager_for(_Dir(), None, 16, True, RowMemory.pages).num_blocks == 4 * 4 + 2 * 64 // 16  # every slot full + cache
    with pytest.raises(ValueError, match=re.escape("kv_cache_memory 100 = 100 bytes holds no KV block of 16 tokens "
                                                   "(4096 bytes); give at least 4096")):
        kv_manager_for(_Dir(), 100, 16, True, RowMemory.pages)
    with pytest.raises(ValueError, match=re.escape("kv_cache_memory 100001 = 100001 bytes exceeds the memory available "
                                                   "now (100000 bytes, MemAvailable)")):
        kv_manager_for(_Dir(), 100_001, 16, True, RowMemory.pages)


def test_tensorrt_budget_covers_the_reserved_slots_or_is_refused():
    reserved = 5 * 64 * 256                  # 4 slots + scratch of 64 tokens, reserved on the device
    kv = kv_manager_for(_Dir(), reserved + 3 * 16 * 256, 16, True, RowMemory.reserved)
    assert kv.num_blocks == 3 and kv.grow("a", 64) and kv.row("a") == []   # rows take no blocks
    with pytest.raises(ValueError, match=re.escape(f"TensorRT reserves every KV slot in full (4 + 1 scratch × "
                                                   f"max_seq_len 64 = {reserved} bytes)")):
        kv_manager_for(_Dir(), reserved - 1, 16, True, RowMemory.reserved)

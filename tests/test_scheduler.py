"""Scheduler: admission order, chunk boundaries, alternation, slot moves, prefix-cache ops."""
from __future__ import annotations

import re

import pytest

from trtbuild.runtime.core.kv_manager import KVManager
from trtbuild.runtime.core.sampling import SamplingParams
from trtbuild.runtime.core.scheduler import Batching, Phase, Request, Scheduler
from trtbuild.runtime.core.step import CopySlot, Discard, LoadBlock, SaveBlock, StepKind


def req(rid: str, n: int, max_tokens: int, first: int = 0) -> Request:
    return Request(rid=rid, prompt=list(range(first, first + n)), params=SamplingParams(max_tokens=max_tokens))


def test_inflight_batching_exact_schedule():
    s = Scheduler(capacity=2, max_seq_len=32, max_chunk=4, token_budget=6)
    for r in (req("A", 10, 2), req("B", 3, 3, first=50), req("C", 2, 1, first=80)):
        s.add(r)

    plan = s.schedule()  # A and B admitted (slots 0, 1); C waits. Chunks: A 4, B min(3, budget 2) = 2
    step = plan.step
    assert plan.ops == [] and step.kind == StepKind.prefill and step.first_slot == 0
    assert step.rids == ("A", "B") and step.tokens == ((0, 1, 2, 3), (50, 51)) and step.starts == (0, 0)
    assert step.samples == (False, False) and [r.rid for r in s.waiting] == ["C"]
    assert s.commit(step, {}) == []

    step = s.schedule().step  # A's next 4, B's last 1 token: B samples
    assert step.tokens == ((4, 5, 6, 7), (52,)) and step.starts == (4, 2) and step.samples == (False, True)
    (emitted,) = s.commit(step, {"B": 100})
    assert emitted[0].rid == "B" and emitted[1] == 100 and s.requests["B"].phase == Phase.decoding

    plan = s.schedule()  # B swaps to slot 0 through scratch slot 2; decode goes first after a prefill
    # B's 3 cached, A's 8; then the scratch slot's pages go back
    assert plan.ops == [CopySlot(1, 2, 3), CopySlot(0, 1, 8), CopySlot(2, 0, 3), Discard((2,), ())]
    assert plan.step.kind == StepKind.decode and plan.step.rids == ("B",)
    assert plan.step.tokens == ((100,),) and plan.step.starts == (3,) and plan.step.first_slot == 0
    s.commit(plan.step, {"B": 101})

    step = s.schedule().step  # A finishes its prompt from slot 1
    assert step.kind == StepKind.prefill and step.first_slot == 1 and step.rids == ("A",)
    assert step.tokens == ((8, 9),) and step.starts == (8,) and step.samples == (True,)
    s.commit(step, {"A": 200})

    step = s.schedule().step  # both decode in one step, in slot order
    assert step.kind == StepKind.decode and step.rids == ("B", "A")
    assert step.tokens == ((101,), (200,)) and step.starts == (4, 10)
    s.commit(step, {"B": 102, "A": 201})  # both reach max_tokens
    assert [(r.rid, r.output, r.finish_reason) for r in s.pop_finished()] == [
        ("A", [200, 201], "length"), ("B", [100, 101, 102], "length")]

    plan = s.schedule()  # C takes slot 0 as soon as slots free
    assert plan.ops == [CopySlot(1, 0, 0), Discard((0, 1), ())] and plan.step.rids == ("C",)  # A moved, then finished: nothing to copy and plan.step.tokens == ((80, 81),)


def test_long_prompt_is_chunked_at_max_chunk():
    s = Scheduler(capacity=1, max_seq_len=64, max_chunk=8)
    s.add(req("A", 20, 1))
    chunks = []
    while (step := s.schedule().step) is not None:
        chunks.append((step.starts[0], len(step.tokens[0])))
        s.commit(step, {"A": 7} if step.samples[0] else {})
    assert chunks == [(0, 8), (8, 8), (16, 4)]
    assert s.pop_finished()[0].output == [7]


def test_stop_tokens_and_eos_finish_requests():
    s = Scheduler(capacity=2, max_seq_len=32, max_chunk=8, eos_token_ids=(0,))
    s.add(Request("A", [5, 6], SamplingParams(max_tokens=10, stop_token_ids=(9,))))
    s.add(Request("B", [5, 6], SamplingParams(max_tokens=10, ignore_eos=True)))
    step = s.schedule().step
    s.commit(step, {"A": 9, "B": 0})
    assert s.requests["A"].finish_reason == "stop" and s.requests["B"].phase == Phase.decoding


def test_static_batching_waits_for_the_whole_wave():
    s = Scheduler(capacity=2, max_seq_len=32, max_chunk=8, batching=Batching.static)
    for rid, n in (("A", 1), ("B", 3), ("C", 1)):
        s.add(req(rid, 2, n))
    s.commit(s.schedule().step, {"A": 1, "B": 1})   # A done after its first token
    s.pop_finished()
    step = s.schedule().step
    assert step.rids == ("B",) and [r.rid for r in s.waiting] == ["C"]  # C does not take A's slot
    s.commit(step, {"B": 1})
    s.commit(s.schedule().step, {"B": 1})
    s.pop_finished()
    assert s.schedule().step.rids == ("C",)


def test_prefix_cache_saves_prompt_blocks_and_loads_them_for_a_later_request():
    s = Scheduler(capacity=2, max_seq_len=32, max_chunk=8, kv=KVManager(num_blocks=16, block_size=2))
    s.add(Request("A", [1, 2, 3, 4, 5], SamplingParams(max_tokens=1)))
    step = s.schedule().step
    s.commit(step, {"A": 42})
    s.pop_finished()
    s.add(Request("B", [1, 2, 3, 4, 6], SamplingParams(max_tokens=1)))
    plan = s.schedule()
    # A's row held blocks 0-2; its two full prompt blocks were saved into blocks 3 and 4 from its
    # slot before the slot's pages are returned and it is reused; then they load for B.
    assert plan.ops == [SaveBlock(0, 0, 3), SaveBlock(0, 1, 4), Discard((0,), ()), LoadBlock(3, 0, 0),
                        LoadBlock(4, 0, 1)]
    assert plan.step.tokens == ((6,),) and plan.step.starts == (4,)
    assert s.requests["B"].cached_tokens == 4
    assert (s.kv.stats.hits, s.kv.stats.misses) == (2, 2)
    assert s.kv.row("B") == [5, 6, 7] and s.kv.uses("B") == [3, 4] and s.kv.ref_count(3) == 1


@pytest.mark.parametrize("prompt, max_tokens, message", [
    ([], 4, "empty prompt"),
    (list(range(30)), 4, "prompt of 30 tokens + max_tokens 4 = 34 exceeds the engine's max_seq_len 32"),
])
def test_requests_that_cannot_fit_are_refused_without_disturbing_others(prompt, max_tokens, message):
    s = Scheduler(capacity=2, max_seq_len=32, max_chunk=8)
    s.add(req("ok", 3, 2))
    with pytest.raises(ValueError, match=re.escape(message)):
        s.add(Request("bad", prompt, SamplingParams(max_tokens=max_tokens)))
    assert list(s.requests) == ["ok"] and s.schedule().step.rids == ("ok",)


def test_padded_chunks_never_write_past_the_cache():
    s = Scheduler(capacity=2, max_seq_len=16, max_chunk=8, token_budget=16)
    s.add(req("long", 14, 1))
    s.add(req("short", 8, 1))
    step = s.schedule().step   # both get 8 tokens: padded S = 8, long's write 0..7, short's 0..7
    assert step.rids == ("long", "short")
    s.commit(step, {"short": 3})
    step = s.schedule().step
    # long needs 6 more at 8 (8 + 6 ≤ 16): fine on its own
    assert step.rids == ("long",) and step.starts == (8,) and len(step.tokens[0]) == 6


def test_greedy_runs_stop_at_max_tokens_and_end_rows_at_their_stop_ids():
    s = Scheduler(capacity=3, max_seq_len=64, max_chunk=8, eos_token_ids=(0,))
    s.add(Request("A", [5, 6], SamplingParams(max_tokens=10)))
    s.add(Request("B", [7], SamplingParams(max_tokens=6, stop_token_ids=(9,))))
    step = s.schedule().step
    assert s.run_length(step, 8) == 1  # a prefill step
    s.commit(step, {"A": 11, "B": 21})
    step = s.schedule().step
    assert step.tokens == ((11,), (21,)) and step.starts == (2, 1)
    assert s.run_length(step, 8) == 5 and s.run_length(step, 3) == 3 and s.run_length(step, 1) == 1  # B: 5 left

    seen = []
    s.commit_run(step, [[12, 22], [13, 9], [14, 23]], lambda request, token: seen.append((request.rid, token)))
    a, b = s.requests["A"], s.requests["B"]
    assert seen == [("A", 12), ("A", 13), ("A", 14), ("B", 22), ("B", 9)]  # B ends at its stop id
    assert a.output == [11, 12, 13, 14] and a.computed == 5 and a.written == 5
    assert b.output == [21, 22, 9] and b.finish_reason == "stop"
    s.pop_finished()
    step = s.schedule().step
    assert step.rids == ("A",) and step.tokens == ((14,),) and step.starts == (5,)

    def end_at_string(request, token):  # what LLM's detokenizer does when a stop string completes
        if token == 15:
            s.finish(request.rid, "stop")

    s.commit_run(step, [[15], [16]], end_at_string)
    assert a.output == [11, 12, 13, 14, 15] and a.finish_reason == "stop"


@pytest.mark.parametrize("params, prefilling, expected", [
    (SamplingParams(max_tokens=20, temperature=0.7), False, 1),   # samples
    (SamplingParams(max_tokens=20, logprobs=True), False, 1),     # reads its logits
    (SamplingParams(max_tokens=20, top_k=1, temperature=0.7), False, 8),  # top_k 1 is greedy
    (SamplingParams(max_tokens=20), True, 1),                     # a prompt's chunks alternate in
])
def test_run_length_is_one_where_a_step_must_see_its_logits_or_a_prompt_waits(params, prefilling, expected):
    s = Scheduler(capacity=2, max_seq_len=64, max_chunk=4)
    s.add(Request("A", [5, 6], params))
    s.commit(s.schedule().step, {"A": 11})
    if prefilling:
        s.add(Request("B", list(range(10)), SamplingParams(max_tokens=4)))  # admitted; its chunks are next
    step = s.schedule().step
    assert step.kind == StepKind.decode and s.run_length(step, 8) == expected

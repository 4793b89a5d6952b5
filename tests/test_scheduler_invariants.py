"""Randomized workloads through the scheduler, slot table and KV manager (prefix cache, block
budget) against a cache model that records which token sits at each slot position: before every
step, each row's slot must hold exactly its request's history, whatever moves, saves, loads,
discards and preemptions came before, and every position a step writes lies in blocks the row holds."""
from __future__ import annotations

import numpy as np
import pytest

from trtbuild.runtime.core.kv_manager import KVManager
from trtbuild.runtime.core.sampling import SamplingParams
from trtbuild.runtime.core.scheduler import Request, Scheduler
from trtbuild.runtime.core.step import CopySlot, Discard, LoadBlock, SaveBlock


class TokenCache:
    """Stands in for the KV pools: position p of a slot holds the token whose K/V would be there."""

    def __init__(self, slots: int, length: int, blocks: int, block_size: int):
        self.pool = np.full((slots + 1, length), -1)
        self.blocks = np.full((max(blocks, 1), block_size), -1)
        self.bs = block_size

    def apply(self, op) -> None:
        if isinstance(op, CopySlot):  # only the filled positions: a short length would lose history
            self.pool[op.dst, :op.length] = self.pool[op.src, :op.length]
        elif isinstance(op, SaveBlock):
            self.blocks[op.block] = self.pool[op.slot, op.index * self.bs:(op.index + 1) * self.bs]
        elif isinstance(op, LoadBlock):
            self.pool[op.slot, op.index * self.bs:(op.index + 1) * self.bs] = self.blocks[op.block]
        elif isinstance(op, Discard):  # what the engine hands back reads as nothing
            self.pool[list(op.slots)] = -1
            self.blocks[list(op.blocks)] = -1


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("prefix", [True, False])
@pytest.mark.parametrize("multi_step", [1, 4])
@pytest.mark.parametrize("num_blocks", [96 + 12, 24])
def test_every_step_sees_exactly_its_history(seed, prefix, multi_step, num_blocks):
    """With ``multi_step`` > 1, greedy decode steps run back to back (scheduler.run_length), each
    row fed its previous token, sometimes cut short (as an arrival or a stop id cuts the LLM's).
    108 blocks: every slot fits max_seq_len and the cache 12 blocks; 24: requests are preempted."""
    rng = np.random.default_rng(seed)
    capacity, s_max, bs = 4, 96, 4
    cache = KVManager(num_blocks, bs, prefix_caching=prefix)
    sched = Scheduler(capacity=capacity, max_seq_len=s_max, max_chunk=16, token_budget=24, kv=cache,
                      eos_token_ids=(0,))
    model = TokenCache(capacity, s_max, num_blocks, bs)
    shared = rng.integers(1, 50, size=20).tolist()
    expected_lengths, pending, finished = {}, 30, []
    for step_index in range(5000):
        while pending and rng.random() < 0.3:   # requests arrive while others run
            prompt = (shared[: rng.integers(0, 21)] + rng.integers(1, 50, size=rng.integers(1, 30)).tolist())
            max_tokens = int(rng.integers(1, 20))
            rid = f"r{30 - pending}"
            sched.add(Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
            expected_lengths[rid] = max_tokens
            pending -= 1
        if not sched.has_work():
            if not pending:
                break
            continue
        plan = sched.schedule()
        for op in plan.ops:
            model.apply(op)
        step = plan.step
        if step is None:
            continue
        assert step.first_slot + len(step.rids) <= capacity
        steps = sched.run_length(step, multi_step)
        if steps > 1:
            steps = int(rng.integers(1, steps + 1))
            fed = [list(t) for t in step.tokens]  # each row's token of the current step
            produced = []
            for i in range(steps):
                for row, rid in enumerate(step.rids):
                    start = step.starts[row] + i
                    if i == 0:
                        assert model.pool[row, :start].tolist() == sched.requests[rid].tokens[:start]
                    assert start < cache.held_positions(rid)
                    model.pool[row, start] = fed[row][0]
                fed = [[int(rng.integers(1, 50))] for _ in step.rids]
                produced.append([t[0] for t in fed])
            sched.commit_run(step, produced, lambda request, token: None)
            finished += sched.pop_finished()
            continue
        sampled = {}
        for row, (rid, tokens, start) in enumerate(zip(step.rids, step.tokens, step.starts)):
            request = sched.requests[rid]
            slot = step.first_slot + row
            assert sched.slots.slot_of(rid) == slot
            history = request.tokens[:start]
            assert model.pool[slot, :start].tolist() == history, (seed, step_index, rid)
            assert start + step.seq_len <= s_max        # padded writes stay inside the cache
            assert start + step.seq_len <= cache.held_positions(rid)  # ... and in the row's blocks
            model.pool[slot, start:start + len(tokens)] = tokens
            if step.samples[row]:
                sampled[rid] = int(rng.integers(1, 50))
        sched.commit(step, sampled)
        finished += sched.pop_finished()
    assert not pending and not sched.has_work()
    assert sorted(r.rid for r in finished) == sorted(expected_lengths)
    assert all(len(r.output) == expected_lengths[r.rid] and r.finish_reason == "length" for r in finished)
    if prefix:
        assert cache.stats.hits > 0
    assert (cache.stats.preemptions > 0) == (num_blocks == 24)
    assert cache.num_used == cache.num_cached  # rows gave every block back; only the cache holds some

"""The one adaptive speculation policy (runtime/speculation/adaptive.py) over candidates from any
source: which source a row verifies and the batch's S, drafting's measured cost, one exploration
rule for every source, ``always`` and pinned candidates. Exact asserts on fixed step times."""
from __future__ import annotations

import numpy as np
import pytest

from trtbuild.contract.speculation import Source
from trtbuild.runtime.core.scheduler import Draft
from trtbuild.runtime.core.tree import Accepted, Tree
from trtbuild.runtime.speculation.acceptance import AcceptanceModel, SpeculationStats
from trtbuild.runtime.speculation.adaptive import (EXPLORE_AFTER, AdaptivePolicy, Candidate, Decision,
                                                  SpeculationMode)
from trtbuild.runtime.speculation.chain import chain_tree
from trtbuild.runtime.speculation.host import HostDrafting
from trtbuild.runtime.speculation.step_times import StepTimes
from trtbuild.runtime.speculation.trees import MedusaTrees

# A Medusa tree prefix series of 4 choices, and chains of 8 that keep each token with 0.5 / 0.9.
TREE = Candidate(Source.medusa, np.array([0.0, 0.9, 1.7, 2.4, 3.0]))
WEAK_CHAIN = Candidate(Source.prompt_lookup, np.arange(9) * 0.5)
STRONG_CHAIN = Candidate(Source.prompt_lookup, np.arange(9) * 0.9)


def _times(plain: float, per_token: float, batches=(1,)) -> StepTimes:
    """Step times where a step of S tokens a row costs plain + per_token × (S - 1) at every batch given."""
    times = StepTimes()
    for batch in batches:
        for seq in (1, 2, 5, 9):
            times.observe(batch, seq, plain + per_token * (seq - 1))
    return times


def _policy(times: StepTimes, mode=SpeculationMode.adaptive) -> AdaptivePolicy:
    return AdaptivePolicy(times, dict.fromkeys((Source.medusa, Source.prompt_lookup, Source.draft_head)),
                          SpeculationStats(), mode)


def test_a_row_verifies_the_source_of_the_higher_expected_rate():
    """Steps of 10 ms + 1 ms a drafted token. The tree's 4 choices give (1 + 3.0) / 14 ms = 286
    tokens/s, a weak chain's 8 tokens (1 + 4.0) / 18 ms = 278: the tree. A strong chain's 8 give
    (1 + 7.2) / 18 ms = 456: the chain. Both beat plain's 100 by more than MIN_GAIN."""
    policy = _policy(_times(0.010, 0.001))
    assert policy.choose(1, {"a": [TREE, WEAK_CHAIN]}) == Decision(5, {"a": (Source.medusa, 4)})
    assert policy.choose(1, {"a": [TREE, STRONG_CHAIN]}) == Decision(9, {"a": (Source.prompt_lookup, 8)})
    # One batch, one S: a row with only the tree verifies all of it beside the strong chain's row.
    assert policy.choose(2, {"a": [TREE], "b": [STRONG_CHAIN]}) == Decision(
        9, {"a": (Source.medusa, 4), "b": (Source.prompt_lookup, 8)})
    # Verifying costs as much as decoding one by one: plain.
    assert _policy(_times(0.010, 0.010)).choose(1, {"a": [TREE, STRONG_CHAIN]}) == Decision()


def test_a_source_whose_measured_drafting_cost_loses_is_not_chosen():
    """A draft source as strong as STRONG_CHAIN, drafting at a measured 10 ms a token a row (a
    plain step's worth): each drafted token costs more than the 0.9 it keeps is worth, so beside
    the tree the tree is verified, and alone nothing: its best, (1 + 0.9) / (11 + 10) ms = 90
    tokens/s, is below plain's 100. Measured free, it wins as STRONG_CHAIN does."""
    head = Candidate(Source.draft_head, STRONG_CHAIN.expected)
    free = _policy(_times(0.010, 0.001))
    assert free.choose(1, {"a": [TREE, head]}) == Decision(9, {"a": (Source.draft_head, 8)})
    dear = _policy(_times(0.010, 0.001))
    dear.measured(Source.draft_head, tokens=16, seconds=16 * 0.010)
    assert dear.drafting_cost(Source.draft_head) == pytest.approx(0.010)
    assert dear.choose(1, {"a": [TREE, head]}) == Decision(5, {"a": (Source.medusa, 4)})
    assert dear.choose(1, {"a": [head]}) == Decision()
    assert free.choose(1, {"a": [head]}) == Decision(9, {"a": (Source.draft_head, 8)})


@pytest.mark.parametrize("source", [Source.medusa, Source.prompt_lookup, Source.draft_head])
def test_exploration_comes_after_exactly_explore_after_verification_costs_of_plain_decoding(source):
    """Any source, one unit: plain steps of 2^-7 s, verifications of 2^-3 s (exact in binary). A
    draft that keeps little pays nowhere; its likeliest-to-pay verification (2 tokens: (1 + 0.2) /
    2^-3 s) costs 2^-3 s, so it is verified once after EXPLORE_AFTER × 2^-3 s = 1600 plain steps."""
    times = StepTimes()
    for seq in (1, 2, 3):
        times.observe(1, seq, 2 ** -7 if seq == 1 else 2 ** -3)
    policy = _policy(times)
    rows = {"a": [Candidate(source, np.array([0.0, 0.1, 0.2]))]}
    assert EXPLORE_AFTER == 100
    policy.stood_aside(1, 1599)
    assert policy.choose(1, rows) == Decision()
    policy.stood_aside(1, 1)
    assert policy.choose(1, rows) == Decision(3, {"a": (source, 2)})
    assert policy.choose(1, rows) == Decision()   # explored: its budget starts again
    policy.stood_aside(1, 1599)
    assert policy.choose(1, rows) == Decision()


def test_each_source_explores_on_its_own_budget():
    times = StepTimes()
    for seq in (1, 2, 3):
        times.observe(1, seq, 2 ** -7 if seq == 1 else 2 ** -3)
    policy = _policy(times)
    low = np.array([0.0, 0.1, 0.2])
    rows = {"a": [Candidate(Source.medusa, low), Candidate(Source.prompt_lookup, low)]}
    policy.stood_aside(1, 1600)
    explored = [policy.choose(1, rows) for _ in range(3)]
    assert {d.picks["a"][0] for d in explored[:2]} == {Source.medusa, Source.prompt_lookup}
    assert [d.seq for d in explored] == [3, 3, 1]


def test_always_verifies_every_draft_whole_without_step_times():
    policy = _policy(StepTimes(), SpeculationMode.always)
    assert policy.choose(2, {"a": [TREE, WEAK_CHAIN], "b": [Candidate(Source.prompt_lookup, np.arange(3) * 0.9)]}) \
        == Decision(9, {"a": (Source.prompt_lookup, 8), "b": (Source.prompt_lookup, 2)})


def test_a_pinned_tree_is_verified_whole_and_chains_ride_along_up_to_what_pays():
    """A pinned tree of 2 choices (S = 3) costs nothing to decide: no step times needed alone.
    Beside it a strong chain of another row is verified whole (S = 9), a weak one is not
    stretched past what pays."""
    pinned = Candidate(Source.medusa, np.array([0.0, 0.6, 0.9]), pinned=True)
    assert _policy(StepTimes()).choose(1, {"a": [pinned]}) == Decision(3, {"a": (Source.medusa, 2)})
    policy = _policy(_times(0.010, 0.001, batches=(2,)))
    assert policy.choose(2, {"a": [pinned], "b": [STRONG_CHAIN]}) == Decision(
        9, {"a": (Source.medusa, 2), "b": (Source.prompt_lookup, 8)})
    steep = _policy(_times(0.010, 0.010, batches=(2,)))
    assert steep.choose(2, {"a": [pinned], "b": [WEAK_CHAIN]}) == Decision(
        3, {"a": (Source.medusa, 2), "b": (Source.prompt_lookup, 2)})


def test_every_source_records_through_the_same_call():
    """One call for a Medusa tree and a chain: each source's model learns, the counters count both."""
    stats = SpeculationStats()
    tree = Tree(((0,), (0, 0)))
    trees = MedusaTrees(tree, AcceptanceModel([[0.5], [0.5]]), stats)
    host = HostDrafting({Source.prompt_lookup: _Silent()}, 8)
    policy = AdaptivePolicy(StepTimes(), {Source.medusa: trees, Source.prompt_lookup: host}, stats)
    for _ in range(50):
        policy.record("a", Draft(tree, (3, 4), Source.medusa), Accepted((1,), (3,)))
        policy.record("b", Draft(chain_tree(2), (5, 6), Source.prompt_lookup, (0.5, 0.5)), Accepted((1, 2), (5, 6)))
    # (kept + 20 × the prior 0.5) / (tried + 20): head 0 kept all 50, head 1 none.
    assert trees.acceptance.probability(0, 0) == pytest.approx(60 / 70)
    assert trees.acceptance.probability(1, 0) == pytest.approx(10 / 70)
    assert stats.head_tried == [50, 50] and stats.head_accepted == [50, 0]
    assert host.probabilities(Source.prompt_lookup, "b", (0.5, 0.5))[:2].min() > 0.9
    assert stats.as_dict()["sources"] == {"medusa": {"verified_rows": 50, "accepted_tokens": 50, "mean_tokens_per_step": 2.0},
                                          "prompt_lookup": {"verified_rows": 50, "accepted_tokens": 100,
                                                            "mean_tokens_per_step": 3.0}}
    policy.close("b", [1, 2])
    assert host.sources[Source.prompt_lookup].closed == ["b"]


class _Silent:
    """A host source that proposes nothing (the record test needs none)."""

    def __init__(self):
        self.closed = []

    def propose(self, rid, context, max_tokens):
        from trtbuild.runtime.speculation.sources import Proposal
        return Proposal((), ())

    def close(self, rid, context):
        self.closed.append(rid)

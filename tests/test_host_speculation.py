"""Speculation without training, in the step loop: prompt-lookup and suffix chains verified by
the same step as Medusa trees. Greedy output identical to plain decoding for every source, in
mixed batches, streamed, with stop strings inside an accepted run; sampled acceptance of a chain
gives plain sampling's token (tests/test_seeded_sampling.py: its distribution, and whole seeded
requests); the batch policy and its exploration; the server's field."""
from __future__ import annotations

import numpy as np
import pytest

from trtbuild.contract.speculation import Source
from trtbuild.runtime.core.sampling import Sampler, SamplingParams
from trtbuild.runtime.llm import LLM
from trtbuild.runtime.speculation.chain import chain_tree
from trtbuild.runtime.speculation.acceptance import SpeculationStats
from trtbuild.runtime.speculation.adaptive import (DRAFT_SHARE, EXPLORE_AFTER, AdaptivePolicy, Candidate,
                                                  SpeculationMode)
from trtbuild.runtime.speculation.host import FIRST_REACH, HostDrafting
from trtbuild.runtime.speculation.medusa import accept_greedy, accept_sampled
from trtbuild.runtime.speculation.step_times import StepTimes

# Code that repeats itself: the second copy's tokens are in the prompt already.
BODY = ("def moving_average(values, window):\n    total = 0.0\n    out = []\n    for i, v in enumerate(values):\n"
        "        total += v\n        if i >= window:\n            total -= values[i - window]\n"
        "        out.append(total / min(i + 1, window))\n    return out\n\n")
REPEAT = BODY + "\n# The same function again:\n" + BODY[:40]
PROMPTS = [REPEAT, "def fibonacci(n):", BODY + BODY[:60], "import os\n\ndef list_files(path):"]
ALWAYS = SpeculationMode.always


def _chain_logits(rows: list[list[float]]) -> np.ndarray:
    return np.log(np.array(rows, np.float64))  # [T, V]: log-probabilities, temperature 1 gives them back


def test_chain_tree_is_a_path():
    tree = chain_tree(3)
    assert tree.size == 4 and tree.parents == (-1, 0, 1, 2) and tree.children == ((1,), (2,), (3,), ())


def test_greedy_acceptance_of_a_chain_keeps_the_agreeing_prefix():
    tree = chain_tree(3)
    logits = np.zeros((4, 5))
    logits[0, 2] = logits[1, 4] = logits[2, 0] = logits[3, 1] = 1.0   # the model's argmax after each node
    assert accept_greedy(tree, [9, 2, 4, 3], logits).tokens == (2, 4)   # the third guess (3) is not 0
    assert accept_greedy(tree, [9, 2, 4, 0], logits).tokens == (2, 4, 0)
    assert accept_greedy(tree, [9, 1, 4, 0], logits).tokens == ()


def test_sampled_acceptance_of_a_chain_gives_plain_samplings_token():
    """A one-guess chain [2] under p: for each seed the guess is kept exactly when plain sampling
    at that position draws 2, and otherwise the token sampled at the rejection is plain
    sampling's (never 2). 400 seeds, both outcomes seen."""
    p = [0.1, 0.5, 0.25, 0.15]
    logits = _chain_logits([p, [0.25] * 4])
    kept = 0
    for seed in range(400):
        sampler = Sampler(SamplingParams(temperature=1.0, seed=seed))
        plain = sampler.sample(logits[0], 5)[0]
        path = accept_sampled(chain_tree(1), [0, 2], logits, sampler, 5)
        assert path.tokens == ((2,) if plain == 2 else ())
        if not path.tokens:
            assert sampler.sample(logits[0], 5)[0] == plain != 2
        kept += len(path.tokens)
    assert 60 < kept < 140  # p(2) = 0.25 of 400


def test_a_guess_the_model_never_samples_is_never_kept():
    logits = _chain_logits([[0.5, 0.5, 1e-300], [0.5, 0.5, 1e-300]])
    for seed in range(200):
        sampler = Sampler(SamplingParams(temperature=1.0, seed=seed))
        assert accept_sampled(chain_tree(1), [0, 2], logits, sampler, 0).tokens == ()
        assert sampler.sample(logits[0], 0)[0] in (0, 1)


class _FixedSource:
    """A host source proposing a given chain (the policy's tests need no real source)."""

    def __init__(self, source: Source, tokens: tuple[int, ...], stated: float = 0.5):
        self.source, self.tokens, self.stated, self.closed = source, tokens, stated, []

    def propose(self, rid, context, max_tokens):
        from trtbuild.runtime.speculation.sources import Proposal

        tokens = self.tokens[:max_tokens]
        return Proposal(tokens, (self.stated,) * len(tokens))

    def close(self, rid, context):
        self.closed.append(rid)


def _times(plain: float, per_token: float) -> StepTimes:
    """Step times where a verification of S tokens costs plain + per_token × (S - 1)."""
    times = StepTimes()
    for seq in (1, 2, 5, 9):
        times.observe(1, seq, plain + per_token * (seq - 1))
    return times


HALF = (0.5,) * 8


def _drafting(times: StepTimes, mode=SpeculationMode.adaptive) -> HostDrafting:
    """Prompt lookup proposing 0..7, with the adaptive policy over it as ``host.policy``."""
    host = HostDrafting({Source.prompt_lookup: _FixedSource(Source.prompt_lookup, tuple(range(8)))}, 8, mode)
    host.policy = AdaptivePolicy(times, dict.fromkeys(host.sources, host), SpeculationStats(), mode)
    return host


def _choose(host: HostDrafting, batch: int, drafts: dict) -> int:
    """The chain length the policy verifies for these rows' drafts (0: plain)."""
    decision = host.policy.choose(batch, {rid: [Candidate(d.source, d.expected)] for rid, d in drafts.items()})
    return decision.seq - 1


def test_policy_verifies_where_kept_tokens_pay_and_not_where_they_do_not():
    cheap, dear = _drafting(_times(0.010, 0.0005)), _drafting(_times(0.010, 0.010))
    for host in (cheap, dear):
        for _ in range(30):   # the request's chains have been kept whole
            host.record("a", Source.prompt_lookup, HALF, 8)
    draft = cheap.draft("a", [1, 2, 3], (Source.prompt_lookup,), 100)
    assert draft.tokens == tuple(range(8)) and draft.expected[-1] > 7
    assert _choose(cheap, 1, {"a": draft}) == 8
    # Verifying costs as much as decoding one by one: nothing to gain.
    assert _choose(dear, 1, {"a": dear.draft("a", [1, 2, 3], (Source.prompt_lookup,), 100)}) == 0


def test_policy_steps_aside_for_drafts_that_are_never_kept_then_explores():
    """Standing aside, prompt lookup is verified again once plain decoding since it last verified
    took EXPLORE_AFTER times its likeliest-to-pay verification's cost (one token: 2^-7 + 2^-9 s),
    that is EXPLORE_AFTER × 1.25 plain steps of 2^-7 s (times exact in binary)."""
    host = _drafting(_times(2 ** -7, 2 ** -9))
    for _ in range(30):
        host.record("a", Source.prompt_lookup, HALF, 0)

    def choice() -> int:
        return _choose(host, 1, {"a": host.draft("a", [1], (Source.prompt_lookup,), 100)})

    assert EXPLORE_AFTER == 100
    host.policy.stood_aside(1, 124)
    assert choice() == 0
    host.policy.stood_aside(1, 1)
    assert [choice(), choice()] == [1, 0]   # one verification of the first token, then plain again


def test_always_mode_verifies_every_draft_whole_and_the_limit_caps_it():
    host = _drafting(StepTimes(), ALWAYS)
    draft = host.draft("a", [1], (Source.prompt_lookup,), 3)
    assert draft.tokens == (0, 1, 2) and _choose(host, 4, {"a": draft}) == 3
    assert host.draft("a", [1], (Source.suffix,), 8) is None   # not a source this engine drafts with
    host.close("a", [1, 2])
    assert host.sources[Source.prompt_lookup].closed == ["a"]


def test_chains_reach_twice_as_deep_as_the_longest_run_kept():
    """A depth never reached has only its prior: a source's chains are verified twice as deep as
    its longest kept run (at least FIRST_REACH), so the first bet is 2 tokens, not 16 (at
    batch 8 on SmolLM2 a 17-token verification costs 7x a plain step). ``always`` is not limited."""
    host = _drafting(_times(0.010, 0.0005))

    def length() -> int:
        return len(host.draft("a", [1], (Source.prompt_lookup,), 100).tokens)

    assert length() == FIRST_REACH == 2
    host.record("a", Source.prompt_lookup, HALF[:2], 2)   # both kept
    assert length() == 4
    host.record("a", Source.prompt_lookup, HALF[:4], 3)
    assert length() == 6
    host.record("a", Source.prompt_lookup, HALF[:6], 1)   # a shorter run does not shrink the reach
    assert length() == 6
    host.record("b", Source.prompt_lookup, HALF[:6], 6)   # another request's run counts too
    assert length() == 8                                  # 12, the engine's max_tokens caps it
    assert len(_drafting(StepTimes(), ALWAYS).draft("a", [1], (Source.prompt_lookup,), 100).tokens) == 8


def test_acceptance_is_learned_per_depth_and_per_request():
    host = _drafting(StepTimes(), ALWAYS)
    for _ in range(50):
        host.record("a", Source.prompt_lookup, HALF, 2)   # always the first two kept, the third refused
    probs = host.probabilities(Source.prompt_lookup, "a", HALF)
    assert probs[0] > 0.9 and probs[1] > 0.9 and probs[2] < 0.1
    # Depth 3 was never tried: the calibration of "stated 0.5" speaks for it (100 of 150 kept, prior 0.5 × 8).
    assert probs[3] == pytest.approx((100 + 8 * 0.5) / (150 + 8))
    assert host.probabilities(Source.prompt_lookup, "b", HALF)[2] < 0.2   # a new request starts from the shared figure


def test_a_sure_source_is_calibrated_at_depths_never_tried():
    """A source stating 1.0 for every token (a suffix chain seen once does) whose first token is
    never kept: its deep tokens, never tried, are judged by what "1.0" proved worth, not by its
    word, and the policy steps aside (before calibration it verified 16-token chains in free chat)."""
    host = HostDrafting({Source.suffix: _FixedSource(Source.suffix, tuple(range(8)), stated=1.0)}, 8)
    host.policy = AdaptivePolicy(_times(0.010, 0.002), {Source.suffix: host}, SpeculationStats())
    fresh = host.draft("a", [1], (Source.suffix,), 100)
    assert 0 < _choose(host, 1, {"a": fresh}) < 8   # trusted halfway at first: a short chain
    for _ in range(10):
        host.record("b", Source.suffix, (1.0,) * 8, 0)
    probs = host.probabilities(Source.suffix, "a", (1.0,) * 8)
    assert probs[7] == pytest.approx(8 * 0.75 / (10 + 8)) and probs[0] < probs[7]
    assert _choose(host, 1, {"a": host.draft("a", [1], (Source.suffix,), 100)}) == 0


def test_a_draft_models_tokens_are_judged_by_what_it_stated_not_by_depth():
    """A per-token source (the draft head): first tokens stated 0.95 are kept, first tokens stated
    0.25 never, 200 times each. Each later chain's estimate follows its own token's tenth (the calibration:
    kept/tried with the shrunk prior counting 8), where a depth-averaged source gives both about
    the same figure (depth 1 kept half)."""
    sure, unsure = (0.95, 0.5), (0.25, 0.5)
    hosts = {per_token: HostDrafting({Source.draft_head: _FixedSource(Source.draft_head, (1, 2))}, 4,
                                     per_token=per_token) for per_token in (True, False)}
    for host in hosts.values():
        for _ in range(200):
            host.record("a", Source.draft_head, sure, 1)    # the 0.95 token kept, the 0.5 one not
            host.record("a", Source.draft_head, unsure, 0)
    per_token = hosts[True]
    assert per_token.probabilities(Source.draft_head, "b", sure)[0] == pytest.approx((200 + 8 * 0.725) / (200 + 8))
    assert per_token.probabilities(Source.draft_head, "b", unsure)[0] == pytest.approx((0 + 8 * 0.375) / (200 + 8))
    # Stated 0.5 was tried 200 times at depth 2 and never kept.
    assert per_token.probabilities(Source.draft_head, "b", sure)[1] == pytest.approx(8 * 0.5 / (200 + 8))
    averaged = hosts[False]
    assert averaged.probabilities(Source.draft_head, "b", sure)[0] == pytest.approx(
        averaged.probabilities(Source.draft_head, "b", unsure)[0], abs=0.03)


def test_the_draft_head_stops_a_chain_whose_next_token_cannot_pay():
    """Drafting a token costs a row its share of a draft run; it saves at most a row's plain
    step times the chance every token before it is kept. 2 ms a run a row, plain 20 ms a row:
    a chain goes on while the product of its calibrated probabilities is ≥ 0.1. Before any
    verification a stated q counts as 0.5 + 0.5·(q − 0.5): 0.3 → 0.4, so two such tokens (0.16)
    are worth a third and three (0.064) are not. Always mode, an unmeasured drafter, or no plain
    step time: drafted to full length."""
    from types import SimpleNamespace

    from trtbuild.runtime.speculation.draft_head_source import DraftHeadSource

    drafter = SimpleNamespace(seconds_per_row_run=0.002)
    worth_more = DraftHeadSource(drafter, 8, SpeculationMode.adaptive)._worth_more(0.020)
    assert worth_more([0.3, 0.3]) and not worth_more([0.3, 0.3, 0.3])
    assert worth_more([0.9] * 6) and not worth_more([0.9] * 7)   # 0.7⁶ = 0.118, 0.7⁷ = 0.082
    assert DraftHeadSource(drafter, 8, ALWAYS)._worth_more(0.020) is None
    assert DraftHeadSource(SimpleNamespace(seconds_per_row_run=None), 8, SpeculationMode.adaptive)._worth_more(0.02) is None
    assert DraftHeadSource(drafter, 8, SpeculationMode.adaptive)._worth_more(None) is None


class _TreeSource:
    """A draft model's chain 10, 11, 12 (stated 0.95, 0.95, 0.15) and its runners-up at each depth."""

    source = Source.draft_head
    ALTERNATIVES = (((20, 0.03), (21, 0.01)), ((22, 0.35),), ((23, 0.45),))

    def propose(self, rid, context, max_tokens):
        from trtbuild.runtime.speculation.sources import Proposal

        return Proposal((10, 11, 12)[:max_tokens], (0.95, 0.95, 0.15)[:max_tokens], self.ALTERNATIVES[:max_tokens])

    def close(self, rid, context):
        pass


def test_a_draft_models_runners_up_make_a_tree_of_its_likeliest_nodes():
    """Before any verification a stated q is worth 0.25 + 0.5·q. Node values: the chain's 0.725,
    0.725², 0.725²·0.325; siblings 0.265 and 0.255 at depth 1, 0.725·0.425 beside the second
    token, 0.725²·0.475 beside the third. The five likeliest, parents first: (0,), (0, 0),
    (0, 1), (1,), (2,). A sibling costs no draft run: the first n nodes need the chain as deep as
    the deepest of them."""
    host = HostDrafting({Source.draft_head: _TreeSource()}, 3, ALWAYS, per_token=True, max_nodes=5)
    draft = host.draft("a", [1], (Source.draft_head,), 8)
    assert draft.choices == ((0,), (0, 0), (0, 1), (1,), (2,))
    assert draft.tokens == (10, 11, 22, 20, 21) and draft.stated == (0.95, 0.95, 0.35, 0.03, 0.01)
    values = [0.725, 0.725 ** 2, 0.725 * 0.425, 0.265, 0.255]
    assert draft.expected == pytest.approx(np.concatenate(([0.0], np.cumsum(values))))
    assert draft.drafted.tolist() == [0, 1, 2, 2, 2, 2]
    tree = draft.tree(3)
    assert tree.parents == (-1, 0, 1, 1) and draft.tree(2).choices == chain_tree(2).choices
    # The chain alone where there are no runners-up; a tree never outgrows max_nodes.
    wide = HostDrafting({Source.draft_head: _TreeSource()}, 3, ALWAYS, per_token=True, max_nodes=16)
    assert len(wide.draft("a", [1], (Source.draft_head,), 8).tokens) == 7
    with pytest.raises(ValueError, match="max_nodes 2: valid max_tokens"):
        HostDrafting({Source.draft_head: _TreeSource()}, 3, per_token=True, max_nodes=2)


def test_a_verified_tree_counts_every_node_whose_parent_was_kept():
    """Kept: (0,) then its sibling-child (0, 1). Tried: every node under the root or under (0,):
    all five. Calibration by stated tenth: 0.95 tried twice, kept once (the chain's second token
    lost to its sibling); 0.35 tried and kept; 0.03 and 0.01 (tenth 0) tried twice, never kept.
    The per-depth counts see a path two deep in a tree two deep."""
    from trtbuild.runtime.core.scheduler import Draft
    from trtbuild.runtime.core.tree import Accepted

    host = HostDrafting({Source.draft_head: _TreeSource()}, 3, per_token=True, max_nodes=5)
    draft = host.draft("a", [1], (Source.draft_head,), 8)
    host.verified("a", Draft(draft.tree(5), draft.tokens, Source.draft_head, draft.stated), Accepted((1, 3), (10, 22)))
    calibration = host.calibration[Source.draft_head]
    assert calibration.trials.tolist() == [2, 0, 0, 1, 0, 0, 0, 0, 0, 2]
    assert calibration.hits.tolist() == [0, 0, 0, 1, 0, 0, 0, 0, 0, 1]
    counts = host.counts[Source.draft_head]
    assert counts.trials.tolist() == [1, 1, 0] and counts.hits.tolist() == [1, 1, 0]


def test_the_calibration_tool_sees_every_node_the_runtime_counts():
    """benchmarks/draft_calibration.py's recorder, on the model the policy reports verifications
    to: a tree's five tried nodes (as above), then a chain's kept token and the one after it, as
    (depth, stated, kept); the model still learns from both."""
    import sys
    from pathlib import Path

    from trtbuild.runtime.core.scheduler import Draft
    from trtbuild.runtime.core.tree import Accepted

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from draft_calibration import recording

    host = HostDrafting({Source.draft_head: _TreeSource()}, 3, per_token=True, max_nodes=5)
    tried = recording(host)
    draft = host.draft("a", [1], (Source.draft_head,), 8)
    host.verified("a", Draft(draft.tree(5), draft.tokens, Source.draft_head, draft.stated), Accepted((1, 3), (10, 22)))
    host.verified("a", Draft(chain_tree(3), (10, 11, 12), Source.draft_head, (0.95, 0.95, 0.15)),
                  Accepted((1,), (10,)))
    assert tried == [(0, 0.95, True), (1, 0.95, False), (1, 0.35, True), (0, 0.03, False), (0, 0.01, False),
                     (0, 0.95, True), (1, 0.95, False)]
    assert host.calibration[Source.draft_head].trials.sum() == 7


def test_the_policy_charges_a_tree_only_for_the_chain_it_drafted():
    """A draft costing 10 ms a drafted token against a 20 ms plain step (verification + 1 ms a
    token): one chain token and its two siblings, 1.0 tokens expected, verify for 23 + 10 ms,
    2.0 tokens (0.061 a ms against plain's 0.050, over MIN_GAIN). Priced as three drafted
    tokens (53 ms) the same candidate would not pay."""
    times = _times(0.020, 0.001)
    policy = AdaptivePolicy(times, {}, SpeculationStats())
    policy.measured(Source.draft_head, 1, 0.010)
    expected = np.array([0.0, 0.5, 0.8, 1.0])
    tree = Candidate(Source.draft_head, expected, drafted=np.array([0, 1, 1, 1]))
    assert policy.decide(1, {"a": [tree]}).picks == {"a": (Source.draft_head, 3)}
    assert policy.decide(1, {"a": [Candidate(Source.draft_head, expected)]}).picks == {}


def test_drafting_backs_off_after_a_decision_that_verified_nothing():
    """A drafting call that verified nothing costing 1 ms: the next waits until the engine has
    stepped 1 ms / DRAFT_SHARE, the one after it twice that; a request never drafted for is due at
    once; a verification drafts again at the next step."""
    policy = _drafting(_times(0.010, 0.002)).policy
    assert policy.due(["a"])
    policy.drafted(["a"], 0.001, verifies=False)
    wait = 0.001 / DRAFT_SHARE
    policy.stepped(0.9 * wait)
    assert not policy.due(["a"]) and policy.due(["a", "b"])
    policy.stepped(0.2 * wait)
    assert policy.due(["a"])
    policy.drafted(["a"], 0.001, verifies=False)  # the second in a row: twice the wait
    policy.stepped(1.9 * wait)
    assert not policy.due(["a"])
    policy.stepped(0.2 * wait)
    assert policy.due(["a"])
    policy.drafted(["a"], 0.001, verifies=True)
    assert policy.due(["a"])
    policy.drafted(["a"], 0.001, verifies=False)
    policy.close("a", [1])
    assert policy.due(["a"])   # a new request may reuse an ended one's id
    always = _drafting(StepTimes(), ALWAYS).policy
    always.drafted(["a"], 0.001, verifies=False)
    assert always.due(["a"])


def test_the_back_off_doubles_per_unverified_call_up_to_sixteen_times_and_resets_on_a_verification():
    from trtbuild.runtime.speculation.adaptive import MAX_DOUBLINGS, Backoff

    def waits(backoff: Backoff, calls: int) -> list[float]:
        out = []
        for _ in range(calls):
            backoff.drafted(0.002, verified=False)
            out.append(round(backoff.owed * DRAFT_SHARE / 0.002, 9))  # in units of the first wait
            backoff.stepped(backoff.owed)
            assert backoff.due()
        return out

    backoff = Backoff()
    assert backoff.due() and MAX_DOUBLINGS == 4
    assert waits(backoff, 7) == [1, 2, 4, 8, 16, 16, 16]
    backoff.drafted(0.002, verified=True)
    assert backoff.due() and waits(backoff, 2) == [1, 2]


def test_a_drafting_call_with_no_request_decoding_is_not_one_that_verified_nothing():
    """Steps of prompts prefilling (no request decoding) call the policy with no rows; they do not
    deepen the back-off: the first unverified call after them waits 1 ms / DRAFT_SHARE, not more."""
    policy = _drafting(_times(0.010, 0.002)).policy
    for _ in range(5):
        policy.drafted([], 0.001, verifies=False)
        policy.stepped(0.010)
    policy.drafted(["a"], 0.001, verifies=False)
    policy.stepped(1.1 * 0.001 / DRAFT_SHARE)
    assert policy.due(["a"])


class _DraftHead:
    """The draft head source as the engine core sees it, its back-off the real one: in sync with
    every row, drafting for 1 ms and offering no chain (so nothing it drafts is verified)."""

    def __init__(self):
        from trtbuild.runtime.speculation.adaptive import Backoff

        self.backoff = Backoff()

    def due(self):
        return self.backoff.due()

    def stepped(self, seconds):
        self.backoff.stepped(seconds)

    def decided(self, seconds, verified):
        self.backoff.drafted(seconds, verified)

    def in_sync(self, rid, root_position):
        return True

    def draft(self, rows, row_seconds=None):
        return {}, (0.001 if rows else 0.0), 0


def test_the_draft_heads_back_off_counts_only_calls_that_drafted_for_a_row():
    """The engine core's drafting after five steps of a prompt prefilling (nothing decoding, so the
    draft head drafts for no row), then one whose 1 ms of drafting is not verified: the draft head
    is due again once the engine stepped 1 ms / DRAFT_SHARE, as after a first unverified call."""
    from types import SimpleNamespace

    from trtbuild.runtime.core.scheduler import Phase, Request
    from trtbuild.runtime.engine_core import EngineCore, Sampling
    from trtbuild.runtime.speculation.speculation import Speculation

    times, head = _times(0.010, 0.002), _DraftHead()
    policy = AdaptivePolicy(times, {Source.draft_head: HostDrafting({}, 8, SpeculationMode.adaptive)},
                            SpeculationStats(), SpeculationMode.adaptive)
    spec = Speculation((Source.draft_head,), times, SpeculationStats(), policy, None, None, head)
    request = Request("a", [1, 2, 3], SamplingParams(max_tokens=16), phase=Phase.prefilling)
    decoding: list[str] = []
    scheduler = SimpleNamespace(requests={"a": request}, slots=SimpleNamespace(decoding=lambda: decoding))
    core = EngineCore(None, scheduler, spec, multi_step=1)
    core.sampling["a"] = Sampling(Sampler(request.params), sources=(Source.draft_head,))

    def step(seconds: float) -> None:  # as EngineCore.step: the step's time, then drafting
        policy.stepped(seconds)
        head.stepped(seconds)
        core._draft({})

    for _ in range(5):
        step(0.010)
    request.phase, request.output, request.computed = Phase.decoding, [4], 3
    decoding.append("a")
    step(0.010)  # drafts for "a": 1 ms, not verified
    assert not head.due()
    head.stepped(1.1 * 0.001 / DRAFT_SHARE)
    assert head.due()


def test_a_drafting_call_that_drafted_nothing_leaves_the_policys_back_off_alone():
    """No host source; a request that just started decoding while the draft head backs off: the
    policy is due (the request was never drafted for), the draft head is not, and nothing is
    drafted. That call must not count as one that verified nothing: once the draft head is due,
    the very next step drafts for the request (it used to wait out the policy's back-off too)."""
    from types import SimpleNamespace

    from trtbuild.runtime.core.scheduler import Phase, Request
    from trtbuild.runtime.engine_core import EngineCore, Sampling
    from trtbuild.runtime.speculation.speculation import Speculation

    times, head = _times(0.010, 0.002), _DraftHead()
    policy = AdaptivePolicy(times, {Source.draft_head: HostDrafting({}, 8, SpeculationMode.adaptive)},
                            SpeculationStats(), SpeculationMode.adaptive)
    spec = Speculation((Source.draft_head,), times, SpeculationStats(), policy, None, None, head)
    request = Request("a", [1, 2, 3], SamplingParams(max_tokens=16), phase=Phase.decoding)
    request.output, request.computed = [4], 3
    scheduler = SimpleNamespace(requests={"a": request}, slots=SimpleNamespace(decoding=lambda: ["a"]))
    core = EngineCore(None, scheduler, spec, multi_step=1)
    core.sampling["a"] = Sampling(Sampler(request.params), sources=(Source.draft_head,))
    head.decided(0.001, verified=False)  # backing off from an earlier request's drafting
    assert policy.due(["a"]) and not head.due()
    core._draft({})  # nothing drafted
    head.stepped(1.0)
    policy.stepped(1e-4)
    core._draft({})
    assert not head.due()  # it drafted (1 ms, not verified): backing off again


def test_a_verification_is_priced_with_the_drafting_after_it():
    """Kept whole, an 8-token chain pays against 10 ms plain steps; not once drafting for the
    next step costs 100 ms a row (the bundled model's steps are 0.5 ms, its drafting 1 ms)."""
    host = _drafting(_times(0.010, 0.0005))
    for _ in range(30):
        host.record("a", Source.prompt_lookup, HALF, 8)

    def choice() -> int:
        return _choose(host, 1, {"a": host.draft("a", [1, 2, 3], (Source.prompt_lookup,), 100)})

    assert choice() == 8
    for _ in range(3):
        host.policy.drafted(["a"], 0.100, verifies=True)
    assert host.policy.drafting_estimate(2) == pytest.approx(0.200)
    assert choice() == 0


# -- end to end on the bundled model (specs/tiny-code-speculation.yaml) ----------------------------

@pytest.fixture(scope="module")
def plain(speculation_engine):
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    with LLM(speculation_engine, backend="onnxruntime", speculation=()) as llm:
        return [c.token_ids for c in llm.generate(PROMPTS, params)]


@pytest.mark.parametrize("sources", [(Source.prompt_lookup,), (Source.suffix,)], ids=lambda s: s[0].value)
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_output_is_plain_decodings_for_every_source(speculation_engine, plain, sources, batch):
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    with LLM(speculation_engine, backend="onnxruntime", speculation=sources, speculation_mode=ALWAYS) as llm:
        got = [c for i in range(0, len(PROMPTS), batch) for c in llm.generate(PROMPTS[i:i + batch], params)]
        stats = llm.speculation.stats
    assert [c.token_ids for c in got] == plain
    # The bundled model repeats itself ("if path is None: return path" ...): those runs are drafted.
    assert stats.source_rows[sources[0].value] > 0 and sum(c.accepted_tokens for c in got) >= 20
    assert min(c.decode_steps for c in got) < 40


def test_adaptive_mixed_batch_and_streaming_match_plain(speculation_engine, plain):
    """One batch: a request per source, one with none, the engine's default; streamed too."""
    choices = [None, (), (Source.suffix,), (Source.prompt_lookup,)]
    params = [SamplingParams(max_tokens=48, ignore_eos=True, speculation=c) for c in choices]
    with LLM(speculation_engine, backend="onnxruntime") as llm:   # adaptive, the engine dir's sources
        assert llm.speculation.sources == (Source.prompt_lookup, Source.suffix)
        got = llm.generate(PROMPTS, params)
        pieces = list(llm.stream(PROMPTS[3], params[0]))
    assert [c.token_ids for c in got] == plain
    assert pieces[-1].completion.token_ids == plain[3] and "".join(d.text for d in pieces) == got[3].text
    assert got[1].accepted_tokens == 0   # speculation=(): never drafted for


def test_always_mixed_batch_verifies_chains_beside_plain_rows(speculation_engine, plain):
    choices = [(Source.prompt_lookup,), (), (Source.suffix,), ()]
    params = [SamplingParams(max_tokens=48, ignore_eos=True, speculation=c) for c in choices]
    with LLM(speculation_engine, backend="onnxruntime", speculation_mode=ALWAYS) as llm:
        got = llm.generate(PROMPTS, params)
        verified = llm.speculation.stats.verify_steps
    assert [c.token_ids for c in got] == plain and verified > 0
    assert got[0].accepted_tokens > 0 and got[1].accepted_tokens == got[3].accepted_tokens == 0


def test_stop_string_inside_an_accepted_run(speculation_engine, plain):
    with LLM(speculation_engine, backend="onnxruntime", speculation=()) as llm:
        full = llm.generate([PROMPTS[3]], SamplingParams(max_tokens=48, ignore_eos=True))[0].text
    # The model's output repeats a clause: the stop's second half lies in a drafted run.
    stop = "path\n    if path is None:\n        return path\n    if"
    assert stop in full
    params = SamplingParams(max_tokens=48, ignore_eos=True, stop=(stop,))
    with LLM(speculation_engine, backend="onnxruntime", speculation=(Source.prompt_lookup,),
             speculation_mode=ALWAYS) as llm:
        got = llm.generate([PROMPTS[3]], params)[0]
    assert got.text == full[:full.index(stop)] and got.finish_reason == "stop" and got.accepted_tokens > 0


def test_max_tokens_and_eos_end_inside_a_run(speculation_engine, plain):
    with LLM(speculation_engine, backend="onnxruntime", speculation=(Source.prompt_lookup,),
             speculation_mode=ALWAYS) as llm:
        got = llm.generate([PROMPTS[3]], SamplingParams(max_tokens=37, ignore_eos=True))[0]
    assert got.token_ids == plain[3][:37] and got.finish_reason == "length"


def test_requests_and_llms_asking_for_what_is_not_served_are_refused(speculation_engine, tiny_engine):
    with LLM(speculation_engine, backend="onnxruntime", speculation=(Source.prompt_lookup,),
             speculation_mode=ALWAYS) as llm:
        with pytest.raises(ValueError, match="speculation: suffix is not served by this engine"):
            llm.generate(["x"], SamplingParams(max_tokens=2, speculation=(Source.suffix,)))
    with pytest.raises(ValueError, match="speculation medusa: .* without Medusa heads"):
        LLM(speculation_engine, backend="onnxruntime", speculation=(Source.medusa,))
    with pytest.raises(ValueError, match="without a verification path"):
        LLM(tiny_engine, backend="onnxruntime", speculation=(Source.prompt_lookup,))
    with pytest.raises(ValueError, match="speculation must be None or a tuple of Source"):
        SamplingParams(speculation=("prompt_lookup",))


def test_cli_run_takes_speculation_and_refuses_unknown_sources(speculation_engine, plain):
    import subprocess
    import sys

    run = [sys.executable, "-m", "trtbuild.cli", "run", str(speculation_engine), "--prompt", PROMPTS[0],
           "--max-tokens", "48", "--temperature", "0", "--json"]
    ok = subprocess.run([*run, "--speculation", "prompt_lookup,suffix", "--speculation-mode", "always"],
                        capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    import json
    assert json.loads(ok.stdout)["token_ids"][:16] == plain[0][:16]
    bad = subprocess.run([*run, "--speculation", "ngram"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--speculation" in bad.stderr and "prompt_lookup" in bad.stderr
    # A tree width for an engine dir without a draft head: one line, exit 2.
    wide = subprocess.run([*run, "--draft-tree-width", "2"], capture_output=True, text=True)
    assert wide.returncode == 2 and wide.stderr.count("\n") == 1, wide.stderr
    assert "draft_tree_width 2: " in wide.stderr and "built without a draft head" in wide.stderr


def test_server_speculation_field_and_usage(speculation_engine, tmp_path):
    import httpx

    from serving import served

    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 32, "temperature": 0, "ignore_eos": True}
    with served(speculation_engine, tmp_path / "serve.log", "--speculation-mode", "always") as running:
        drafted = httpx.post(f"{running.base}/v1/completions", json=body, timeout=60).json()
        off = httpx.post(f"{running.base}/v1/completions", json={**body, "speculation": []}, timeout=60).json()
        bad = httpx.post(f"{running.base}/v1/completions", json={**body, "speculation": ["ngram"]}, timeout=60)
    assert drafted["choices"][0]["text"] == off["choices"][0]["text"]
    assert drafted["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] > 0
    assert off["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] == 0
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "speculation"


def test_a_planted_acceptance_bug_is_caught(speculation_engine, plain, monkeypatch):
    """Accepting one guess past the model's agreement changes the output: the identity tests
    above would fail on such a bug."""
    from trtbuild.runtime import engine_core
    from trtbuild.runtime.core.tree import Accepted

    def one_too_many(tree, tokens, logits):
        path = accept_greedy(tree, tokens, logits)
        after = tree.children[path.last_node]
        return Accepted(path.nodes + after[:1], path.tokens + tuple(tokens[n] for n in after[:1]))

    monkeypatch.setattr(engine_core, "accept_greedy", one_too_many)
    with LLM(speculation_engine, backend="onnxruntime", speculation=(Source.prompt_lookup,),
             speculation_mode=ALWAYS) as llm:
        got = llm.generate(PROMPTS, SamplingParams(max_tokens=48, ignore_eos=True))
    assert [c.token_ids for c in got] != plain


@pytest.mark.parametrize("source", [Source.prompt_lookup, Source.suffix], ids=lambda s: s.value)
def test_real_model_greedy_output_is_plain_decodings(smollm2_engine, source):
    """SmolLM2-135M-Instruct asked to repeat a function with a small change: the drafts are
    mostly kept, and the tokens are plain decoding's."""
    from trtbuild.runtime.server.chat import chat_template

    code = BODY.replace("values", "xs")
    messages = [[{"role": "user", "content": f"Rewrite this function with the variable total renamed to acc:\n\n{code}"}],
                [{"role": "user", "content": "Name three colours."}]]
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    outputs = {}
    for name, sources in (("plain", ()), ("drafted", (source,))):
        with LLM(smollm2_engine, backend="onnxruntime", speculation=sources, speculation_mode=ALWAYS) as llm:
            template = chat_template(llm.engine_dir)
            outputs[name] = llm.generate([template.render(m) for m in messages], params)
    assert [c.token_ids for c in outputs["drafted"]] == [c.token_ids for c in outputs["plain"]]
    assert outputs["drafted"][0].accepted_tokens >= 8   # its preamble is not in the prompt; the code is


def test_constrained_requests_accept_only_what_the_grammar_allows(speculation_engine):
    """A chain's tokens walk the grammar's masks: acceptance stops at a token it refuses, so
    greedy constrained output is plain decoding's; sampled constrained output still matches."""
    import re

    from trtbuild.runtime.structured.constraint import Regex

    pattern = r"(ab|cd)( (ab|cd)){11,15}\."
    params = [SamplingParams(max_tokens=48, constraint=Regex(pattern)), SamplingParams(max_tokens=48)]
    prompts = ["# pairs: ab cd ab cd ab cd ab cd ab cd ab cd\npairs = '", PROMPTS[3]]
    with LLM(speculation_engine, backend="onnxruntime", speculation=(), multi_step=1) as llm:
        expected = [c.token_ids for c in llm.generate(prompts, params)]
    with LLM(speculation_engine, backend="onnxruntime", speculation=(Source.prompt_lookup,),
             speculation_mode=ALWAYS, multi_step=1) as llm:
        got = llm.generate(prompts, params)
        sampled = llm.generate(prompts[:1] * 6, [SamplingParams(max_tokens=48, temperature=0.8, seed=s,
                                                                constraint=Regex(pattern)) for s in range(6)])
    assert [c.token_ids for c in got] == expected and re.fullmatch(pattern, got[0].text)
    assert got[0].accepted_tokens > 0
    assert all(re.fullmatch(pattern, c.text) for c in sampled)

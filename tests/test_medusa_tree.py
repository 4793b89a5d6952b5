"""Medusa trees, acceptance, verification-step arrays and the scheduler's handling of them:
exact asserts, no engine."""
from __future__ import annotations

import re

import numpy as np
import pytest

from trtbuild.builder.medusa.tree import default_tree, ordered, rank_accuracy
from trtbuild.contract.medusa_acceptance import tree_problem
from trtbuild.runtime.core.engine import step_arrays
from trtbuild.runtime.core.tree import Accepted, Tree
from trtbuild.runtime.speculation.medusa import accept_greedy, accept_sampled, candidates
from trtbuild.runtime.core.kv_pools import HostPools, PoolShape
from trtbuild.runtime.core.sampling import Sampler, SamplingParams
from trtbuild.runtime.core.scheduler import Draft, Phase, Request, Scheduler
from trtbuild.runtime.core.step import KeepPath, StepKind
from trtbuild.contract.speculation import Source
from trtbuild.runtime.speculation.acceptance import AcceptanceModel, SpeculationStats
from trtbuild.runtime.speculation.adaptive import EXPLORE_AFTER, AdaptivePolicy
from trtbuild.runtime.speculation.step_times import StepTimes
from trtbuild.runtime.speculation.trees import MedusaTrees

TREE = Tree(((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)))  # nodes 1..6


def onehot(vocab: int, *tokens: int) -> np.ndarray:
    rows = np.zeros((len(tokens), vocab), np.float32)
    rows[np.arange(len(tokens)), tokens] = 1.0
    return rows


def test_tree_structure():
    assert TREE.size == 7 and TREE.depth == 3
    assert TREE.parents == (-1, 0, 0, 1, 1, 2, 3)
    assert TREE.depths.tolist() == [0, 1, 1, 2, 2, 2, 3]
    assert TREE.children == ((1, 2), (3, 4), (5,), (6,), (), (), ())
    assert TREE.top_k == (2, 2, 1)
    # row i: node i sees itself and its ancestors
    assert TREE.ancestors.astype(int).tolist() == [
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0, 0],
        [1, 1, 0, 1, 0, 0, 0],
        [1, 1, 0, 0, 1, 0, 0],
        [1, 0, 1, 0, 0, 1, 0],
        [1, 1, 0, 1, 0, 0, 1]]
    assert TREE.prefix(2).choices == ((0,), (1,))


@pytest.mark.parametrize("choices, message", [
    (((0, 0), (0,)), "tree choice [0, 0] comes before its parent [0]"),
    (((0, 0),), "tree choice [0, 0] has no parent [0] in the tree"),
    (((0,), (0,)), "twice"),
    (((),), "non-empty"),
    (((0,), (-1,)), "ranks ≥ 0"),
])
def test_tree_refuses_malformed_choices(choices, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        Tree(choices)


@pytest.mark.parametrize("k", [1, 2, 5, 16, 17, 40])
def test_top_k_ranks_like_a_full_sort_ties_by_lower_index(k):
    from trtbuild.runtime.speculation.medusa import ARGMAX_TOP_K, _top_k

    rng = np.random.default_rng(k)
    tied = rng.integers(0, 5, 4096).astype(np.float32)  # many ties: exact order where k argmaxes rank them
    for logits in (rng.standard_normal(4096).astype(np.float32), *((tied,) if k <= ARGMAX_TOP_K else ())):
        expected = np.lexsort((np.arange(4096), -logits))[:k]  # descending, lower index first
        assert _top_k(logits, k).tolist() == expected.tolist()
        assert logits.shape == (4096,) and np.isfinite(logits).all()  # the caller's logits are left as they were


def test_candidates_take_each_heads_ranked_guesses():
    medusa = np.array([[0.1, 0.9, 0.5, 0.0],     # head 0: ranks → tokens 1, 2
                       [0.7, 0.0, 0.0, 0.8],     # head 1: 3, 0
                       [0.0, 0.0, 1.0, 0.0]])    # head 2: 2
    assert candidates(TREE, 9, medusa) == [9, 1, 2, 3, 0, 3, 2]


def test_greedy_acceptance_walks_the_longest_agreeing_path():
    tokens = [9, 1, 2, 3, 0, 3, 2]
    # base argmax after: root → 1 (node 1), node 1 → 0 (node 4), node 4 → 3 (no child): stop
    logits = onehot(10, 1, 0, 5, 5, 3, 5, 5)
    assert accept_greedy(TREE, tokens, logits) == Accepted(nodes=(1, 4), tokens=(1, 0))
    # root's argmax 7 matches no child: nothing accepted, the bonus is 7
    assert accept_greedy(TREE, tokens, onehot(10, 7, 0, 0, 0, 0, 0, 0)) == Accepted((), ())
    # the full depth-3 chain 1 → 3 → 2
    assert accept_greedy(TREE, tokens, onehot(10, 1, 3, 5, 2, 5, 5, 5)).nodes == (1, 3, 6)
    assert Accepted((1, 3, 6), (1, 3, 2)).last_node == 6 and Accepted((), ()).last_node == 0


def test_sampled_acceptance_follows_the_seeded_tokens_through_a_tree():
    """Temperature 1 over rows that favour the tree's tokens: for 300 seeds the walk takes a child
    exactly when the request's seeded token at that position (plain sampling's) is the child's,
    and stops where that token is no child's; both root children, and depth 3, are reached."""
    tokens = [9, 1, 2, 3, 0, 3, 2]
    logits = np.zeros((7, 10))
    logits[0, 1], logits[0, 2] = 1.5, 1.0    # root: children 1 and 2 likely, nothing sure
    logits[1, 3], logits[1, 0] = 1.5, 1.0
    logits[2, 3] = logits[3, 2] = 2.0
    reached = set()
    for seed in range(300):
        sampler = Sampler(SamplingParams(temperature=1.0, seed=seed))
        path = accept_sampled(TREE, tokens, logits, sampler, 10)
        node = 0
        for depth, child in enumerate(path.nodes):
            assert TREE.parents[child] == node and tokens[child] == sampler.sample(logits[node], 10 + depth)[0]
            node = child
        end = sampler.sample(logits[node], 10 + len(path.nodes))[0]
        assert end not in [tokens[c] for c in TREE.children[node]]
        reached.update(path.nodes)
    assert {1, 2, 6} <= reached


def test_verification_step_arrays():
    tree = Tree(((0,), (1,), (0, 0)))
    sched = Scheduler(capacity=2, max_seq_len=16, max_chunk=8)
    for rid, prompt in (("a", [5, 6, 7]), ("b", [8])):
        sched.add(Request(rid, prompt, SamplingParams(max_tokens=4)))
    step = sched.schedule().step
    sched.commit(step, {"a": 1, "b": 2})
    sched.requests["a"].draft = Draft(tree, (11, 12, 13))
    step = sched.schedule().step
    assert step.kind == StepKind.decode and step.verifies
    assert step.tokens == ((1, 11, 12, 13), (2,)) and step.starts == (3, 1)
    arrays = step_arrays(step, max_seq_len=16)
    assert arrays.position_ids.tolist() == [[3, 4, 4, 5], [1, 2, 3, 4]]  # tree depths; b continues
    assert arrays.write_index.tolist() == [3, 1] and arrays.kv_length.tolist() == [7, 2]
    assert arrays.logits_index.tolist() == [[0, 1, 2, 3], [0, 1, 2, 3]]
    mask = arrays.attention_mask[0, 0, :, :8].astype(int).tolist()
    assert mask == [[1, 1, 1, 1, 0, 0, 0, 0],
                    [1, 1, 1, 1, 1, 0, 0, 0],
                    [1, 1, 1, 1, 0, 1, 0, 0],
                    [1, 1, 1, 1, 1, 0, 1, 0]]
    assert arrays.attention_mask[1, 0, 0, :4].astype(int).tolist() == [1, 1, 0, 0]


def test_commit_keeps_the_accepted_path_and_moves_its_kv():
    tree = Tree(((0,), (1,), (1, 0)))
    sched = Scheduler(capacity=2, max_seq_len=32, max_chunk=8)
    sched.add(Request("a", [5, 6, 7], SamplingParams(max_tokens=10)))
    sched.commit(sched.schedule().step, {"a": 1})
    sched.requests["a"].draft = Draft(tree, (11, 12, 13))
    step = sched.schedule().step
    # node 2 (token 12) then node 3 (token 13) accepted; the bonus token is 20
    emitted = sched.commit(step, {"a": 20}, {"a": Accepted((2, 3), (12, 13))})
    request = sched.requests["a"]
    assert [t for _, t in emitted] == [12, 13, 20]
    assert request.output == [1, 12, 13, 20] and request.computed == 3 + 3 and request.draft is None
    plan = sched.schedule()
    assert plan.ops == [KeepPath(slot=0, start=3, nodes=(2, 3))]
    assert plan.step.tokens == ((20,),) and plan.step.starts == (6,) and not plan.step.verifies


def test_path_already_in_place_needs_no_move_and_eos_ends_mid_path():
    tree = Tree(((0,), (0, 0)))
    sched = Scheduler(capacity=1, max_seq_len=32, max_chunk=8, eos_token_ids=(0,))
    sched.add(Request("a", [5], SamplingParams(max_tokens=10)))
    sched.commit(sched.schedule().step, {"a": 1})
    sched.requests["a"].draft = Draft(tree, (7, 0))
    step = sched.schedule().step
    emitted = sched.commit(step, {"a": 9}, {"a": Accepted((1, 2), (7, 0))})
    assert [t for _, t in emitted] == [7, 0]  # eos accepted: the bonus token is dropped
    request = sched.pop_finished()[0]
    assert request.finish_reason == "stop" and request.output == [1, 7, 0]


def test_near_max_seq_len_the_batch_decodes_plainly():
    tree = Tree(((0,), (0, 0), (0, 0, 0)))
    sched = Scheduler(capacity=2, max_seq_len=12, max_chunk=8)
    sched.add(Request("a", [1] * 6, SamplingParams(max_tokens=6)))
    sched.add(Request("b", [2] * 2, SamplingParams(max_tokens=4)))
    step = sched.schedule().step
    sched.commit(step, {"a": 3, "b": 4})
    for rid in "ab":
        sched.requests[rid].draft = Draft(tree, (5, 6, 7))
    sched.requests["a"].computed = 9  # 9 + 4 tree tokens > 12: nobody verifies this step
    step = sched.schedule().step
    assert not step.verifies and step.tokens == ((3,), (4,))
    assert sched.requests["a"].phase == Phase.decoding


def test_keep_path_moves_kv_positions_in_order():
    pools = HostPools(PoolShape(num_layers=1, capacity=2, num_kv_heads=1, max_seq_len=10, head_dim=1,
                                dtype=np.dtype(np.float32), prefix_blocks=0, block_size=4))
    pool = pools.pools["key_0"]  # [slots, H, S_max, D]
    pool[:] = np.arange(2 * 1 * 10 * 1, dtype=np.float32).reshape(2, 1, 10, 1)
    pools.keep_path(slot=1, start=2, nodes=(2, 5))
    assert pool[1, 0, :, 0].tolist() == [10, 11, 12, 14, 17, 15, 16, 17, 18, 19]
    assert pool[0, 0, :, 0].tolist() == list(range(10))


def _medusa_policy(tree: Tree, acceptance: AcceptanceModel, times: StepTimes,
                   fixed: int | None = None) -> tuple[MedusaTrees, AdaptivePolicy]:
    stats = SpeculationStats()
    trees = MedusaTrees(tree, acceptance, stats, fixed)
    return trees, AdaptivePolicy(times, {Source.medusa: trees}, stats)


def _tree_size(tree: Tree, acceptance: AcceptanceModel, times: StepTimes, fixed: int | None = None) -> int:
    """The tree prefix the policy verifies for one row at batch 1 (0: plain)."""
    trees, policy = _medusa_policy(tree, acceptance, times, fixed)
    return policy.choose(1, {"a": [trees.candidate()]}).seq - 1


def test_policy_speculates_only_when_it_pays():
    tree = Tree(((0,), (0, 0), (0, 0, 0), (1,)))
    acceptance = AcceptanceModel([[0.6, 0.2], [0.6, 0.2], [0.6, 0.2]])
    assert acceptance.expected_accepted(tree).round(3).tolist() == [0.0, 0.6, 0.96, 1.176, 1.376]
    flat, steep = StepTimes(), StepTimes()
    for seq in (1, 2, 3, 4, 5):
        flat.observe(1, seq, 0.010)            # bandwidth-bound: more tokens cost nothing
        steep.observe(1, seq, 0.010 * seq)     # compute-bound: cost grows with tokens
    assert _tree_size(tree, acceptance, flat) == 4
    assert _tree_size(tree, acceptance, steep) == 0
    assert _tree_size(tree, acceptance, steep, fixed=2) == 2
    assert MedusaTrees(tree, acceptance, SpeculationStats(), fixed=0).candidate() is None
    with pytest.raises(ValueError, match="valid 0"):
        MedusaTrees(tree, acceptance, SpeculationStats(), fixed=5)


def test_policy_compares_a_tree_with_what_a_multi_step_run_costs():
    tree = Tree(((0,), (0, 0), (0, 0, 0), (1,)))
    acceptance = AcceptanceModel([[0.6, 0.2], [0.6, 0.2], [0.6, 0.2]])  # E[accepted] with 4 choices: 1.376
    cheap_runs, dear_runs = StepTimes(), StepTimes()
    for times in (cheap_runs, dear_runs):
        for seq in (1, 2, 3, 4, 5):
            times.observe(1, seq, 0.010)  # flat: against single plain steps a tree of 4 pays 2.4x
    cheap_runs.observe_run(1, 8, 8 * 0.004)   # but a run's step costs 4 ms: 250 tok/s > 2.376 / 10 ms
    dear_runs.observe_run(1, 8, 8 * 0.007)    # 143 tok/s: the tree still pays by more than MIN_GAIN
    assert cheap_runs.plain_estimate(1) == 0.004 and dear_runs.plain_estimate(1) == 0.007
    assert cheap_runs.plain_estimate(4) == 4 * 0.004  # beyond the measured batches rows scale time
    assert _tree_size(tree, acceptance, cheap_runs) == 0
    assert _tree_size(tree, acceptance, dear_runs) == 4


def test_policy_standing_aside_explores_within_its_time_budget_and_takes_a_tree_when_it_pays():
    """Times exact in binary: plain steps of 2^-7 s, verifications measured in a slow spell at 2^-3 s."""
    tree = Tree(((0,), (0, 0), (0, 0, 0), (1,)))
    acceptance = AcceptanceModel([[0.6, 0.2], [0.6, 0.2], [0.6, 0.2]])
    times = StepTimes()
    times.observe(1, 1, 2 ** -7)
    for seq in (2, 3, 4, 5):
        times.observe(1, seq, 2 ** -3)  # no tree pays
    times.observe(1, 2, 0.150)
    trees, policy = _medusa_policy(tree, acceptance, times)
    one = {"a": [trees.candidate()]}
    assert policy.choose(1, one).seq == 1
    # The likeliest-to-pay tree (all 4 choices: 2.376 tokens / 2^-3 s) costs 2^-3 s to verify: it is
    # explored once plain decoding since the source last verified took EXPLORE_AFTER × 2^-3 s.
    assert EXPLORE_AFTER == 100
    budget_steps = 1600  # 100 × 2^-3 s in plain steps of 2^-7 s
    policy.stood_aside(1, budget_steps - 1)
    assert policy.choose(1, one).seq == 1
    policy.stood_aside(1, 1)
    # Asking (the step before: compute the heads?) does not spend it; choosing does, then plain again.
    assert [policy.decide(1, one).seq, policy.choose(1, one).seq, policy.choose(1, one).seq] == [5, 5, 1]
    assert policy.stats.plain_steps == budget_steps
    # Another batch size keeps its own budget: none spent there yet.
    assert policy.choose(2, {"a": [trees.candidate()], "b": [trees.candidate()]}).seq == 1
    for _ in range(3):
        times.observe(1, 5, 0.012)  # that verification and others measured now: the tree pays
    assert policy.choose(1, one).seq == 5


def test_acceptance_model_learns_from_verifications():
    tree = Tree(((0,), (0, 0)))
    model = AcceptanceModel([[0.5], [0.5]])
    for _ in range(200):
        model.record(tree, Accepted((1,), (3,)))  # head 0 always right, head 1 always wrong
    assert model.probability(0, 0) > 0.95 and model.probability(1, 0) < 0.05
    _, policy = _medusa_policy(tree, AcceptanceModel([[0.5], [0.5]]), StepTimes())
    draft = Draft(tree, (3, 4), Source.medusa)
    for _ in range(3):
        policy.record("a", draft, Accepted((1, 2), (3, 4)))
    policy.record("a", draft, Accepted((), ()))
    assert policy.stats.head_tried == [4, 3] and policy.stats.head_accepted == [3, 3]
    assert policy.stats.mean_accepted_per_step == 1 + 6 / 4


def test_default_tree_is_grown_likeliest_first():
    accuracy = rank_accuracy(((0.6, 0.7), (0.5, 0.6)), 2)  # exact-rank: [0.6, 0.1], [0.5, 0.1]
    assert [[round(p, 3) for p in row] for row in accuracy] == [[0.6, 0.1], [0.5, 0.1]]
    tree = default_tree(accuracy, 4)
    assert tree == ((0,), (0, 0), (1,), (0, 1))  # 0.6, 0.3, 0.1, 0.06
    assert ordered(((1,), (0, 1), (0,), (0, 0)), accuracy) == tree
    assert Tree(default_tree(rank_accuracy(None, 4), 63)).size == 64  # generic prior for public heads


@pytest.mark.parametrize("tree, message", [
    (((0,), (0, 0, 0)), "no parent"),
    (((0,), (0,)), "twice"),
    (((0, 0, 0, 0, 0),), "num_heads=4"),
    (((0,), (-2,)), "negative"),
])
def test_tree_problem_messages(tree, message):
    assert message in tree_problem(tree, 4)


def test_the_build_takes_a_tree_in_any_order_the_runtime_parents_first():
    tree = ((0, 0), (0,))
    assert tree_problem(tree, 4) is None and "comes before its parent" in tree_problem(tree, 4, parents_first=True)
    assert tree_problem(((0,), (0, 0)), 4, parents_first=True) is None

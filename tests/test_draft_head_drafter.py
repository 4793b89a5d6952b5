"""The draft head's runtime drafter against a pure-torch reference: DraftHead.forward run
autoregressively over the same features and tokens, its own hidden state as the next feature."""
import numpy as np
import pytest
import torch

from trtbuild.builder.draft_head.cpu_graph import draft_cpu_graph
from trtbuild.builder.draft_head.export import export_draft_graph
from trtbuild.builder.draft_head.model import random_draft_head
from trtbuild.contract.draft_head import DraftHeadConfig, DraftLayerShape
from trtbuild.runtime.core.sampling import Sampler, SamplingParams
from trtbuild.runtime.speculation.draft_head import DraftHeadDrafter, Observation
from trtbuild.runtime.speculation.full_sampling import accept_sampled_full, draft_uniforms

HIDDEN, TARGET_VOCAB, DRAFT_VOCAB, MAX_SEQ = 32, 64, 24, 48
KV_TOLERANCE = 1e-5  # max abs difference of the draft's K/V fed the same history in other pieces


@pytest.fixture(scope="module", params=["draft.onnx", "draft.cpu.onnx"])
def draft_graph(request, tmp_path_factory):
    """The draft and its graph in both forms; the CPU form folds at most 2 rows a run, so the
    3-row tests also cover a step split into runs."""
    config = DraftHeadConfig(taps=(0, 1, 2), target_vocab_size=TARGET_VOCAB, target_num_layers=4,
                             draft_vocab_size=DRAFT_VOCAB,
                             layer=DraftLayerShape(hidden_size=HIDDEN, intermediate_size=64, num_heads=4,
                                                   num_kv_heads=2, head_dim=8, rms_norm_eps=1e-5,
                                                   rope_theta=10000.0))
    draft = random_draft_head(config, std=0.3)
    path = export_draft_graph(draft, MAX_SEQ, max_batch=4, max_step_tokens=16,
                              path=tmp_path_factory.mktemp("draft") / "draft.onnx")
    return draft, (path if request.param == "draft.onnx" else draft_cpu_graph(path, rows=2))


def drafter(draft_graph, capacity=4) -> DraftHeadDrafter:
    draft, path = draft_graph
    return DraftHeadDrafter(path, draft.draft_to_target.numpy(), MAX_SEQ, capacity)


def history(seed: int, length: int):
    """A request's target features at positions 0..length−1 and tokens at 1..length."""
    rng = np.random.default_rng(seed)
    return rng.normal(0, 1, (length, HIDDEN)).astype(np.float32), rng.integers(0, TARGET_VOCAB, length).tolist()


def reference_chain(draft, features, tokens, start, k) -> list[int]:
    """Greedy chain of ``k`` from the draft having seen positions start.. (features, tokens),
    recomputing the whole sequence per token with the training forward."""
    mapping = draft.draft_to_target
    feats, toks, chain = torch.tensor(features), torch.tensor(tokens), []
    with torch.no_grad():
        for _ in range(k):
            seq = len(toks)
            positions = torch.arange(start, start + seq)[None]
            mask = torch.ones(seq, seq, dtype=torch.bool).tril()[None, None]
            logits, hidden, _ = draft(toks[None], feats[None], positions, mask)
            token = int(mapping[int(logits[0, -1].argmax())])
            chain.append(token)
            toks = torch.cat((toks, torch.tensor([token])))
            feats = torch.cat((feats, hidden[0, -1:]))
    return chain


def test_chain_equals_the_reference_batch_1(draft_graph):
    features, tokens = history(1, 9)
    d = drafter(draft_graph)
    d.observe([Observation("a", 0, features, tokens)])
    chain = d.propose(["a"], 5)["a"]
    assert list(chain.tokens) == reference_chain(draft_graph[0], features, tokens, 0, 5)
    assert len(chain.probabilities) == 5 and all(0 < p <= 1 for p in chain.probabilities)
    assert d.seconds_per_token > 0 and d.observe_seconds > 0


def test_runners_up_are_the_next_ranks_of_each_depths_distribution(draft_graph):
    """width 3: the chain is width 1's, and beside each of its tokens the draft's second and third
    likeliest ids at that depth (target ids, their probabilities), read off the same run's q. A
    chain drawn from q has no runners-up: refused."""
    d = drafter(draft_graph)
    for rid, seed in (("a", 5), ("b", 6)):
        d.observe([Observation(rid, 0, *history(seed, 7))])
    chains = d.propose(["a", "b"], 4)
    wide = d.propose(["a", "b"], 4, with_distributions=True, width=3)
    for rid in "ab":
        assert wide[rid].tokens == chains[rid].tokens and chains[rid].alternatives == ()
        assert len(wide[rid].alternatives) == 4
        for depth, q in enumerate(wide[rid].distributions):
            order = np.argsort(-q, kind="stable")[:3]
            assert int(d.draft_to_target[order[0]]) == wide[rid].tokens[depth]
            assert wide[rid].alternatives[depth] == tuple((int(d.draft_to_target[t]), float(q[t])) for t in order[1:])
    with pytest.raises(ValueError, match="width 2: a chain drawn from q has no runners-up"):
        d.propose(["a"], 2, uniforms=np.full((1, 2), 0.5), width=2)
    with pytest.raises(ValueError, match="width 0: valid 1 to the draft's vocabulary"):
        d.propose(["a"], 2, width=0)


def test_chain_equals_the_reference_batch_3_of_different_lengths(draft_graph):
    d = drafter(draft_graph)
    lengths = {"a": 5, "b": 11, "c": 1}
    histories = {rid: history(i + 10, n) for i, (rid, n) in enumerate(lengths.items())}
    d.observe([Observation(rid, 0, *histories[rid]) for rid in lengths])  # one padded run
    chains = d.propose(list(lengths), 4)
    for rid in lengths:
        assert list(chains[rid].tokens) == reference_chain(draft_graph[0], *histories[rid], 0, 4), rid
    # Step by step too: each row observes a different number of new positions in one call.
    more = {rid: history(i + 20, n) for i, (rid, n) in enumerate({"a": 3, "b": 1, "c": 2}.items())}
    d.observe([Observation(rid, lengths[rid], *more[rid]) for rid in lengths])
    chains = d.propose(list(lengths), 3)
    for rid in lengths:
        features = np.concatenate((histories[rid][0], more[rid][0]))
        tokens = histories[rid][1] + more[rid][1]
        assert list(chains[rid].tokens) == reference_chain(draft_graph[0], features, tokens, 0, 3), rid
    # Rows out of slot order (their caches gathered, not a view of the pool) draft the same.
    assert {rid: c.tokens for rid, c in d.propose(["c", "a"], 3).items()} == \
        {rid: chains[rid].tokens for rid in ("c", "a")}


def test_a_chain_stops_where_another_token_is_not_worth_drafting(draft_graph):
    """``worth_more`` sees each row's probabilities so far; a row it refuses stops, the others go on
    and draft the same tokens as without it (the prefix of the full chains)."""
    d = drafter(draft_graph)
    for i, rid in enumerate("abc"):
        d.observe([Observation(rid, 0, *history(i + 40, 6 + i))])
    full = d.propose(["a", "b", "c"], 5)
    seen = []
    stop_b = lambda probs: (seen.append(tuple(probs)), probs != list(full["b"].probabilities[:2]))[1]  # noqa: E731
    cut = d.propose(["a", "b", "c"], 5, worth_more=stop_b)
    assert {rid: len(c.tokens) for rid, c in cut.items()} == {"a": 5, "b": 2, "c": 5}
    for rid in "abc":
        assert cut[rid].tokens == full[rid].tokens[:len(cut[rid].tokens)], rid
    # Asked after each drafted token but the last: a, b, c at depths 1 and 2, then a and c at 3 and 4.
    assert len(seen) == 3 + 3 + 2 + 2
    assert d.propose(["a"], 5, worth_more=lambda probs: False)["a"].tokens == full["a"].tokens[:1]


def test_the_draft_head_source_cuts_the_chains_that_cannot_pay(draft_graph):
    """Through DraftHeadSource.draft: with a plain row's seconds given, a row whose first token's
    calibrated probability is below (a run's seconds a row) / (a row's plain seconds) gets a
    chain of one token, the others two (a fresh source reaches two deep); without them, or in
    always mode, every chain is drafted in full. Greedy and sampled rows alike."""
    from trtbuild.contract.speculation import Source
    from trtbuild.runtime.speculation.adaptive import SpeculationMode
    from trtbuild.runtime.speculation.draft_head_source import DraftHeadSource

    d = drafter(draft_graph)
    source = DraftHeadSource(d, 8, SpeculationMode.adaptive, width=1)
    for i, rid in enumerate("abcd"):
        d.observe([Observation(rid, 0, *history(i + 60, 5 + i))])
    samplers = {"c": Sampler(SamplingParams(temperature=1.0, seed=3)), "d": Sampler(SamplingParams(temperature=0.7))}
    rows = [(rid, 0, 8, samplers.get(rid)) for rid in "abcd"]
    full, _, _ = source.draft(rows)
    assert {rid: len(c.draft.tokens) for rid, c in full.items()} == dict.fromkeys("abcd", 2)
    first = {rid: source.model.probabilities(Source.draft_head, None, c.draft.stated[:1])[0] for rid, c in full.items()}
    floor = float(np.median(list(first.values())))
    d.seconds_per_row_run = 0.001
    cut, _, _ = source.draft(rows, row_seconds=0.001 / floor)
    assert {rid: len(c.draft.tokens) for rid, c in cut.items()} == {rid: 2 if p >= floor else 1 for rid, p in first.items()}
    assert 1 in {len(c.draft.tokens) for c in cut.values()}
    for rid, chain in cut.items():
        assert chain.draft.tokens == full[rid].draft.tokens[:len(chain.draft.tokens)], rid
        if rid in ("c", "d"):   # the sampled rows' q, one per drafted token
            assert chain.distributions.shape == (len(chain.draft.tokens), DRAFT_VOCAB)
    always = DraftHeadSource(d, 8, SpeculationMode.always, width=1)
    assert all(len(c.draft.tokens) == 8 for c in always.draft(rows, row_seconds=1e-9)[0].values())


def test_rollback_after_a_rejection(draft_graph):
    """Draft 4, then the target accepts 2 and samples 1: positions L−1, L, L+1 are observed with the
    target's features; the drafted scratch at L+2 is never read."""
    length = 8
    features, tokens = history(3, length)
    d = drafter(draft_graph)
    d.observe([Observation("a", 0, features, tokens)])
    drafted = d.propose(["a"], 4)["a"].tokens
    new_features, _ = history(4, 3)
    new_tokens = [drafted[0], drafted[1], (drafted[2] + 1) % TARGET_VOCAB]  # 2 accepted, 1 sampled
    d.observe([Observation("a", length, new_features, new_tokens)])
    all_features, all_tokens = np.concatenate((features, new_features)), tokens + new_tokens
    fresh = drafter(draft_graph)
    fresh.observe([Observation("a", 0, all_features, all_tokens)])
    committed = length + 3  # positions 0..committed−1 computed by the target
    for mine, theirs in zip(d.cache("a"), fresh.cache("a")):
        assert np.abs(mine[:, :committed] - theirs[:, :committed]).max() < KV_TOLERANCE
    assert d.propose(["a"], 4)["a"].tokens == fresh.propose(["a"], 4)["a"].tokens
    assert list(d.propose(["a"], 4)["a"].tokens) == reference_chain(draft_graph[0], all_features, all_tokens, 0, 4)
    # A rejection at the first draft: only the sampled token's position is observed.
    d.observe([Observation("a", committed, *history(5, 1))])
    reference = reference_chain(draft_graph[0], np.concatenate((all_features, history(5, 1)[0])),
                                all_tokens + history(5, 1)[1], 0, 3)
    assert list(d.propose(["a"], 3)["a"].tokens) == reference


def test_unseen_prefix_positions_are_masked_not_read_as_zeros(draft_graph):
    """A request whose first 6 positions came from a prefix cache: the draft sees only 6.. ."""
    features, tokens = history(6, 10)
    d = drafter(draft_graph)
    d.observe([Observation("a", 6, features[6:], tokens[6:])])
    assert list(d.propose(["a"], 4)["a"].tokens) == reference_chain(draft_graph[0], features[6:], tokens[6:], 6, 4)


def test_slot_reuse_after_close(draft_graph):
    d = drafter(draft_graph, capacity=1)
    d.observe([Observation("a", 0, *history(7, 12))])
    d.propose(["a"], 3)
    with pytest.raises(ValueError, match="all 1 draft slots are taken"):
        d.observe([Observation("b", 0, *history(8, 4))])
    d.close("a")
    # "b" gets a's slot; a's K/V there is stale, and "b" started at 2 never attends to 0..1.
    features, tokens = history(8, 5)
    d.observe([Observation("b", 2, features[2:], tokens[2:])])
    assert list(d.propose(["b"], 3)["b"].tokens) == reference_chain(draft_graph[0], features[2:], tokens[2:], 2, 3)


def test_distributions_and_sampled_drafts(draft_graph):
    d = drafter(draft_graph)
    d.observe([Observation("a", 0, *history(9, 6))])
    greedy = d.propose(["a"], 3, with_distributions=True)["a"]
    assert greedy.distributions.shape == (3, DRAFT_VOCAB)
    np.testing.assert_allclose(greedy.distributions.sum(1), 1, rtol=1e-9)
    mapping = draft_graph[0].draft_to_target.numpy()
    for row, token, prob in zip(greedy.distributions, greedy.tokens, greedy.probabilities):
        assert mapping[row.argmax()] == token and row.max() == prob
    # Drawn at uniforms: a uniform of 0 takes the first draft id with probability above 0.
    sampled = d.propose(["a"], 2, with_distributions=True, uniforms=np.zeros((1, 2)))["a"]
    assert sampled.tokens[0] == mapping[0]
    assert sampled.distributions.shape == (2, DRAFT_VOCAB)
    # The full-distribution rule takes the chain and its q over the draft's ids as they come.
    sampler = Sampler(SamplingParams(temperature=1.0, seed=3))
    uniforms = draft_uniforms(sampler, 0, 3)[None]
    chain = d.propose(["a"], 3, with_distributions=True, uniforms=uniforms)["a"]
    logits = np.random.default_rng(0).normal(0, 1, (4, TARGET_VOCAB))
    out = accept_sampled_full(chain.tokens, chain.distributions, logits, sampler, 0, q_ids=mapping)
    assert out.tokens == chain.tokens[:len(out.tokens)] and 0 <= out.next_token < TARGET_VOCAB


def test_bad_input(draft_graph):
    d = drafter(draft_graph)
    with pytest.raises(ValueError, match=rf"features have shape \[3, 16\]; \[n, {HIDDEN}\] expected"):
        d.observe([Observation("a", 0, np.zeros((3, 16), np.float32), [1, 2, 3])])
    with pytest.raises(ValueError, match="outside the cache"):
        d.observe([Observation("a", MAX_SEQ - 1, *history(1, 2))])
    with pytest.raises(ValueError, match="has not been observed"):
        d.propose(["nobody"], 2)
    d.observe([Observation("a", 0, *history(1, 2))])
    with pytest.raises(ValueError, match="repeat"):
        d.propose(["a", "a"], 2)
    with pytest.raises(ValueError, match=rf"draft_to_target has shape \[3\]; \[{DRAFT_VOCAB}\] expected"):
        DraftHeadDrafter(draft_graph[1], np.arange(3), MAX_SEQ, 2)


def test_long_catch_up_in_chunks_and_rows_at_the_cache_end(draft_graph):
    """A 20-position prompt observed in chunks of 6 beside a 2-position row that ends the cache
    (padding it to the chunk would run past S_max): both draft as the reference."""
    draft, path = draft_graph
    d = DraftHeadDrafter(path, draft.draft_to_target.numpy(), MAX_SEQ, 4, max_step_tokens=6)
    long_features, long_tokens = history(11, 20)
    end_features, end_tokens = history(12, MAX_SEQ - 1)
    d.observe([Observation("end", 0, end_features[:-2], end_tokens[:-2])])
    d.observe([Observation("long", 0, long_features, long_tokens),
               Observation("end", MAX_SEQ - 3, end_features[-2:], end_tokens[-2:])])
    assert list(d.propose(["long"], 3)["long"].tokens) == reference_chain(draft, long_features, long_tokens, 0, 3)
    # At the cache's end the chain stops where a draft step would write past it.
    assert list(d.propose(["end"], 3)["end"].tokens) == reference_chain(draft, end_features, end_tokens, 0, 2)
    with pytest.raises(ValueError, match="repeat"):
        d.observe([Observation("long", 20, *history(1, 1)), Observation("long", 21, *history(2, 1))])


def test_positions_skipped_over_are_masked_with_the_chain_drafted_there(draft_graph):
    """Observed 0..5, a chain drafted at 6..8, then 12..15 observed (6..11 never read): the draft
    attends to 0..5 and 12..15 only, as a drafter that never drafted there does (the chain's
    scratch at 6..8 is not read)."""
    features, tokens = history(20, 16)
    seen = drafter(draft_graph)
    seen.observe([Observation("a", 0, features[:6], tokens[:6])])
    seen.propose(["a"], 4)
    seen.observe([Observation("a", 12, features[12:], tokens[12:])])
    fresh = drafter(draft_graph)
    fresh.observe([Observation("a", 0, features[:6], tokens[:6])])
    fresh.observe([Observation("a", 12, features[12:], tokens[12:])])
    assert np.flatnonzero(seen.requests["a"].known).tolist() == [*range(6), *range(12, 16)]
    mine, theirs = (d.propose(["a"], 3, with_distributions=True)["a"] for d in (seen, fresh))
    assert mine.tokens == theirs.tokens
    np.testing.assert_allclose(mine.distributions, theirs.distributions, atol=1e-5)


def _source(draft_graph, window, capacity=4):
    from trtbuild.runtime.speculation.adaptive import SpeculationMode
    from trtbuild.runtime.speculation.draft_head_source import DraftHeadSource

    return DraftHeadSource(drafter(draft_graph, capacity), 3, SpeculationMode.always, window=window, width=1)


def test_the_source_reads_only_when_drafting_and_only_the_newest_window(draft_graph):
    """Steps' positions are held, not read; ``draft`` reads the newest 4 (the window) and drafts
    from them as a drafter that observed just those positions does."""
    features, tokens = history(21, 12)
    source = _source(draft_graph, window=4)
    source.hold(Observation("a", 0, features[:10], tokens[:10]))   # a prompt of 10
    source.hold(Observation("a", 10, features[10:11], tokens[10:11]))  # one decode step
    assert "a" not in source.drafter.requests  # nothing read yet
    assert source.in_sync("a", 11) and not source.in_sync("a", 10)
    chains, seconds, drafted = source.draft([("a", 0, 8, None)])
    read = source.drafter.requests["a"]
    assert read.last == 10 and np.flatnonzero(read.known[:11]).tolist() == [7, 8, 9, 10]  # 11.. : the chain's scratch
    fresh = drafter(draft_graph)
    fresh.observe([Observation("a", 7, features[7:11], tokens[7:11])])
    assert chains["a"].draft.tokens == fresh.propose(["a"], 3)["a"].tokens
    assert seconds > 0 and drafted == 3
    # The next step's position is held again; the read after it appends to what was read.
    source.hold(Observation("a", 11, features[11:12], tokens[11:12]))
    source.draft([("a", 0, 8, None)])
    assert read.last == 11 and np.flatnonzero(read.known[:12]).tolist() == [7, 8, 9, 10, 11]


def test_the_source_holds_a_restart_over_what_it_held_and_drops_what_a_gap_leaves(draft_graph):
    features, tokens = history(22, 12)
    other, _ = history(23, 12)
    source = _source(draft_graph, window=32)
    source.hold(Observation("a", 0, features[:6], tokens[:6]))
    source.hold(Observation("a", 3, other[3:8], tokens[3:8]))  # recomputed from 3: its features replace
    source.hold(Observation("b", 0, features[:4], tokens[:4]))
    source.hold(Observation("b", 8, features[8:10], tokens[8:10]))  # past a gap: 0..3 are dropped
    assert source.in_sync("a", 8) and source.in_sync("b", 10)
    chains, _, _ = source.draft([("a", 0, 8, None), ("b", 0, 8, None)])
    fresh = drafter(draft_graph)
    fresh.observe([Observation("a", 0, np.concatenate((features[:3], other[3:8])), tokens[:8]),
                   Observation("b", 8, features[8:10], tokens[8:10])])
    expected = fresh.propose(["a", "b"], 3)
    assert {rid: c.draft.tokens for rid, c in chains.items()} == {rid: c.tokens for rid, c in expected.items()}
    assert np.flatnonzero(source.drafter.requests["b"].known[:10]).tolist() == [8, 9]


def test_the_source_drafts_for_the_rows_it_has_slots_for(draft_graph):
    """One draft slot, two requests held: the first read gets a chain, the other none (no error)
    and keeps what is held; once the first closes, the other is read and drafted for, from every
    position it held, as a drafter that observed them does."""
    source = _source(draft_graph, window=32, capacity=1)
    for rid, seed in (("a", 24), ("b", 25)):
        source.hold(Observation(rid, 0, *history(seed, 5)))
    chains, _, _ = source.draft([("a", 0, 8, None), ("b", 0, 8, None)])
    assert list(chains) == ["a"]
    assert source.in_sync("b", 5)
    source.close("a", ())
    chains, _, _ = source.draft([("b", 0, 8, None)])
    fresh = drafter(draft_graph)
    fresh.observe([Observation("b", 0, *history(25, 5))])
    assert list(chains) == ["b"] and chains["b"].draft.tokens == fresh.propose(["b"], 3)["b"].tokens


def test_the_source_refuses_an_empty_window(draft_graph):
    with pytest.raises(ValueError, match="window 0: valid 1 or more"):
        _source(draft_graph, window=0)

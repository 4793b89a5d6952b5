"""Host draft sources (prompt lookup, suffix): exact proposals on hand-made token lists,
incremental indexing equal to indexing at once, the cross-request store's bound. No engine."""
from __future__ import annotations

import random

import numpy as np
import pytest

from trtbuild.contract.speculation import PromptLookupConfig, Source, SpeculationConfig, SuffixConfig
from trtbuild.runtime.speculation.sources import EMPTY, PromptLookupSource, Proposal, SuffixSource, sources_for
from trtbuild.runtime.speculation.sources.suffix_trie import SuffixTrie


def lookup(**settings) -> PromptLookupSource:
    return PromptLookupSource(PromptLookupConfig(**settings))


def suffix(**settings) -> SuffixSource:
    return SuffixSource(SuffixConfig(**settings))


# --- prompt lookup ---------------------------------------------------------------------------

def test_lookup_repeat_inside_the_prompt():
    # [10, 11, 12] occurred at 0: what followed it there, P = m / (m + 1) for m = 3, 4, 5, 6 matched tokens
    proposal = lookup(num_tokens=4).propose("r", [10, 11, 12, 13, 14, 99, 10, 11, 12], 8)
    assert proposal == Proposal((13, 14, 99, 10), (3 / 4, 4 / 5, 5 / 6, 6 / 7))


def test_lookup_repeat_across_prompt_and_output():
    source = lookup(num_tokens=3)
    prompt = [7, 1, 2, 3, 4, 5, 8]
    assert source.propose("r", prompt, 8) == EMPTY        # 8 occurs nowhere before
    assert source.propose("r", prompt + [1, 2], 8).tokens == (3, 4, 5)
    assert source.propose("r", prompt + [1, 2, 3, 4], 8).tokens == (5, 8, 1)


def test_lookup_extrapolates_a_repeat_that_reaches_the_end():
    # the latest [5, 6] with a follower starts at 2; copying runs past the context into the draft
    assert lookup(num_tokens=5, max_ngram=2).propose("r", [5, 6, 5, 6], 8).tokens == (5, 6, 5, 6, 5)


def test_lookup_no_match_is_empty():
    assert lookup().propose("r", [1, 2, 3, 4, 5], 8) == EMPTY
    assert lookup().propose("r", [], 8) == EMPTY
    assert lookup(min_ngram=2).propose("r", [1, 2, 3, 4, 2], 8) == EMPTY   # only a 1-gram matches


def test_lookup_max_tokens_caps_the_chain():
    context = [1, 2, 3, 4, 5, 6, 7, 1, 2]
    assert lookup().propose("a", context, 2).tokens == (3, 4)
    assert lookup().propose("b", context, 0) == EMPTY
    assert lookup(num_tokens=3).propose("c", context, 50).tokens == (3, 4, 5)
    with pytest.raises(ValueError, match="max_tokens -1: valid 0 or more"):
        lookup().propose("d", context, -1)


def test_lookup_prefers_the_longest_ngram():
    # [2] was last followed by 5, but the 2-gram [1, 2] (followed by 3) is longer
    assert lookup(num_tokens=1).propose("r", [1, 2, 3, 7, 2, 5, 9, 1, 2], 8) == Proposal((3,), (2 / 3,))


def test_lookup_takes_the_most_recent_occurrence():
    assert lookup(num_tokens=1, max_ngram=2).propose("r", [1, 2, 3, 1, 2, 4, 1, 2], 8).tokens == (4,)


def test_lookup_refuses_a_shrinking_context_and_close_forgets():
    source = lookup()
    source.propose("r", [1, 2, 3, 1, 2], 8)
    with pytest.raises(ValueError, match="context of request 'r' shrank from 5 to 2 tokens"):
        source.propose("r", [1, 2], 8)
    source.close("r", [1, 2, 3, 1, 2])
    assert source.propose("r", [4, 5], 8) == EMPTY   # a fresh request: nothing of the old one is left


def random_context(rng: random.Random, length: int, vocab: int) -> list[int]:
    """Random tokens over a small vocabulary with copied spans, so that matches happen."""
    tokens: list[int] = []
    while len(tokens) < length:
        if tokens and rng.random() < 0.4:
            start = rng.randrange(len(tokens))
            tokens += tokens[start:start + rng.randrange(1, 8)]
        else:
            tokens.append(rng.randrange(vocab))
    return tokens[:length]


@pytest.mark.parametrize("make", [lambda: lookup(num_tokens=6, min_ngram=1, max_ngram=3),
                                  lambda: lookup(num_tokens=4, min_ngram=2, max_ngram=5),
                                  lambda: suffix(num_tokens=8, max_depth=6, max_match=4, min_probability=0.05,
                                                 cross_request=0),
                                  lambda: suffix(num_tokens=8, max_depth=8, max_match=32, min_probability=0.0,
                                                 cross_request=0)],
                         ids=["lookup-1-3", "lookup-2-5", "suffix-depth6", "suffix-depth8"])
def test_incremental_equals_from_scratch(make):
    """One source fed each context in growing pieces proposes what a fresh one fed it at once does."""
    rng = random.Random(1234)
    growing, checked = make(), 0
    for case in range(200):
        context = random_context(rng, rng.randrange(1, 120), rng.choice((3, 8, 30)))
        cuts = sorted(rng.sample(range(1, len(context) + 1), min(len(context), rng.randrange(1, 6))))
        rid = f"case{case}"
        for cut in cuts:
            max_tokens = rng.randrange(0, 10)
            fresh = make().propose("once", context[:cut], max_tokens)
            assert growing.propose(rid, context[:cut], max_tokens) == fresh, (case, cut)
            checked += fresh != EMPTY
        growing.close(rid, context)
    assert checked > 100   # most cases did propose something


# --- suffix ----------------------------------------------------------------------------------

FREQUENCY = [5, 6, 1, 5, 6, 2, 5, 7, 3, 5]   # 5 is followed by 6 twice, by 7 once


def test_suffix_the_more_frequent_continuation_wins():
    # 6 with 2/3; after [5, 6] came 1 and 2 once each: the more recent, 2, with 1/2
    assert suffix().propose("r", FREQUENCY, 2) == Proposal((6, 2), (2 / 3, 1 / 2))


def test_suffix_min_probability_cuts_the_path():
    assert suffix(min_probability=0.5).propose("r", FREQUENCY, 8) == Proposal((6,), (2 / 3,))   # path 1/3 < 0.5
    assert suffix(min_probability=0.7).propose("r", FREQUENCY, 8) == EMPTY


def test_suffix_prefers_the_longest_match():
    # [2, 3] was followed by 9 and by 8; [4, 2, 3] only by 8
    assert suffix().propose("r", [1, 2, 3, 9, 4, 2, 3, 8, 4, 2, 3], 1) == Proposal((8,), (1.0,))


def test_suffix_follows_the_match_past_the_context_end():
    context = [1, 2, 3, 4, 1, 2]
    assert suffix().propose("r", context, 6) == Proposal((3, 4, 1, 2, 3, 4), (1.0,) * 6)


def test_suffix_caps_at_max_depth_and_max_tokens():
    context = list(range(20)) + [0]
    assert suffix(max_depth=5).propose("a", context, 16).tokens == (1, 2, 3, 4, 5)
    assert suffix(max_depth=1).propose("e", context, 16).tokens == (1,)
    assert suffix().propose("b", context, 3).tokens == (1, 2, 3)
    assert suffix().propose("c", context, 0) == EMPTY
    assert suffix().propose("d", [1, 2, 3], 8) == EMPTY


def test_suffix_uses_recent_requests_outputs():
    source = suffix(cross_request=2)
    source.propose("a", [100, 101], 8)                     # prompt: the output starts after it
    source.close("a", [100, 101, 40, 41, 42, 43])
    # a new request whose own text has no match finds [40, 41] in the finished request's output
    assert source.propose("b", [200, 40, 41], 2) == Proposal((42, 43), (1.0, 1.0))
    # prompts are not kept: [100, 101] was request a's prompt
    assert source.propose("c", [300, 100], 2) == EMPTY


def test_suffix_cross_request_store_forgets_the_oldest():
    source = suffix(cross_request=2)
    for rid, output in (("a", [40, 41]), ("b", [50, 51]), ("c", [60, 61])):
        source.propose(rid, [1], 8)
        source.close(rid, [1, *output])
    assert source.propose("new1", [9, 40], 8) == EMPTY            # a's output was forgotten
    assert source.propose("new2", [9, 50], 8) == Proposal((51,), (1.0,))
    assert source.propose("new3", [9, 60], 8) == Proposal((61,), (1.0,))


@pytest.mark.parametrize("kept, expected", [(3, Proposal((42,), (2 / 3,))), (2, Proposal((42,), (1.0,)))])
def test_suffix_recent_outputs_count_frequencies_until_forgotten(kept, expected):
    source = suffix(cross_request=kept)
    for rid, output in (("a", [40, 41]), ("b", [40, 42]), ("c", [40, 42])):
        source.propose(rid, [1], 8)
        source.close(rid, [1, *output])
    # three outputs kept: 40 was followed by 42 twice, by 41 once; two kept: a's 41 is uncounted
    assert source.propose("new", [9, 40], 8) == expected


def test_suffix_cross_request_zero_keeps_nothing():
    source = suffix(cross_request=0)
    source.propose("a", [1], 8)
    source.close("a", [1, 40, 41])
    assert source.propose("b", [9, 40], 8) == EMPTY


def test_suffix_close_forgets_the_request():
    source = suffix(cross_request=0)
    source.propose("r", [1, 2, 3, 1, 2], 8)
    source.close("r", [1, 2, 3, 1, 2])
    assert source.propose("r", [1, 2], 8) == EMPTY   # no shrink error, no match from the old text


def test_suffix_trie_memory_is_bounded_and_retract_empties_it():
    rng = random.Random(7)
    trie = SuffixTrie(depth=4)
    texts = [random_context(rng, 60, 5) for _ in range(3)]
    for text in texts:
        trie.extend(text)

    def nodes(node) -> int:
        return 1 + sum(nodes(child) for _, child in node.children())

    assert nodes(trie.root) <= 1 + 4 * 180
    assert trie.root.continued == 180   # every token counted once as a 1-token suffix
    for text in texts:
        trie.retract(text)
    assert nodes(trie.root) == 1 and trie.root.continued == 0


def test_suffix_trie_finds_the_longest_suffix_and_counts_it():
    """Against brute force: the longest suffix of a query that occurs in a text (at most depth
    tokens), and how often it occurs in all texts."""
    rng = random.Random(99)
    depth = 5
    texts = [random_context(rng, rng.randrange(1, 40), 4) for _ in range(6)]
    trie = SuffixTrie(depth)
    for text in texts:
        trie.extend(text)

    def occurrences(pattern: list[int]) -> int:
        return sum(text[i:i + len(pattern)] == pattern for text in texts for i in range(len(text) - len(pattern) + 1))

    for _ in range(300):
        query = [rng.randrange(5) for _ in range(rng.randrange(0, 9))]   # token 4 occurs nowhere
        node = trie.longest_suffix(query)
        longest = max((n for n in range(min(depth, len(query)) + 1) if occurrences(query[len(query) - n:]) > 0))
        assert node.depth == longest
        if longest:
            assert node.count == occurrences(query[len(query) - longest:])


# --- sources_for ----------------------------------------------------------------------------

def test_sources_for_builds_the_host_sources_listed():
    config = SpeculationConfig((Source.medusa, Source.suffix, Source.prompt_lookup), 17,
                               prompt_lookup=PromptLookupConfig(num_tokens=5), suffix=SuffixConfig())
    sources = sources_for(config)
    assert list(sources) == [Source.suffix, Source.prompt_lookup]
    assert isinstance(sources[Source.suffix], SuffixSource) and sources[Source.suffix].source is Source.suffix
    assert isinstance(sources[Source.prompt_lookup], PromptLookupSource)
    assert sources[Source.prompt_lookup].config.num_tokens == 5
    assert sources_for(SpeculationConfig((Source.medusa,), 8)) == {}


def test_sources_refuse_bad_settings():
    with pytest.raises(ValueError, match=r"prompt_lookup: min_ngram 3, max_ngram 2: valid"):
        lookup(min_ngram=3, max_ngram=2)
    with pytest.raises(ValueError, match=r"suffix: max_depth 20: valid 1 to num_tokens \(16\)"):
        suffix(max_depth=20)


@pytest.mark.parametrize("make", [lookup, suffix], ids=["lookup", "suffix"])
def test_a_numpy_context_gives_python_ints(make):
    context = np.array([1, 2, 3, 4, 1, 2], dtype=np.int64)
    proposal = make().propose("r", context, 2)
    assert proposal.tokens == (3, 4) and all(type(token) is int for token in proposal.tokens)

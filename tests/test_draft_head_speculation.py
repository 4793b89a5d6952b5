"""The draft head in the step loop (runtime/speculation/draft_head_source.py, runtime/engine_core.py):
greedy tokens equal plain decoding's with the draft head beside Medusa, prompt lookup and plain rows in
one step; its cache after many rejections holds exactly what a fresh drafter fed the committed
history computes; a seeded sampled request's tokens equal plain sampling's (the point-mass rule);
an unseeded one verifies by the full-distribution rule; a request asking for it on an engine
without one is refused. The engine: the bundled model with its Medusa heads, prompt lookup and a
draft head trained on it here (a few seconds), verifying every draft (``always``)."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from conftest import TINY_CODE, write_spec
from test_draft_head_build import make_draft_dir

pytestmark = pytest.mark.slow

PROMPTS = ["def fibonacci(n):\n    ", "class Stack:\n    def push(self, item):\n        ",
           "import os\n\ndef walk(path):\n    ", "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    "]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    import subprocess
    import sys

    work = tmp_path_factory.mktemp("draft-head-speculation")
    draft = _trained_draft(work)
    spec = write_spec(work / "spec.yaml", TINY_CODE,
                      build={"max_batch_size": 4, "max_input_len": 64, "max_seq_len": 160},
                      speculative={"medusa": {"heads": str(TINY_CODE / "medusa"), "num_heads": 4, "tree": "default"},
                                   "prompt_lookup": {}, "draft_head": {"path": str(draft), "num_tokens": 4}})
    proc = subprocess.run([sys.executable, "-m", "trtbuild.cli", "build", str(spec), "-o", str(work / "engine")],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return work / "engine"


def _trained_draft(work):
    """A draft head trained on the bundled model's own text (seconds), or random weights where the
    trainer is not at hand."""
    try:
        from trtbuild.builder.draft_head.train import DraftTrainOptions, train_draft_head
    except ImportError:
        return make_draft_dir(work / "draft")
    options = DraftTrainOptions(draft_vocab=1024, seq_len=48, sequences=48, prompt_len=16, steps=80, batch=4, lr=3e-3)
    train_draft_head(TINY_CODE, [TINY_CODE / "heldout.txt"], work / "draft", options, progress=lambda _: None)
    return work / "draft"


def _llm(engine, mode="always", draft_tree_width=None):
    from trtbuild.runtime.llm import LLM
    from trtbuild.runtime.speculation.adaptive import SpeculationMode

    return LLM(engine, backend="onnxruntime", threads=2, speculation_mode=SpeculationMode(mode),
               draft_tree_width=draft_tree_width)


def test_greedy_tokens_equal_plain_with_every_source_in_one_step(engine):
    from trtbuild.contract.speculation import Source
    from trtbuild.runtime.core.sampling import SamplingParams

    rows = [(Source.draft_head,), (Source.prompt_lookup,), (Source.medusa,), ()]
    with _llm(engine) as llm:
        plain = [c.token_ids for c in llm.generate(PROMPTS, SamplingParams(max_tokens=40, ignore_eos=True,
                                                                           speculation=()))]
        mixed = llm.generate(PROMPTS, [SamplingParams(max_tokens=40, ignore_eos=True, speculation=s) for s in rows])
        before = Counter(llm.speculation.stats.tree_sizes)
        alone = [llm.generate([p], SamplingParams(max_tokens=40, ignore_eos=True,
                                                  speculation=(Source.draft_head,)))[0] for p in PROMPTS]
        alone_sizes = llm.speculation.stats.tree_sizes - before
        batched = llm.generate(PROMPTS, SamplingParams(max_tokens=40, ignore_eos=True,
                                                       speculation=(Source.draft_head,)))
        stats = llm.speculation.stats.as_dict()["sources"]
    assert [c.token_ids for c in mixed] == plain
    assert [c.token_ids for c in alone] == plain
    assert [c.token_ids for c in batched] == plain
    assert stats["draft_head"]["verified_rows"] > 0
    # A trained draft keeps some of its guesses on the model's own text.
    assert sum(c.accepted_tokens for c in alone) > 0, stats
    # Trees over the chain by default (TREE_WIDTH tokens a depth): wider than a chain of 4.
    assert max(alone_sizes) > 1 + 4, alone_sizes


def test_width_one_verifies_chains_with_the_same_tokens(engine):
    from trtbuild.contract.speculation import Source
    from trtbuild.runtime.core.sampling import SamplingParams

    with _llm(engine, draft_tree_width=1) as llm:
        plain = [c.token_ids for c in llm.generate(PROMPTS, SamplingParams(max_tokens=40, ignore_eos=True,
                                                                           speculation=()))]
        drafted = llm.generate(PROMPTS, SamplingParams(max_tokens=40, ignore_eos=True, speculation=(Source.draft_head,)))
        sizes = llm.speculation.stats.tree_sizes
    assert [c.token_ids for c in drafted] == plain
    assert sizes and max(sizes) <= 1 + 4, sizes


def test_draft_cache_after_rejections_is_the_committed_history(engine):
    """Every verification writes its chain's K/V past the root and keeps only what was accepted;
    the next read of the committed positions overwrites the rest. After a request of many
    verifications, its draft cache at every position read equals what a fresh drafter computes
    from the same history in one pass (max abs difference 1e-4: float32, other batch shapes).
    The drafter reads a request's positions only when it drafts: the last read is at most one
    verification (1 + a chain) and one plain step before the end; with a prompt shorter than the
    read window, every position up to there was read."""
    from trtbuild.contract.speculation import Source
    from trtbuild.runtime.backends.onnxruntime.engine import OnnxRuntimeEngine
    from trtbuild.runtime.core.sampling import SamplingParams
    from trtbuild.runtime.core.step import Step, StepKind
    from trtbuild.runtime.engine_dir import load
    from trtbuild.runtime.speculation.draft_head import DraftHeadDrafter, Observation
    from trtbuild.runtime.speculation.draft_head_source import READ_WINDOW, read_draft_map

    kept = {}
    with _llm(engine) as llm:
        drafter = llm.speculation.draft_head.drafter
        close = drafter.close

        def keep_then_close(rid):  # the cache as the request ends, before its slot is freed
            if rid in drafter.requests:
                keys, values = drafter.cache(rid)
                request = drafter.requests[rid]
                kept[rid] = (keys.copy(), values.copy(), request.last, request.known.copy())
            close(rid)

        drafter.close = keep_then_close
        [done] = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=48, ignore_eos=True,
                                                          speculation=(Source.draft_head,)))
        stats = llm.speculation.stats.as_dict()["sources"]["draft_head"]
    assert stats["verified_rows"] >= 8  # many verifications, most of their guesses rejected
    (keys, values, last, known), = kept.values()
    history = list(done.prompt_token_ids) + list(done.token_ids)
    d = load(engine)
    assert len(done.prompt_token_ids) < READ_WINDOW
    # After the last read: that drafting call's verification (1 + a chain) and the final step's token.
    assert len(history) - 2 - (2 + d.draft_head.num_tokens) <= last < len(history) - 2
    assert known[:last + 1].all()
    target = OnnxRuntimeEngine(d, threads=2)
    out = target.step(Step(kind=StepKind.prefill, first_slot=0, rids=("fresh",), tokens=(tuple(history[:-1]),),
                           starts=(0,), samples=(True,)))
    fresh = DraftHeadDrafter(d.draft_head_graph, read_draft_map(d), d.max_seq_len, capacity=1, threads=2,
                             max_step_tokens=d.max_seq_len)
    fresh.observe([Observation("fresh", 0, out.draft_features[0, :len(history) - 1], history[1:])])
    fresh_keys, fresh_values = fresh.cache("fresh")
    n = last + 1
    assert np.abs(keys[:, :n] - fresh_keys[:, :n]).max() < 1e-4
    assert np.abs(values[:, :n] - fresh_values[:, :n]).max() < 1e-4


def test_seeded_sampling_equals_plain_sampling(engine):
    from trtbuild.contract.speculation import Source
    from trtbuild.runtime.core.sampling import SamplingParams

    with _llm(engine) as llm:
        params = dict(max_tokens=32, ignore_eos=True, temperature=0.8, top_p=0.95, seed=11)
        plain = [c.token_ids for c in llm.generate(PROMPTS, SamplingParams(**params, speculation=()))]
        drafted = [c.token_ids for c in llm.generate(PROMPTS, SamplingParams(**params,
                                                                             speculation=(Source.draft_head,)))]
        rows = llm.speculation.stats.as_dict()["sources"]["draft_head"]["verified_rows"]
    assert drafted == plain and rows > 0


def test_unseeded_sampling_verifies_by_the_full_rule(engine, monkeypatch):
    import trtbuild.runtime.engine_core as core
    from trtbuild.contract.speculation import Source
    from trtbuild.runtime.core.sampling import SamplingParams

    calls = []
    rule = core.accept_sampled_full

    def counted(*args, **kwargs):
        calls.append(len(args[0]))
        return rule(*args, **kwargs)

    monkeypatch.setattr(core, "accept_sampled_full", counted)
    with _llm(engine) as llm:
        done = llm.generate(PROMPTS, SamplingParams(max_tokens=24, ignore_eos=True, temperature=1.0,
                                                    speculation=(Source.draft_head,)))
    assert all(len(c.token_ids) == 24 for c in done)
    assert calls and all(k >= 1 for k in calls)


def test_asking_for_a_draft_head_the_engine_lacks_is_refused(tmp_path, tiny_engine):
    from trtbuild.contract.speculation import Source
    from trtbuild.runtime.llm import LLM

    with pytest.raises(ValueError, match="draft_head"):
        LLM(tiny_engine, backend="onnxruntime", threads=2, speculation=(Source.draft_head,))
    with pytest.raises(ValueError, match="draft_tree_width 3: .* was built without a draft head"):
        LLM(tiny_engine, backend="onnxruntime", threads=2, draft_tree_width=3)


def test_a_tree_width_below_one_is_refused(engine):
    with pytest.raises(ValueError, match=r"draft_tree_width 0: valid 1 \(chains\) or more"):
        _llm(engine, draft_tree_width=0)

"""draft.cpu.onnx (builder/draft_head/cpu_graph.py) against draft.onnx: the target's CPU passes
match the draft's sites, and the fused graph computes what the exported one does."""
import numpy as np
import onnx
import pytest

from trtbuild.builder.draft_head.cpu_graph import EXPECTED, draft_cpu_graph, run_draft_passes
from trtbuild.builder.draft_head.export import export_draft_graph
from trtbuild.builder.draft_head.model import random_draft_head
from trtbuild.builder.errors import UserError
from trtbuild.contract.draft_head import DRAFT_HIDDEN, DRAFT_LOGITS, FEATURES, DraftHeadConfig, DraftLayerShape
from trtbuild.contract.step import StepArrays, fill_step_arrays
from trtbuild.plugins.onnxruntime.session import run, session

HIDDEN, VOCAB, MAX_SEQ, KV_HEADS, HEAD_DIM = 32, 64, 40, 2, 8
TOLERANCE = 1e-4  # max abs difference, float32


@pytest.fixture(scope="module")
def graphs(tmp_path_factory):
    config = DraftHeadConfig(taps=(0, 1, 2), target_vocab_size=VOCAB, target_num_layers=4, draft_vocab_size=20,
                             layer=DraftLayerShape(hidden_size=HIDDEN, intermediate_size=48, num_heads=4,
                                                   num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, rms_norm_eps=1e-5,
                                                   rope_theta=10000.0))
    draft = random_draft_head(config, std=0.3, seed=1)
    path = export_draft_graph(draft, MAX_SEQ, max_batch=2, max_step_tokens=8,
                              path=tmp_path_factory.mktemp("draft") / "draft.onnx")
    return path, draft_cpu_graph(path, rows=2)


def test_the_target_passes_match_every_draft_site(graphs):
    result = run_draft_passes(graphs[0], rows=2)
    matches = {r["pass"]: r["matches"] for r in result.records if "matches" in r}
    assert matches == EXPECTED
    ops = [n.op_type for n in onnx.load(graphs[1], load_external_data=False).graph.node]
    # One GroupQueryAttention per row count behind an If; no decomposed attention, no scatter.
    assert ops.count("If") == 1 and "Softmax" not in ops and "ScatterElements" not in ops
    assert ops.count("RMSNormalization") == 4 and ops.count("SkipSimplifiedLayerNormalization") == 1


def test_prefill_and_steps_match_the_exported_graph(graphs):
    """A prefill of 7 positions, then 3 single steps, each graph on its own cache."""
    plain, fused = (session(p) for p in graphs)
    rng = np.random.default_rng(0)
    caches = {form: [np.zeros((1, KV_HEADS, MAX_SEQ, HEAD_DIM), np.float32) for _ in range(2)]
              for form in ("plain", "fused")}
    start = 0
    worst = {DRAFT_LOGITS: 0.0, DRAFT_HIDDEN: 0.0, "cache": 0.0}
    for n in (7, 1, 1, 1):
        tokens = rng.integers(0, VOCAB, n).tolist()
        arrays = fill_step_arrays(StepArrays.empty(1, n, 1, MAX_SEQ), [tokens], [start], MAX_SEQ)
        features = rng.normal(0, 1, (1, n, HIDDEN)).astype(np.float32)
        outs = {}
        for form, graph in (("plain", plain), ("fused", fused)):
            keys, values = caches[form]
            outs[form] = run(graph, {**arrays.as_dict(), FEATURES: features, "past_key_0": keys,
                                     "past_value_0": values})
            caches[form] = [outs[form]["present_key_0"], outs[form]["present_value_0"]]
        for name in (DRAFT_LOGITS, DRAFT_HIDDEN):
            assert outs["fused"][name].shape == outs["plain"][name].shape
            worst[name] = max(worst[name], float(np.abs(outs["fused"][name] - outs["plain"][name]).max()))
        start += n
        for mine, theirs in zip(caches["fused"], caches["plain"]):
            worst["cache"] = max(worst["cache"], float(np.abs(mine[:, :, :start] - theirs[:, :, :start]).max()))
    assert max(worst.values()) <= TOLERANCE, worst


def test_a_graph_exported_without_head_counts_is_refused(graphs, tmp_path):
    model = onnx.load(graphs[0], load_external_data=False)
    del model.metadata_props[:]
    old = tmp_path / "draft.onnx"
    onnx.save_model(model, old)
    with pytest.raises(UserError, match="no draft_num_heads/draft_num_kv_heads metadata; export it again"):
        draft_cpu_graph(old)

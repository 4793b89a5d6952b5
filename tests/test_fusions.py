"""Each fusion on small hand-built graphs: match counts, checks that refuse, numerics."""
from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs
import pytest

from trtbuild.builder.numerics import compare, run_onnx
from trtbuild.builder.passes import PassContext, PassError
from trtbuild.builder.passes.fuse_attention import fuse_attention
from trtbuild.builder.passes.fuse_rmsnorm import fuse_rmsnorm
from trtbuild.builder.passes.fuse_rotary import fuse_rotary
from trtbuild.builder.frontend.checkpoint import ArchConfig

import graphs

CTX = PassContext(spec=None)


def fuse(fusion, model):
    result = fusion(gs.import_onnx(model), CTX)
    return result, gs.export_onnx(result.graph)


def ops(model) -> list[str]:
    return sorted(node.op_type for node in model.graph.node)


def test_rmsnorm_fuses_to_one_node_with_same_numerics():
    model = graphs.rmsnorm()
    x = {"x": np.random.default_rng(1).standard_normal((2, 3, 16)).astype(np.float32)}
    result, fused = fuse(fuse_rmsnorm, model)
    assert result.stats["matches"] == 1 and result.modified
    assert ops(fused) == ["RMSNormalization"]
    node = fused.graph.node[0]
    assert node.name.endswith("RMSNormalization")
    stats = compare(run_onnx(fused, x), run_onnx(model, x))["y"]
    assert stats.max_abs < 1e-5, stats


@pytest.mark.parametrize("graph", [graphs.rmsnorm(power=3.0), graphs.rmsnorm(axis=1)])
def test_rmsnorm_check_refuses_other_reductions(graph):
    result, fused = fuse(fuse_rmsnorm, graph)
    assert result.stats["matches"] == 0 and not result.modified
    assert list(result.stats["skipped"].values())[0] in ("power is not 2", "reduces over axes [1], not the last")
    assert "RMSNormalization" not in ops(fused)


def test_rotary_fuses_to_rotary_embedding_with_same_numerics():
    model = graphs.rotary()
    rng = np.random.default_rng(2)
    feeds = {"x": rng.standard_normal((2, 3, 4, 8)).astype(np.float32),
             "position_ids": np.array([[0, 1, 2, 3], [7, 8, 9, 10]], np.int32)}
    result, fused = fuse(fuse_rotary, model)
    assert result.stats["matches"] == 1
    assert ops(fused) == ["Cast", "RotaryEmbedding"]
    stats = compare(run_onnx(fused, feeds), run_onnx(model, feeds))["y"]
    assert stats.max_abs < 1e-5, stats


def test_attention_fuses_to_tensor_scatter_and_attention_with_same_numerics():
    model = graphs.attention()
    feeds = graphs.attention_inputs()
    result, fused = fuse(fuse_attention, model)
    assert result.stats["matches"] == 1
    # Attention reads the caches up to max(kv_length) only: one shared ReduceMax, K/V/mask slices.
    assert ops(fused) == ["Attention", "ReduceMax", "Slice", "Slice", "Slice", "TensorScatter", "TensorScatter"]
    before, after = run_onnx(model, feeds), run_onnx(fused, feeds)
    for name, stats in compare(after, before).items():
        assert stats.max_abs < 1e-5, (name, stats)
    # The cache write really lands at write_index: slot 1's new keys at positions 5..7.
    np.testing.assert_array_equal(after["present_key_0"][1, :, 5:8], feeds["k"][1])


def test_attention_without_gqa_repeat_also_fuses():
    model = graphs.attention(heads=2, kv_heads=2)
    feeds = graphs.attention_inputs(heads=2, kv_heads=2)
    result, fused = fuse(fuse_attention, model)
    assert result.stats["matches"] == 1
    assert compare(run_onnx(fused, feeds), run_onnx(model, feeds))["y"].max_abs < 1e-5


def test_attention_check_refuses_a_soft_mask_fill():
    result, fused = fuse(fuse_attention, graphs.attention(fill=-10.0))
    assert result.stats["matches"] == 0
    assert "large negative" in list(result.stats["skipped"].values())[0]


def test_fewer_matches_than_the_architecture_has_is_an_error():
    arch = ArchConfig(architecture="LlamaForCausalLM", vocab_size=16, hidden_size=16, intermediate_size=32,
                      num_layers=2, num_heads=2, num_kv_heads=1, head_dim=8, rms_norm_eps=1e-5,
                      max_position_embeddings=16, tie_word_embeddings=False, qk_norm=False, sliding_window=None)
    ctx = PassContext(spec=None, arch=arch)
    with pytest.raises(PassError, match=r"fuse_rmsnorm matched 1 of the 5 sites a LlamaForCausalLM with 2 layers has"):
        fuse_rmsnorm(gs.import_onnx(graphs.rmsnorm()), ctx)
    with pytest.raises(PassError, match=r"fuse_attention matched 0 of the 2 sites"):
        fuse_attention(gs.import_onnx(graphs.rmsnorm()), ctx)


def test_canonicalize_folds_constants_drops_dead_nodes_and_names_nodes():
    from onnx import TensorProto, helper, numpy_helper

    from trtbuild.builder.passes.canonicalize import canonicalize

    nodes = [helper.make_node("Add", ["c1", "c2"], ["c3"]),             # constant: folded
             helper.make_node("Mul", ["x", "c3"], ["y"]),
             helper.make_node("Neg", ["x"], ["unused"], name="dead")]   # feeds nothing: removed
    inits = [numpy_helper.from_array(np.float32(2.0), "c1"), numpy_helper.from_array(np.float32(3.0), "c2")]
    model = graphs._model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])], inits)
    result = canonicalize(gs.import_onnx(model), CTX)
    out = gs.export_onnx(result.graph)
    assert result.modified and [n.op_type for n in out.graph.node] == ["Mul"]
    assert out.graph.node[0].name == "/model/Mul"
    x = {"x": np.arange(4, dtype=np.float32)}
    np.testing.assert_allclose(run_onnx(out, x)["y"], x["x"] * 5.0)

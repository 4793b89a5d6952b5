"""The CPU stage's passes hold their expected match counts: on a chain of the planted form each
matches, and an architecture whose chain differs fails the pass, naming it and the site, rather
than leaving a half-rewritten decode graph. Structure only (the graphs are not run here; the
build's numerics gate runs the real ones at a decode step)."""
from __future__ import annotations

import onnx_graphsurgeon as gs
import pytest
from onnx import TensorProto, helper

from trtbuild.builder.frontend.checkpoint import ArchConfig
from trtbuild.builder.passes import PIPELINE, CpuGraph, PassContext, PassError

ARCH = ArchConfig(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=1,
                  num_heads=2, num_kv_heads=1, head_dim=8, rms_norm_eps=1e-5, max_position_embeddings=64,
                  tie_word_embeddings=False, qk_norm=False, sliding_window=None)
CTX = PassContext(spec=None, rank=0, arch=ARCH, cpu_graphs=frozenset(CpuGraph))
FLOAT = TensorProto.FLOAT


def run(name, model):
    (p,) = [p for p in PIPELINE if p.name == name]
    assert p.cpu and p.per_rank
    return p.run(gs.import_onnx(model), CTX)


def _model(nodes, inputs, outputs, initializers=()):
    values = lambda names, kind: [helper.make_tensor_value_info(n, kind, None) for n in names]  # noqa: E731
    graph = helper.make_graph(nodes, "planted", [*values(inputs, FLOAT), *values(("write_index", "kv_length"),
                                                                                  TensorProto.INT64)],
                              values(outputs, FLOAT), list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 24), helper.make_opsetid("com.microsoft", 1)])


def _weight(name, shape=(16, 16)):
    return helper.make_tensor(name, FLOAT, shape, [0.0] * (shape[0] * shape[1]))


def attention_chain(query_norm: bool = False):
    """One layer's attention chain as the export and fuse_* passes leave it; ``query_norm`` puts a
    per-head norm between the query's Transpose and its rotary (Qwen3's form)."""
    nodes = []
    for name in ("q", "k", "v"):
        nodes += [helper.make_node("MatMul", ["x", f"w{name}"], [f"{name}_proj"]),
                  helper.make_node("Reshape", [f"{name}_proj", "heads"], [f"{name}_heads"]),
                  helper.make_node("Transpose", [f"{name}_heads"], [f"{name}_t"], perm=[0, 2, 1, 3])]
    query = "q_t"
    if query_norm:
        nodes.append(helper.make_node("RMSNormalization", ["q_t", "qn"], ["q_normed"], axis=-1))
        query = "q_normed"
    nodes += [helper.make_node("RotaryEmbedding", [query, "cos", "sin", "position_ids"], ["q_rot"]),
              helper.make_node("RotaryEmbedding", ["k_t", "cos", "sin", "position_ids"], ["k_rot"]),
              helper.make_node("TensorScatter", ["past_key_0", "k_rot", "write_index"], ["present_key_0"]),
              helper.make_node("TensorScatter", ["past_value_0", "v_t", "write_index"], ["present_value_0"]),
              helper.make_node("Slice", ["present_key_0", "s0", "s1"], ["k_all"]),
              helper.make_node("Slice", ["present_value_0", "s0", "s1"], ["v_all"]),
              helper.make_node("Attention", ["q_rot", "k_all", "v_all", "mask", "", "", "kv_length"], ["attn"],
                               scale=0.35),
              helper.make_node("Transpose", ["attn"], ["attn_t"], perm=[0, 2, 1, 3]),
              helper.make_node("Reshape", ["attn_t", "flat"], ["attn_out"]),
              helper.make_node("MatMul", ["attn_out", "wo"], ["logits"])]
    return _model(nodes, ["x", "heads", "cos", "sin", "position_ids", "mask", "s0", "s1", "flat", "qn",
                          "past_key_0", "past_value_0"],
                  ["logits", "present_key_0", "present_value_0"],
                  [_weight(w) for w in ("wq", "wk", "wv", "wo")])


def test_group_query_attention_matches_the_chain_and_fails_a_chain_that_differs():
    result = run("cpu_group_query_attention", attention_chain())
    assert result.stats["matches"] == 1 == result.stats["expected"]
    assert [n.op for n in result.graph.nodes].count("GroupQueryAttention") == 1
    with pytest.raises(PassError, match=r"cpu_group_query_attention matched 0 of the 1 sites a LlamaForCausalLM with "
                                        r"1 layers has; not matched: \{'attention': 'q/k/v are not Transpose"):
        run("cpu_group_query_attention", _named(attention_chain(query_norm=True), "Attention", "attention"))


def test_verify_attention_wires_positions_and_the_tree_mask_into_group_query_attention():
    decode = next(n for n in run("cpu_group_query_attention", attention_chain()).graph.nodes
                  if n.op == "GroupQueryAttention")
    result = run("cpu_verify_attention", attention_chain())
    assert result.stats["matches"] == 1 == result.stats["expected"]
    (verify,) = [n for n in result.graph.nodes if n.op == "GroupQueryAttention"]
    # The decode wiring reads neither: a plain decode step does not fill them.
    assert len(decode.inputs) == 9 and len(verify.inputs) == 11
    positions, bias = verify.inputs[9:]
    assert positions.inputs[0].op == "Cast" and positions.inputs[0].inputs[0].name == "position_ids"
    where = bias.inputs[0]
    assert where.op == "Where" and where.inputs[0].inputs[0].op == "Slice"
    assert where.inputs[0].inputs[0].inputs[0].name == "attention_mask"
    # Its filled length counts the step's tokens from write_index (kv_length is not read).
    seqlens = verify.inputs[5].inputs[0]  # Cast(write_index + S - 1)
    assert seqlens.op == "Cast" and seqlens.inputs[0].inputs[0].op == "Sub"


def _named(model, op, name):
    next(n for n in model.graph.node if n.op_type == op).name = name
    return model


def _gqa(query, key, value, name="gqa"):
    return helper.make_node("GroupQueryAttention", [query, key, value, "past_key_0", "past_value_0", "seqlens", "total"],
                            ["logits", "present_key_0", "present_value_0"], domain="com.microsoft", num_heads=2,
                            kv_num_heads=1, name=name)


def test_pack_qkv_packs_one_input_and_fails_projections_of_different_inputs():
    def model(k_input):
        nodes = [helper.make_node("MatMul", ["x", "wq"], ["q"]), helper.make_node("MatMul", [k_input, "wk"], ["k"]),
                 helper.make_node("MatMul", ["x", "wv"], ["v"]), _gqa("q", "k", "v")]
        return _model(nodes, ["x", "y", "past_key_0", "past_value_0", "seqlens", "total"],
                      ["logits", "present_key_0", "present_value_0"], [_weight(w) for w in ("wq", "wk", "wv")])

    assert run("cpu_pack_qkv", model("x")).stats["matches"] == 1
    with pytest.raises(PassError, match=r"cpu_pack_qkv matched 0 of the 1 sites .* not matched: \{'gqa': 'q/k/v are "
                                        r"not three MatMuls of one input"):
        run("cpu_pack_qkv", model("y"))  # e.g. an architecture whose keys read another stream


def test_drop_row_gather_bypasses_the_gather_and_fails_a_step_that_gathers_otherwise():
    def model(axis):
        nodes = [helper.make_node("Unsqueeze", ["logits_index", "axes"], ["index3"]),
                 helper.make_node("Expand", ["index3", "shape"], ["index"]),
                 helper.make_node("GatherElements", ["hidden", "index"], ["picked"], axis=axis),
                 helper.make_node("MatMul", ["picked", "w"], ["logits"])]
        return _model(nodes, ["hidden", "logits_index", "axes", "shape"], ["logits"], [_weight("w")])

    assert run("cpu_drop_row_gather", model(1)).stats["matches"] == 1
    with pytest.raises(PassError, match="cpu_drop_row_gather matched 0 of the 1 sites"):
        run("cpu_drop_row_gather", model(2))


def test_skip_norm_fuses_every_residual_norm_and_fails_when_one_is_not_residual():
    def model(second_is_residual):
        nodes = [helper.make_node("Add", ["a", "b"], ["sum1"]),
                 helper.make_node("RMSNormalization", ["sum1", "n1"], ["h1"], axis=-1),
                 helper.make_node("Add" if second_is_residual else "Mul", ["h1", "sum1"], ["sum2"]),
                 helper.make_node("RMSNormalization", ["sum2", "n2"], ["logits"], axis=-1)]
        return _model(nodes, ["a", "b", "n1", "n2"], ["logits", "sum2"])

    assert run("cpu_skip_norm", model(True)).stats["matches"] == 2  # 2 per layer, 1 layer
    with pytest.raises(PassError, match="cpu_skip_norm matched 1 of the 2 sites"):
        run("cpu_skip_norm", model(False))  # e.g. a parallel-residual block: no Add before the norm

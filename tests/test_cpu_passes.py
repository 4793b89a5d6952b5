"""The CPU stage's passes hold their expected match counts: on a chain of the planted form each
matches, and an architecture whose chain differs fails the pass, naming it and the site, rather
than leaving a half-rewritten decode graph. Structure only (the graphs are not run here; the
build's numerics gate runs the real ones at a step of their kind, and
tests/test_speculation_build.py runs a verification of several rows against the rank graph)."""
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


def test_verify_attention_rotates_outside_and_wires_the_tree_mask_into_group_query_attention():
    decode = next(n for n in run("cpu_group_query_attention", attention_chain()).graph.nodes
                  if n.op == "GroupQueryAttention")
    result = run("cpu_verify_attention", attention_chain())
    assert result.stats["matches"] == 1 == result.stats["expected"]
    (verify,) = [n for n in result.graph.nodes if n.op == "GroupQueryAttention"]  # one row at most: no If
    # The decode wiring rotates inside and reads no mask: a plain decode step does not fill it.
    assert decode.attrs["do_rotary"] == 1 and len(decode.inputs) == 9
    # Verification rotates each row at its own positions before the rows are folded into heads.
    assert verify.attrs["do_rotary"] == 0 and len(verify.inputs) == 11
    made_by = lambda node, i=0: node.inputs[i].inputs[0]  # noqa: E731  (the node producing an input)
    chain, node = [], made_by(verify)
    while node.op != "RotaryEmbedding":
        chain.append(node.op)
        node = made_by(node)
    assert chain == ["Unsqueeze", "Reshape", "Transpose"]  # [B, H, S, D] → [1, S, B·H·D]
    bias = made_by(verify, 10)  # Reshape(Expand(Where(Slice(attention_mask)))): a bias per folded head
    where = made_by(made_by(bias))
    assert [bias.op, made_by(bias).op, where.op, made_by(where).op] == ["Reshape", "Expand", "Where", "Slice"]
    assert made_by(where).inputs[0].name == "attention_mask"
    # One filled length for every row: the largest write_index plus the step's tokens (kv_length is not read).
    seqlens = made_by(verify, 5)  # Cast(max(write_index) + S - 1)
    start = made_by(made_by(made_by(seqlens)))
    assert seqlens.op == "Cast" and start.op == "ReduceMax" and start.inputs[0].name == "write_index"


def test_verify_attention_holds_one_group_query_attention_per_row_count_behind_ifs():
    """Up to three rows: Ifs on the row count pick GroupQueryAttention over 1, 2 or 3 rows' heads;
    the exporter's Shape(cache)[0:1] (the batch size) reads write_index, as the caches come folded."""
    from trtbuild.builder.passes.cpu_group_query_attention import group_query_attention
    from trtbuild.contract.step import VERIFY_ROWS

    planted = attention_chain()
    planted.graph.node.append(helper.make_node("Shape", ["past_value_0"], ["batch"], start=0, end=1, name="batch"))
    planted.graph.output.append(helper.make_tensor_value_info("batch", TensorProto.INT64, None))
    done = group_query_attention(planted, 2, 1, CpuGraph.verify, 3)
    assert done.matches == 1 and done.metadata == {VERIFY_ROWS: 3}

    def attentions(graph):
        for node in graph.node:
            if node.op_type == "GroupQueryAttention":
                yield {a.name: helper.get_attribute_value(a) for a in node.attribute}
            for attr in node.attribute:
                if attr.HasField("g"):
                    yield from attentions(attr.g)

    heads = sorted((a["num_heads"], a["kv_num_heads"]) for a in attentions(done.model.graph))
    assert heads == [(2, 1), (4, 2), (6, 3)]
    assert [n.op_type for n in done.model.graph.node].count("If") == 1  # rows == 1 ? … : (rows == 2 ? … : 3 rows)
    (shape,) = [n for n in done.model.graph.node if n.name == "batch"]
    assert list(shape.input) == ["write_index"]
    planted = attention_chain()
    planted.graph.node.append(helper.make_node("Shape", ["past_value_0"], ["dims"], start=1, name="dims"))
    planted.graph.output.append(helper.make_tensor_value_info("dims", TensorProto.INT64, None))
    refused = group_query_attention(planted, 2, 1, CpuGraph.verify, 3)
    assert refused.matches == 0 and "beyond the batch dim" in refused.unmatched["dims"]


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

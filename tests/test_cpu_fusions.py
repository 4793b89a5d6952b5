"""The CPU stage's rewrites on small hand-made graphs: what they match, what they leave alone,
and that ONNX Runtime computes the same numbers after them; the CPU step model's If and next
inputs."""
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from trtbuild.plugins.onnxruntime import session as ort_config
from trtbuild.builder.passes.cpu_drop_row_gather import drop_row_gather
from trtbuild.builder.passes.cpu_pack_qkv import pack_qkv
from trtbuild.builder.passes.cpu_skip_norm import skip_norm

HIDDEN = 16


def _model(nodes, inputs, outputs, initializers=(), opset=24):
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset),
                                                   helper.make_opsetid("com.microsoft", 1)])


def _tensor(name, shape):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def _pair(rewritten):
    return rewritten.model, rewritten.matches


def _run(model, feeds):
    return ort_config.run(ort_config.session(model, 1), feeds)


def test_skip_norm_fuses_residual_norms_and_keeps_the_sum():
    rng = np.random.default_rng(0)
    weight = numpy_helper.from_array(rng.standard_normal(HIDDEN).astype(np.float32), "w")
    nodes = [helper.make_node("Add", ["a", "b"], ["sum"]),
             helper.make_node("RMSNormalization", ["sum", "w"], ["normed"], epsilon=1e-5, axis=-1),
             # a norm over another axis is not the fused op's form: left alone
             helper.make_node("Add", ["normed", "sum"], ["sum2"]),
             helper.make_node("RMSNormalization", ["sum2", "w2"], ["normed2"], epsilon=1e-5, axis=1)]
    weight2 = numpy_helper.from_array(rng.standard_normal((3, HIDDEN)).astype(np.float32), "w2")
    model = _model(nodes, [_tensor("a", [2, 3, HIDDEN]), _tensor("b", [2, 3, HIDDEN])],
                   [_tensor("sum", None), _tensor("normed2", None)], [weight, weight2])
    fused, count = _pair(skip_norm(model))
    assert count == 1
    assert [n.op_type for n in fused.graph.node] == ["SkipSimplifiedLayerNormalization", "Add", "RMSNormalization"]
    feeds = {"a": rng.standard_normal((2, 3, HIDDEN)).astype(np.float32),
             "b": rng.standard_normal((2, 3, HIDDEN)).astype(np.float32)}
    before, after = _run(model, feeds), _run(fused, feeds)
    for name in ("sum", "normed2"):  # the residual sum stays an output, exactly
        np.testing.assert_allclose(after[name], before[name], rtol=1e-5, atol=1e-5)


def _attention(query, key, value):
    return helper.make_node("GroupQueryAttention", [query, key, value, "past_k", "past_v", "seqlens", "total"],
                            ["out", "present_k", "present_v"], domain="com.microsoft", num_heads=2, kv_num_heads=1)


def test_pack_qkv_packs_three_projections_of_one_input():
    rng = np.random.default_rng(1)
    weights = [numpy_helper.from_array(rng.standard_normal((HIDDEN, n)).astype(np.float32), name)
               for name, n in (("wq", 16), ("wk", 8), ("wv", 8))]
    nodes = [helper.make_node("MatMul", ["x", w], [w + "_out"]) for w in ("wq", "wk", "wv")]
    nodes.append(_attention("wq_out", "wk_out", "wv_out"))
    inputs = [_tensor("x", [1, 1, HIDDEN]), _tensor("past_k", [1, 1, 8, 8]), _tensor("past_v", [1, 1, 8, 8]),
              helper.make_tensor_value_info("seqlens", TensorProto.INT32, [1]),
              helper.make_tensor_value_info("total", TensorProto.INT32, [])]
    model = _model(nodes, inputs, [_tensor("out", None), _tensor("present_k", None), _tensor("present_v", None)],
                   weights)
    packed, count = _pair(pack_qkv(model))
    assert count == 1
    assert [n.op_type for n in packed.graph.node] == ["Concat", "MatMul", "GroupQueryAttention"]
    attention = packed.graph.node[-1]
    assert attention.input[1] == attention.input[2] == ""
    feeds = {"x": rng.standard_normal((1, 1, HIDDEN)).astype(np.float32),
             "past_k": rng.standard_normal((1, 1, 8, 8)).astype(np.float32),
             "past_v": rng.standard_normal((1, 1, 8, 8)).astype(np.float32),
             "seqlens": np.array([3], np.int32), "total": np.array(4, np.int32)}
    before, after = _run(model, feeds), _run(packed, feeds)
    for name in ("out", "present_k", "present_v"):
        np.testing.assert_allclose(after[name], before[name], rtol=1e-5, atol=1e-5)


def _quantized_projections(kind: str, widths=(("wq", 16), ("wk", 8), ("wv", 8))):
    """DequantizeLinear → MatMul q/k/v projections into a GroupQueryAttention: int4 codes with a
    scale per 8 input channels (axis 0), or int8 codes with one scale per output channel."""
    rng = np.random.default_rng(4)
    nodes, tensors = [], []
    for name, n in widths:
        if kind == "int4":
            codes = rng.integers(-8, 8, (HIDDEN, n))
            tensors += [helper.make_tensor(f"{name}_q", TensorProto.INT4, [HIDDEN, n], codes.flatten().tolist()),
                        numpy_helper.from_array(rng.uniform(0.01, 0.1, (HIDDEN // 8, n)).astype(np.float32), f"{name}_s")]
            attributes = {"axis": 0, "block_size": 8}
        else:
            codes = rng.integers(-128, 128, (HIDDEN, n)).astype(np.int8)
            tensors += [numpy_helper.from_array(codes, f"{name}_q"),
                        numpy_helper.from_array(rng.uniform(0.01, 0.1, n).astype(np.float32), f"{name}_s")]
            attributes = {"axis": 1}
        nodes += [helper.make_node("DequantizeLinear", [f"{name}_q", f"{name}_s"], [f"{name}_w"], **attributes),
                  helper.make_node("MatMul", ["x", f"{name}_w"], [f"{name}_out"])]
    nodes.append(_attention("wq_out", "wk_out", "wv_out"))
    inputs = [_tensor("x", [1, 1, HIDDEN]), _tensor("past_k", [1, 1, 8, 8]), _tensor("past_v", [1, 1, 8, 8]),
              helper.make_tensor_value_info("seqlens", TensorProto.INT32, [1]),
              helper.make_tensor_value_info("total", TensorProto.INT32, [])]
    return _model(nodes, inputs, [_tensor("out", None), _tensor("present_k", None), _tensor("present_v", None)],
                  tensors)


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_pack_qkv_packs_quantized_projections_from_external_weights(kind, tmp_path):
    import onnx

    path = tmp_path / "model.onnx"
    onnx.save_model(_quantized_projections(kind), path, save_as_external_data=True, location="model.onnx.data",
                    size_threshold=0)
    model = onnx.load(path, load_external_data=False)  # as the runtime holds a rank graph
    packed, count = _pair(pack_qkv(model, tmp_path))
    assert count == 1
    assert [n.op_type for n in packed.graph.node] == ["DequantizeLinear", "MatMul", "GroupQueryAttention"]
    rng = np.random.default_rng(5)
    feeds = {"x": rng.standard_normal((1, 1, HIDDEN)).astype(np.float32),
             "past_k": rng.standard_normal((1, 1, 8, 8)).astype(np.float32),
             "past_v": rng.standard_normal((1, 1, 8, 8)).astype(np.float32),
             "seqlens": np.array([3], np.int32), "total": np.array(4, np.int32)}
    before = ort_config.run(ort_config.session(path, 1), feeds)
    after = ort_config.run(ort_config.session(packed, 1, tmp_path), feeds)
    for name in ("out", "present_k", "present_v"):
        np.testing.assert_allclose(after[name], before[name], rtol=1e-5, atol=1e-5)


def test_pack_qkv_leaves_quantized_projections_of_different_forms():
    model = _quantized_projections("int4")
    blocks = next(a for a in model.graph.node[2].attribute if a.name == "block_size")  # wk's: 8 → 16 channels
    blocks.i = 16
    model.graph.initializer[3].CopyFrom(numpy_helper.from_array(np.full((1, 8), 0.05, np.float32), "wk_s"))
    packed, count = _pair(pack_qkv(model))
    assert count == 0 and packed.graph.node == model.graph.node


def test_pack_qkv_leaves_a_projection_someone_else_reads():
    weights = [numpy_helper.from_array(np.ones((HIDDEN, n), np.float32), name)
               for name, n in (("wq", 16), ("wk", 8), ("wv", 8))]
    nodes = [helper.make_node("MatMul", ["x", w], [w + "_out"]) for w in ("wq", "wk", "wv")]
    nodes += [_attention("wq_out", "wk_out", "wv_out"), helper.make_node("Identity", ["wk_out"], ["k_copy"])]
    inputs = [_tensor("x", [1, 1, HIDDEN]), _tensor("past_k", [1, 1, 8, 8]), _tensor("past_v", [1, 1, 8, 8]),
              helper.make_tensor_value_info("seqlens", TensorProto.INT32, [1]),
              helper.make_tensor_value_info("total", TensorProto.INT32, [])]
    model = _model(nodes, inputs, [_tensor("out", None), _tensor("k_copy", None)], weights)
    packed, count = _pair(pack_qkv(model))
    assert count == 0 and packed.graph.node == model.graph.node


def test_step_model_runs_the_branch_plain_decode_names_and_feeds_the_next_step():
    from trtbuild.builder.emit.cpu_step_model import feeding_decode_model, step_model
    from trtbuild.contract.step import NEXT_INPUTS, PLAIN_DECODE, TREE_VERIFY

    rng = np.random.default_rng(2)
    weight = numpy_helper.from_array(rng.standard_normal((HIDDEN, 4)).astype(np.float32), "w")
    positions = [helper.make_tensor_value_info(name, TensorProto.INT64, [2]) for name in ("write_index", "kv_length")]

    def graph(op):
        return _model([helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node(op, ["y", "y"], ["logits"])],
                      [_tensor("x", [2, 1, HIDDEN]), *positions], [_tensor("logits", None)], [weight])

    rank, decode = graph("Add"), graph("Mul")
    model = step_model(rank, decode, None)
    assert TREE_VERIFY not in [i.name for i in model.graph.input]  # no heads: no verification graph
    assert not model.graph.initializer  # each branch holds the weights it reads
    branches = {a.name: a.g for a in model.graph.node[0].attribute}
    assert [t.name for t in branches["then_branch"].initializer] == ["w"] == \
        [t.name for t in branches["else_branch"].initializer]
    x = rng.standard_normal((2, 1, HIDDEN)).astype(np.float32)
    y = x @ numpy_helper.to_array(weight)  # [B, R = 1, V]
    write, length = np.array([5, 9]), np.array([6, 10])
    for plain, expected in ((True, y * y), (False, y + y)):
        out = _run(model, {"x": x, "write_index": write, "kv_length": length, PLAIN_DECODE: np.array(plain)})
        np.testing.assert_allclose(out["logits"], expected, rtol=1e-5, atol=1e-5)
        # The next greedy step's inputs: each row's argmax, one position further.
        assert out[NEXT_INPUTS["input_ids"]].dtype == np.int32
        assert out[NEXT_INPUTS["input_ids"]].tolist() == expected.argmax(-1).tolist()
        assert out[NEXT_INPUTS["write_index"]].tolist() == [6, 10] and out[NEXT_INPUTS["kv_length"]].tolist() == [7, 11]
    # Without the If (benchmarks/cpu_step_overheads.py's reference): the same plain decode step.
    alone = _run(feeding_decode_model(decode), {"x": x, "write_index": write, "kv_length": length})
    plain = _run(model, {"x": x, "write_index": write, "kv_length": length, PLAIN_DECODE: np.array(True)})
    assert alone.keys() == plain.keys() and all(np.array_equal(alone[k], plain[k]) for k in plain)
    assert len(decode.graph.node) == 2  # the decode model itself is left as it was


def test_step_model_with_a_verification_graph_runs_it_where_tree_verify_says():
    from trtbuild.builder.emit.cpu_step_model import decode_branch, step_model, verify_branch
    from trtbuild.contract.step import PLAIN_DECODE, TREE_VERIFY

    rng = np.random.default_rng(4)
    weight = numpy_helper.from_array(rng.standard_normal((HIDDEN, 4)).astype(np.float32), "w")
    positions = [helper.make_tensor_value_info(name, TensorProto.INT64, [1]) for name in ("write_index", "kv_length")]

    def graph(op):
        return _model([helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node(op, ["y", "y"], ["logits"])],
                      [_tensor("x", [1, 3, HIDDEN]), *positions], [_tensor("logits", None)], [weight])

    rank, decode, verify = graph("Add"), graph("Mul"), graph("Max")
    model = step_model(rank, decode, verify)
    assert [i.name for i in model.graph.input][-2:] == [PLAIN_DECODE, TREE_VERIFY]
    x = rng.standard_normal((1, 3, HIDDEN)).astype(np.float32)
    y = x @ numpy_helper.to_array(weight)  # [B, R, V]
    feeds = {"x": x, "write_index": np.array([5]), "kv_length": np.array([8])}
    for plain, tree, expected in ((True, False, y * y), (True, True, y * y), (False, True, y), (False, False, y + y)):
        out = _run(model, {**feeds, PLAIN_DECODE: np.array(plain), TREE_VERIFY: np.array(tree)})
        np.testing.assert_allclose(out["logits"], expected, rtol=1e-5, atol=1e-5)
    # Each branch comes back out as the model it was built from, named as the step's outputs.
    for branch, op in ((decode_branch(model), "Mul"), (verify_branch(model), "Max")):
        assert [n.op_type for n in branch.graph.node] == ["MatMul", op]
        assert [o.name for o in branch.graph.output] == ["logits"]
        assert PLAIN_DECODE not in [i.name for i in branch.graph.input]
    assert verify_branch(step_model(rank, decode, None)) is None


def test_step_model_skips_the_medusa_heads_where_draft_heads_says_so():
    from trtbuild.builder.emit.cpu_step_model import decode_branch, step_model
    from trtbuild.contract.step import DRAFT_HEADS, PLAIN_DECODE, TREE_VERIFY

    rng = np.random.default_rng(6)
    vocab, heads = 4, 2
    lm_head = numpy_helper.from_array(rng.standard_normal((HIDDEN, vocab)).astype(np.float32), "lm_head")
    head_w = numpy_helper.from_array(rng.standard_normal((HIDDEN, heads * vocab)).astype(np.float32), "heads")
    shape = numpy_helper.from_array(np.array([0, 1, heads, vocab], np.int64), "heads_shape")
    positions = [helper.make_tensor_value_info(name, TensorProto.INT64, [2]) for name in ("write_index", "kv_length")]
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT32, [2, 1]), _tensor("x", [2, 1, HIDDEN]),
              *positions]
    outputs = [_tensor("logits", None), _tensor("medusa_logits", ["B", "R", heads, vocab])]

    def graph(op):
        return _model([helper.make_node(op, ["x", "x"], ["h"]),
                       helper.make_node("MatMul", ["h", "lm_head"], ["logits"]),
                       helper.make_node("MatMul", ["h", "heads"], ["flat"]),
                       helper.make_node("Reshape", ["flat", "heads_shape"], ["medusa_logits"])],
                      inputs, outputs, [lm_head, head_w, shape])

    decode = graph("Mul")
    model = step_model(graph("Add"), decode, graph("Max"))
    assert [i.name for i in model.graph.input][-3:] == [PLAIN_DECODE, TREE_VERIFY, DRAFT_HEADS]
    # The heads' weight lives in the branch that reads it (ONNX Runtime prepacks it there); lm_head stays.
    branch = decode_branch(model)
    (draft,) = [n for n in branch.graph.node if n.op_type == "If"]
    then = next(a.g for a in draft.attribute if a.name == "then_branch")
    assert {t.name for t in then.initializer} == {"heads", "heads_shape"}
    assert "lm_head" in {t.name for t in branch.graph.initializer} and "heads" not in \
        {t.name for t in branch.graph.initializer}
    x = rng.standard_normal((2, 1, HIDDEN)).astype(np.float32)
    feeds = {"input_ids": np.array([[3], [5]], np.int32), "x": x, "write_index": np.array([5, 9]),
             "kv_length": np.array([6, 10]), PLAIN_DECODE: np.array(True), TREE_VERIFY: np.array(False)}
    alone = _run(decode, {k: v for k, v in feeds.items() if k not in (PLAIN_DECODE, TREE_VERIFY)})
    drafted = _run(model, {**feeds, DRAFT_HEADS: np.array(True)})
    skipped = _run(model, {**feeds, DRAFT_HEADS: np.array(False)})
    assert np.array_equal(drafted["logits"], alone["logits"]) and np.array_equal(skipped["logits"], alone["logits"])
    assert np.array_equal(drafted["medusa_logits"], alone["medusa_logits"]) and alone["medusa_logits"].any()
    assert skipped["medusa_logits"].shape == (2, 1, heads, vocab) and not skipped["medusa_logits"].any()
    # Every other step ignores it: the rank graph and the verification graph compute the heads.
    for plain, tree in ((False, False), (False, True)):
        out = _run(model, {**feeds, PLAIN_DECODE: np.array(plain), TREE_VERIFY: np.array(tree),
                           DRAFT_HEADS: np.array(False)})
        assert out["medusa_logits"].any()
    # Without heads the decode graph is left as it was: no DRAFT_HEADS input.
    plain_model = step_model(*(_model([helper.make_node(op, ["x", "x"], ["h"]),
                                       helper.make_node("MatMul", ["h", "lm_head"], ["logits"])],
                                      inputs, outputs[:1], [lm_head]) for op in ("Add", "Mul")), None)
    assert DRAFT_HEADS not in [i.name for i in plain_model.graph.input]


def _row_gather_model(index_input):
    """hidden [B, S, D] → GatherElements at Expand(Unsqueeze(index)) → Add → RMSNormalization."""
    rng = np.random.default_rng(3)
    weight = numpy_helper.from_array(rng.standard_normal(HIDDEN).astype(np.float32), "w")
    shape = numpy_helper.from_array(np.array([2, 1, HIDDEN], np.int64), "shape")
    axes = numpy_helper.from_array(np.array([2], np.int64), "axes")
    nodes = [helper.make_node("Unsqueeze", [index_input, "axes"], ["index3"]),
             helper.make_node("Expand", ["index3", "shape"], ["index"]),
             helper.make_node("GatherElements", ["hidden", "index"], ["picked"], axis=1),
             helper.make_node("Add", ["picked", "residual"], ["sum"]),
             helper.make_node("RMSNormalization", ["sum", "w"], ["out"], epsilon=1e-5, axis=-1)]
    inputs = [_tensor("hidden", [2, 1, HIDDEN]), _tensor("residual", [2, 1, HIDDEN]),
              helper.make_tensor_value_info(index_input, TensorProto.INT64, [2, 1])]
    return _model(nodes, inputs, [_tensor("out", None)], [weight, shape, axes])


def test_drop_row_gather_bypasses_the_logits_row_gather_of_a_one_token_step():
    model = _row_gather_model("logits_index")
    dropped, count = _pair(drop_row_gather(model))
    assert count == 1
    assert [n.op_type for n in dropped.graph.node] == ["Unsqueeze", "Expand", "Add", "RMSNormalization"]
    fused, norms = _pair(skip_norm(dropped))  # the last norm now fuses like the others
    assert norms == 1
    rng = np.random.default_rng(4)
    feeds = {"hidden": rng.standard_normal((2, 1, HIDDEN)).astype(np.float32),
             "residual": rng.standard_normal((2, 1, HIDDEN)).astype(np.float32),
             "logits_index": np.zeros((2, 1), np.int64)}  # one token a row: index 0
    np.testing.assert_allclose(_run(fused, feeds)["out"], _run(model, feeds)["out"], rtol=1e-5, atol=1e-5)


def test_drop_row_gather_leaves_other_gathers():
    model = _row_gather_model("other_index")
    dropped, count = _pair(drop_row_gather(model))
    assert count == 0 and dropped.graph.node == model.graph.node


def test_int4_codes_concatenate_exactly_whatever_their_widths():
    from trtbuild.builder.passes.cpu_pack_qkv import _concat

    rng = np.random.default_rng(6)
    codes = [rng.integers(-8, 8, (3, n)) for n in (3, 5, 2)]  # rows of 1.5, 2.5 and 1 bytes
    tensors = [helper.make_tensor(f"c{i}", TensorProto.INT4, c.shape, c.flatten().tolist()) for i, c in enumerate(codes)]
    packed = _concat(tensors, 1, "packed", None)
    assert list(packed.dims) == [3, 10] and len(packed.raw_data) == 15
    assert numpy_helper.to_array(packed).tolist() == np.concatenate(codes, axis=1).tolist()


def _planted_heads_model(vocab: int, s_max: int, rng):
    """An LM head and one Medusa head reading ``hidden`` [B, R, HIDDEN] (the rows at logits_index),
    with the step inputs heads_at_path_end reads."""
    w_lm, w_head = (rng.standard_normal((HIDDEN, vocab)).astype(np.float32) for _ in range(2))
    axes = numpy_helper.from_array(np.array([2], np.int64), "axes")
    nodes = [helper.make_node("MatMul", ["hidden", "w_lm"], ["logits"], name="/model/lm_head/MatMul"),
             helper.make_node("MatMul", ["hidden", "w_head"], ["head"], name="/medusa_head.0/out/MatMul"),
             helper.make_node("Unsqueeze", ["head", "axes"], ["medusa_logits"], name="/medusa_head.0/out/Unsqueeze")]
    inputs = [_tensor("hidden", ["B", "R", HIDDEN]),
              helper.make_tensor_value_info("input_ids", TensorProto.INT32, ["B", "S"]),
              helper.make_tensor_value_info("position_ids", TensorProto.INT32, ["B", "S"]),
              helper.make_tensor_value_info("write_index", TensorProto.INT64, ["B"]),
              helper.make_tensor_value_info("kv_length", TensorProto.INT64, ["B"]),
              helper.make_tensor_value_info("attention_mask", TensorProto.BOOL, ["B", 1, "S", s_max]),
              helper.make_tensor_value_info("logits_index", TensorProto.INT64, ["B", "R"])]
    model = _model(nodes, inputs, [_tensor("logits", ["B", "R", vocab]), _tensor("medusa_logits", ["B", "R", 1, vocab])],
                   [numpy_helper.from_array(w_lm, "w_lm"), numpy_helper.from_array(w_head, "w_head"), axes])
    return model, w_lm, w_head


STEP_FEEDS = ("input_ids", "position_ids", "write_index", "kv_length", "attention_mask", "logits_index")


def test_heads_at_path_end_run_the_heads_where_greedy_acceptance_ends():
    """heads_at_path_end on a planted LM head and one Medusa head: for trees whose accepted path
    ends at the root, mid-tree or at a leaf, the graph's head logits equal the head at
    runtime.medusa.accept_greedy's last node, and the logits are untouched."""
    from trtbuild.builder.passes.heads_at_path_end import heads_at_path_end
    from trtbuild.contract.step import step_arrays
    from trtbuild.runtime.core.tree import Tree
    from trtbuild.runtime.speculation.medusa import accept_greedy

    vocab, s_max = 8, 32
    rng = np.random.default_rng(7)
    model, w_lm, w_head = _planted_heads_model(vocab, s_max, rng)
    rewritten, count = _pair(heads_at_path_end(model))
    assert count == 1
    tree = Tree(((0,), (1,), (0, 0), (1, 0), (0, 1), (0, 0, 0), (0, 0, 1), (2,)))
    ends = set()
    for trial in range(24):
        hidden = rng.standard_normal((1, tree.size, HIDDEN)).astype(np.float32)
        logits = hidden[0] @ w_lm  # [T, V]
        # Per depth, the rank whose guess is the argmax (3: none); the first trials reach a leaf and stop at the root.
        right = [np.zeros(tree.depth, int), np.full(tree.depth, 3)][trial] if trial < 2 else rng.integers(0, 4, tree.depth)
        tokens = [5] + [int((logits[tree.parents[n]].argmax() + path[-1] - right[len(path) - 1]) % vocab)
                        for n, path in enumerate(tree.choices, start=1)]
        arrays = step_arrays([tokens], [3 + trial % 16], s_max, trees=[tree]).as_dict()
        out = _run(rewritten, {"hidden": hidden, **{k: arrays[k] for k in STEP_FEEDS}})
        end = accept_greedy(tree, tokens, logits).last_node
        ends.add(end)
        np.testing.assert_allclose(out["logits"][0], logits, rtol=1e-5, atol=1e-5)
        assert out["medusa_logits"].shape == (1, 1, 1, vocab)
        np.testing.assert_allclose(out["medusa_logits"][0, 0, 0], hidden[0, end] @ w_head, rtol=1e-5, atol=1e-5)
    assert len(ends) >= 4 and 0 in ends and max(tree.depths[list(ends)]) == 3  # root, mid-tree and leaf ends


def test_heads_at_path_end_stop_at_a_plain_rows_only_token_and_at_the_one_row_of_a_prefill():
    """A verification step's plain row (one token, the rest padding) ends at its token even where
    its padding happens to be the argmax chain; a prefill (R = 1, the last token's row) ends at it."""
    from trtbuild.builder.passes.heads_at_path_end import heads_at_path_end
    from trtbuild.contract.step import step_arrays
    from trtbuild.runtime.core.tree import Tree

    vocab, s_max = 8, 32
    rng = np.random.default_rng(8)
    model, w_lm, w_head = _planted_heads_model(vocab, s_max, rng)
    rewritten = heads_at_path_end(model).model
    tree = Tree(((0,), (0, 0)))
    hidden = rng.standard_normal((2, tree.size, HIDDEN)).astype(np.float32)
    logits = hidden @ w_lm  # [B, T, V]
    chain = [int(logits[0, 0].argmax()), int(logits[0, 1].argmax())]  # the tree row: accepted to its leaf
    arrays = step_arrays([[5, *chain], [4]], [3, 9], s_max, trees=[tree, None]).as_dict()
    arrays["input_ids"][1, 1:] = [logits[1, 0].argmax(), logits[1, 1].argmax()]  # padding that would be accepted
    out = _run(rewritten, {"hidden": hidden, **{k: arrays[k] for k in STEP_FEEDS}})
    np.testing.assert_allclose(out["medusa_logits"][:, 0, 0], hidden[[0, 1], [2, 0]] @ w_head, rtol=1e-5, atol=1e-5)
    prefill = step_arrays([[1, 2, 3, 4, 5]], [0], s_max).as_dict()  # logits at the last token only
    last = hidden[:1, :1]
    out = _run(rewritten, {"hidden": last, **{k: prefill[k] for k in STEP_FEEDS}})
    np.testing.assert_allclose(out["medusa_logits"][0, 0, 0], last[0, 0] @ w_head, rtol=1e-5, atol=1e-5)

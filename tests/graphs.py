"""Hand-built decomposed graphs (onnx.helper) for fusion tests, with numpy inputs."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = [helper.make_opsetid("", 24)]


def _model(nodes, inputs, outputs, initializers) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "hand_built", inputs, outputs, initializers)
    return helper.make_model(graph, opset_imports=OPSET)


def _const(name: str, value) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(value), name)


def rmsnorm(power: float = 2.0, axis: int = -1, hidden: int = 16, eps: float = 1e-5) -> onnx.ModelProto:
    """y = w * (x * 1/sqrt(mean(x**power, axis) + eps)) over x [2, 3, hidden]."""
    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("Pow", ["x", "two"], ["sq"]),
        helper.make_node("ReduceMean", ["sq", "axes"], ["mean"], keepdims=1),
        helper.make_node("Add", ["mean", "eps"], ["var"]),
        helper.make_node("Sqrt", ["var"], ["std"]),
        helper.make_node("Reciprocal", ["std"], ["inv"]),
        helper.make_node("Mul", ["x", "inv"], ["normed"]),
        helper.make_node("Mul", ["weight", "normed"], ["y"]),
    ]
    inits = [_const("two", np.float32(power)), _const("axes", np.array([axis], np.int64)),
             _const("eps", np.float32(eps)), _const("weight", rng.standard_normal(hidden).astype(np.float32))]
    return _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, hidden])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3, hidden])], inits)


def rotary(batch=2, heads=3, seq=4, dim=8, s_max=16, theta=10000.0) -> onnx.ModelProto:
    """x * cos + rotate_half(x) * sin, cos/sin rows gathered from tables by position_ids."""
    inv = 1.0 / theta ** (np.arange(0, dim, 2) / dim)
    freqs = np.arange(s_max)[:, None] * inv[None, :]
    half = dim // 2
    nodes = []
    for name in ("cos", "sin"):
        nodes += [helper.make_node("Gather", [f"{name}_table", "position_ids"], [f"{name}_rows"]),
                  helper.make_node("Concat", [f"{name}_rows", f"{name}_rows"], [f"{name}_cat"], axis=-1),
                  helper.make_node("Unsqueeze", [f"{name}_cat", "one"], [name])]
    nodes += [
        helper.make_node("Slice", ["x", "half", "end", "minus_one"], ["upper"]),
        helper.make_node("Neg", ["upper"], ["neg"]),
        helper.make_node("Slice", ["x", "zero", "half", "minus_one"], ["lower"]),
        helper.make_node("Concat", ["neg", "lower"], ["rot"], axis=-1),
        helper.make_node("Mul", ["x", "cos"], ["xc"]),
        helper.make_node("Mul", ["rot", "sin"], ["rs"]),
        helper.make_node("Add", ["xc", "rs"], ["y"]),
    ]
    inits = [_const("cos_table", np.cos(freqs).astype(np.float32)), _const("sin_table", np.sin(freqs).astype(np.float32)),
             _const("one", np.array([1], np.int64)), _const("half", np.array([half], np.int64)),
             _const("end", np.array([2 ** 62], np.int64)), _const("zero", np.array([0], np.int64)),
             _const("minus_one", np.array([-1], np.int64))]
    return _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, heads, seq, dim]),
                          helper.make_tensor_value_info("position_ids", TensorProto.INT32, [batch, seq])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, heads, seq, dim])], inits)


def attention(batch=2, heads=4, kv_heads=2, seq=3, dim=8, s_max=16, fill=-3.4e38) -> onnx.ModelProto:
    """Cache scatter at write_index + GQA repeat + masked softmax attention, one layer."""
    group = heads // kv_heads
    nodes = [
        helper.make_node("Range", ["zero_s", "seq_len", "one_s"], ["steps"]),
        helper.make_node("Unsqueeze", ["write_index", "one"], ["wi"]),
        helper.make_node("Unsqueeze", ["steps", "zero"], ["st"]),
        helper.make_node("Add", ["wi", "st"], ["slots"]),
        helper.make_node("Unsqueeze", ["slots", "one_three"], ["slots4"]),
        helper.make_node("Expand", ["slots4", "index_shape"], ["index"]),
    ]
    for kind, new in (("key", "k"), ("value", "v")):
        nodes += [
            helper.make_node("ScatterElements", [f"past_{kind}_0", "index", new], [f"present_{kind}_0"], axis=2),
            helper.make_node("Unsqueeze", [f"present_{kind}_0", "two"], [f"{new}_u"]),
            helper.make_node("Expand", [f"{new}_u", "repeat_shape"], [f"{new}_e"]),
            helper.make_node("Reshape", [f"{new}_e", "heads_shape"], [f"{new}_rep"]),
        ]
    nodes += [
        helper.make_node("Transpose", ["k_rep"], ["kt"], perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["q", "kt"], ["qk"]),
        helper.make_node("Mul", ["qk", "scale"], ["scores"]),
        helper.make_node("Range", ["zero_s", "s_max", "one_s"], ["cache_pos"]),
        helper.make_node("Unsqueeze", ["cache_pos", "zero"], ["cp"]),
        helper.make_node("Unsqueeze", ["kv_length", "one"], ["kl"]),
        helper.make_node("Less", ["cp", "kl"], ["valid"]),
        helper.make_node("Unsqueeze", ["valid", "one_two"], ["valid4"]),
        helper.make_node("And", ["attention_mask", "valid4"], ["mask"]),
        helper.make_node("Not", ["mask"], ["masked"]),
        helper.make_node("Where", ["masked", "fill", "scores"], ["filled"]),
        helper.make_node("Softmax", ["filled"], ["probs"], axis=-1),
        helper.make_node("MatMul", ["probs", "v_rep"], ["y"]),
    ]
    inits = [_const("zero_s", np.int64(0)), _const("one_s", np.int64(1)), _const("seq_len", np.int64(seq)),
             _const("s_max", np.int64(s_max)), _const("zero", np.array([0], np.int64)),
             _const("one", np.array([1], np.int64)), _const("two", np.array([2], np.int64)),
             _const("one_two", np.array([1, 2], np.int64)), _const("one_three", np.array([1, 3], np.int64)),
             _const("index_shape", np.array([batch, kv_heads, seq, dim], np.int64)),
             _const("repeat_shape", np.array([batch, kv_heads, group, s_max, dim], np.int64)),
             _const("heads_shape", np.array([batch, heads, s_max, dim], np.int64)),
             _const("scale", np.float32(dim ** -0.5)), _const("fill", np.float32(fill))]
    f = TensorProto.FLOAT
    inputs = [helper.make_tensor_value_info("q", f, [batch, heads, seq, dim]),
              helper.make_tensor_value_info("k", f, [batch, kv_heads, seq, dim]),
              helper.make_tensor_value_info("v", f, [batch, kv_heads, seq, dim]),
              helper.make_tensor_value_info("past_key_0", f, [batch, kv_heads, s_max, dim]),
              helper.make_tensor_value_info("past_value_0", f, [batch, kv_heads, s_max, dim]),
              helper.make_tensor_value_info("write_index", TensorProto.INT64, [batch]),
              helper.make_tensor_value_info("kv_length", TensorProto.INT64, [batch]),
              helper.make_tensor_value_info("attention_mask", TensorProto.BOOL, [batch, 1, seq, s_max])]
    outputs = [helper.make_tensor_value_info("y", f, [batch, heads, seq, dim]),
               helper.make_tensor_value_info("present_key_0", f, [batch, kv_heads, s_max, dim]),
               helper.make_tensor_value_info("present_value_0", f, [batch, kv_heads, s_max, dim])]
    return _model(nodes, inputs, outputs, inits)


def attention_inputs(batch=2, heads=4, kv_heads=2, seq=3, dim=8, s_max=16, seed=0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    write = np.array([0, 5], np.int64)[:batch]
    positions = write[:, None] + np.arange(seq)[None, :]
    feeds = {"q": rng.standard_normal((batch, heads, seq, dim)).astype(np.float32),
             "k": rng.standard_normal((batch, kv_heads, seq, dim)).astype(np.float32),
             "v": rng.standard_normal((batch, kv_heads, seq, dim)).astype(np.float32),
             "write_index": write, "kv_length": write + seq,
             "attention_mask": np.arange(s_max)[None, None, None, :] <= positions[:, None, :, None]}
    for kind in ("key", "value"):
        cache = np.zeros((batch, kv_heads, s_max, dim), np.float32)
        for b in range(batch):
            cache[b, :, : write[b]] = rng.standard_normal((kv_heads, write[b], dim))
        feeds[f"past_{kind}_0"] = cache
    return feeds

"""fuse_attention: cache scatter + matmul/where/softmax/matmul → ``TensorScatter`` ×2 + ``Attention``.

Before: ``present_k = ScatterElements(past_k, slots, k, axis=2)`` (same for v), the caches
repeated to every query head (GQA), ``softmax(where(!mask, min, q @ kᵀ * scale)) @ v``.
After: ``present_k = TensorScatter(past_k, k, write_index)`` (in place in TensorRT) and
``Attention(q, present_k[:, :, :L], present_v[:, :, :L], attention_mask[..., :L],
nonpad_kv_seqlen=kv_length)`` with ``L = max(kv_length)``; Attention does the head grouping
and the per-row length mask itself.
"""
from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from .fusion import Fusion, Match, new_node, shared_node
from .pattern import Constant, Either, Op, Optional, Tensor, ancestors_include, constant_value, producer


def _cache(name: str) -> Either:
    scatter = Op("ScatterElements", name=f"{name}_scatter",
                 inputs=(Tensor(f"past_{name}"), Tensor("slots"), Tensor(f"new_{name}")))
    repeated = Op("Reshape", inputs=(Op("Expand", inputs=(Op("Unsqueeze", inputs=(scatter, Constant(f"{name}_axis"))),
                                                        Tensor(f"{name}_shape"))), Tensor(f"{name}_rshape")))
    return Either((repeated, scatter))


PATTERN = Op("MatMul", inputs=(
    Optional("Cast", Op("Softmax", name="softmax", inputs=(
        Op("Where", inputs=(
            Op("Not", inputs=(Tensor("mask"),)),
            Constant("fill"),
            Optional("Cast", Op("Mul", commutative=True, inputs=(
                Op("MatMul", inputs=(Tensor("q"), Op("Transpose", name="k_transpose", inputs=(_cache("k"),)))),
                Constant("scale")))),
        )),
    ))),
    _cache("v"),
))


def _graph_input(tensor, name: str) -> bool:
    return isinstance(tensor, gs.Variable) and tensor.name == name and producer(tensor) is None


def _check(found: Match, ctx) -> str | None:
    for name in ("k", "v"):
        scatter = found[f"{name}_scatter"]
        if scatter.attrs.get("axis") not in (2, -2) or scatter.attrs.get("reduction", "none") not in ("none", b"none"):
            return f"{name} cache update is not a plain scatter along the sequence axis"
        if not _graph_input(found[f"past_{name}"], found[f"past_{name}"].name) or \
                not found[f"past_{name}"].name.startswith(f"past_{'key' if name == 'k' else 'value'}_"):
            return f"{name} cache is not a past_* graph input"
    if found["k_transpose"].attrs.get("perm") != [0, 1, 3, 2]:
        return "keys are not transposed on their last two axes"
    if found["softmax"].attrs.get("axis", -1) not in (-1, 3):
        return "softmax is not over the last axis"
    if float(np.asarray(constant_value(found["fill"])).reshape(-1)[0]) > -1e30:
        return "masked scores are not filled with a large negative value"
    if not ancestors_include(found["slots"], "write_index"):
        return "cache write positions do not come from write_index"
    if not (ancestors_include(found["mask"], "attention_mask") and ancestors_include(found["mask"], "kv_length")):
        return "mask does not come from attention_mask and kv_length"
    return None


def _input(graph: gs.Graph, name: str) -> gs.Variable:
    return next(t for t in graph.inputs if t.name == name)


def _used_length(graph: gs.Graph) -> gs.Variable:
    """max(kv_length) as a 1-D slice end: attention reads only the filled part of the caches."""
    def build():
        out = gs.Variable("kv_used_length", dtype=np.int64, shape=[1])
        return new_node("ReduceMax", "/model/attention/kv_used_length", [_input(graph, "kv_length")],
                        {"keepdims": 1}, [out])
    return shared_node(graph, "/model/attention/kv_used_length", build)


def _slice_cache(graph: gs.Graph, tensor, axis: int, name: str) -> tuple[gs.Node, gs.Variable]:
    zero = gs.Constant(f"{name}/start", np.array([0], np.int64))
    axes = gs.Constant(f"{name}/axis", np.array([axis], np.int64))
    out = gs.Variable(f"{tensor.name}_used", dtype=tensor.dtype)
    return new_node("Slice", name, [tensor, zero, _used_length(graph), axes], outputs=[out]), out


def _replace(found: Match, graph: gs.Graph, ctx) -> list[gs.Node]:
    nodes = []
    write_index = _input(graph, "write_index")
    presents = {}
    for name in ("k", "v"):
        scatter = found[f"{name}_scatter"]
        present = scatter.outputs[0]
        scatter.outputs.clear()
        nodes.append(new_node("TensorScatter", scatter.name.rsplit("/", 1)[0] + f"/TensorScatter_{name}",
                              [found[f"past_{name}"], found[f"new_{name}"], write_index],
                              {"axis": -2, "mode": "linear"}, [present]))
        presents[name] = present
    # Attention reads the caches only up to the longest valid length in the batch: positions
    # past every row's kv_length are masked anyway, and S_max can be far longer than any row.
    used = {}
    for name in ("k", "v"):
        node, used[name] = _slice_cache(graph, presents[name], 2, f"{found.scope}/Slice_{name}")
        nodes.append(node)
    mask = shared_node(graph, "/model/attention/mask_used",
                   lambda: _slice_cache(graph, _input(graph, "attention_mask"), 3, "/model/attention/mask_used")[0])
    scale = float(np.asarray(constant_value(found["scale"])).reshape(-1)[0])
    inputs = [found["q"], used["k"], used["v"], mask, gs.Variable.empty(), gs.Variable.empty(),
              _input(graph, "kv_length")]
    nodes.append(new_node("Attention", f"{found.scope}/Attention", inputs, {"scale": scale}))
    return nodes


fuse_attention = Fusion(name="fuse_attention", root_op="MatMul", pattern=PATTERN, replace=_replace,
                        check=_check, expected=lambda arch: arch.num_layers)

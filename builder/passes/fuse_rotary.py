"""fuse_rotary: ``x * cos + rotate_half(x) * sin`` → ``RotaryEmbedding`` (opset 23).

The step graph gathers cos/sin rows from constant tables [S_max, Dh/2] by ``position_ids``;
those tables become the op's ``cos_cache``/``sin_cache`` and ``position_ids`` its input.
"""
from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from .fusion import Fusion, Match, new_node, shared_node
from .pattern import Constant, Either, Op, Optional, Tensor, constant_value, match


PATTERN = Op("Add", commutative=True, inputs=(
    Op("Mul", commutative=True, inputs=(Tensor("x"), Tensor("cos"))),
    Op("Mul", commutative=True, inputs=(
        Op("Concat", inputs=(Op("Neg", inputs=(Op("Slice", name="upper"),)), Op("Slice", name="lower"))),
        Tensor("sin"))),
))

# cos = unsqueeze(cat(table[position_ids], table[position_ids]), 1), possibly cast
_TABLE_ROWS = Either((
    Op("Gather", inputs=(Constant("table"), Optional("Cast", Tensor("positions")))),
    Op("GatherND", inputs=(Constant("table"), Op("Unsqueeze", inputs=(
        Optional("Cast", Tensor("positions")), Constant("axes"))))),
))
TABLE = Optional("Cast", Op("Unsqueeze", inputs=(
    Optional("Cast", Op("Concat", inputs=(Tensor("rows"), Tensor("rows")))), Constant("axis"))))


def _slice_bounds(node: gs.Node):
    starts, ends = (int(np.asarray(constant_value(t)).reshape(-1)[0]) for t in node.inputs[1:3])
    axes = int(np.asarray(constant_value(node.inputs[3])).reshape(-1)[0]) if len(node.inputs) > 3 else None
    return starts, ends, axes


def _table(tensor) -> tuple[gs.Tensor, gs.Tensor] | None:
    """(the constant table, the tensor indexing its rows) behind a cos or sin input."""
    outer = match(TABLE, tensor)
    inner = match(_TABLE_ROWS, outer["rows"]) if outer is not None else None
    return (inner["table"], inner["positions"]) if inner is not None else None


def _check(found: Match, ctx) -> str | None:
    x = found["x"]
    for name in ("upper", "lower"):
        node = found[name]
        if node.inputs[0] is not x or any(constant_value(t) is None for t in node.inputs[1:]):
            return "rotate_half does not slice x by constants"
    dim = x.shape[-1] if x.shape else None
    if not isinstance(dim, int) or dim % 2:
        return f"head dim {dim} is not a known even number"
    half = dim // 2
    up, low = _slice_bounds(found["upper"]), _slice_bounds(found["lower"])
    if up[0] != half or low[0] != 0 or low[1] != half or up[2] not in (-1, 3, None):
        return f"slices {up}, {low} are not the two halves of the last axis"
    for name in ("cos", "sin"):
        table = _table(found[name])
        if table is None:
            return f"{name} is not gathered from a constant table by position"
        values, positions = np.asarray(constant_value(table[0])), table[1]
        if values.ndim != 2 or values.shape[1] != half:
            return f"{name} table has shape {values.shape}, not [S_max, {half}]"
        if not (isinstance(positions, gs.Variable) and positions.name == "position_ids"):
            return f"{name} rows are indexed by {positions.name}, not the position_ids input"
    return None


def _positions_int64(graph: gs.Graph) -> gs.Variable:
    """One shared int64 view of position_ids (the contract feeds int32; the op wants int64)."""
    def build() -> gs.Node:
        positions = next(t for t in graph.inputs if t.name == "position_ids")
        out = gs.Variable("position_ids_int64", dtype=np.int64, shape=positions.shape)
        return new_node("Cast", "/model/rotary/position_ids_int64", [positions], {"to": 7}, [out])
    return shared_node(graph, "/model/rotary/position_ids_int64", build)


def _replace(found: Match, graph: gs.Graph, ctx) -> list[gs.Node]:
    # The step graph's tables are already the op's caches: [S_max, Dh/2], indexed by position.
    inputs = [found["x"], _table(found["cos"])[0], _table(found["sin"])[0], _positions_int64(graph)]
    return [new_node("RotaryEmbedding", f"{found.scope}/RotaryEmbedding", inputs, {"interleaved": 0})]


fuse_rotary = Fusion(name="fuse_rotary", root_op="Add", pattern=PATTERN, replace=_replace,
                     check=_check, expected=lambda arch: 2 * arch.num_layers)

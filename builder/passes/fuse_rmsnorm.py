"""fuse_rmsnorm: ``w * (x * rsqrt(mean(x**2, -1) + eps))`` → ``RMSNormalization`` (opset 23)."""
from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from .fusion import Fusion, Match, new_node
from .pattern import Constant, Op, Optional, Tensor, constant_value

# transformers' RMSNorm: x.float(); x * rsqrt(x.pow(2).mean(-1, keepdim=True) + eps); w * x.to(dtype)
PATTERN = Op("Mul", commutative=True, inputs=(
    Constant("weight"),
    Optional("Cast", Op("Mul", commutative=True, inputs=(
        Tensor("x32"),
        Op("Reciprocal", inputs=(Op("Sqrt", inputs=(Op("Add", commutative=True, inputs=(
            Op("ReduceMean", name="mean", inputs=(
                Op("Pow", inputs=(Tensor("x32"), Constant("two"))), Constant("axes"))),
            Constant("eps"))),)),)),
    ))),
))


def _check(found: Match, ctx) -> str | None:
    if float(np.asarray(constant_value(found["two"])).reshape(-1)[0]) != 2.0:
        return "power is not 2"
    axes = np.asarray(constant_value(found["axes"])).reshape(-1).tolist()
    rank = len(found["x32"].shape) if found["x32"].shape else None
    if axes not in ([-1],) and not (rank and axes == [rank - 1]):
        return f"reduces over axes {axes}, not the last"
    if found["mean"].attrs.get("keepdims", 1) != 1:
        return "mean does not keep dims"
    return None


def _replace(found: Match, graph: gs.Graph, ctx) -> list[gs.Node]:
    x = found["x32"]
    cast = x.inputs[0] if len(x.inputs) == 1 and x.inputs[0].op == "Cast" else None
    source = cast.inputs[0] if cast is not None else x  # the norm's input before any up-cast
    eps = float(np.asarray(constant_value(found["eps"])).reshape(-1)[0])
    return [new_node("RMSNormalization", f"{found.scope}/RMSNormalization", [source, found["weight"]],
                     {"axis": -1, "epsilon": eps, "stash_type": int(onnx.TensorProto.FLOAT)})]


def _expected(arch) -> int:
    per_layer = 4 if arch.qk_norm else 2
    return arch.num_layers * per_layer + 1


fuse_rmsnorm = Fusion(name="fuse_rmsnorm", root_op="Mul", pattern=PATTERN, replace=_replace,
                      check=_check, expected=_expected)

"""``DistCollective``: the collective of tensor-parallel rank graphs (domain ``trtbuild``).

TensorRT side: its ONNX parser imports ``DistCollective`` by op type, in any domain, into
``IDistCollectiveLayer`` (checked with TensorRT-RTX 1.7, ahead of time, no GPU); the
execution context takes the NCCL communicator through ``set_communicator``. Attributes as
TensorRT wants them: all_reduce ``reduce_op="sum", root=-1``; all_gather ``reduce_op="none",
root=-1, nb_rank=N``, gathering along axis 0.

CPU side: ONNX Runtime has no such op, so rank graphs are cut at their collectives
(plugins/onnxruntime/segments.py) and the collective runs between the pieces: in numpy here (the
numerics check, all ranks in one process) or over torch.distributed (the runtime).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

OP, DOMAIN = "DistCollective", "trtbuild"
ALL_REDUCE, ALL_GATHER = "all_reduce", "all_gather"


@dataclass(frozen=True)
class Collective:
    """One DistCollective node as data: what it does, over how many ranks, input → output."""

    operation: str   # all_reduce | all_gather
    world: int
    input: str
    output: str

    @classmethod
    def of(cls, node) -> "Collective":
        """From an onnx NodeProto."""
        attrs = {a.name: a for a in node.attribute}
        operation = attrs["collective_operation"].s.decode()
        world = attrs["nb_rank"].i if "nb_rank" in attrs else 0
        return cls(operation, world, node.input[0], node.output[0])

    def reference(self, inputs: list[np.ndarray]) -> list[np.ndarray]:
        """What each rank receives, given every rank's input (numpy; float64 accumulation)."""
        if self.operation == ALL_REDUCE:
            total = np.sum([x.astype(np.float64) for x in inputs], axis=0).astype(inputs[0].dtype)
            return [total] * len(inputs)
        if self.operation == ALL_GATHER:
            return [np.concatenate(inputs, axis=0)] * len(inputs)
        raise ValueError(f"{OP}: collective_operation {self.operation!r} is not implemented on CPU")


def all_reduce(graph: gs.Graph, x: gs.Variable, world: int, name: str) -> gs.Variable:
    """Sum of ``x`` over the ranks, same shape."""
    out = gs.Variable(f"{name}_out", dtype=x.dtype, shape=x.shape)
    graph.layer(op=OP, name=name, inputs=[x], outputs=[out], domain=DOMAIN,
                attrs={"collective_operation": ALL_REDUCE, "reduce_op": "sum", "root": -1, "nb_rank": world})
    return out


def all_gather_last_axis(graph: gs.Graph, x: gs.Variable, world: int, name: str, dims: int) -> gs.Variable:
    """Every rank's ``x`` [..., V/N] concatenated on the last axis → [..., V], in rank order.

    TensorRT gathers along axis 0, so the last axis goes first and back: a transpose of the
    logits rows only (logits_index), never of the hidden states. ``dims``: the rank of ``x``."""
    to_front = [dims - 1, *range(dims - 1)]
    to_back = [*range(1, dims), 0]
    front = gs.Variable(f"{name}/front", dtype=x.dtype)
    gathered = gs.Variable(f"{name}/gathered", dtype=x.dtype)
    out = gs.Variable(f"{name}_out", dtype=x.dtype)
    graph.layer(op="Transpose", name=f"{name}/ToFront", inputs=[x], outputs=[front], attrs={"perm": to_front})
    graph.layer(op=OP, name=name, inputs=[front], outputs=[gathered], domain=DOMAIN,
                attrs={"collective_operation": ALL_GATHER, "reduce_op": "none", "root": -1, "nb_rank": world})
    graph.layer(op="Transpose", name=f"{name}/ToBack", inputs=[gathered], outputs=[out], attrs={"perm": to_back})
    return out

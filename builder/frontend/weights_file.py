"""The step graph's weights written into its external-data file, one tensor at a time, from the
checkpoint's weight map; a Linear's weight is stored transposed ([in, out]) so its MatMul reads
it directly.

Memory holds one tensor (and its converted or transposed copy), never the model.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import onnx
import torch

from ...checkpoint.weight_map import WeightMap
from ..spec.dtype import DType

ALIGN = 64  # bytes: each tensor starts aligned, so a memory map of it is aligned for any dtype


@dataclass(frozen=True)
class GraphWeight:
    """One weight initializer of the exported graph and where its values come from: a
    checkpoint tensor (``key``) or values computed at export (the rotary tables)."""

    name: str
    shape: tuple[int, ...]
    key: str | None
    values: torch.Tensor | None


def fold_weight_transposes(graph: onnx.GraphProto, weights: set[str]) -> dict[str, str]:
    """Removes each ``Transpose(W)`` (2-D, perm [1, 0]) whose weight feeds nothing else; its
    consumers read a new initializer ``W.T`` instead. Returns {new name: weight name}.
    A weight read twice (a tied embedding: Gather and lm_head) keeps its Transpose."""
    uses = Counter(name for node in graph.node for name in node.input if name in weights)
    transposed, renamed, kept = {}, {}, []
    for node in graph.node:
        perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), [1, 0])
        if node.op_type == "Transpose" and node.input[0] in weights and uses[node.input[0]] == 1 and perm == [1, 0]:
            new = f"{node.input[0]}.T"
            transposed[new] = node.input[0]
            renamed[node.output[0]] = new
        else:
            kept.append(node)
    del graph.node[:]
    graph.node.extend(kept)
    for node in graph.node:
        for index, name in enumerate(node.input):
            if name in renamed:
                node.input[index] = renamed[name]
    return transposed


def write_weights(graph: onnx.GraphProto, graph_weights: dict[str, GraphWeight], transposed: dict[str, str],
                  weights: WeightMap, dtype: DType, data_path: Path) -> int:
    """Streams every weight the graph reads into ``data_path`` (in order of first use, so the same
    graph gives the same bytes) and declares it as an external initializer; returns the bytes written."""
    order = list(dict.fromkeys(name for node in graph.node for name in node.input
                               if name in graph_weights or name in transposed))
    offset = written = 0
    onnx_type = dtype.onnx
    with open(data_path, "wb") as out:
        for name in order:
            weight = graph_weights[transposed.get(name, name)]
            tensor = _values(weight, weights, dtype.torch)
            if tuple(tensor.shape) != weight.shape:
                raise ValueError(f"checkpoint tensor {weight.key} has shape {tuple(tensor.shape)}; "
                                 f"the graph expects {weight.shape}")
            if name in transposed:
                tensor = tensor.t()
            data = tensor.contiguous().view(torch.uint8).numpy()
            pad = -offset % ALIGN
            out.write(b"\0" * pad)
            offset += pad
            out.write(memoryview(data).cast("B"))
            initializer = onnx.TensorProto(name=name, data_type=onnx_type, dims=list(tensor.shape))
            initializer.data_location = onnx.TensorProto.EXTERNAL
            for key, value in (("location", data_path.name), ("offset", str(offset)), ("length", str(data.nbytes))):
                entry = initializer.external_data.add()
                entry.key, entry.value = key, value
            graph.initializer.append(initializer)
            offset += data.nbytes
            written += data.nbytes
            del tensor, data
    return written


def _values(weight: GraphWeight, weights: WeightMap, dtype: torch.dtype) -> torch.Tensor:
    if weight.values is not None:
        return weight.values.to(dtype)
    return weights.for_shape(weight.key, weight.shape, dtype)  # a vocabulary cut for the numerics check

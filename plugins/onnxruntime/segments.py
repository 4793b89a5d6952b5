"""Rank graphs cut at their collectives, for ONNX Runtime (which has no DistCollective).

A rank model becomes segments: runs of nodes between collectives, each a model of its own
whose inputs are what it reads from the step's inputs or from earlier segments and
collectives, and whose outputs are what later ones (or the step's outputs) read. Between two
segments sits one ``Collective``. Weights stay where they are: segments reference the rank's
external-data file, resolved from ``base_dir``.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
from onnx import helper

from . import session as ort_config
from .session import CpuActivations, Spinning
from ..collectives import OP, Collective


@dataclass
class Segment:
    model: onnx.ModelProto | None  # None: no nodes (a collective's output is the step's output)
    inputs: list[str]
    outputs: list[str]
    collective: Collective | None   # runs after this segment; None for the last


def _elem_types(model: onnx.ModelProto) -> dict[str, int]:
    """Element type of every tensor: shape inference over a copy whose collectives are Identity
    (a collective keeps its input's type)."""
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    for node in probe.graph.node:
        if node.op_type == OP:
            node.op_type, node.domain = "Identity", ""
            del node.attribute[:]
    del probe.graph.initializer[:]  # types come from the graph's declared inputs; weights below
    types = {v.name: v.type.tensor_type.elem_type for v in (*model.graph.input, *model.graph.output)}
    types.update({t.name: t.data_type for t in model.graph.initializer})
    probe.graph.input.extend(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
                             for t in model.graph.initializer)
    inferred = onnx.shape_inference.infer_shapes(probe, strict_mode=False)
    for value in inferred.graph.value_info:
        types.setdefault(value.name, value.type.tensor_type.elem_type)
    return types


def split(model: onnx.ModelProto) -> list[Segment]:
    """The model's nodes (in topological order) cut at each DistCollective."""
    graph = model.graph
    runs: list[list[onnx.NodeProto]] = [[]]
    collectives: list[Collective] = []
    for node in graph.node:
        if node.op_type == OP:
            collectives.append(Collective.of(node))
            runs.append([])
        else:
            runs[-1].append(node)
    initializers = {t.name: t for t in graph.initializer}
    graph_outputs = [o.name for o in graph.output]
    types = _elem_types(model)
    # What each later piece reads: segment nodes' inputs, and each collective's input.
    needed_after: list[set[str]] = []
    later: set[str] = set(graph_outputs)
    for index in range(len(runs) - 1, -1, -1):
        needed_after.insert(0, set(later))
        later |= {name for node in runs[index] for name in node.input if name}
        if index > 0:
            later.add(collectives[index - 1].input)
    segments = []
    for index, nodes in enumerate(runs):
        collective = collectives[index] if index < len(collectives) else None
        if not nodes:
            segments.append(Segment(None, [], [], collective))
            continue
        produced = {name for node in nodes for name in node.output}
        read = list(dict.fromkeys(name for node in nodes for name in node.input if name))
        inputs = [n for n in read if n not in produced and n not in initializers]
        wanted = needed_after[index] | ({collective.input} if collective else set())
        outputs = [n for node in nodes for n in node.output if n in wanted]
        body = helper.make_graph(
            nodes, f"{graph.name}_segment{index}",
            [helper.make_tensor_value_info(n, types[n], None) for n in inputs],
            [helper.make_tensor_value_info(n, types[n], None) for n in outputs],
            [initializers[n] for n in read if n in initializers])
        segment_model = helper.make_model(body, opset_imports=[i for i in model.opset_import if i.domain != "trtbuild"],
                                          ir_version=model.ir_version)
        segments.append(Segment(segment_model, inputs, outputs, collective))
    return segments


class SegmentedRank:
    """One rank's segments as ONNX Runtime sessions."""

    def __init__(self, model: onnx.ModelProto, base_dir: Path | None, threads: int = 0,
                 activations: CpuActivations = CpuActivations.float):
        self.outputs = [o.name for o in model.graph.output]
        self.segments = split(model)
        self.sessions = [None if s.model is None else
                         ort_config.session(s.model, threads, base_dir, Spinning.never, activations)
                         for s in self.segments]


CollectiveFn = Callable[[Collective, np.ndarray], np.ndarray]


class LocalRanks:
    """All ranks of a tensor-parallel step in this process, collectives in numpy: the build's
    numerics check and ``trtbuild eval`` (exact sums, no process group needed)."""

    def __init__(self, models: list[onnx.ModelProto], base_dir: Path | None, threads: int = 0,
                 activations: CpuActivations = CpuActivations.float):
        self.ranks = [SegmentedRank(model, base_dir, threads, activations) for model in models]
        self.output_names = [o.name for o in models[0].graph.output]

    def run(self, feeds: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
        values = [dict(f) for f in feeds]
        for index in range(len(self.ranks[0].segments)):
            for rank, state in zip(self.ranks, values):
                session = rank.sessions[index]
                if session is not None:
                    state.update(ort_config.run(session, state))
            collective = self.ranks[0].segments[index].collective
            if collective is not None:
                received = collective.reference([state[collective.input] for state in values])
                for state, value in zip(values, received):
                    state[collective.output] = value
        return [{name: state[name] for name in self.output_names} for state in values]


def run_ranks(models: list[onnx.ModelProto], feeds: list[dict[str, np.ndarray]],
              base_dir: Path | None, activations: CpuActivations = CpuActivations.float) -> list[dict[str, np.ndarray]]:
    """One step of all ranks' graphs (see LocalRanks)."""
    return LocalRanks(models, base_dir, 0, activations).run(feeds)

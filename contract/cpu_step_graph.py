"""One ONNX Runtime model for every CPU step: an ``If`` on the bool input ``plain_decode`` runs the
CPU decode graph (contract/cpu_decode_graph.py) for plain decode steps and the rank graph for
everything else (prefill chunks, Medusa verification).

Why one model and not two sessions: each ONNX Runtime session owns a thread pool whose idle
worker keeps spinning for milliseconds after a run, so with two sessions on 2 cores a prefill
after decode steps ran 2× slower (benchmarks/cpu_decode.py). In one session the steps share one
pool; the If costs a few microseconds a step.

Each branch holds the initializers it reads (copies of the same TensorProtos, external data
included, so the weights file is not duplicated): ONNX Runtime's subgraph rewrites, e.g.
``DequantizeLinear → MatMul`` into its n-bit GEMM, only find weights in their own graph.
"""
from __future__ import annotations

import onnx
from onnx import TensorProto, helper

PLAIN_DECODE = "plain_decode"  # bool scalar: the step is a plain decode step (one token a row)


def _branch(model: onnx.ModelProto, tag: str, outputs: list[str]) -> onnx.GraphProto:
    """``model``'s graph as a subgraph: the step's outputs renamed (a subgraph may not produce a
    name the outer graph defines), the initializers its nodes read, no inputs of its own."""
    rename = {name: f"{tag}/{name}" for name in outputs}
    graph = onnx.GraphProto(name=f"{tag}_step")
    graph.node.extend(model.graph.node)
    for node in graph.node:
        for i, name in enumerate(node.output):
            node.output[i] = rename.get(name, name)
        for i, name in enumerate(node.input):
            node.input[i] = rename.get(name, name)
    read = {name for node in graph.node for name in node.input}
    graph.initializer.extend(t for t in model.graph.initializer if t.name in read)
    for value in model.graph.output:
        out = graph.output.add()
        out.CopyFrom(value)
        out.name = rename[value.name]
    return graph


def step_model(rank: onnx.ModelProto, decode: onnx.ModelProto) -> onnx.ModelProto:
    """The rank graph's inputs plus ``plain_decode``, its outputs, chosen by one If node."""
    outputs = [o.name for o in rank.graph.output]
    if [o.name for o in decode.graph.output] != outputs:
        raise ValueError("the decode graph's outputs differ from the rank graph's")
    step = helper.make_node("If", [PLAIN_DECODE], outputs, name="cpu_step",
                            then_branch=_branch(decode, "decode", outputs), else_branch=_branch(rank, "rank", outputs))
    graph = helper.make_graph([step], "cpu_step", [*rank.graph.input,
                                                   helper.make_tensor_value_info(PLAIN_DECODE, TensorProto.BOOL, [])],
                              list(rank.graph.output))
    model = helper.make_model(graph, opset_imports=list(decode.opset_import))
    model.ir_version = rank.ir_version
    return model

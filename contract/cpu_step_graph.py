"""One ONNX Runtime model for every CPU step: an ``If`` on the bool input ``plain_decode`` runs the
CPU decode graph (contract/cpu_decode_graph.py) for plain decode steps and the rank graph for
everything else (prefill chunks, Medusa verification).

Why one model and not two sessions: each ONNX Runtime session owns a thread pool whose idle
worker keeps spinning for milliseconds after a run, so with two sessions on 2 cores a prefill
after decode steps ran 2× slower (benchmarks/cpu_decode.py). In one session the steps share one
pool; the If costs 12–18 µs of a batch-1 step on the bundled model (3–4 %; at batch 8 it is
within the noise of benchmarks/cpu_step_overheads.py).
ONNX Runtime's process-wide pool (``set_global_thread_pool_sizes`` with
``use_per_session_threads = False``) would let two sessions share workers without the If, but
once it exists every session the process creates must opt in: a default ``InferenceSession``,
the user's own included, then fails ("use_per_session_threads must be false when using a global
thread pool", onnxruntime 1.32), and the pool cannot be resized or replaced. A library cannot
impose that, so the runtime does not use it.

After the If, the model also computes each row's next decode inputs from the step's logits
(``NEXT_INPUTS``): the argmax as ``input_ids``, and ``write_index``/``kv_length`` one further.
The runtime binds them onto its input buffers, so greedy steps run back to back (runtime/llm.py,
multi-step) with nothing but the run between them: Python's numpy calls between runs cost
10–25 µs each on caches the run just evicted.

Each branch holds the initializers it reads (copies of the same TensorProtos, external data
included, so the weights file is not duplicated): ONNX Runtime's subgraph rewrites, e.g.
``DequantizeLinear → MatMul`` into its n-bit GEMM, only find weights in their own graph.
"""
from __future__ import annotations

import onnx
from onnx import TensorProto, helper

PLAIN_DECODE = "plain_decode"  # bool scalar: the step is a plain decode step (one token a row)
# Outputs: the inputs of the next greedy decode step, as a plain decode step leaves them.
NEXT_INPUTS = {"input_ids": "next_input_ids", "write_index": "next_write_index", "kv_length": "next_kv_length"}


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
    graph = helper.make_graph([step, *_next_inputs()], "cpu_step",
                              [*rank.graph.input, helper.make_tensor_value_info(PLAIN_DECODE, TensorProto.BOOL, [])],
                              [*rank.graph.output, *_next_outputs()])
    model = helper.make_model(graph, opset_imports=list(decode.opset_import))
    model.ir_version = rank.ir_version
    return model


def feeding_decode_model(decode: onnx.ModelProto) -> onnx.ModelProto:
    """The decode graph with the NEXT_INPUTS nodes and no If: what the step model runs at a plain
    decode step, less the If (benchmarks/cpu_step_overheads.py measures the difference)."""
    model = onnx.ModelProto()
    model.CopyFrom(decode)
    model.graph.node.extend(_next_inputs())
    model.graph.output.extend(_next_outputs())
    return model


def _next_outputs() -> list[onnx.ValueInfoProto]:
    return [helper.make_tensor_value_info(NEXT_INPUTS["input_ids"], TensorProto.INT32, ["B", "R"]),
            helper.make_tensor_value_info(NEXT_INPUTS["write_index"], TensorProto.INT64, ["B"]),
            helper.make_tensor_value_info(NEXT_INPUTS["kv_length"], TensorProto.INT64, ["B"])]


def _next_inputs() -> list[onnx.NodeProto]:
    """The NEXT_INPUTS nodes. Every one reads the logits, so it runs after the If has read the
    inputs it may overwrite (bound onto the same buffers); the increment is the logits' row
    count R, 1 at a plain decode step, rather than a constant that could be added first."""
    return [helper.make_node("ArgMax", ["logits"], ["next/argmax"], axis=-1, keepdims=0, name="next/argmax"),  # [B, R]
            helper.make_node("Cast", ["next/argmax"], [NEXT_INPUTS["input_ids"]], to=TensorProto.INT32,
                             name="next/input_ids"),
            helper.make_node("Shape", ["logits"], ["next/rows"], start=1, end=2, name="next/rows"),  # [1]: R
            helper.make_node("Add", ["write_index", "next/rows"], [NEXT_INPUTS["write_index"]], name="next/write_index"),
            helper.make_node("Add", ["kv_length", "next/rows"], [NEXT_INPUTS["kv_length"]], name="next/kv_length")]

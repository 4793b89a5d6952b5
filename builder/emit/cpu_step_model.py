"""``rankN.cpu.onnx``: one ONNX Runtime model for every CPU step of a rank.

An ``If`` on the bool input ``plain_decode`` runs the CPU decode graph (the CPU stage's output:
GroupQueryAttention, packed q/k/v, fused residual norms) for plain decode steps and the rank
graph for everything else (prefill chunks, verifications). With any draft source (Medusa heads,
prompt lookup, suffix) the CPU stage also makes a verification graph (the same fusions, GroupQueryAttention taking a tree of S tokens
of one row): the If's other branch is then a second If, on ``tree_verify``, between it and the
rank graph, so a verification of batch 1 runs on it. After the If the model computes
each row's next decode inputs from the step's logits (``NEXT_INPUTS``: the argmax as
``input_ids``, ``write_index``/``kv_length`` one further), which the runtime binds onto its input
buffers so greedy steps run back to back.

Why one model and not two sessions: each ONNX Runtime session owns a thread pool whose idle
worker keeps spinning for milliseconds after a run, so with two sessions on 2 cores a prefill
after decode steps ran 2× slower (benchmarks/cpu_decode.py). In one session the steps share one
pool; the If costs 12–29 µs of a batch-1 step on the bundled model (benchmarks/cpu_step_overheads.py).
Each branch holds the initializers it reads: ONNX Runtime's subgraph rewrites (e.g.
``DequantizeLinear → MatMul`` into its n-bit GEMM) only find weights in their own graph.

Weights: every tensor the two branches share with the rank graph is read from the rank's own
data file (``rankN.onnx.data``, same bytes, same offsets: nothing is written twice); only tensors
the CPU stage made (packed quantized q/k/v) go to ``rankN.cpu.onnx.data``.
"""
from __future__ import annotations

from pathlib import Path

import onnx
from onnx import TensorProto, helper

from ...contract.step import DRAFT_HEADS, NEXT_INPUTS, PLAIN_DECODE, TREE_VERIFY, VERIFY_ROWS
from .draft_heads import heads_on_demand
from .rank_onnx import INLINE_BELOW


def _branch(model: onnx.ModelProto, tag: str, outputs: list[str]) -> onnx.GraphProto:
    """``model``'s graph as a subgraph: the step's outputs renamed (a subgraph may not produce a
    name the outer graph defines), the initializers its nodes read, no inputs of its own."""
    rename = {name: f"{tag}/{name}" for name in outputs}
    graph = onnx.GraphProto(name=f"{tag}_step")
    graph.node.extend(model.graph.node)
    for node in graph.node:
        for i, name in enumerate(node.output):
            node.output[i] = rename.get(name, name)
        _rename_reads(node, rename)
    read = {name for node in graph.node for name in node.input}
    graph.initializer.extend(t for t in model.graph.initializer if t.name in read)
    for value in model.graph.output:
        out = graph.output.add()
        out.CopyFrom(value)
        out.name = rename[value.name]
    return graph


def step_model(rank: onnx.ModelProto, decode: onnx.ModelProto, verify: onnx.ModelProto | None) -> onnx.ModelProto:
    """The rank graph's inputs plus ``plain_decode`` (and ``tree_verify`` with a verification graph,
    ``draft_heads`` with Medusa heads: builder/emit/draft_heads.py), its outputs plus
    NEXT_INPUTS, the branch chosen by If."""
    outputs = [o.name for o in rank.graph.output]
    for graph in (decode, verify):
        if graph is not None and [o.name for o in graph.graph.output] != outputs:
            raise ValueError("a CPU graph's outputs differ from the rank graph's")
    declared_inputs, declared_outputs = _declared(rank, verify)
    inputs = [*declared_inputs, helper.make_tensor_value_info(PLAIN_DECODE, TensorProto.BOOL, [])]
    otherwise = _branch(rank, "rank", outputs)
    if verify is not None:
        inputs.append(helper.make_tensor_value_info(TREE_VERIFY, TensorProto.BOOL, []))
        otherwise = _choice(TREE_VERIFY, "verify_or_rank", _branch(verify, "verify", outputs), otherwise,
                            declared_outputs)
    drafting = heads_on_demand(decode)
    if drafting is not decode:
        inputs.append(helper.make_tensor_value_info(DRAFT_HEADS, TensorProto.BOOL, []))
    step = helper.make_node("If", [PLAIN_DECODE], outputs, name="cpu_step",
                            then_branch=_branch(drafting, "decode", outputs), else_branch=otherwise)
    graph = helper.make_graph([step, *_next_inputs()], "cpu_step", inputs, [*declared_outputs, *_next_outputs()])
    model = helper.make_model(graph, opset_imports=list(decode.opset_import))
    model.ir_version = rank.ir_version
    model.metadata_props.extend(decode.metadata_props)
    if verify is not None:
        model.metadata_props.extend(p for p in verify.metadata_props if p.key == VERIFY_ROWS)
    return model


def _declared(rank: onnx.ModelProto, verify: onnx.ModelProto | None) -> tuple[list, list]:
    """The step's inputs and outputs as the rank graph declares them, but for the values the
    verification graph declares otherwise: the caches, which it takes with their rows folded into
    heads ([1, B·H_kv, S_max, D], builder/passes/cpu_group_query_attention.py)."""
    if verify is None:
        return list(rank.graph.input), list(rank.graph.output)
    own = {v.name: v for v in (*verify.graph.input, *verify.graph.output)}
    pick = lambda values: [own.get(v.name, v) for v in values]  # noqa: E731
    return pick(rank.graph.input), pick(rank.graph.output)


def _choice(condition: str, tag: str, then: onnx.GraphProto, otherwise: onnx.GraphProto,
            outputs: list[onnx.ValueInfoProto]) -> onnx.GraphProto:
    """A subgraph holding one If between two branches, its outputs the step's renamed by ``tag``."""
    names = [f"{tag}/{o.name}" for o in outputs]
    node = helper.make_node("If", [condition], names, name=tag, then_branch=then, else_branch=otherwise)
    graph = onnx.GraphProto(name=f"{tag}_step")
    graph.node.append(node)
    for value, name in zip(outputs, names):
        out = graph.output.add()
        out.CopyFrom(value)
        out.name = name
    return graph


def feeding_decode_model(decode: onnx.ModelProto) -> onnx.ModelProto:
    """The decode graph with the NEXT_INPUTS nodes and no If: what the step model runs at a plain
    decode step, less the If (benchmarks/cpu_step_overheads.py measures the difference)."""
    model = onnx.ModelProto()
    model.CopyFrom(decode)
    model.graph.node.extend(_next_inputs())
    model.graph.output.extend(_next_outputs())
    return model


def decode_branch(step: onnx.ModelProto) -> onnx.ModelProto:
    """The decode graph of a step model as a model of its own (its outputs named as the rank graph's)."""
    (node,) = [n for n in step.graph.node if n.op_type == "If"]
    return _branch_model(step, _attribute(node, "then_branch"), node.output)


def verify_branch(step: onnx.ModelProto) -> onnx.ModelProto | None:
    """The verification graph of a step model as a model of its own, or None where it has none."""
    (node,) = [n for n in step.graph.node if n.op_type == "If"]
    inner = [n for n in _attribute(node, "else_branch").node if n.op_type == "If"]
    return _branch_model(step, _attribute(inner[0], "then_branch"), node.output) if inner else None


def _attribute(node: onnx.NodeProto, name: str):
    return next(helper.get_attribute_value(a) for a in node.attribute if a.name == name)


def _rename_reads(node: onnx.NodeProto, rename: dict[str, str]) -> None:
    """``node``'s inputs renamed, and those its subgraphs read from the outer scope (the
    draft_heads If's heads read the step's logits: builder/passes/heads_at_path_end)."""
    for i, name in enumerate(node.input):
        node.input[i] = rename.get(name, name)
    for attribute in node.attribute:
        for graph in [attribute.g] if attribute.HasField("g") else list(attribute.graphs):
            inner = {name for n in graph.node for name in n.output}  # a subgraph's own values keep their names
            for n in graph.node:
                _rename_reads(n, {k: v for k, v in rename.items() if k not in inner})


def _branch_model(step: onnx.ModelProto, branch: onnx.GraphProto, names) -> onnx.ModelProto:
    """``branch`` with the step's inputs and its outputs renamed to ``names``."""
    graph = onnx.GraphProto()
    graph.CopyFrom(branch)
    rename = {value.name: name for name, value in zip(names, graph.output)}
    for inner in graph.node:
        for i, value in enumerate(inner.output):
            inner.output[i] = rename.get(value, value)
        _rename_reads(inner, rename)
    for value in graph.output:
        value.name = rename[value.name]
    graph.input.extend(i for i in step.graph.input if i.name not in (PLAIN_DECODE, TREE_VERIFY)
                       and (i.name != DRAFT_HEADS or any(DRAFT_HEADS in n.input for n in graph.node)))
    model = helper.make_model(graph, opset_imports=list(step.opset_import))
    model.ir_version = step.ir_version
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


def save_cpu_step_model(decode: onnx.ModelProto, verify: onnx.ModelProto | None, rank: onnx.ModelProto,
                        path: Path) -> Path | None:
    """Writes the step model of ``rank`` (as saved: its large tensors in its data file),
    ``decode`` and ``verify`` (the CPU stage's graphs; no verification graph: None) to ``path``;
    returns its own data file, if it needs one. A CPU graph's tensor of the rank's name, type and
    shape is the rank's (the CPU passes never change a weight, they only add tensors), so it is
    read from the rank's data file; a tensor both CPU graphs made (packed q/k/v) is written once."""
    path = Path(path)
    shared = {t.name: t for t in rank.graph.initializer}
    data_path = path.parent / f"{path.name}.data"
    offset = 0
    with open(data_path, "wb") as out:
        for tensor in (t for model in (decode, verify) if model is not None for t in model.graph.initializer):
            known = shared.get(tensor.name)
            if known is not None and (known.data_type, list(known.dims)) == (tensor.data_type, list(tensor.dims)):
                tensor.CopyFrom(known)
                continue
            if known is not None:
                raise ValueError(f"{path}: tensor {tensor.name} differs from the rank graph's of that name")
            if tensor.data_location == TensorProto.EXTERNAL:
                raise ValueError(f"{path}: tensor {tensor.name} is external and not the rank graph's")
            if not tensor.HasField("raw_data") or len(tensor.raw_data) < INLINE_BELOW:
                continue
            data = tensor.raw_data
            tensor.ClearField("raw_data")
            out.write(data)
            for key, value in (("location", data_path.name), ("offset", str(offset)), ("length", str(len(data)))):
                entry = tensor.external_data.add()
                entry.key, entry.value = key, value
            tensor.data_location = TensorProto.EXTERNAL
            offset += len(data)
            shared[tensor.name] = tensor  # the other CPU graph's tensor of this name reads these bytes
    if offset == 0:
        data_path.unlink()
    onnx.save_model(step_model(rank, decode, verify), path)
    return data_path if offset else None

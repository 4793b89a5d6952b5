"""PassManager: ordering checked up front, errors name the pass and its predecessors,
the numerics gate fails a pass that changes results, provenance and dumps."""
from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest

from trtbuild.builder.errors import UserError
from trtbuild.builder.numerics import run_onnx
from trtbuild.builder.passes import PIPELINE, CpuGraph, Pass, PassContext, PassError, PassResult
from trtbuild.builder.passes.base import graph_metadata, record_metadata
from trtbuild.builder.passes.fuse_rmsnorm import fuse_rmsnorm
from trtbuild.builder.passes.instruments import to_onnx
from trtbuild.builder.passes.manager import PassManager
from trtbuild.builder.passes.numerics_gate import NumericsGate

import graphs

CTX = PassContext(spec=None)


def identity(graph, ctx):
    return PassResult(graph=graph, modified=False)


def boom(graph, ctx):
    raise RuntimeError("kaboom")


def scale_weight(graph, ctx):
    weight = next(t for t in graph.tensors().values() if t.name == "weight")
    weight.values = weight.values * 1.5
    return PassResult(graph=graph, modified=True)


def test_disabling_a_required_pass_is_refused_before_anything_runs():
    with pytest.raises(PassError, match="pass fuse_rmsnorm requires canonicalize, which is disabled"):
        PassManager(PIPELINE, disabled=frozenset({"canonicalize"}))


def test_heads_at_path_end_cannot_be_disabled_alone():
    """A Medusa engine's medusa_logits are [B, 1, K, V] only after heads_at_path_end; without it the
    runtime would misread [B, R, K, V]. Disabling both (no heads) is fine."""
    with pytest.raises(PassError, match="pass heads_at_path_end cannot be disabled while attach_medusa runs"):
        PassManager(PIPELINE, disabled=frozenset({"heads_at_path_end"}))
    PassManager(PIPELINE, disabled=frozenset({"heads_at_path_end", "attach_medusa"}))


def test_requirement_must_run_earlier():
    passes = (Pass("b", identity, requires=("a",)), Pass("a", identity))
    with pytest.raises(PassError, match="pass b requires a to run before it"):
        PassManager(passes)


def test_unknown_pass_names_are_refused():
    with pytest.raises(UserError, match="unknown pass 'fuse_rms'; passes: canonicalize, fuse_rmsnorm"):
        PassManager(PIPELINE, disabled=frozenset({"fuse_rms"}))


def test_failure_names_the_pass_and_those_before_it():
    passes = (Pass("first", identity), Pass("second", identity), Pass("broken", boom), Pass("never", identity))
    manager = PassManager(passes)
    with pytest.raises(PassError, match=r"pass broken failed: RuntimeError: kaboom \(after first, second\)"):
        manager.run(gs.import_onnx(graphs.rmsnorm()), CTX)


def test_numerics_gate_fails_the_pass_that_changes_results():
    model = graphs.rmsnorm()
    feeds = {"x": np.random.default_rng(0).standard_normal((2, 3, 16)).astype(np.float32)}
    gate = NumericsGate(feeds, run_onnx(model, feeds), atol=1e-4, rtol=1e-4)
    passes = (Pass("fuse_rmsnorm", fuse_rmsnorm), Pass("scale_weight", scale_weight))
    with pytest.raises(PassError, match=r"pass scale_weight broke numerics: y max_abs .* \(after fuse_rmsnorm\)"):
        PassManager(passes, numerics=gate).run(gs.import_onnx(model), CTX)


def test_records_provenance_and_dumps(tmp_path):
    model = graphs.rmsnorm()
    feeds = {"x": np.random.default_rng(0).standard_normal((2, 3, 16)).astype(np.float32)}
    records = []
    gate = NumericsGate(feeds, run_onnx(model, feeds), atol=1e-4, rtol=1e-4)
    manager = PassManager((Pass("fuse_rmsnorm", fuse_rmsnorm),), dump_after=frozenset({"fuse_rmsnorm"}),
                          dump_dir=tmp_path / "dumps", numerics=gate, on_record=records.append)
    result = manager.run(gs.import_onnx(model), CTX)
    (record,) = records
    assert record["pass"] == "fuse_rmsnorm" and record["matches"] == 1
    assert record["ops_before"] == {"Add": 1, "Mul": 2, "Pow": 1, "Reciprocal": 1, "ReduceMean": 1, "Sqrt": 1}
    assert record["ops_after"] == {"RMSNormalization": 1}
    assert record["numerics"]["ok"] and record["numerics"]["vs_torch"]["max_abs"] < 1e-5
    dumped = onnx.load(tmp_path / "dumps" / "all" / "001_fuse_rmsnorm.onnx")
    assert [n.op_type for n in dumped.graph.node] == ["RMSNormalization"]
    exported = to_onnx(result.graph, result.provenance[0])
    meta = {p.key: p.value for p in exported.graph.node[0].metadata_props}
    assert meta == {"created_by": "fuse_rmsnorm"}


def drop_an_output(graph, ctx):
    graph.outputs = graph.outputs[:1]
    return PassResult(graph=graph, modified=True)


def _two_outputs() -> onnx.ModelProto:
    """y = rmsnorm(x) and z = x + x: two outputs, as a step has logits and present_* caches."""
    model = graphs.rmsnorm()
    model.graph.node.append(onnx.helper.make_node("Add", ["x", "x"], ["z"]))
    model.graph.output.append(onnx.helper.make_tensor_value_info("z", onnx.TensorProto.FLOAT, [2, 3, 16]))
    return model


def test_numerics_gate_fails_a_pass_that_drops_an_output_but_not_one_not_made_yet():
    model = _two_outputs()
    feeds = {"x": np.random.default_rng(0).standard_normal((2, 3, 16)).astype(np.float32)}
    reference = run_onnx(model, feeds)
    # medusa_logits-like: the reference has it, no graph has made it yet: skipped, not a failure.
    reference["heads"] = np.zeros(3, np.float32)
    passes = (Pass("fuse_rmsnorm", fuse_rmsnorm), Pass("drop_an_output", drop_an_output))
    with pytest.raises(PassError, match=r"pass drop_an_output: the graph lost the output\(s\) z \(after fuse_rmsnorm\)"):
        PassManager(passes, numerics=NumericsGate(feeds, reference, atol=1e-4, rtol=1e-4)).run(gs.import_onnx(model), CTX)
    result = PassManager(passes[:1], numerics=NumericsGate(feeds, reference, atol=1e-4, rtol=1e-4)).run(
        gs.import_onnx(model), CTX)
    assert result.records[0]["numerics"]["ok"]


def record_plan(graph, ctx):
    record_metadata(graph, "plan", [1, 2])
    return PassResult(graph=graph, modified=False)


def test_metadata_recorded_before_the_split_reaches_every_rank_graph():
    passes = (Pass("record_plan", record_plan), Pass("per_rank", identity, per_rank=True))
    result = PassManager(passes).run(gs.import_onnx(graphs.rmsnorm()), PassContext(spec=None, world_size=2, tensor_size=2))
    assert len(result.graphs) == 2 and result.graphs[0] is not result.graphs[1]
    assert [graph_metadata(g) for g in result.graphs] == [{"plan": "[1, 2]"}] * 2


def rebuild_renamed(graph, ctx):
    """A whole-model pass that returns a new graph rather than editing its argument."""
    fresh = graph.copy()
    fresh.nodes[0].name = "made_by_rebuild"
    return PassResult(graph=fresh, modified=True)


@pytest.mark.parametrize("world_size", [1, 2])
def test_the_split_copies_what_the_whole_model_passes_returned(world_size):
    passes = (Pass("rebuild", rebuild_renamed), Pass("per_rank", identity, per_rank=True))
    start = gs.import_onnx(graphs.rmsnorm())
    result = PassManager(passes).run(start, PassContext(spec=None, world_size=world_size, tensor_size=world_size))
    assert [g.nodes[0].name for g in result.graphs] == ["made_by_rebuild"] * world_size
    assert start.nodes[0].name != "made_by_rebuild"


def mark_cpu(graph, ctx):
    graph.nodes[0].name = "cpu_only"
    return PassResult(graph=graph, modified=True)


def mark_verify(graph, ctx):
    graph.nodes[0].name = f"verify_after_{graph.nodes[0].name}"
    return PassResult(graph=graph, modified=True)


@pytest.mark.parametrize("made", [frozenset(CpuGraph), frozenset({CpuGraph.decode}), frozenset()])
def test_each_cpu_graph_runs_on_its_own_copy_of_the_finished_rank_graph(made):
    passes = (Pass("fuse_rmsnorm", fuse_rmsnorm), Pass("plan", record_plan, per_rank=True),
              Pass("mark_cpu", mark_cpu, per_rank=True, cpu=CpuGraph.decode),
              Pass("mark_verify", mark_verify, per_rank=True, cpu=CpuGraph.verify))
    records = []
    result = PassManager(passes, on_record=records.append).run(gs.import_onnx(graphs.rmsnorm()),
                                                               PassContext(spec=None, cpu_graphs=made))
    rank_names = [n.name for n in result.graph.nodes]
    assert rank_names[0] not in ("cpu_only", "verify_after_cpu_only")  # the rank graph TensorRT compiles is untouched
    assert result.cpu_graphs.keys() == made  # base.cpu_graphs_made said which: the others' passes do not run
    assert [r["pass"] for r in records] == ["fuse_rmsnorm", "plan", *(["mark_cpu"] if CpuGraph.decode in made else []),
                                            *(["mark_verify"] if CpuGraph.verify in made else [])]
    if CpuGraph.decode in made:
        (decode,) = result.cpu_graphs[CpuGraph.decode]
        assert [n.name for n in decode.nodes] == ["cpu_only"] and graph_metadata(decode) == {"plan": "[1, 2]"}
        assert records[2]["ops_after"] == {"RMSNormalization": 1}
    if CpuGraph.verify in made:  # a copy of the rank graph, not of the decode graph
        (verify,) = result.cpu_graphs[CpuGraph.verify]
        assert [n.name for n in verify.nodes] == [f"verify_after_{rank_names[0]}"]


def test_a_cpu_graph_whose_passes_are_split_is_refused():
    passes = (Pass("mark_cpu", mark_cpu, per_rank=True, cpu=CpuGraph.decode),
              Pass("mark_verify", mark_verify, per_rank=True, cpu=CpuGraph.verify),
              Pass("mark_cpu_again", mark_cpu, per_rank=True, cpu=CpuGraph.decode))
    with pytest.raises(PassError, match="pass mark_cpu_again makes the CPU decode graph, whose passes ran before "
                                        "mark_verify's: each CPU graph's passes come together"):
        PassManager(passes)


def test_a_rank_graph_pass_after_the_cpu_stage_is_refused():
    passes = (Pass("mark_cpu", mark_cpu, per_rank=True, cpu=CpuGraph.decode), Pass("late", identity, per_rank=True))
    with pytest.raises(PassError, match="pass late runs on the rank graph but comes after the CPU-stage pass mark_cpu"):
        PassManager(passes)

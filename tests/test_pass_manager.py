"""PassManager: ordering checked up front, errors name the pass and its predecessors,
the numerics gate fails a pass that changes results, provenance and dumps."""
from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest

from trtbuild.builder.errors import UserError
from trtbuild.builder.numerics import run_onnx
from trtbuild.builder.passes import PIPELINE, Pass, PassContext, PassError, PassResult
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

"""The CPU runtime refuses, in one line and before any rank loads, an engine dir whose ranks
cannot fit in this machine's RAM (issue 26: a Llama-3-8B fp16 TP=2 dir was killed mid-load)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from trtbuild.plugins.onnxruntime.session import session
from trtbuild.runtime import engine_factory as engines
from trtbuild.runtime.backends.onnxruntime import memory
from trtbuild.runtime.engine_dir import EngineDir, EngineDirError

GIB = 1 << 30


def dir_of(ranks: int, weight_bytes: int, dtype: str = "float16", mode: str = "none") -> EngineDir:
    manifest = {"spec": {"model": {"dtype": dtype}, "quantization": {"mode": mode}}, "pipeline_parallel": 1,
                "ranks": [{"weight_bytes": weight_bytes} for _ in range(ranks)]}
    return EngineDir(path=Path("/engines/llama-3-8b-tp2"), manifest=manifest)


def test_float16_ranks_count_twice_their_weights_and_the_refusal_says_what_would_run():
    llama_8b_tp2 = dir_of(2, 8_555_995_136)  # the rank weight bytes of benchmarks/build_scale.py's 8b-tp2 row
    assert memory.needed_bytes(llama_8b_tp2, [0, 1]) == 2 * (GIB // 2 + 2 * 8_555_995_136)
    line = memory.memory_refusal(llama_8b_tp2, 24 * GIB, [0, 1])
    assert line is not None and "\n" not in line
    assert "/engines/llama-3-8b-tp2" in line and "32.9 GiB" in line and "24.0 GiB" in line
    assert "float16 MatMuls in float32" in line and "int4_weight_only" in line
    assert memory.memory_refusal(llama_8b_tp2, 40 * GIB, [0, 1]) is None


def test_float32_and_quantized_weights_count_once():
    assert memory.needed_bytes(dir_of(1, 4 * GIB, dtype="float32"), [0]) == GIB // 2 + 4 * GIB
    assert memory.needed_bytes(dir_of(1, 4 * GIB, mode="int4_weight_only"), [0]) == GIB // 2 + 4 * GIB


def test_torchrun_counts_only_this_nodes_ranks(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert memory.local_ranks(dir_of(4, GIB)) == [0, 1]
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert memory.local_ranks(dir_of(4, GIB)) == [0, 1, 2, 3]


def test_the_cpu_backend_is_refused_before_loading(monkeypatch):
    monkeypatch.setattr(memory, "machine_bytes", lambda: 24 * GIB)
    monkeypatch.setattr(EngineDir, "require_cpu_graphs", lambda self, why="": None)
    with pytest.raises(EngineDirError, match="would need ≈ 32.9 GiB"):
        engines.resolve_backend(dir_of(2, 8_555_995_136), "onnxruntime")
    assert engines.resolve_backend(dir_of(2, GIB), "onnxruntime") == "onnxruntime"


def test_onnx_runtime_holds_a_float16_weight_as_float32(tmp_path):
    """The fact the factor of 2 rests on: a float16 MatMul's weight, external, costs its session
    about twice its bytes of anonymous memory (a float32 copy), where a float32 weight costs once.
    If ONNX Runtime gains a float16 GEMM on this CPU, this fails and the factor should go."""
    from trtbuild.builder.progress import rss_parts

    grown = {}
    for dtype, proto_type in ((np.float16, TensorProto.FLOAT16), (np.float32, TensorProto.FLOAT)):
        weight = np.random.default_rng(0).standard_normal((2048, 8192)).astype(dtype)  # 32 or 64 MiB
        graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                                  [helper.make_tensor_value_info("x", proto_type, [1, 2048])],
                                  [helper.make_tensor_value_info("y", proto_type, [1, 8192])],
                                  [numpy_helper.from_array(weight, "w")])
        path = tmp_path / f"{proto_type}.onnx"
        onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path,
                  save_as_external_data=True, location=f"{proto_type}.data")
        del weight, graph
        before = rss_parts()[0]
        sess = session(path, threads=1)
        sess.run(None, {"x": np.ones((1, 2048), dtype)})
        grown[dtype] = (rss_parts()[0] - before) / (2048 * 8192 * np.dtype(dtype).itemsize)
        del sess
    assert grown[np.float16] > 1.6, grown   # ≈ 2: the float32 copy
    assert grown[np.float32] < 1.3, grown   # ≈ 1: its prepacked copy


def test_trtbuild_run_refuses_in_one_line_with_exit_2(tiny_engine, monkeypatch):
    from click.testing import CliRunner

    from trtbuild.cli.main import main

    monkeypatch.setattr(memory, "machine_bytes", lambda: 1 << 20)
    result = CliRunner().invoke(main, ["run", str(tiny_engine), "--prompt", "def f():", "--max-tokens", "4"])
    assert result.exit_code == 2
    assert result.output.count("\n") == 1 and "would need ≈ 0.5 GiB of RAM" in result.output


def test_the_server_runs_onnx_runtime_threads_sleeping(tiny_engine, monkeypatch):
    """A spinning engine thread keeps the cores from the server's event loop between steps
    (benchmarks/serve_load.py: half the server's tokens/s at 8 in flight); offline LLM keeps spinning."""
    from click.testing import CliRunner

    from trtbuild.cli.main import main
    from trtbuild.plugins.onnxruntime.session import Spinning
    from trtbuild.runtime import llm as llm_module

    def spinning_of(llm) -> str:
        return llm.engine.session.get_session_options().get_session_config_entry("session.intra_op.allow_spinning")

    with llm_module.LLM(tiny_engine, backend="onnxruntime") as offline:
        assert spinning_of(offline) == "1"
    with llm_module.LLM(tiny_engine, backend="onnxruntime", spinning=Spinning.never) as sleeping:
        assert spinning_of(sleeping) == "0"
    asked = {}

    def refuse(*args, **kwargs):
        asked.update(kwargs)
        raise EngineDirError("stop here")

    monkeypatch.setattr(llm_module, "LLM", refuse)
    result = CliRunner().invoke(main, ["serve", str(tiny_engine), "--port", "0"])
    assert result.exit_code == 2 and asked["spinning"] is Spinning.never

"""The streaming build (issue 26): the step exported from a meta-device model with its weights
streamed from the checkpoint, tied embeddings at TP=2, the numerics check on a depth-truncated
graph (and a pass planted to break layer 0 caught by it), and the export's memory bound."""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
from onnx import helper

from conftest import make_checkpoint, write_spec
from ort_greedy import transformers_greedy
from trtbuild.builder import build as build_module
from trtbuild.builder import numerics
from trtbuild.builder.build import BuildOptions, build
from trtbuild.builder.export_stage import export_stage, weight_bytes
from trtbuild.builder.errors import UserError
from trtbuild.builder.frontend.weights_file import fold_weight_transposes
from trtbuild.builder.isolate import run_isolated
from trtbuild.builder.passes import PIPELINE, PassResult
from trtbuild.builder.progress import Progress, Verbosity
from trtbuild.builder.spec.resolve import load_spec

PROMPTS = [[5, 17, 300, 41], [9, 8, 7]]


def test_linear_weight_transposes_fold_but_a_shared_table_keeps_its_own():
    nodes = [helper.make_node("Transpose", ["w"], ["w_t"], perm=[1, 0]),
             helper.make_node("MatMul", ["x", "w_t"], ["y"]),
             helper.make_node("Gather", ["table", "ids"], ["e"]),
             helper.make_node("Transpose", ["table"], ["table_t"], perm=[1, 0]),
             helper.make_node("MatMul", ["e", "table_t"], ["z"])]
    graph = helper.make_graph(nodes, "g", [], [])
    assert fold_weight_transposes(graph, {"w", "table"}) == {"w.T": "w"}
    assert [n.op_type for n in graph.node] == ["MatMul", "Gather", "Transpose", "MatMul"]
    assert list(graph.node[0].input) == ["x", "w.T"]


def test_check_plan_whole_truncated_and_bfloat16(checkpoints, tmp_path):
    spec = load_spec(write_spec(tmp_path / "a.yaml", checkpoints["llama"]))
    assert numerics.check_plan(spec, 10 << 20).record() == {"check": "whole model", "layers": 2, "of_layers": 2,
                                                           "dtype": "float32", "vocab_rows": 4096}
    assert numerics.check_plan(spec, 600 << 20).record()["check"] == "truncated"
    bf16 = load_spec(write_spec(tmp_path / "b.yaml", checkpoints["llama"], model={"dtype": "bfloat16"}))
    plan = numerics.check_plan(bf16, 10 << 20)  # ONNX Runtime's CPU kernels lack bf16: the same weights in fp32
    assert (plan.whole, plan.layers, plan.dtype.value) == (False, 2, "float32")
    off = load_spec(write_spec(tmp_path / "c.yaml", checkpoints["llama"], passes={"numerics": False}))
    assert numerics.check_plan(off, 10 << 20) is None


@pytest.mark.slow
def test_tied_embeddings_at_tp2_with_the_truncated_check(tmp_path, monkeypatch):
    """Qwen2 (tied embeddings, q/k/v biases) stored in bfloat16, 3 layers, built float32 at TP=2 and
    checked on 2 of its layers and 1024 of its 4096 vocabulary rows: the rank graphs generate
    transformers' greedy tokens, and the pass log says which check ran."""
    from safetensors.torch import load_file, save_file

    from trtbuild.runtime.llm import LLM
    from trtbuild.runtime.core.sampling import SamplingParams

    checkpoint = make_checkpoint(tmp_path / "qwen2", "qwen2", layers=3)
    for path in checkpoint.glob("*.safetensors"):
        save_file({k: v.bfloat16() for k, v in load_file(path).items()}, path, metadata={"format": "pt"})
    spec = load_spec(write_spec(tmp_path / "spec.yaml", checkpoint, parallel={"tensor": 2},
                                passes={"numerics_whole_max_mib": 0}))
    monkeypatch.setattr(numerics, "TRUNCATED_VOCAB", 1024)
    summary = build(spec, BuildOptions(out=tmp_path / "out"), Progress(Verbosity.error))
    records = [json.loads(line) for line in (tmp_path / "out" / "passes.jsonl").read_text().splitlines()]
    shard = [r for r in records if r["pass"] == "shard_tensor_parallel"]
    assert [r["numerics"]["check"] for r in shard] == ["truncated", "truncated"]
    assert shard[0]["numerics"]["layers"] == 2 and shard[0]["numerics"]["of_layers"] == 3
    assert shard[0]["numerics"]["vocab_rows"] == 1024
    assert shard[0]["numerics"]["ranks_together"] == 2 and shard[0]["numerics"]["ok"]
    assert shard[0]["structure"]["layers_alike"] == 3 and shard[0]["matches"] == 7 * 3 + 1
    assert [p.name for p in summary.processes] == ["export", "engine rank0", "engine rank1"]
    with LLM(tmp_path / "out", backend="onnxruntime") as llm:
        ours = [c.token_ids for c in llm.generate(PROMPTS, SamplingParams(max_tokens=8, ignore_eos=True))]
    assert ours == transformers_greedy(checkpoint, PROMPTS, 8)


def _break_layer_zero(graph, ctx):
    """fuse_rmsnorm, then layer 0's input norm gets a wrong epsilon (same ops, same shapes)."""
    result = PIPELINE[1].run(graph, ctx)
    for node in result.graph.nodes:
        if node.name == "/model/layers.0/input_layernorm/RMSNormalization":
            node.attrs["epsilon"] = 10.0
    return PassResult(graph=result.graph, modified=True, stats=result.stats)


@pytest.mark.slow
def test_truncated_check_names_a_pass_that_breaks_layer_zero(checkpoints, tmp_path, monkeypatch):
    planted = (PIPELINE[0], replace(PIPELINE[1], run=_break_layer_zero), *PIPELINE[2:])
    monkeypatch.setattr(build_module, "PIPELINE", planted)
    spec = load_spec(write_spec(tmp_path / "spec.yaml", checkpoints["llama"], passes={"numerics_whole_max_mib": 0}))
    with pytest.raises(UserError, match=r"^pass fuse_rmsnorm broke numerics on the first 2 of 2 decoder layers"):
        build(spec, BuildOptions(out=tmp_path / "out"), Progress(Verbosity.error))
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_one_rank_with_the_truncated_check_and_the_cpu_stage(tmp_path):
    """TP=1 above the whole-check size: the structure check runs after the CPU stage too (whose
    decode graph fuses each residual into the next norm, so its first and last layers differ by
    design) and the build generates transformers' greedy tokens; an int4 build was refused here."""
    from trtbuild.runtime.llm import LLM
    from trtbuild.runtime.core.sampling import SamplingParams

    checkpoint = make_checkpoint(tmp_path / "llama", "llama", layers=4)
    spec = load_spec(write_spec(tmp_path / "spec.yaml", checkpoint, passes={"numerics_whole_max_mib": 0}))
    build(spec, BuildOptions(out=tmp_path / "out"), Progress(Verbosity.error))
    records = [json.loads(line) for line in (tmp_path / "out" / "passes.jsonl").read_text().splitlines()]
    skip_norm = next(r for r in records if r["pass"] == "cpu_skip_norm")
    assert skip_norm["structure"]["layers_alike"] == 4 and skip_norm["matches"] == 2 * 4
    with LLM(tmp_path / "out", backend="onnxruntime") as llm:
        ours = [c.token_ids for c in llm.generate(PROMPTS, SamplingParams(max_tokens=8, ignore_eos=True))]
    assert ours == transformers_greedy(checkpoint, PROMPTS, 8)


def _big_checkpoint(directory):
    """~225 MB of float32 weights (vocabulary 32000, 8 layers of width 512)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", vocab_size=32000, hidden_size=512, intermediate_size=1536,
                                  num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
                                  max_position_embeddings=512, tie_word_embeddings=False)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory, safe_serialization=True)
    return directory


@pytest.mark.slow
def test_export_never_holds_the_model(checkpoints, tmp_path):
    """The export process (a fresh subprocess, as in a build) of a ~225 MB checkpoint: within the
    target (0.25 × weights + 1.5 GiB), and its heap grows by well under the weights over a tiny
    model's: by about one tensor's transposed copy (the largest, lm_head, is 29 % of these
    weights), where loading the model would add all of them."""
    big = load_spec(write_spec(tmp_path / "big.yaml", _big_checkpoint(tmp_path / "big")))
    small = load_spec(write_spec(tmp_path / "small.yaml", checkpoints["llama"]))
    peaks = {}
    for name, spec in (("small", small), ("big", big)):
        (tmp_path / name / "w").mkdir(parents=True, exist_ok=True)
        check = numerics.check_plan(spec, weight_bytes(spec))
        exported = run_isolated(export_stage, spec, tmp_path / name / "w", check)
        peaks[name] = exported.peak
    weights = (tmp_path / "big" / "w" / "step.onnx.data").stat().st_size
    assert weights > 200e6
    assert peaks["big"].peak <= 0.25 * weights + 1.5 * 2**30
    assert peaks["big"].anon - peaks["small"].anon < 0.6 * weights, (peaks, weights)


def test_a_written_slice_leaves_memory(tmp_path):
    """WeightWriter (what shard_tensor_parallel writes each rank's slices with) keeps the constants
    it returns but not their bytes: 256 MB written, the heap grows by far less. (Clearing raw_data
    on the proto that held them kept the bytes in protobuf's arena: a TP=2 build held the model.)
    Measured in a fresh process: a long test session's heap moves by itself."""
    script = f"""
import numpy as np
from pathlib import Path
from trtbuild.builder.passes.weights import WeightWriter, read
from trtbuild.builder.progress import rss_parts
out = Path({str(tmp_path)!r})
writer = WeightWriter(out / "rank0.shard.data")
kept = []
before, _ = rss_parts()
for k in range(8):
    kept.append(writer.constant(f"w{{k}}", np.full((4096, 4096), k, np.float16)))  # 32 MiB each
print(rss_parts()[0] - before, float(read(kept[5], out)[17, 4000]))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    grown, value = result.stdout.split()
    assert (tmp_path / "rank0.shard.data").stat().st_size == 8 * 2**25
    assert int(grown) < 64 * 2**20, f"the heap grew by {int(grown) / 2**20:.0f} MiB for 256 MiB written"
    assert float(value) == 5.0


def test_memory_refusal_names_what_fits():
    from trtbuild.builder.plan.build_cost import BuildPlan, memory_refusal

    plan = BuildPlan(parameters=8_000_000_000, model_bytes=16e9, tp=1, cpu_graphs=True, export_bytes=16e9)
    assert memory_refusal(plan, 64 * 2**30, [1, 2, 4, 8]) is None  # 0.2 GB + 2 × 16 GB fits 64 GiB
    line = memory_refusal(plan, 24 * 2**30, [1, 2, 4, 8])
    assert "\n" not in line and "≈ 30.0 GiB" in line and "parallel.tensor: 2" in line and "int4" in line
    # Medusa heads count in the need, are named, and decide which tensor parallelism fits: 16 GB of
    # weights and 8 GB of heads need 0.2 GB + 2 × 24 GB (44.9 GiB) at TP 1; in 20 GiB, TP 2 would
    # fit the weights alone (15.1 GiB) but not with its half of the heads (22.5 GiB); TP 4 does.
    heads = BuildPlan(parameters=8_000_000_000, model_bytes=16e9, tp=1, cpu_graphs=True, export_bytes=16e9,
                      medusa_bytes=8e9, medusa_ranks=1)
    line = memory_refusal(heads, 20 * 2**30, [1, 2, 4, 8])
    assert "≈ 44.9 GiB" in line and "14.9 GiB of weights and 7.5 GiB of Medusa heads" in line
    assert "parallel.tensor: 4" in line


def test_disk_refusal_counts_the_exports_file_and_each_ranks_data():
    from trtbuild.builder.plan.build_cost import GIB, BuildPlan, disk_refusal

    fp16 = BuildPlan(parameters=8_000_000_000, model_bytes=16e9, tp=2, cpu_graphs=True, export_bytes=16e9)
    assert fp16.disk_peak_bytes == 32e9 + GIB  # the export's file + both ranks' data (the engines come after it goes)
    int4 = BuildPlan(parameters=8_000_000_000, model_bytes=4.5e9, tp=2, cpu_graphs=True, export_bytes=16e9)
    assert int4.disk_peak_bytes == 16e9 + 2 * 4.5e9 + GIB  # codes once whole, once sliced
    assert disk_refusal(fp16, int(40e9), "/big") is None
    line = disk_refusal(fp16, int(20e9), "/small")
    assert line.startswith("/small: ") and "≈ 30.8 GiB" in line and "\n" not in line


def test_a_rank_data_file_adopts_a_weight_file_it_reads_whole(tmp_path):
    """save_graph moves a weight file only this graph reads, and reads (nearly) whole, into the
    rank's data file (no second copy on disk), with bytes ONNX Runtime reads as the copy's; a file
    read in part is copied, so the data file holds next to no unreferenced bytes."""
    import numpy as np
    import onnx
    from onnx import helper, numpy_helper

    from trtbuild.builder.emit.rank_onnx import save_graph
    from trtbuild.builder.numerics import run_onnx

    rng = np.random.default_rng(0)
    a, b, c = (rng.standard_normal((64, 64)).astype(np.float32) for _ in range(3))
    weights = tmp_path / "w"
    weights.mkdir()
    (weights / "shard.data").write_bytes(a.tobytes() + b"\0" * 64 + b.tobytes())  # alignment padding is no bar
    (weights / "shared.data").write_bytes(c.tobytes() + a.tobytes())  # only its first half is read

    def model():
        inits = []
        for name, location, offset in (("A", "shard.data", 0), ("B", "shard.data", a.nbytes + 64), ("C", "shared.data", 0)):
            tensor = numpy_helper.from_array(np.zeros((64, 64), np.float32), name)
            tensor.ClearField("raw_data")
            tensor.data_location = onnx.TensorProto.EXTERNAL
            for key, value in (("location", location), ("offset", str(offset)), ("length", str(a.nbytes))):
                entry = tensor.external_data.add()
                entry.key, entry.value = key, value
            inits.append(tensor)
        nodes = [helper.make_node("MatMul", ["x", "A"], ["y1"]), helper.make_node("MatMul", ["y1", "B"], ["y2"]),
                 helper.make_node("MatMul", ["y2", "C"], ["y"])]
        graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 64])],
                                  [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 64])], inits)
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 24)])

    x = {"x": rng.standard_normal((1, 64)).astype(np.float32)}
    save_graph(model(), tmp_path / "copied" / "rank0.onnx", weights)
    save_graph(model(), tmp_path / "adopted" / "rank0.onnx", weights, frozenset({"shard.data", "shared.data"}))
    assert not (weights / "shard.data").exists() and (weights / "shared.data").exists()
    assert (tmp_path / "copied" / "rank0.onnx.data").stat().st_size == 3 * a.nbytes
    assert (tmp_path / "adopted" / "rank0.onnx.data").stat().st_size == 3 * a.nbytes + 64
    expected = x["x"] @ a @ b @ c
    for name in ("copied", "adopted"):
        got = run_onnx(tmp_path / name / "rank0.onnx", x)["y"]
        assert np.allclose(got, expected, rtol=1e-4, atol=1e-3), name


def test_build_refuses_a_rank_engine_larger_than_ram_in_one_line(tmp_path):
    import subprocess
    import sys

    from conftest import REPO
    from trtbuild.builder.plan.build_cost import machine_ram_bytes

    if machine_ram_bytes() > 300e9:
        pytest.skip("this machine has the RAM for a 70B rank engine at TP=1")
    config = {k: v for k, v in json.loads((REPO / "builder/data/models/llama-3-70b.json").read_text()).items()
              if not k.startswith("_")}
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(config))
    spec = write_spec(tmp_path / "spec.yaml", tmp_path / "ckpt", model={"dtype": "float16"})
    proc = subprocess.run([sys.executable, "-m", "trtbuild.cli", "build", str(spec), "-o", str(tmp_path / "out")],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "needs ≈" in proc.stderr and "--ignore-memory-check" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_plan_prints_the_build_side_of_a_70b_tp8_build():
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "trtbuild.cli", "plan", "llama-3-70b", "--tp", "8", "--json"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    side = json.loads(proc.stdout)["build"]
    weights = side["model_bytes"]
    assert side["tp"] == 8 and side["stages_peak_bytes"] == round(0.25 * weights + 1.5 * 2**30)
    assert side["engine_peak_bytes"] == round(0.2e9 + 2 * weights / 8)
    assert side["per_process_peak_bytes"] == max(side["stages_peak_bytes"], side["engine_peak_bytes"])


def test_a_write_into_a_mapped_tensor_stays_out_of_the_checkpoint(checkpoints, tmp_path):
    """Fake quantization writes dequantized weights into the reference model in place: with a
    read-only mapping that was a segfault; copy-on-write keeps it private."""
    import hashlib
    import shutil

    import torch

    from trtbuild.checkpoint.weight_map import WeightMap

    checkpoint = shutil.copytree(checkpoints["llama"], tmp_path / "ckpt")
    files = sorted(checkpoint.glob("*.safetensors"))
    before = [hashlib.sha256(f.read_bytes()).hexdigest() for f in files]
    tensor = WeightMap.from_checkpoint(checkpoint).tensor("model.layers.0.self_attn.q_proj.weight")
    tensor.copy_(tensor + 1.0)
    fresh = WeightMap.from_checkpoint(checkpoint).tensor("model.layers.0.self_attn.q_proj.weight")
    assert torch.equal(tensor, fresh + 1.0)
    assert [hashlib.sha256(f.read_bytes()).hexdigest() for f in files] == before


def _layered_graph(*layer_ops):
    """A chain of nodes named as decoder layer ``i``'s, ``layer_ops[i]`` their op types."""
    import numpy as np
    import onnx_graphsurgeon as gs

    x = gs.Variable("x", np.float32, [2, 4])
    nodes, tensor = [], x
    for layer, ops in enumerate(layer_ops):
        for k, op in enumerate(ops):
            out = gs.Variable(f"t{layer}_{k}", np.float32)
            inputs = [tensor, gs.Constant(f"w{layer}_{k}", np.ones((4, 4), np.float32))]
            nodes.append(gs.Node(op, f"/model/layers.{layer}/{op}_{k}", inputs=inputs, outputs=[out]))
            tensor = out
    return gs.Graph(nodes=nodes, inputs=[x], outputs=[tensor])


def test_structure_check_names_a_layer_unlike_the_others(tmp_path):
    from trtbuild.builder.passes import Pass
    from trtbuild.builder.passes.structure_check import StructureCheck

    def graph(layer1_ops):
        return _layered_graph(["MatMul", "Add"], layer1_ops, ["MatMul", "Add"])

    check = StructureCheck(3, tmp_path, {"check": "truncated"})
    record = {}
    result = PassResult(graph=None, modified=True)
    check.after_all(Pass("p", None), [graph(["MatMul", "Add"])], [result], [record], [])
    assert record["structure"]["layers_alike"] == 3 and record["structure"]["ops_per_layer"] == 2
    check.first = True
    with pytest.raises(UserError, match=r"after pass p decoder layer 1 differs from layer 2"):
        check.after_all(Pass("p", None), [graph(["MatMul"])], [result], [{}], [])


def test_structure_check_compares_layers_of_one_kept_form_with_each_other(tmp_path):
    """A GGUF mix keeps layers' linears in different forms (layer_forms): layers 1 and 3 here
    (an offset correction's extra MatMul) are compared with each other, 0 and 2 with each other;
    a layer unlike the others of its own form is still named, and the record says which layers'
    forms the truncated check (its first layer here) did not run."""
    import torch

    from trtbuild.builder.passes import Pass
    from trtbuild.builder.passes.structure_check import StructureCheck, layer_forms
    from trtbuild.builder.quant.algorithms import QuantizedLinear

    graph = _layered_graph
    def linear(offsets: bool) -> QuantizedLinear:
        return QuantizedLinear(codes=torch.zeros(4, 4, dtype=torch.int8), scales=torch.ones(4, 1), bits=4, group=4,
                               offsets=torch.zeros(4, 1) if offsets else None)

    plain, offset = ["MatMul", "Add"], ["MatMul", "Add", "MatMul"]
    forms = layer_forms({f"layers.{i}.mlp.down_proj": linear(offsets=i % 2 == 1) for i in range(4)}, 4)
    check = StructureCheck(4, tmp_path, {"check": "truncated", "layers": 1}, forms=forms)
    record, result = {}, PassResult(graph=None, modified=True)
    check.after_all(Pass("p", None), [graph(plain, offset, plain, offset)], [result], [record], [])
    assert record["structure"]["layer_forms"] == 2 and record["structure"]["layers_of_forms_not_in_the_check"] == [1, 3]
    assert record["structure"]["layers_compared_with_none"] == []
    # A form only one layer has: that layer is compared with nothing, and the record names it.
    alone = layer_forms({"layers.2.mlp.down_proj": linear(offsets=True)}, 4)
    record = {}
    StructureCheck(4, tmp_path, {"check": "truncated", "layers": 1}, forms=alone).after_all(
        Pass("p", None), [graph(plain, plain, offset, plain)], [result], [record], [])
    assert record["structure"]["layers_compared_with_none"] == [2]
    check.first = True
    with pytest.raises(UserError, match=r"after pass p decoder layer 1 differs from layer 3"):
        check.after_all(Pass("p", None), [graph(plain, plain, plain, offset)], [result], [{}], [])
    with pytest.raises(UserError, match=r"after pass p decoder layer 0 differs from layer 3"):  # one form for all
        StructureCheck(4, tmp_path, {"check": "truncated"}).after_all(
            Pass("p", None), [graph(plain, offset, plain, offset)], [result], [{}], [])


@pytest.mark.slow
def test_a_gpu_only_dir_holds_the_engines_alone_and_the_cpu_runtime_says_why(tmp_path):
    """build.cpu_graphs: false — the graphs are built, checked and compiled, then left out: the
    dir holds the engine, tokenizer and manifest (still hashed and trust-checked); run, eval and
    LLM on CPU refuse it in one line naming the field."""
    import subprocess
    import sys

    from trtbuild.runtime.engine_dir import EngineDirError
    from trtbuild.runtime.llm import LLM

    checkpoint = make_checkpoint(tmp_path / "llama", "llama")
    spec = write_spec(tmp_path / "spec.yaml", checkpoint, build={"cpu_graphs": False})
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "trtbuild.cli", "build", str(spec), "-o", str(out)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "left out the ONNX graphs" in proc.stderr
    assert not list(out.glob("*.onnx*")) and (out / "rank0.engine").is_file()
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["cpu_graphs"] is False and manifest["ranks"][0]["onnx"] is None
    shown = subprocess.run([sys.executable, "-m", "trtbuild.cli", "inspect", str(out)],
                           capture_output=True, text=True)
    assert shown.returncode == 0, shown.stderr
    assert "CPU graphs left out" in shown.stdout
    for command in (["run", str(out), "--prompt", "def f"], ["eval", str(out), "--data", str(spec)]):
        refused = subprocess.run([sys.executable, "-m", "trtbuild.cli", *command], capture_output=True, text=True)
        assert refused.returncode == 2, refused.stderr
        assert refused.stderr.count("\n") == 1 and "build.cpu_graphs: false" in refused.stderr
    with pytest.raises(EngineDirError, match="cpu_graphs: false"):
        LLM(out, backend="onnxruntime")
    (out / "rank0.engine").write_bytes(b"tampered")
    with pytest.raises(EngineDirError, match="sha256 differs"):
        LLM(out, backend="onnxruntime")

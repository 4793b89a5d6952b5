"""End to end: `trtbuild build` on the bundled model and on random checkpoints of other families."""
from __future__ import annotations

import json
import subprocess
import sys

import onnx
import pytest

from trtbuild.builder.build import BuildOptions, build
from trtbuild.builder.emit.cpu_step_model import decode_branch
from trtbuild.runtime.engine_dir_check import check_engine_dir
from trtbuild.contract.step import DECODE_READS, io_cache_names
from trtbuild.builder.progress import Progress, Verbosity
from trtbuild.builder.spec.resolve import load_spec
from trtbuild.runtime.llm import LLM
from trtbuild.runtime.core.sampling import SamplingParams

from conftest import TINY_CODE, write_spec
from ort_greedy import greedy, transformers_greedy

pytestmark = pytest.mark.slow

PROMPTS = ["def fibonacci(n):\n", "import os\n\nclass Config:\n    def __init__(self, path):\n",
           "for i in range(", "    return self._"]


def test_engine_dir_is_complete_and_hashes_verify(tiny_engine):
    manifest = json.loads((tiny_engine / "manifest.json").read_text())
    assert manifest["schema_version"] == 8
    assert manifest["speculation"] is None and manifest["medusa"] is None  # no draft source: plain decode only
    # Every file the runtime reads beside the ranks': written (and hashed) or recorded absent.
    assert manifest["side_files"] == {"tokenizer.json": True, "tokenizer_config.json": True,
                                      "chat_template.jinja": False, "generation_config.json": True,
                                      "config.json": True}
    built = manifest["tensorrt"]
    if built["flavor"] == "tensorrt-rtx":  # ahead of time: the spec's targets
        assert built["compute_capabilities"] == ["sm80", "sm86", "sm89"] and not built["portable"]
    else:  # TensorRT builds for the GPU it runs on (the spec's targets must include it)
        assert len(built["compute_capabilities"]) == 1 and built["compute_capabilities"][0] in ("sm80", "sm86", "sm89")
    assert manifest["cuda_graph_batch_sizes"] == [1, 2, 4, 8]
    for name in ("rank0.engine", "rank0.onnx", "rank0.onnx.data", "passes.jsonl", "tokenizer.json"):
        assert name in manifest["files"], name
    check_engine_dir(tiny_engine, manifest)  # every needed file listed, inside, hashes match
    assert (tiny_engine / "rank0.engine").stat().st_size > 1_000_000
    # A single-rank engine is paged: its I/O is rank0.paged.onnx's (contract/step.py PAGED_INPUTS).
    assert manifest["kv_cache"] == {"layout": "paged", "block_size": 16, "pool": [[16, 2, 32]]}
    io = {row["name"]: row for row in manifest["ranks"][0]["io"]}
    assert io["input_ids"]["dtype"] == "int32" and "write_index" not in io
    assert io["block_table"]["dtype"] == "int32" and io["kv_slots"]["shape"][1:] == ["seq", 2]
    assert io["attention_mask"]["dtype"] == "bool" and io["attention_mask"]["shape"][3] == "kv_positions"
    assert io["past_key_5"]["shape"] == ["pool_blocks", 16, 2, 32]
    assert io["present_key_5"]["aliases"] == "past_key_5"
    assert isinstance(io["logits"]["shape"][0], str)  # symbolic batch


def test_every_site_fused_on_the_tiny_model(tiny_engine):
    records = {r["pass"]: r for r in map(json.loads, (tiny_engine / "passes.jsonl").read_text().splitlines())}
    assert list(records) == ["canonicalize", "fuse_rmsnorm", "fuse_rotary", "fuse_attention", "quantize_weights",
                            "split_pipeline_stages", "shard_tensor_parallel", "attach_medusa", "heads_at_path_end",
                            "plan_cuda_graphs",
                            "cpu_group_query_attention", "cpu_pack_qkv", "cpu_drop_row_gather", "cpu_skip_norm",
                            "page_kv_cache"]
    assert records["split_pipeline_stages"]["modified"] is False  # one stage
    assert records["shard_tensor_parallel"]["modified"] is False  # one rank
    assert records["quantize_weights"]["modified"] is False  # quantization.mode: none
    assert records["attach_medusa"]["modified"] is False  # no speculative section
    assert records["fuse_rmsnorm"]["matches"] == 13  # 2 per layer + final norm
    assert records["fuse_rotary"]["matches"] == 12   # q and k per layer
    assert records["fuse_attention"]["matches"] == 6
    for name in ("fuse_rmsnorm", "fuse_rotary", "fuse_attention"):
        numerics = records[name]["numerics"]
        assert numerics["ok"] and numerics["vs_torch"]["max_abs"] < 1e-3, (name, numerics)
    # The CPU stage: every layer's chain becomes GroupQueryAttention, its q/k/v packed, the
    # logits-row gather bypassed, 12 residual norms fused (the 13 less the first, which reads the
    # embedding), each checked at a decode step against the rank graph, tolerance in the log.
    counts = [records[name]["matches"] for name in ("cpu_group_query_attention", "cpu_pack_qkv",
                                                     "cpu_drop_row_gather", "cpu_skip_norm")]
    assert counts == [6, 6, 1, 12]
    for name in ("cpu_group_query_attention", "cpu_pack_qkv", "cpu_drop_row_gather", "cpu_skip_norm"):
        numerics = records[name]["numerics"]
        assert numerics["step"] == "decode" and numerics["ok"] and numerics["atol"] == 1e-3, (name, numerics)
        assert numerics["vs_rank_graph"]["max_abs"] < 1e-4, (name, numerics)
    assert "vs_rank_graph" not in records["fuse_attention"]["numerics"]
    model = onnx.load(tiny_engine / "rank0.onnx", load_external_data=False)
    # A decode step fills only what the decode graph reads (runtime/backends/onnxruntime/step_graph.py).
    decode = decode_branch(onnx.load(tiny_engine / "rank0.cpu.onnx", load_external_data=False))
    read = {name for node in decode.graph.node for name in node.input}
    assert {i.name for i in model.graph.input} & read == {*DECODE_READS, *io_cache_names(6, "past")}
    assert {n.op_type for n in decode.graph.node} >= {"GroupQueryAttention", "SkipSimplifiedLayerNormalization"}
    # The CPU step model reads the rank's weight file: no second copy of the weights.
    manifest = json.loads((tiny_engine / "manifest.json").read_text())
    assert manifest["ranks"][0]["cpu_onnx"] == "rank0.cpu.onnx" and manifest["ranks"][0]["cpu_onnx_data"] is None
    assert "rank0.cpu.onnx" in manifest["files"] and (tiny_engine / "rank0.cpu.onnx").stat().st_size < 1 << 20
    graph = model.graph
    ops = {n.op_type for n in graph.node}
    assert {"Attention", "TensorScatter", "RotaryEmbedding", "RMSNormalization"} <= ops
    assert not ops & {"Softmax", "ScatterElements", "Pow", "Neg"}
    origin = {n.name: {p.key: p.value for p in n.metadata_props}["created_by"] for n in graph.node}
    assert origin["/model/layers.3/self_attn/Attention"] == "fuse_attention"
    assert origin["/model/layers.3/self_attn/q_proj/MatMul"] == "export"
    assert (tiny_engine / "dumps" / "all" / "004_fuse_attention.onnx").is_file()  # before the 1 → N split


def test_rank_graph_and_cpu_decode_graph_generate_the_same_greedy_tokens_as_transformers(tiny_engine):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_engine)
    prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    ours = greedy(tiny_engine / "rank0.onnx", prompts, 24, num_layers=6, num_kv_heads=2, head_dim=32, s_max=1024)
    assert ours == transformers_greedy(TINY_CODE, prompts, 24)
    # The runtime's default CPU path: plain decode steps on rank0.cpu.onnx's decode graph.
    llm = LLM(tiny_engine, backend="onnxruntime", threads=2)
    assert llm.engine.decode == "rank0.cpu.onnx"
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(prompts, params)] == ours


def test_inspect_shows_the_pass_table(tiny_engine):
    proc = subprocess.run([sys.executable, "-m", "trtbuild.cli", "inspect", str(tiny_engine)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "all hashes verify" in proc.stdout
    assert "fuse_attention" in proc.stdout and "LlamaForCausalLM: 6 layers" in proc.stdout
    cpu_rows = [line.split() for line in proc.stdout.splitlines() if " cpu_" in line]
    assert [(row[1], row[4]) for row in cpu_rows] == [("cpu_group_query_attention", "6"), ("cpu_pack_qkv", "6"),
                                                      ("cpu_drop_row_gather", "1"), ("cpu_skip_norm", "12")]
    node = subprocess.run([sys.executable, "-m", "trtbuild.cli", "inspect", str(tiny_engine),
                           "--node", "/model/layers.0/self_attn/Attention"], capture_output=True, text=True)
    assert "created by fuse_attention" in node.stdout
    cpu = subprocess.run([sys.executable, "-m", "trtbuild.cli", "inspect", str(tiny_engine), "--node",
                          "/model/layers.0/self_attn/Attention/cpu_decode"], capture_output=True, text=True)
    assert "(CPU decode graph): GroupQueryAttention, created by cpu_group_query_attention" in cpu.stdout, cpu.stderr


@pytest.mark.parametrize("family", ["mistral", "qwen2", "qwen3"])
def test_other_families_build_and_match_transformers(family, checkpoints, tmp_path):
    spec = load_spec(write_spec(tmp_path / "spec.yaml", checkpoints[family]))
    summary = build(spec, BuildOptions(out=tmp_path / "out"), Progress(Verbosity.error))
    records = {r["pass"]: r for r in summary.pass_records}
    norms_per_layer = 4 if family == "qwen3" else 2
    assert records["fuse_rmsnorm"]["matches"] == 2 * norms_per_layer + 1
    assert records["fuse_rotary"]["matches"] == 4 and records["fuse_attention"]["matches"] == 2
    prompts = [[5, 17, 300, 41], [9, 8, 7]]
    arch = spec.arch
    ours = greedy(tmp_path / "out" / "rank0.onnx", prompts, 8, arch.num_layers, arch.num_kv_heads, arch.head_dim, 128)
    assert ours == transformers_greedy(checkpoints[family], prompts, 8)
    # The runtime's decode steps run GroupQueryAttention where the chain is the plain pattern; Qwen3's
    # per-head norms sit inside it, so it has no CPU stage and its decode runs the rank graph. Same
    # tokens either way.
    llm = LLM(tmp_path / "out", backend="onnxruntime", threads=2)
    assert llm.engine.decode == (None if family == "qwen3" else "rank0.cpu.onnx")
    assert ("cpu_group_query_attention" in records) == (family != "qwen3")
    if family != "qwen3":  # Qwen2's biased q/k/v projections are not packed (a declared count, not a skip)
        assert records["cpu_pack_qkv"]["matches"] == records["cpu_pack_qkv"]["expected"] == (0 if family == "qwen2" else 2)
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    assert [o.token_ids for o in outs] == ours


def test_same_spec_and_checkpoint_give_identical_onnx(checkpoints, tmp_path):
    spec = load_spec(write_spec(tmp_path / "spec.yaml", checkpoints["llama"]))
    hashes = []
    for name in ("a", "b"):
        summary = build(spec, BuildOptions(out=tmp_path / name), Progress(Verbosity.error))
        hashes.append({k: v["sha256"] for k, v in summary.manifest["files"].items() if ".onnx" in k})
    assert hashes[0] == hashes[1] and len(hashes[0]) == 4  # rank0.onnx, its data, rank0.paged.onnx, rank0.cpu.onnx


def test_failed_build_leaves_nothing_behind(checkpoints, tmp_path):
    spec_path = write_spec(tmp_path / "spec.yaml", checkpoints["llama"], passes={"atol": 1e-12, "rtol": 1e-12})
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "trtbuild.cli", "build", str(spec_path), "-o", str(out)],
                          capture_output=True, text=True)
    assert proc.returncode == 2, proc.stderr
    assert "broke numerics" in proc.stderr and "Traceback" not in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["spec.yaml"]


def test_cli_json_summary_is_the_only_stdout(checkpoints, tmp_path):
    spec_path = write_spec(tmp_path / "spec.yaml", checkpoints["llama"])
    proc = subprocess.run([sys.executable, "-m", "trtbuild.cli", "build", str(spec_path), "-o",
                           str(tmp_path / "out"), "--json"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert [s["stage"] for s in summary["stages"]][2:5] == ["write rank0.onnx", "write rank0.paged.onnx",
                                                            "write rank0.cpu.onnx"]
    assert [s["stage"].split(" ")[0] for s in summary["stages"]] == ["export", "passes", "write", "write", "write",
                                                                      "engine", "manifest"]
    assert summary["engines"][0]["bytes"] > 0 and summary["peak_rss_bytes"] > 0

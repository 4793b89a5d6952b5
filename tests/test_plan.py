"""trtbuild plan: memory and roofline figures against hand-computed and well-known values."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from trtbuild.builder.errors import UserError
from trtbuild.builder.frontend.checkpoint import arch_config
from trtbuild.builder.plan.estimate import Plan, find_gpu, workload_for
from trtbuild.builder.plan.model_size import param_counts
from trtbuild.builder.plan.advice import recommendations

from conftest import REPO, TINY_CODE

LLAMA_2_70B = dict(architectures=["LlamaForCausalLM"], vocab_size=32000, hidden_size=8192, intermediate_size=28672,
                   num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=4096,
                   rms_norm_eps=1e-5, tie_word_embeddings=False)
LLAMA_3_8B = dict(architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                  num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                  rms_norm_eps=1e-5, tie_word_embeddings=False, rope_theta=500000.0)


def config_dir(tmp_path, name, config):
    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return path


def make_plan(checkpoint, gpu="H100-SXM", precision="fp16", tp=1, **workload) -> Plan:
    arch = arch_config(checkpoint)
    return Plan(arch=arch, gpu=find_gpu(gpu), gpus=tp, tp=tp, precision=precision,
                workload=workload_for(None, arch, precision=precision, **workload), counts=param_counts(arch))


def test_llama_2_70b_reproduces_the_well_known_memory_table(tmp_path):
    ckpt = config_dir(tmp_path, "llama-2-70b", LLAMA_2_70B)
    plan = make_plan(ckpt, gpu="A100-80GB")
    assert plan.counts.total == pytest.approx(68.98e9, rel=0.001)
    assert plan.weights("fp16") == pytest.approx(140e9, rel=0.03)
    assert plan.weights("int8") == pytest.approx(70e9, rel=0.03)
    assert plan.weights("int4") == pytest.approx(35e9, rel=0.05)
    assert plan.min_gpus("fp16") == 2 and not plan.fits("fp16", 1)     # needs two 80 GB GPUs
    assert plan.min_gpus("int8") == 1                                  # fits one 80 GB GPU
    l40s = make_plan(ckpt, gpu="L40S")
    assert l40s.fits("int4", 1)                                        # one 48 GB GPU, KV included
    assert 48e9 * 0.9 - l40s.per_rank("int4", 1) > 4e9                 # with room to spare for more KV
    assert plan.kv_per_token == 2 * 80 * 8 * 128 * 2


def test_llama_3_8b_hand_computed_figures(tmp_path):
    plan = make_plan(config_dir(tmp_path, "llama-3-8b", LLAMA_3_8B), gpu="H100-SXM")
    assert plan.counts.total == 8_030_261_248
    assert plan.kv_per_token == 131_072                                # 2 · 32 layers · 8 heads · 128 · 2 bytes
    assert plan.prefill_flops_per_token == 2 * (6_979_321_856 + 525_336_576)
    assert plan.weights("fp16") == 16_060_522_496
    assert plan.weights_floor_s() * 1e3 == pytest.approx(16_060_522_496 / 3.35e12 * 1e3, rel=1e-9)  # 4.794 ms
    assert plan.as_dict()["weights_read_ms"] == pytest.approx(4.7942, abs=1e-4)
    # The decode floor reads each sequence's KV too: 4096 tokens of mean context × 128 KiB.
    assert plan.as_dict()["decode_floor_ms"] == pytest.approx((16_060_522_496 + 4096 * 131_072) / 3.35e12 * 1e3,
                                                              abs=1e-4)
    assert plan.min_gpus("fp16") == 1


def test_bundled_model_hand_computed_figures():
    plan = make_plan(TINY_CODE, precision="fp32", batch=8, seq_len=1024)
    assert plan.counts.total == 6_622_464
    assert plan.kv_per_token == 2 * 6 * 2 * 32 * 4                    # float32 cache: 3072 bytes
    assert plan.prefill_flops_per_token == 2 * (6 * 753_664 + 4096 * 256)
    assert plan.weights("fp32") == 4 * 6_622_464
    assert plan.decode_bytes(1) == 4 * 6_622_464 + 512 * 3072


def test_recommendations_name_their_figures(tmp_path):
    ckpt = config_dir(tmp_path, "llama-2-70b", LLAMA_2_70B)
    recs = recommendations(make_plan(ckpt, gpu="A100-80GB"))
    texts = [r["recommendation"] for r in recs]
    assert texts[0] == "smallest tensor parallelism that fits at fp16: 2 × A100-80GB"
    assert texts[1] == "quantization that fits one A100-80GB: int8"   # A100 has no fp8
    assert all(r["figure"] for r in recs)
    big_batch = recommendations(make_plan(ckpt, gpu="H100-SXM", batch=512, seq_len=256))
    assert any(r["recommendation"].startswith("Medusa does not help at max_batch_size 512") for r in big_batch)
    small = recommendations(make_plan(ckpt, gpu="H100-SXM", batch=1, seq_len=256))
    assert any(r["recommendation"].startswith("Medusa can help at max_batch_size 1 if heads accept ≥ 0.1")
               for r in small)


def test_cli_plan_json_and_errors(tmp_path):
    ckpt = config_dir(tmp_path, "llama-3-8b", LLAMA_3_8B)
    proc = subprocess.run([sys.executable, "-m", "trtbuild.cli", "plan", str(ckpt), "--gpu", "h100", "--json"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    figures = json.loads(proc.stdout)
    for key in ("weight_bytes", "kv_bytes_per_token", "min_gpus", "decode_floor_ms"):
        assert key in figures
    assert figures["min_gpus"]["int4"] == 1 and figures["weight_bytes"]["fp16"] == 16_060_522_496
    text = subprocess.run([sys.executable, "-m", "trtbuild.cli", "plan", str(REPO / "specs" / "tiny-code.yaml")],
                          capture_output=True, text=True)
    assert text.returncode == 0 and "recommendations" in text.stdout
    bad = subprocess.run([sys.executable, "-m", "trtbuild.cli", "plan", str(ckpt), "--gpu", "V100"],
                         capture_output=True, text=True)
    assert bad.returncode == 2
    assert bad.stderr.startswith("error: --gpu: unknown GPU 'V100'; valid: A100-40GB, A100-80GB, H100-SXM")
    spec = tmp_path / "nockpt.yaml"
    spec.write_text(f"model: {{checkpoint: {tmp_path / 'missing'}}}\n")
    bad = subprocess.run([sys.executable, "-m", "trtbuild.cli", "plan", str(spec)], capture_output=True, text=True)
    assert bad.returncode == 2 and "model.checkpoint" in bad.stderr and "does not exist" in bad.stderr
    unknown = subprocess.run([sys.executable, "-m", "trtbuild.cli", "plan", "llama-9-1t"], capture_output=True,
                             text=True)
    assert unknown.returncode == 2 and unknown.stderr.strip() == (
        "error: llama-9-1t: neither a spec file, a checkpoint dir, a .gguf file nor a known model (llama-3-70b, "
        "llama-3-8b, llama-3.1-405b, mistral-7b, qwen2.5-7b)")


def plan_cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trtbuild.cli", "plan", *map(str, args)],
                          capture_output=True, text=True)


def test_readme_examples_run_without_the_checkpoint():
    """specs/llama-3-8b.yaml points at /models/…, absent here: plan uses the shipped config."""
    proc = plan_cli(REPO / "specs" / "llama-3-8b.yaml", "--gpu", "L40S")
    assert proc.returncode == 0, proc.stderr
    assert "planning with the shipped config.json of llama-3-8b" in proc.stderr
    assert "8.030 B parameters" in proc.stdout
    by_name = plan_cli("llama-3-70b", "--gpu", "H200", "--precision", "fp8", "--json")
    assert by_name.returncode == 0, by_name.stderr
    figures = json.loads(by_name.stdout)
    assert figures["parameters"] == pytest.approx(70.55e9, rel=0.001) and figures["precision"] == "fp8"


@pytest.mark.parametrize("gpu, expected", [
    ("H200", "H200 (sm90) cannot run TensorRT-RTX engines (its runtime refuses sm90): build with build.backend: "
             "tensorrt on an sm90 GPU; this spec's backend auto builds TensorRT-RTX engines on a machine without a GPU"),
    ("B200", "B200 (sm100) cannot run TensorRT-RTX engines (its runtime refuses sm100)"),
    ("RTX-5090", "RTX-5090 (sm120) is not among this spec's build.targets (sm80, sm86, sm89): add sm120"),
    ("L40S", "L40S (sm89) runs TensorRT-RTX engines built anywhere (targets including sm89, or portable)"),
])
def test_plan_says_which_engines_run_on_the_gpu(gpu, expected):
    proc = plan_cli(REPO / "specs" / "tiny-code.yaml", "--gpu", gpu)
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("engines"))
    assert expected in line


def test_quantized_specs_are_planned_as_themselves(tmp_path):
    from trtbuild.builder.plan.model_size import weight_bytes

    counts = param_counts(arch_config(config_dir(tmp_path, "llama-3-8b", LLAMA_3_8B)))
    fixed = 2 * (counts.embedding + counts.head + counts.other)
    assert weight_bytes(counts, "fp8") == fixed + counts.linear
    assert weight_bytes(counts, "fp4") == fixed + counts.linear * (0.5 + 1 / 16)  # an fp8 scale per 16
    for mode, precision in (("fp8", "fp8"), ("nvfp4", "fp4"), ("w8a8", "w8a8"), ("int4_weight_only", "int4")):
        spec = tmp_path / f"{mode}.yaml"
        spec.write_text(f"model: {{checkpoint: {TINY_CODE}}}\nbuild: {{targets: [sm120], max_seq_len: 512}}\n"
                        f"quantization: {{mode: {mode}, calibration: {{data: [{TINY_CODE / 'heldout.txt'}]}}}}\n")
        proc = plan_cli(spec, "--json")
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["precision"] == precision
    h100 = plan_cli(spec.parent / "nvfp4.yaml", "--gpu", "H100-SXM")
    assert "note       H100-SXM has no fp4 tensor cores; compute figures use its fp16 peak" in h100.stdout


def test_min_gpus_counts_only_tensor_parallelism_the_spec_accepts(tmp_path):
    # 24 heads over 3 KV heads: 2 and 4 ranks would split a KV head, so 3 or 6 is next after 1.
    config = dict(LLAMA_3_8B, hidden_size=6144, num_attention_heads=24, num_key_value_heads=3, intermediate_size=24576,
                  vocab_size=129024)
    plan = make_plan(config_dir(tmp_path, "gqa3", config), gpu="L40S", batch=32, seq_len=8192)
    assert not plan.fits("fp16", 1) and plan.fits("fp16", 2)  # memory alone would say 2
    assert plan.min_gpus("fp16") == 3
    bad = plan_cli(config_dir(tmp_path, "gqa3b", config), "--tp", "2")
    assert bad.returncode == 2 and bad.stderr.strip() == (
        "error: --tp: 2 neither divides nor is a multiple of num_key_value_heads=3 (KV heads are split or "
        "replicated whole)")


def test_plan_says_one_thing_at_a_time():
    text = plan_cli(REPO / "specs" / "tiny-code.yaml").stdout
    assert "never" not in text
    assert "decode is bandwidth-bound at every batch size" in text


def test_unknown_gpu_lists_the_table():
    with pytest.raises(UserError, match="valid: A100-40GB, A100-80GB, H100-SXM, H100-PCIe, H200, L40S, RTX-4090, RTX-5090, B200"):
        find_gpu("TPU")


def test_medusa_prediction_follows_the_roofline(tmp_path):
    import dataclasses

    from trtbuild.builder.plan.estimate import MedusaPlan

    medusa = MedusaPlan(num_heads=4, num_layers=1, choices=((0,), (0, 0), (0, 0, 0), (1,)),
                        rank_accuracy=[[0.6, 0.2]] * 4)
    assert [round(e, 3) for e in medusa.expected_accepted()] == [0.0, 0.6, 0.96, 1.176, 1.376]
    plan = dataclasses.replace(make_plan(config_dir(tmp_path, "llama-3-8b", LLAMA_3_8B), gpu="H100-SXM",
                                         seq_len=256), medusa=medusa)
    # batch 1 is bandwidth-bound: 5 tokens cost what 1 does, so the whole tree pays
    n, tokens, speedup = plan.medusa_choice(1)
    assert (n, round(tokens, 3)) == (4, 2.376) and speedup == pytest.approx(2.376, rel=0.01)
    # at batch 1024 a step is compute-bound: 5× the tokens cost ~5× the time, so it steps aside
    assert plan.medusa_choice(1024) == (0, 1.0, 1.0)
    proc = subprocess.run([sys.executable, "-m", "trtbuild.cli", "plan",
                           str(REPO / "specs" / "tiny-code-medusa.yaml"), "--json"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    figures = json.loads(proc.stdout)
    assert figures["medusa"]["1"]["tree_choices"] > 0
    # The advice states the figures worked out by hand above: at batch 1 the whole tree, 2.376 tokens a step.
    single = dataclasses.replace(plan, workload=dataclasses.replace(plan.workload, max_batch=1))
    (advice,) = [r for r in recommendations(single) if "Medusa" in r["recommendation"]]
    assert advice["recommendation"].startswith("Medusa helps at max_batch_size 1: verify 4 guesses per step")
    assert advice["figure"].startswith("2.38 tokens per step")
    huge = dataclasses.replace(plan, workload=dataclasses.replace(plan.workload, max_batch=1024))
    advice = next(r["recommendation"] for r in recommendations(huge) if "Medusa" in r["recommendation"])
    assert advice.startswith("Medusa does not help at max_batch_size 1024")


def test_speculation_plan_states_the_verification_for_any_source(tmp_path):
    """A verification of S tokens a row costs ~1 plain step while decoding reads weights
    (batch 1) and ~S steps once compute-bound; it pays above MIN_GAIN · cost − 1 accepted guesses."""
    from trtbuild.builder.plan.estimate import SpeculationPlan

    plan = dataclasses.replace(make_plan(config_dir(tmp_path, "llama-3-8b", LLAMA_3_8B), gpu="H100-SXM", seq_len=256),
                               speculation=SpeculationPlan(("prompt_lookup",), 9))
    assert plan.verification(1) == pytest.approx((1.0, 0.1))
    assert plan.verification(1024) == pytest.approx((9.0, 8.9))
    proc = subprocess.run([sys.executable, "-m", "trtbuild.cli", "plan", str(REPO / "specs" / "tiny-code-speculation.yaml")],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "speculation (prompt_lookup, suffix; verification S = 17, step times from the roofline" in proc.stdout
    assert "  batch 1: a verification of 17 tokens a row costs 1.00x a plain decode step; it pays above 0.10 " \
           "accepted guesses per step" in proc.stdout.splitlines()
    figures = json.loads(subprocess.run([sys.executable, "-m", "trtbuild.cli", "plan", str(REPO / "specs" / "tiny-code.yaml"),
                                         "--json"], capture_output=True, text=True, check=True).stdout)
    assert figures["speculation"] is None


# models/tiny-code/medusa: 4 heads of 1 residual block, D = 256, V = 4096, float32. A head's
# constants: the block's [D, D] weight and [D] bias, and its own [V, D] projection.
HEAD_BLOCK = 256 * 256 + 256
HEAD_OUT = 4096 * 256
MEDUSA_BYTES = 4 * (HEAD_BLOCK + HEAD_OUT) * 4  # 17,829,888: what a real build's rank0.onnx.data grows by


def test_the_plan_counts_the_medusa_heads_in_the_engine_dir():
    from trtbuild.builder.plan.build_cost import spec_build_plan
    from trtbuild.builder.spec.resolve import load_spec

    medusa, plain = (spec_build_plan(load_spec(REPO / "specs" / name)) for name in ("tiny-code-medusa.yaml",
                                                                                  "tiny-code.yaml"))
    # the heads are in the rank graph's data file (the CPU graph reads that one) and in the engine
    assert medusa.dir_bytes == plain.dir_bytes + 2 * MEDUSA_BYTES
    assert medusa.disk_peak_bytes == plain.disk_peak_bytes + 2 * MEDUSA_BYTES
    assert medusa.engine_peak_bytes == plain.engine_peak_bytes + 2 * MEDUSA_BYTES
    assert medusa.medusa_bytes == MEDUSA_BYTES and plain.medusa_bytes == 0
    shown = {name: plan_cli(REPO / "specs" / f"{name}.yaml", "--json") for name in ("tiny-code-medusa", "tiny-code")}
    assert all(p.returncode == 0 for p in shown.values()), {n: p.stderr for n, p in shown.items()}
    builds = {name: json.loads(p.stdout)["build"] for name, p in shown.items()}
    assert builds["tiny-code-medusa"]["medusa_bytes"] == MEDUSA_BYTES
    assert builds["tiny-code-medusa"]["dir_bytes"] == builds["tiny-code"]["dir_bytes"] + 2 * MEDUSA_BYTES
    text = plan_cli(REPO / "specs" / "tiny-code-medusa.yaml").stdout
    assert "(engines + the CPU graphs' weights + the Medusa heads)" in text


@pytest.mark.parametrize("train_out, tensor, quantization, expected", [
    (True, 2, None, (2 * 4 * HEAD_BLOCK + 4 * HEAD_OUT) * 4),  # each rank its blocks, a slice of each projection
    (False, 1, None, 4 * HEAD_BLOCK * 4),                      # frozen projections are the LM head's weight
    (False, 2, None, 2 * 4 * HEAD_BLOCK * 4),
    (False, 1, "int8_weight_only", MEDUSA_BYTES),              # a quantized LM head is never shared
])
def test_the_medusa_heads_bytes_follow_sharing_and_tensor_parallelism(tmp_path, train_out, tensor, quantization,
                                                                      expected):
    import shutil

    from trtbuild.builder.plan.build_cost import spec_build_plan
    from trtbuild.builder.spec.resolve import load_spec
    from conftest import write_spec

    heads = tmp_path / "heads"
    heads.mkdir()
    source = TINY_CODE / "medusa"
    shutil.copy(source / "medusa_lm_head.safetensors", heads)
    config = json.loads((source / "config.json").read_text())
    config["trtbuild"]["train_out"] = train_out
    (heads / "config.json").write_text(json.dumps(config))
    sections = {"speculative": {"medusa": {"heads": str(heads), "num_heads": 4}}, "parallel": {"tensor": tensor}}
    if quantization:
        sections["quantization"] = {"mode": quantization, "calibration": {"data": [str(TINY_CODE / "heldout.txt")]}}
    spec = load_spec(write_spec(tmp_path / "spec.yaml", TINY_CODE, **sections))
    build = spec_build_plan(spec)
    assert build.medusa_bytes == expected
    # the heaviest rank's engine build holds its share of the heads
    assert build.engine_peak_bytes == 0.2e9 + 2 * (build.rank_bytes + expected / tensor)
    # `plan`'s own build side (from the Plan, at the spec's TP) counts the same bytes
    proc = plan_cli(tmp_path / "spec.yaml", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["build"]["medusa_bytes"] == expected


def test_the_planned_medusa_bytes_are_what_a_build_writes(tiny_engine, medusa_engine):
    from trtbuild.builder.plan.build_cost import spec_build_plan
    from trtbuild.builder.spec.resolve import load_spec

    planned = spec_build_plan(load_spec(REPO / "specs" / "tiny-code-medusa.yaml")).medusa_bytes
    grown = (medusa_engine / "rank0.onnx.data").stat().st_size - (tiny_engine / "rank0.onnx.data").stat().st_size
    assert planned == grown == MEDUSA_BYTES  # the rank graph's data file, exactly; the CPU graph reads it too
    assert not list(medusa_engine.glob("rank0.cpu.onnx.data"))  # float32: no tensor of the CPU graph's own

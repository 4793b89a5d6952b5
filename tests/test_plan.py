"""trtbuild plan: memory and roofline figures against hand-computed and well-known values."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from trtbuild.builder.errors import UserError
from trtbuild.builder.frontend.checkpoint import arch_config
from trtbuild.builder.plan import Plan, find_gpu, param_counts, workload_for

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
    assert plan.as_dict()["decode_floor_ms"] == pytest.approx(4.7942, abs=1e-4)
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
    recs = make_plan(ckpt, gpu="A100-80GB").recommendations()
    texts = [r["recommendation"] for r in recs]
    assert texts[0] == "smallest tensor parallelism that fits at fp16: 2 × A100-80GB"
    assert texts[1] == "quantization that fits one A100-80GB: int8"   # A100 has no fp8
    assert all(r["figure"] for r in recs)
    big_batch = make_plan(ckpt, gpu="H100-SXM", batch=512, seq_len=256).recommendations()
    assert any(r["recommendation"].startswith("Medusa does not help at max_batch_size 512") for r in big_batch)


def test_cli_plan_json_and_errors(tmp_path):
    ckpt = config_dir(tmp_path, "llama-3-8b", LLAMA_3_8B)
    proc = subprocess.run([sys.executable, "-m", "trtbuild.builder.cli", "plan", str(ckpt), "--gpu", "h100", "--json"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    figures = json.loads(proc.stdout)
    for key in ("weight_bytes", "kv_bytes_per_token", "min_gpus", "decode_floor_ms"):
        assert key in figures
    assert figures["min_gpus"]["int4"] == 1 and figures["weight_bytes"]["fp16"] == 16_060_522_496
    text = subprocess.run([sys.executable, "-m", "trtbuild.builder.cli", "plan", str(REPO / "specs" / "tiny-code.yaml")],
                          capture_output=True, text=True)
    assert text.returncode == 0 and "recommendations" in text.stdout
    bad = subprocess.run([sys.executable, "-m", "trtbuild.builder.cli", "plan", str(ckpt), "--gpu", "V100"],
                         capture_output=True, text=True)
    assert bad.returncode == 2
    assert bad.stderr.startswith("error: --gpu: unknown GPU 'V100'; valid: A100-40GB, A100-80GB, H100-SXM")
    spec = tmp_path / "nockpt.yaml"
    spec.write_text(f"model: {{checkpoint: {tmp_path / 'missing'}}}\n")
    bad = subprocess.run([sys.executable, "-m", "trtbuild.builder.cli", "plan", str(spec)], capture_output=True, text=True)
    assert bad.returncode == 2 and "model.checkpoint" in bad.stderr and "does not exist" in bad.stderr


def test_unknown_gpu_lists_the_table():
    with pytest.raises(UserError, match="valid: A100-40GB, A100-80GB, H100-SXM, H100-PCIe, H200, L40S, RTX-4090, RTX-5090, B200"):
        find_gpu("TPU")


def test_medusa_prediction_follows_the_roofline(tmp_path):
    import dataclasses

    from trtbuild.builder.plan import MedusaPlan

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
    proc = subprocess.run([sys.executable, "-m", "trtbuild.builder.cli", "plan",
                           str(REPO / "specs" / "tiny-code-medusa.yaml"), "--json"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["medusa"]["1"]["tree_choices"] > 0

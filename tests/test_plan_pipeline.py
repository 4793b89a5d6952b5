"""``trtbuild plan``'s pipeline side (issue 27): stage memory, hand-offs over nodes, the bubble,
and the T × P layout it recommends; arithmetic on published configs, exact where it can be."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from trtbuild.cli.main import main
from trtbuild.builder.gpus import GB, find_gpu, network_table
from trtbuild.builder.known_models import known_arch
from trtbuild.builder.plan.estimate import Plan, workload_for
from trtbuild.builder.plan.model_size import param_counts
from trtbuild.builder.plan.pipeline import PipelinePlan, recommend_layout
from trtbuild.contract.pipeline import balanced_layers

NDR = network_table()["infiniband-ndr"]


def plan_of(model: str, precision: str, tp: int = 1, gpu: str = "H100-SXM", **workload) -> Plan:
    arch = known_arch(model)
    return Plan(arch=arch, gpu=find_gpu(gpu), gpus=tp, tp=tp, precision=precision,
                workload=workload_for(None, arch, precision=precision, **workload), counts=param_counts(arch))


def test_layers_split_as_evenly_as_they_go():
    assert balanced_layers(126, 4) == (32, 32, 31, 31)
    assert balanced_layers(32, 2) == (16, 16)
    assert balanced_layers(6, 6) == (1,) * 6


def test_stage_weights_add_up_to_the_model_with_the_replicated_tables():
    """T ranks of every stage hold the model's weights once, except what sharding replicates:
    the embedding (T copies on the first stage) and the final norm (T copies on the last)."""
    for model, tp, pp in (("llama-3.1-405b", 8, 2), ("llama-3-70b", 4, 4), ("llama-3-8b", 1, 3)):
        pipe = PipelinePlan(plan_of(model, "fp16", tp), pp, NDR)
        held = sum(pipe.stage_weights(s) for s in range(pp)) * tp
        replicated = (tp - 1) * (pipe.embedding_bytes + 2 * pipe.plan.arch.hidden_size)
        assert held == pytest.approx(pipe.plan.weights() + replicated, rel=1e-12)
    whole = PipelinePlan(plan_of("llama-3-8b", "fp16"), 1, NDR)
    assert whole.stage_weights(0) == pytest.approx(whole.plan.weights(), rel=1e-12)


def test_hand_offs_leave_a_node_only_between_nodes():
    across = PipelinePlan(plan_of("llama-3.1-405b", "fp16", 8, batch=8), 2, NDR)
    assert across.nodes == 2 and across.crosses_node(0)
    assert across.activation_bytes(8, 1) == 8 * 16384 * 2
    assert across.network_bytes_per_step(8, 1) == 8 * 8 * 16384 * 2  # every tensor rank sends its copy
    assert across.hop_s(8, 1, 0) == pytest.approx(5e-6 + 8 * 16384 * 2 / (50 * GB))
    inside = PipelinePlan(plan_of("llama-3-70b", "fp16", 2), 4, NDR)
    assert inside.nodes == 1 and not any(inside.crosses_node(b) for b in range(3))
    assert inside.network_bytes_per_step(8, 1) == 0


def test_bubble_with_and_without_micro_batches():
    pipe = PipelinePlan(plan_of("llama-3-70b", "fp16", 2), 4, NDR)
    assert pipe.bubble(8, micro_batching=False) == 3 / 4
    assert pipe.bubble(2, micro_batching=True) == 3 / 5
    assert pipe.bubble(8, micro_batching=True) == 3 / 7
    assert PipelinePlan(plan_of("llama-3-8b", "fp16"), 1, NDR).bubble(8, micro_batching=False) == 0


def test_the_layout_it_recommends():
    # 405B fp16 (812 GB) does not fit 8 × 80 GB: a full node of tensor ranks per stage, two stages.
    layout = recommend_layout(plan_of("llama-3.1-405b", "fp16", batch=8, seq_len=8192), NDR)
    assert (layout.tp, layout.pp, layout.nodes) == (8, 2, 2)
    # fp8 at one sequence fits one node; 64 sequences of 8192 tokens (270 GB of KV) do not.
    assert (lambda l: (l.tp, l.pp))(recommend_layout(plan_of("llama-3.1-405b", "fp8", batch=1, seq_len=8192), NDR)) \
        == (8, 1)
    assert (lambda l: (l.tp, l.pp))(recommend_layout(plan_of("llama-3.1-405b", "fp8", batch=64, seq_len=8192), NDR)) \
        == (8, 2)
    # A small model: one GPU.
    assert (lambda l: (l.tp, l.pp))(recommend_layout(plan_of("llama-3-8b", "fp16", gpu="L40S", seq_len=8192), NDR)) \
        == (1, 1)


def test_plan_cli_prints_the_stages_and_refuses_more_stages_than_layers():
    result = CliRunner().invoke(main, ["plan", "llama-3.1-405b", "--gpu", "H100-SXM", "--tp", "8", "--pp", "2",
                                       "--batch", "8", "--seq-len", "8192"])
    assert result.exit_code == 0, result.output
    assert "pipeline (8 × 2 = 16 ranks on 2 nodes of 8 × H100-SXM; between nodes InfiniBand NDR" in result.output
    assert "layout: 8 × 2 at fp16" in result.output
    as_json = CliRunner().invoke(main, ["plan", "llama-3-70b", "--tp", "2", "--pp", "4", "--json"])
    report = json.loads(as_json.stdout)
    assert [s["layers"] for s in report["pipeline"]["stages"]] == [20, 20, 20, 20]
    assert report["layout"]["tp"] == 4 and report["layout"]["pp"] == 1
    bad = CliRunner().invoke(main, ["plan", "llama-3-8b", "--pp", "33"])
    assert bad.exit_code == 2 and "--pp: 33 stages for 32 layers" in bad.output


def test_plan_of_a_spec_splits_its_stages_as_the_spec_says(tmp_path):
    """A spec's parallel.layers_per_stage is the split the build makes, so the plan's stage
    memory follows it; another --pp than the spec's balances the layers and says so."""
    spec = tmp_path / "uneven.yaml"
    spec.write_text("model:\n  checkpoint: llama-3-8b\n  dtype: float16\n"
                    "parallel:\n  pipeline: 2\n  layers_per_stage: [12, 20]\n")
    report = json.loads(CliRunner().invoke(main, ["plan", str(spec), "--json"]).stdout)
    stages = report["pipeline"]["stages"]
    assert [s["layers"] for s in stages] == [12, 20]
    balanced = json.loads(CliRunner().invoke(main, ["plan", "llama-3-8b", "--pp", "2", "--json"]).stdout)
    assert [s["layers"] for s in balanced["pipeline"]["stages"]] == [16, 16]
    # The last stage (lm_head and 8 more layers) holds more than the balanced split's.
    assert stages[1]["weights_bytes_per_rank"] > balanced["pipeline"]["stages"][1]["weights_bytes_per_rank"]
    other = CliRunner().invoke(main, ["plan", str(spec), "--pp", "4", "--json"])
    assert other.exit_code == 0
    assert [s["layers"] for s in json.loads(other.stdout)["pipeline"]["stages"]] == [8, 8, 8, 8]
    assert "parallel.layers_per_stage is left out" in other.stderr
    with pytest.raises(ValueError, match="2 stages summing to 32"):
        PipelinePlan(plan_of("llama-3-8b", "fp16"), 2, NDR, (10, 10))

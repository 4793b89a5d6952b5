"""Pipeline stages on the TensorRT backend, on the simulated device (tests/simulated_device.py), not a
GPU test: each rank process (rank 0 here, rank 1 started by it) runs TensorRTEngine's own code as a
stage (runtime/parallel/tensorrt_stage.py) with its hand-off in simulated device memory, moved by the
host-staged gloo transport (runtime/parallel/transport.py; real GPUs take the NCCL one, whose test
is tests/test_tensorrt_runtime.py::test_tensorrt_pipeline_stages_match_the_cpu_runtime). The
tokens must be exactly the CPU runtime's."""
from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from conftest import REPO
from simulated_device import SimulatedDevice, install_in_rank_processes
from trtbuild.runtime.engine_dir import EngineDir, EngineDirError
from trtbuild.runtime.llm import LLM
from trtbuild.runtime.core.sampling import SamplingParams

SHARED = "import os\nimport sys\nimport json\nimport time\nfrom pathlib import Path\n" * 2  # 2 prefix blocks
PROMPTS = ["def fibonacci(n):", "import os\nimport sys", "class Stack:", "    def __init__(self, items):",
           SHARED + "def main():", SHARED + "class Config:"]
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def cpu_tokens(pp2_engine):
    with LLM(pp2_engine, backend="onnxruntime", prefix_cache=True) as llm:
        return [c.token_ids for c in llm.generate(PROMPTS, GREEDY)]


@pytest.fixture
def device(monkeypatch, pp2_engine):
    device = SimulatedDevice(compute_capability="sm89")
    device.install(monkeypatch, [pp2_engine])            # rank 0: this process
    install_in_rank_processes(monkeypatch, [pp2_engine])  # rank 1: the process rank 0 starts
    return device


def gpu_tokens(engine_dir) -> tuple[list[list[int]], dict]:
    """Greedy tokens of PROMPTS on the TensorRT backend (prefix cache on) and what rank 0 saw."""
    from trtbuild.runtime.parallel.pipeline_parallel import StageRunner
    from trtbuild.runtime.parallel.transport import HostStagedTransport
    from trtbuild.runtime.parallel.tensorrt_stage import TensorRTStage

    with LLM(engine_dir, backend="tensorrt", prefix_cache=True) as llm:
        assert llm.engine.paged and llm.scheduler.paged  # each stage pools its own layers' caches
        stage = llm.engine.local
        assert isinstance(stage, StageRunner) and isinstance(stage.engine, TensorRTStage)
        assert isinstance(stage.transport, HostStagedTransport)  # torch here has no CUDA: no NCCL
        first = [llm.submit(p, GREEDY) for p in PROMPTS[:5]]
        for _ in range(3):
            llm.step()
        later = [llm.submit(p, GREEDY) for p in PROMPTS[5:]]  # joins mid-decode, hits the prefix cache
        done = {c.rid: c for c in llm.run_until_done()}
        seen = {"name": llm.engine.name, "sent_bytes": stage.sent_bytes,
                "cached": [done[r].cached_tokens for r in later], "hits": llm.scheduler.kv.stats.hits}
        return [done[r].token_ids for r in first + later], seen


@pytest.mark.slow
def test_stages_on_the_simulated_device_give_the_cpu_runtime_tokens(device, pp2_engine, cpu_tokens):
    tokens, seen = gpu_tokens(pp2_engine)
    assert tokens == cpu_tokens
    assert seen["name"] == "tensorrt (2 pipeline stages × 1 tensor ranks)"
    assert seen["sent_bytes"] > 0 and seen["cached"][0] >= 32 and seen["hits"] >= 2  # the shared blocks, by reference
    assert device.calls["cudaGraphLaunch"] == 0  # stage steps run eagerly


@pytest.mark.slow
def test_medusa_heads_on_the_last_stage_verify_on_the_simulated_device(monkeypatch, tmp_path):
    """Medusa verification steps on stages: the tree's S rows handed on, medusa_logits from the
    last stage's device buffer, keep_path on both stages' caches: plain decoding's tokens."""
    import yaml

    spec = yaml.safe_load((REPO / "specs" / "tiny-code-medusa.yaml").read_text())
    spec["model"]["checkpoint"] = str(REPO / "models" / "tiny-code")
    spec["speculative"]["medusa"]["heads"] = str(REPO / "models" / "tiny-code" / "medusa")
    spec["parallel"] = {"pipeline": 2}
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    proc = subprocess.run([sys.executable, "-m", "trtbuild.cli", "build", str(tmp_path / "spec.yaml"), "-o",
                           str(tmp_path / "medusa-pp2")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    engine = tmp_path / "medusa-pp2"
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    with LLM(engine, backend="onnxruntime", medusa_tree_size=0) as llm:
        plain = [c.token_ids for c in llm.generate(PROMPTS[:4], params)]
    SimulatedDevice().install(monkeypatch, [engine])
    install_in_rank_processes(monkeypatch, [engine])
    with LLM(engine, backend="tensorrt", medusa_tree_size=63) as llm:
        assert llm.engine.paged  # accepted paths kept in both stages' blocks (KeepPathInBlocks)
        assert [c.token_ids for c in llm.generate(PROMPTS[:4], params)] == plain
        assert llm.speculation.stats.verify_steps > 0 and llm.speculation.stats.accepted_tokens > 0


# -- planted faults: the simulation must notice them -----------------------------------------------

def hand_off_from_the_next_slot(stage_step):
    """Stage 0 sends the region of the slot after the one its step wrote (a binding/send offset
    mismatch): stage 1 reads what was never written there, or another micro-batch's rows."""
    def planted(self, step, hidden):
        outputs = stage_step(self, step, hidden)
        out = outputs["hidden_states_out"]
        outputs["hidden_states_out"] = dataclasses.replace(out, address=out.address + self.slot_hidden)
        return outputs
    return planted


def hand_off_one_column_short(stage_step):
    """Stage 0 sends [B, S, D − 1] of its [B, S, D]: gloo takes the short message without a word
    (so does NCCL, or it hangs), and the rest of stage 1's input is what was there before."""
    def planted(self, step, hidden):
        outputs = stage_step(self, step, hidden)
        out = outputs["hidden_states_out"]
        outputs["hidden_states_out"] = dataclasses.replace(out, shape=(*out.shape[:2], out.shape[2] - 1))
        return outputs
    return planted


@pytest.mark.slow
@pytest.mark.parametrize("plant", [hand_off_from_the_next_slot, hand_off_one_column_short])
def test_a_planted_hand_off_fault_changes_the_tokens(device, pp2_engine, cpu_tokens, monkeypatch, plant):
    from trtbuild.runtime.parallel.tensorrt_stage import TensorRTStage

    monkeypatch.setattr(TensorRTStage, "stage_step", plant(TensorRTStage.stage_step))
    assert gpu_tokens(pp2_engine)[0] != cpu_tokens


def test_a_rank_without_an_io_table_is_refused_in_one_line():
    engine_dir = EngineDir(path=REPO / "build" / "x", manifest={"ranks": [{"rank": 0}]})
    with pytest.raises(EngineDirError) as info:
        engine_dir.rank_tensors(0)
    assert str(info.value) == (f"{REPO / 'build' / 'x' / 'manifest.json'}: ranks[0].io is not a list of tensors "
                               "with names; rebuild the engine dir")

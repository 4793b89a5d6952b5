"""The paged TensorRT engine on the simulated device, beyond test_simulated_device's tokens: a
pool too small for every request at once (preemption), host-drafted chains verified in the pool,
structured outputs and stop strings, tables that widen as rows grow. Each run's greedy tokens must
be exactly the ONNX Runtime backend's, whose rows are slots."""
from __future__ import annotations

import pytest

from trtbuild.contract.speculation import Source
from trtbuild.runtime.core.sampling import SamplingParams
from trtbuild.runtime.core.kv_budget import kv_bytes_per_token
from trtbuild.runtime.engine_dir import load
from trtbuild.runtime.llm import LLM
from trtbuild.runtime.speculation.host import SpeculationMode
from trtbuild.runtime.structured.constraint import Regex

from simulated_device import SimulatedDevice

PROMPTS = ["def fibonacci(n):\n", "import os\n", "class Stack:\n    def __init__(self):\n        self.",
           "    for i in range(len(", "# Copyright", "def __repr__(self):\n        return '<%s %r>' % (",
           "from collections import", "x", "while True:\n", "try:\n    import numpy as np\nexcept",
           "if __name__ == '__main__':\n", "return [x for x in"]


@pytest.fixture
def device(monkeypatch, tiny_engine, speculation_engine):
    device = SimulatedDevice(compute_capability="sm89", per_thread_device=True)
    device.install(monkeypatch, [tiny_engine, speculation_engine])
    return device


def tokens(engine_dir, prompts, params, backend, **options):
    with LLM(engine_dir, backend=backend, threads=2, **options) as llm:
        outs = [c.token_ids for c in llm.generate(prompts, params)]
        return outs, llm.scheduler.kv.stats, getattr(llm.engine, "graphs", {})


def test_a_pool_too_small_for_every_request_preempts_and_keeps_the_tokens(device, tiny_engine):
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    per_block = 16 * kv_bytes_per_token(load(tiny_engine))
    cpu, _, _ = tokens(tiny_engine, PROMPTS, params, "onnxruntime")
    # 12 requests of up to ~40 positions (3 blocks each at the end) in 16 blocks
    gpu, stats, graphs = tokens(tiny_engine, PROMPTS, params, "tensorrt", kv_cache_memory=16 * per_block,
                                prefix_cache=False)
    assert stats.preemptions > 0
    assert gpu == cpu
    assert len({width for _, _, width in graphs}) >= 2  # tables widened as rows grew


def test_host_drafted_chains_and_structured_outputs_in_the_pool(device, speculation_engine):
    code = [p * 3 for p in PROMPTS[:4]]  # repeats: prompt lookup finds its chains
    params = SamplingParams(max_tokens=24, ignore_eos=True, speculation=(Source.prompt_lookup, Source.suffix))
    cpu, _, _ = tokens(speculation_engine, code, SamplingParams(max_tokens=24, ignore_eos=True), "onnxruntime")
    with LLM(speculation_engine, backend="tensorrt", speculation_mode=SpeculationMode.always) as llm:
        assert [c.token_ids for c in llm.generate(code, params)] == cpu
        assert llm.speculation.stats.accepted_tokens > 0
    digits = SamplingParams(max_tokens=12, constraint=Regex(r"[0-9]{3}-[a-z]{2,4}"), stop=("-",))
    cpu, _, _ = tokens(speculation_engine, PROMPTS[:3], digits, "onnxruntime")
    gpu, _, _ = tokens(speculation_engine, PROMPTS[:3], digits, "tensorrt")
    assert gpu == cpu and all(len(t) >= 3 for t in gpu)


def test_a_budget_over_what_the_engines_pools_can_hold_is_refused(device, tiny_engine, monkeypatch):
    from trtbuild.runtime.backends.tensorrt import engine as tensorrt_engine

    from trtbuild.runtime.core import kv_budget

    for module in (tensorrt_engine, kv_budget):
        monkeypatch.setattr(module, "max_pool_blocks", lambda block_size, heads, head_dim: 11)
    with pytest.raises(ValueError, match=r"kv_cache_memory buys \d+ KV blocks; this engine's pools hold at most 10 "):
        LLM(tiny_engine, backend="tensorrt", kv_cache_memory="1MiB")
    assert not device.buffers and device.calls["cudaStreamCreate"] == 0  # refused before anything is made
    # No budget given: every row's whole context would be 8 × 64 blocks; the pools' most is taken.
    with LLM(tiny_engine, backend="tensorrt") as llm:
        assert llm.scheduler.kv.num_blocks == 10 and llm.engine.kv.shape.pool[0] == 11

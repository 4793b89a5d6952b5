"""TensorRTEngine's own code on a simulated device (tests/simulated_device.py), not a GPU test:
its device buffers, addresses, the paged pools and block tables (the bundled engines are built
paged: one rank), bucket padding, CUDA-graph capture and replay and Medusa buffers must give
exactly the ONNX Runtime backend's tokens. The slot engines of several ranks: test_simulated_nccl
and test_simulated_pipeline; the slot pools' moves: test_device_pools."""
from __future__ import annotations

import pytest

from trtbuild.runtime.core.kv_manager import KVManager
from trtbuild.runtime.core.paged_pools import DeviceBlockPools, pool_block
from trtbuild.runtime.llm import LLM
from trtbuild.runtime.core.sampling import SamplingParams
from trtbuild.runtime.backends.tensorrt.engine import TensorRTEngine

from simulated_device import SimulatedDevice

PROMPTS = ["def fibonacci(n):\n", "import os\n", "class Stack:\n    def __init__(self):\n        self.",
           "    for i in range(len(", "# Copyright", "def __repr__(self):\n        return '<%s %r>' % (",
           "from collections import", "x"]
GREEDY = SamplingParams(max_tokens=20, ignore_eos=True)
SHARED = "import os\nimport sys\n\n\ndef main(argv):\n    parser = argparse.ArgumentParser()\n" * 2


@pytest.fixture
def device(monkeypatch, tiny_engine, medusa_engine):
    # generate() steps on the LLM's engine-loop thread, not the one that made the engine
    device = SimulatedDevice(compute_capability="sm89", per_thread_device=True)
    device.install(monkeypatch, [tiny_engine, medusa_engine])
    return device


def cpu_tokens(engine_dir, prompts, **options):
    llm = LLM(engine_dir, backend="onnxruntime", threads=2, **options)
    return [c.token_ids for c in llm.generate(prompts, GREEDY)]


def gpu(engine_dir, **options) -> LLM:
    llm = LLM(engine_dir, backend="tensorrt", **options)
    assert isinstance(llm.engine, TensorRTEngine)
    return llm


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_plain_decode_pads_to_buckets_replays_graphs_and_matches_cpu(device, tiny_engine, batch):
    prompts = PROMPTS[:batch]
    llm = gpu(tiny_engine)
    assert [c.token_ids for c in llm.generate(prompts, GREEDY)] == cpu_tokens(tiny_engine, prompts)
    bucket = next(b for b in llm.engine.buckets if b >= batch)  # 3 rows run in the bucket of 4
    assert {key[0] for key in llm.engine.graphs} >= {bucket}
    # Every decode step replays its (bucket, S, table width) capture, but the one that captured it;
    # the paged engine's table widens (1 → 2 → 4 blocks) as the rows grow: a capture per width.
    assert device.calls["cudaGraphLaunch"] == llm.core.stats.decode_steps - len(llm.engine.graphs)
    assert device.calls["cudaStreamBeginCapture"] == len(llm.engine.graphs)
    llm.engine.close()
    assert not device.buffers  # every allocation freed


def test_requests_joining_mid_decode_match_cpu(device, tiny_engine):
    def run(llm):
        first = [llm.submit(p, GREEDY) for p in PROMPTS[:3]]
        for _ in range(3):
            llm.step()
        assert all(len(llm.scheduler.requests[r].output) > 1 for r in first)  # decoding, not done
        later = [llm.submit(p, GREEDY) for p in PROMPTS[3:]]
        done = {c.rid: c.token_ids for c in llm.run_until_done()}
        return [done[r] for r in first + later]

    assert run(gpu(tiny_engine)) == run(LLM(tiny_engine, backend="onnxruntime", threads=2))


def test_prefix_cache_hits_share_blocks_and_match_cpu(device, tiny_engine):
    prompts = [SHARED + tail for tail in ("    return", "    if", "    parser.add_argument(")]
    llm = gpu(tiny_engine, prefix_cache=True)
    outs = llm.generate(prompts[:1], GREEDY)
    tables = []
    step = llm.engine.step
    llm.engine.step = lambda s: tables.append(s.block_tables) or step(s)
    outs += llm.generate(prompts[1:], GREEDY)  # together: both rows' tables start with the same blocks
    assert [c.token_ids for c in outs] == cpu_tokens(tiny_engine, prompts, prefix_cache=False)
    assert all(c.cached_tokens >= 32 for c in outs[1:]) and llm.scheduler.kv.stats.hits >= 4
    assert any(len(rows) == 2 and rows[0][:2] == rows[1][:2] for rows in tables)  # zero copy: one block, two rows


def test_medusa_verification_and_keep_path_match_plain_decoding(device, medusa_engine):
    llm = gpu(medusa_engine, medusa_tree_size=63)
    outs = [c.token_ids for c in llm.generate(PROMPTS[:4], GREEDY)]
    stats = llm.speculation.stats
    assert stats.verify_steps > 0 and stats.accepted_tokens > 0  # keep_path moved accepted K/V
    assert outs == cpu_tokens(medusa_engine, PROMPTS[:4], medusa_tree_size=0)


def test_a_verification_copies_to_the_host_only_what_the_core_reads(device, medusa_engine, monkeypatch):
    """Per verification step, device → host: the logits of each row's tree nodes (the core accepts
    from them) and the heads at one node a row (it drafts from those), nothing of the padding or
    of the other nodes' heads (B·R·K·V was ≈ 1 GB a step at B = 8, R = 64, K = 4, V = 128k)."""
    llm = gpu(medusa_engine, medusa_tree_size=63)
    engine, vocab, heads = llm.engine, llm.engine.dir.vocab_size, llm.engine.dir.medusa["num_heads"]
    step, verifications = engine.step, []

    def counted(s):
        before = device.copied["cudaMemcpyDeviceToHost"]
        out = step(s)
        if s.verifies:
            verifications.append((device.copied["cudaMemcpyDeviceToHost"] - before, len(s.rids), s.seq_len))
        return out

    monkeypatch.setattr(engine, "step", counted)
    llm.generate(PROMPTS[:4], GREEDY)
    assert verifications and any(rows > 1 for _, rows, _ in verifications)
    for copied, rows, seq in verifications:
        assert copied == rows * seq * vocab * 4 + rows * heads * vocab * 4, (rows, seq)


# -- planted bugs: the simulation must notice them ---------------------------------------------

def keep_path_off_by_one(self, blocks, start, nodes):
    """The accepted nodes' K/V moved one position too early (start + i instead of start + 1 + i)."""
    for name in self.pools:
        for i, node in enumerate(nodes):
            self._copy(self._token(name, blocks, start + i), self._token(name, blocks, start + node), self.token_bytes)


def test_a_planted_keep_path_off_by_one_changes_the_tokens(device, medusa_engine, monkeypatch):
    expected = cpu_tokens(medusa_engine, PROMPTS[:4], medusa_tree_size=0)
    monkeypatch.setattr(DeviceBlockPools, "keep_path_in_blocks", keep_path_off_by_one)
    llm = gpu(medusa_engine, medusa_tree_size=63)
    assert [c.token_ids for c in llm.generate(PROMPTS[:4], GREEDY)] != expected


def test_a_planted_shared_block_changes_the_tokens(device, tiny_engine, monkeypatch):
    prompts = [SHARED + tail for tail in ("    return", "    if")]
    expected = cpu_tokens(tiny_engine, prompts, prefix_cache=False)
    # Planted: a hit's second shared block enters the row's table in the first's place too (a
    # permutation would not show: a query that sees every cached position sees them in any order).
    hit = KVManager.hit
    monkeypatch.setattr(KVManager, "hit", lambda self, rid, prompt, blocks: hit(self, rid, prompt,
                                                                                 blocks[1:2] + blocks[1:]))
    llm = gpu(tiny_engine, prefix_cache=True)
    outs = llm.generate(prompts[:1], GREEDY) + llm.generate(prompts[1:], GREEDY)
    assert outs[1].cached_tokens >= 32  # the bug's path ran
    assert [c.token_ids for c in outs] != expected


def test_an_overrun_is_a_cuda_error_not_silent(device, tiny_engine, monkeypatch):
    llm = gpu(tiny_engine)
    last = llm.scheduler.kv.num_blocks - 1
    assert pool_block(last) == llm.engine.kv.shape.pool[0] - 1  # the pool's last block: the budget's last
    monkeypatch.setattr(llm.engine.kv, "block_bytes", llm.engine.kv.block_bytes + 4)  # the last block overruns
    with pytest.raises(RuntimeError, match="overrun an allocation"):
        llm.engine.keep_path_in_blocks((last,), 0, (llm.engine.block_size - 1,))


def test_capture_checks_the_enqueue_and_frees_every_graph(device, tiny_engine, monkeypatch):
    from simulated_tensorrt import SimulatedContext

    llm = gpu(tiny_engine)
    llm.generate(PROMPTS[:2], GREEDY)
    assert llm.engine.graphs and not device.graphs  # each captured graph freed once instantiated
    assert len(device.graph_execs) == len(llm.engine.graphs)
    llm.engine.close()
    assert not device.graph_execs
    # TensorRT refusing the captured enqueue is an error (not an empty graph replayed), and the
    # stream leaves capture mode.
    llm = gpu(tiny_engine)
    enqueue = SimulatedContext.execute_async_v3
    monkeypatch.setattr(SimulatedContext, "execute_async_v3",
                        lambda self, stream: stream.captured is None and enqueue(self, stream))
    with pytest.raises(RuntimeError, match="TensorRT execution failed while capturing a CUDA graph"):
        llm.generate(PROMPTS[:1], GREEDY)
    assert not llm.engine.graphs and not device.graphs and llm.engine.stream.captured is None


def test_a_share_of_memory_is_of_the_gpus_free_memory_on_tensorrt(monkeypatch, tiny_engine):
    """kv_cache_memory 0.5 on the TensorRT backend: half of what the GPU has free (cudaMemGetInfo)
    less the engine about to load (its file's bytes), not of the host's MemAvailable, all of it the
    paged pool's blocks (and one scratch block). A byte budget beyond that is refused naming it."""
    device = SimulatedDevice(compute_capability="sm89", per_thread_device=True, memory_bytes=64 << 20)
    device.install(monkeypatch, [tiny_engine])
    from trtbuild.runtime.core.kv_budget import kv_bytes_per_token
    from trtbuild.runtime.engine_dir import load

    d = load(tiny_engine)
    per_token = kv_bytes_per_token(d)
    free = (64 << 20) - (tiny_engine / "rank0.engine").stat().st_size
    with gpu(tiny_engine, kv_cache_memory=0.5, prefix_cache=True) as llm:
        blocks = llm.scheduler.kv.num_blocks
        assert blocks == free // 2 // (16 * per_token)
        assert llm.engine.kv.nbytes == (blocks + 1) * 16 * per_token
        assert [c.token_ids for c in llm.generate(PROMPTS[:2], GREEDY)] == cpu_tokens(tiny_engine, PROMPTS[:2])
    with pytest.raises(ValueError, match=r"exceeds the memory available now \(\d+ bytes, free on the GPU less "
                                         r"the \d+-byte engine\)"):
        gpu(tiny_engine, kv_cache_memory=free + 1)

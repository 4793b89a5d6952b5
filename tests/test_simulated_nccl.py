"""The NCCL stand-in (tests/simulated_nccl.py) and the rank code over it: issue-order matching,
the buffer limit that makes a wrong send/receive order deadlock, and the leak detector that
catches a communicator never freed (runtime/parallel/nccl.py, runtime/parallel/rank_engines.py)."""
from __future__ import annotations

import socket
import threading
import time
from datetime import timedelta

import numpy as np
import pytest

from simulated_nccl import Aborted, FabricTransport, NcclFabric

TIMEOUT_S = 5.0          # a deadlock of bare messages shows within this
ENGINE_TIMEOUT_S = 120.0  # ranks running ONNX Runtime steps on a loaded machine


def _run_ranks(fabric: NcclFabric, programs, timeout: float = TIMEOUT_S) -> tuple[list[bool], list]:
    """Each program(rank) on its own thread; if any is still running ``timeout`` seconds on, the
    fabric is aborted (a deadlock: its waits raise Aborted). Returns which ranks were still
    blocked at the timeout, and what each raised (None: returned)."""
    raised = [None] * len(programs)

    def run(rank):
        try:
            programs[rank](rank)
        except Exception as exc:  # noqa: BLE001  (reported to the test)
            raised[rank] = exc

    threads = [threading.Thread(target=run, args=(rank,), daemon=True) for rank in range(len(programs))]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    blocked = [thread.is_alive() for thread in threads]
    if any(blocked):
        fabric.abort()
        for thread in threads:
            thread.join(TIMEOUT_S)
    return blocked, raised


def test_sends_between_a_pair_match_receives_in_issue_order():
    fabric = NcclFabric(buffer_bytes=64)
    first, second = np.zeros(4, np.int64), np.zeros(4, np.int64)
    fabric.isend(0, np.arange(4), 1)
    fabric.isend(0, np.arange(4) + 10, 1)
    fabric.wait(fabric.irecv(1, first, 0))
    fabric.wait(fabric.irecv(1, second, 0))
    assert first.tolist() == [0, 1, 2, 3] and second.tolist() == [10, 11, 12, 13]


def test_a_send_over_the_buffer_waits_for_its_receive_and_holds_its_stream():
    fabric = NcclFabric(buffer_bytes=16)
    big = fabric.isend(0, np.ones(8, np.int64), 1)  # 64 bytes > 16
    later = fabric.isend(0, np.ones(1, np.int64), 1)
    assert not big.done and not later.done          # the rank's stream waits behind the big send
    out = np.zeros(8, np.int64)
    fabric.wait(fabric.irecv(1, out, 0))
    assert big.done and later.done and out.tolist() == [1] * 8


def _stage_pattern(receives_first: bool):
    """Two stages, two micro-batches of hand-off and logits (each over the buffer): rank 0 sends
    the hidden states on and receives the logits; rank 1 the other way round. The old StageRunner
    sent every micro-batch before posting a receive; the new one batches each send with its
    micro-batch's receives (batch_isend_irecv)."""
    hidden, logits = np.ones(64, np.float32), np.ones(64, np.float32)

    def rank0(rank):
        transport = FabricTransport(fabric, rank)
        if receives_first:  # what StageRunner does: each send batched with its micro-batch's receives
            sends, posted = zip(*(transport.send_and_receive(hidden, 1, [logits.shape], np.float32, 1)
                                  for _ in range(2)))
            posted = [receiving for each in posted for receiving in each]
        else:
            sends = [transport.send(hidden, 1) for _ in range(2)]
            posted = [transport.irecv_host(logits.shape, np.float32, 1) for _ in range(2)]
        for receiving in posted:
            receiving.wait()
        for sending in sends:
            sending.wait()

    def rank1(rank):
        transport = FabricTransport(fabric, rank)
        sends = []
        for _ in range(2):
            transport.recv_into(np.empty_like(hidden), 0)
            sends.append(transport.send(logits, 0))
        for sending in sends:
            sending.wait()

    fabric = NcclFabric(buffer_bytes=128)
    return fabric, [rank0, rank1]


def test_sending_every_micro_batch_before_posting_receives_deadlocks():
    """The planted bug: the old order (all sends, then the receives) with messages over NCCL's buffer."""
    blocked, raised = _run_ranks(*_stage_pattern(receives_first=False))
    assert blocked == [True, True]
    assert all(isinstance(exc, Aborted) for exc in raised)


def test_each_send_batched_with_its_receives_completes():
    blocked, raised = _run_ranks(*_stage_pattern(receives_first=True))
    assert blocked == [False, False] and raised == [None, None]


@pytest.fixture
def nccl_over_fabric(monkeypatch):
    """runtime/parallel/nccl.py over a fabric, with a gloo group of one rank to carry the unique id."""
    import torch.distributed as dist

    from trtbuild.runtime.parallel import nccl

    fabric = NcclFabric()
    monkeypatch.setattr(nccl, "_library", fabric.library)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            timeout=timedelta(seconds=30))
    yield fabric
    dist.destroy_process_group()


def test_a_communicator_never_freed_is_reported(nccl_over_fabric):
    from trtbuild.runtime.parallel.nccl import NcclCommunicator

    NcclCommunicator.over_group(0, 1, None)  # the planted bug: dropped without close()
    assert nccl_over_fabric.leaks() == ["communicator 1 rank 0 of 1 was never destroyed"]


def test_closing_a_rank_engine_frees_its_communicator(nccl_over_fabric, tiny_engine):
    from trtbuild.runtime.engine_dir import load
    from trtbuild.runtime.parallel.nccl import NcclCommunicator
    from trtbuild.runtime.backends.onnxruntime.engine import OnnxRuntimeEngine
    from trtbuild.runtime.parallel.rank_engines import RankEngine

    communicator = NcclCommunicator.over_group(0, 1, None)
    assert communicator.capsule() is not None
    RankEngine(OnnxRuntimeEngine(load(tiny_engine), threads=1), communicator).close()
    assert nccl_over_fabric.leaks() == []


def _stage_runners_over_fabric(pp2_engine, fabric: NcclFabric, micro_batches: int, step):
    """Both stages of ``pp2_engine`` as StageRunners (runtime/parallel/pipeline_parallel.py, ONNX Runtime
    stages) over the fabric, one thread each, running ``step``; rank 0's StepOutput, which ranks
    were blocked at the timeout, and what each raised."""
    from trtbuild.runtime.engine_dir import load
    from trtbuild.runtime.backends.onnxruntime.engine import OnnxRuntimeEngine
    from trtbuild.runtime.parallel.pipeline_parallel import StageRunner
    from trtbuild.runtime.parallel.rank_engines import TorchCollectives

    engine_dir = load(pp2_engine)  # T = 1: the stages' collective is never called
    runners = [StageRunner(OnnxRuntimeEngine(engine_dir, threads=1, rank=rank, collective=TorchCollectives()),
                           engine_dir, rank, micro_batches, FabricTransport(fabric, rank)) for rank in range(2)]
    outputs = [None, None]

    def program(rank):
        outputs[rank] = runners[rank].step(step)

    blocked, raised = _run_ranks(fabric, [program, program], ENGINE_TIMEOUT_S)
    return outputs[0], blocked, raised


@pytest.mark.slow
def test_stage_runner_prefill_over_nccl_buffers_gives_the_one_rank_tokens(pp2_engine, tiny_engine):
    """The real StageRunner on the stand-in: two micro-batches whose hidden states [B, S, D] and
    logits [B, 1, V] are each far over a 1 KiB buffer, so a send waits for its receive. The old
    order (every micro-batch sent before rank 0 posted a receive) deadlocks here."""
    from trtbuild.runtime.engine_dir import load
    from trtbuild.runtime.backends.onnxruntime.engine import OnnxRuntimeEngine
    from trtbuild.runtime.core.step import Step, StepKind

    step = Step(StepKind.prefill, 0, ("a", "b", "c", "d"), ((1, 2, 3, 4, 5), (6, 7, 8), (9, 10, 11, 12), (13,)),
                (0, 0, 0, 0), (True, True, True, True))
    fabric = NcclFabric(buffer_bytes=1024)
    output, blocked, raised = _stage_runners_over_fabric(pp2_engine, fabric, 2, step)
    assert blocked == [False, False] and raised == [None, None]
    expected = OnnxRuntimeEngine(load(tiny_engine), threads=1).step(step).logits  # [B, 1, V]
    assert output.logits.argmax(-1).tolist() == expected.argmax(-1).tolist()


@pytest.mark.slow
def test_tensor_ranks_on_the_simulated_device_all_reduce_over_nccl(monkeypatch, tp2_engine, tiny_engine):
    """The TP all-reduce path on the simulated device: each rank's TensorRTEngine gets its NCCL
    communicator (runtime/parallel/nccl.py over the stand-in, created collectively) through
    set_communicator, and its DistCollective layers meet the other rank's over it. Greedy tokens
    of a prefill and decode steps (captured and replayed) equal the one-rank engine's; closing the
    communicators leaves no leak."""
    from simulated_device import SimulatedDevice
    from trtbuild.runtime.parallel import nccl
    from trtbuild.runtime.engine_dir import load
    from trtbuild.runtime.backends.onnxruntime.engine import OnnxRuntimeEngine
    from trtbuild.runtime.core.step import Step, StepKind
    from trtbuild.runtime.backends.tensorrt.engine import TensorRTEngine

    device = SimulatedDevice(compute_capability="sm89")
    device.install(monkeypatch, [tp2_engine])
    monkeypatch.setattr(nccl, "_library", lambda: device.nccl)
    fabric, unique, communicators = device.nccl.fabric, nccl.draw_unique_id(), [None, None]

    def join(rank):  # ncclCommInitRank returns once both ranks called it
        communicators[rank] = nccl.NcclCommunicator(rank, 2, unique)

    assert _run_ranks(fabric, [join, join], ENGINE_TIMEOUT_S) == ([False, False], [None, None])
    engine_dir = load(tp2_engine)
    assert engine_dir.kv_cache.paged  # the default layout of every TensorRT build
    ranks = [TensorRTEngine(engine_dir, prefix_blocks=4, rank=rank, communicator=communicators[rank].capsule())
             for rank in range(2)]
    assert all(engine.paged for engine in ranks)
    one_rank = OnnxRuntimeEngine(load(tiny_engine), threads=1)
    prompts = ((1, 2, 3, 4, 5), (6, 7, 8))
    tables = ((2,), (0,))  # each row's one block (its positions stay under 16), the same ids on both ranks
    step = Step(StepKind.prefill, 0, ("a", "b"), prompts, (0, 0), (True, True), block_tables=tables)
    tokens = {"tp2": [], "tp1": []}
    for index in range(4):
        outputs = [None, None]

        def run(rank):
            outputs[rank] = ranks[rank].step(step).logits.argmax(-1)[:, -1].tolist()  # [B]

        assert _run_ranks(fabric, [run, run], ENGINE_TIMEOUT_S) == ([False, False], [None, None])
        assert outputs[0] == outputs[1]  # every tensor rank ends with the same logits
        tokens["tp2"].append(outputs[0])
        tokens["tp1"].append(one_rank.step(step).logits.argmax(-1)[:, -1].tolist())
        step = Step(StepKind.decode, 0, ("a", "b"), tuple((t,) for t in outputs[0]),
                    tuple(len(p) + index for p in prompts), (True, True), block_tables=tables)
    assert tokens["tp2"] == tokens["tp1"]
    for engine, communicator in zip(ranks, communicators):
        engine.close()
        communicator.close()
    assert fabric.leaks() == []


def _tensor_parallel_over_threads(monkeypatch, device, engine_dir, blocks: int, sent: list):
    """The real TensorParallelEngine (rank 0's Engine) over two TensorRT ranks on the simulated
    device, rank 1 on a thread of this process instead of a process (the NCCL stand-in joins
    threads): each message rank 0 broadcasts is encoded, and rank 1 decodes it under its limits and
    runs it (run_message), as serve_rank does. ``sent``: every message, as rank 1 decoded it."""
    import queue

    from trtbuild.runtime.parallel import nccl, tensor_parallel
    from trtbuild.runtime.parallel.protocol import Stop, decode, encode
    from trtbuild.runtime.parallel.rank_engines import RankEngine, rank_limits, run_message
    from trtbuild.runtime.backends.tensorrt.engine import TensorRTEngine

    monkeypatch.setattr(nccl, "_library", lambda: device.nccl)
    unique, communicators = nccl.draw_unique_id(), [None, None]

    def join(rank):
        communicators[rank] = nccl.NcclCommunicator(rank, 2, unique)

    assert _run_ranks(device.nccl.fabric, [join, join], ENGINE_TIMEOUT_S) == ([False, False], [None, None])
    limits = rank_limits(engine_dir, engine_dir.kv_block_size, blocks)
    ranks = [RankEngine(TensorRTEngine(engine_dir, prefix_blocks=blocks, block_size=engine_dir.kv_block_size,
                                       rank=rank, communicator=communicators[rank].capsule()), communicators[rank], limits)
             for rank in range(2)]
    inbox, failed = queue.Queue(), []

    def rank_1():
        try:
            while not isinstance(message := decode(*inbox.get(), rank=1, limits=limits), Stop):
                sent.append(message)
                run_message(ranks[1].engine, message)
        except Exception as exc:  # noqa: BLE001  (the test asserts there was none)
            failed.append(exc)
            device.nccl.fabric.abort()

    thread = threading.Thread(target=rank_1, daemon=True)
    thread.start()
    monkeypatch.setattr(tensor_parallel, "broadcast", lambda message, group=None, limits=None:
                        inbox.put(encode(message, limits)))
    engine = object.__new__(tensor_parallel.TensorParallelEngine)
    engine.world = engine.tensor = 2
    engine.name, engine.paged, engine.limits = "tensorrt (tensor parallel 2)", engine_dir.kv_cache.paged, limits
    engine.own, engine.local, engine.processes, engine.stderr, engine.closed = ranks[0], ranks[0].engine, {}, {}, False

    def stop():
        inbox.put(encode(Stop()))
        thread.join(ENGINE_TIMEOUT_S)
        ranks[1].close()
        assert failed == [] and not thread.is_alive()

    return engine, stop


@pytest.mark.slow
@pytest.mark.parametrize("budget_blocks", [None, 12])
def test_tensor_ranks_share_rank_0s_blocks_and_give_the_cpu_tokens(monkeypatch, tp2_engine, tiny_engine,
                                                                    budget_blocks):
    """The LLM over a paged TP=2 TensorRT engine on the simulated device: every rank holds its own KV
    head's pools under rank 0's block tables (sent in each Step) and moves nothing else. With the
    prefix cache, two rows' tables start with the same blocks (shared by reference on every rank);
    with a pool of 12 blocks for 6 requests, rows are preempted and resumed. Greedy tokens are
    exactly the CPU backend's."""
    from simulated_device import SimulatedDevice
    from trtbuild.runtime.core.kv_budget import RowMemory, kv_bytes_per_token, kv_manager_for
    from trtbuild.runtime.core.sampling import SamplingParams
    from trtbuild.runtime.core.step import Step
    from trtbuild.runtime.engine_dir import load
    from trtbuild.runtime.llm import LLM

    shared = "import os\nimport sys\nimport json\nimport time\n" * 2  # over one 16-token block
    prompts = [shared + "def main():", "def fibonacci(n):", shared + "class Config:", "class Stack:",
               "x = [", shared + "while True:"]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    with LLM(tiny_engine, backend="onnxruntime") as llm:
        cpu = [c.token_ids for c in llm.generate(prompts, params)]
    device = SimulatedDevice(compute_capability="sm89")
    device.install(monkeypatch, [tp2_engine])
    engine_dir = load(tp2_engine)
    assert engine_dir.kv_cache.paged
    memory = None if budget_blocks is None else budget_blocks * 16 * kv_bytes_per_token(engine_dir)
    prefix = budget_blocks is None
    blocks = kv_manager_for(engine_dir, memory, 16, prefix, RowMemory.blocks).num_blocks
    sent = []
    engine, stop = _tensor_parallel_over_threads(monkeypatch, device, engine_dir, blocks, sent)
    try:
        with LLM(tp2_engine, engine=engine, kv_cache_memory=memory, prefix_cache=prefix) as llm:
            assert llm.scheduler.paged and llm.engine.paged
            first = [llm.submit(p, params) for p in prompts[:2]]
            for _ in range(3):
                llm.step()  # the shared prompt's blocks are cached before the others arrive
            later = [llm.submit(p, params) for p in prompts[2:]]
            done = {c.rid: c.token_ids for c in llm.run_until_done()}
            stats = llm.scheduler.kv.stats
    finally:
        stop()
    assert [done[r] for r in first + later] == cpu
    steps = [m for m in sent if isinstance(m, Step)]
    assert steps and all(m.block_tables for m in steps)  # every step the ranks ran was paged
    if prefix:
        firsts = [[t[0] for t, rid in zip(m.block_tables, m.rids) if rid in (first[0], later[0])] for m in steps]
        assert any(len(ids) == 2 and ids[0] == ids[1] for ids in firsts)  # one block, two rows
    else:
        assert stats.preemptions > 0

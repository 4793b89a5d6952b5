"""GPU backend: the rank's TensorRT engine, driven with cuda-python.

KV pools and step I/O live in device memory. An engine built paged (manifest ``kv_cache.layout``)
binds one pool of the KV budget's blocks per cache as both ``past_*`` and ``present_*`` and reads
and writes it through each step's block tables (runtime/core/paged_pools.py); a slot engine binds
``pool + first_slot * slot`` (the engine's KV-cache update writes in place).
Decode steps are padded to the manifest's CUDA-graph batch buckets and replayed as CUDA
graphs once captured: the bucket's addresses and shapes never change (decode binds slots
from 0). Prefill uses the second optimization profile, eagerly. A rank of a pipeline stage binds
only the tensors its engine has (the manifest's I/O table) and holds its stage's caches; its
hand-off is runtime/parallel/tensorrt_stage.py.
"""
from __future__ import annotations

import numpy as np

from ....contract.dtypes import HOST_DTYPES
from ....contract.kv_budget import max_pool_blocks
from ....contract.draft_head import DRAFT_FEATURES
from ....contract.step import BLOCK_TABLE, KV_SLOTS, LOGITS, MEDUSA_LOGITS
from ...core.engine import GreedyRun, StepOutput, StepwiseGreedyRun, paged_step_arrays, step_arrays
from ...engine_dir import EngineDir
from ...core.kv_pools import DevicePools, PoolShape, device_alloc
from ...core.paged_pools import BlockPoolShape, DeviceBlockPools
from .library import cuda_check, cuda_runtime, load_flavor
from ...core.step import Step, StepKind


class TensorRTEngine:
    name = "tensorrt"  # the backend; the manifest names the flavour (tensorrt or tensorrt-rtx)

    def __init__(self, engine_dir: EngineDir, prefix_blocks: int = 0, block_size: int = 16, rank: int = 0,
                 device: int = 0, communicator: object | None = None):
        """``communicator``: for a rank of a tensor-parallel engine, the NCCL communicator capsule
        (runtime/parallel/nccl.py) its DistCollective layers run over. ``prefix_blocks``: the
        prefix store's blocks or, for a paged engine, the KV budget's blocks (its pool)."""
        d = engine_dir
        self.paged = d.kv_cache.paged
        if self.paged:  # refused before anything is created on the device
            if block_size != d.kv_cache.block_size:
                raise ValueError(f"block_size {block_size}: this engine was built paged with blocks of "
                                 f"{d.kv_cache.block_size} tokens (runtime.kv_block_size); use that")
            most = max_pool_blocks(block_size, d.num_kv_heads, d.head_dim) - 1  # and the scratch block
            if prefix_blocks > most:
                raise ValueError(f"kv_cache_memory buys {prefix_blocks} KV blocks; this engine's pools hold at most "
                                 f"{most} (TensorRT's limit of 2^31 - 1 elements a tensor): give a smaller budget")
        # The flavour the manifest names (tensorrt or tensorrt_rtx), checked against this GPU.
        trt, cudart = load_flavor(engine_dir, device), cuda_runtime()
        self.trt, self.cudart, self.dir, self.block_size, self.device = trt, cudart, engine_dir, block_size, device
        self.ok = _ok = cuda_check(cudart)
        _ok(cudart.cudaSetDevice(device))
        self.logger = trt.Logger(trt.Logger.WARNING)
        self.engine = trt.Runtime(self.logger).deserialize_cuda_engine(engine_dir.rank_file(rank, "engine").read_bytes())
        if self.engine is None:
            raise RuntimeError(f"TensorRT could not deserialize {engine_dir.rank_file(rank, 'engine')}")
        self.stream = _ok(cudart.cudaStreamCreate())
        self.contexts = {}
        for kind, profile in ((StepKind.decode, 0), (StepKind.prefill, 1)):
            context = self.engine.create_execution_context()
            context.set_optimization_profile_async(profile, self.stream)
            if communicator is not None and not context.set_communicator(communicator):  # collective: all ranks
                raise RuntimeError(f"TensorRT refused the NCCL communicator for rank {rank}")
            self.contexts[kind] = context
        self.element = HOST_DTYPES[d.dtype]
        if self.paged:
            self.kv = DeviceBlockPools(BlockPoolShape.of(d, self.element, prefix_blocks, rank), cudart, self.stream, _ok)
        else:
            self.kv = DevicePools(PoolShape.of(d, self.element, prefix_blocks, block_size, rank), cudart, self.stream, _ok)
        self.tensors = d.rank_tensors(rank)  # a pipeline stage has some of the step's inputs and outputs
        # A verification scores every guess of any draft source: S and R up to the manifest's
        # verify_tokens (Medusa's heads: on the last stage).
        self.num_heads = d.medusa["num_heads"] if MEDUSA_LOGITS in self.tensors else 0
        speculation = d.speculation
        self.max_rows = rows = speculation.verify_tokens if speculation is not None else 1
        b, s, s_max = d.max_batch_size, max(d.max_input_len, rows), d.max_seq_len
        self.max_seq = s  # the most new tokens a step has (S): a prefill chunk or a verification
        self.max_blocks = s_max // block_size if self.paged else 0  # a block table's widest
        sizes = {"input_ids": b * s * 4, "position_ids": b * s * 4, "write_index": b * 8, "kv_length": b * 8,
                 "attention_mask": b * s * s_max, "logits_index": b * rows * 8,
                 BLOCK_TABLE: b * self.max_blocks * 4, KV_SLOTS: b * s * 2 * 8}
        self.inputs = {name: device_alloc(cudart, _ok, size) for name, size in sizes.items() if name in self.tensors}
        self.logits = device_alloc(cudart, _ok, b * rows * d.vocab_size * 4) if LOGITS in self.tensors else None
        # The heads ran at one node a row (builder/passes/heads_at_path_end): [B, 1, K, V].
        self.medusa = device_alloc(cudart, _ok, b * self.num_heads * d.vocab_size * 4) if self.num_heads else None
        # A draft head's features at every new position: [B, S, D] in the model's dtype.
        self.hidden = d.model["hidden_size"]
        self.features = (device_alloc(cudart, _ok, b * s * self.hidden * self.element.itemsize)
                         if DRAFT_FEATURES in self.tensors else None)
        self.buckets = sorted(d.cuda_graph_batch_sizes)
        self.graphs: dict[tuple[int, int, int], object] = {}  # (batch bucket, S, table width) → CUDA graph

    def _bucket(self, rows: int) -> int | None:
        return next((b for b in self.buckets if b >= rows), None)

    def greedy_run(self, step: Step) -> GreedyRun:
        return StepwiseGreedyRun(self, step)  # each step a CUDA-graph launch already

    def on_device(self) -> None:
        """CUDA's current device is per host thread, and the LLM's engine loop steps on a thread of its
        own: every call that touches device memory first makes this engine's device current (cheap)."""
        self.ok(self.cudart.cudaSetDevice(self.device))

    def step(self, step: Step) -> StepOutput:
        cudart, _ok = self.cudart, self.ok
        self.on_device()
        rows = len(step.rids)
        # Plain decode pads to a CUDA-graph bucket; dummy rows write the scratch block (paged) or the
        # last position of free or prefilling slots, which no prompt reaches. A verification writes
        # S positions, which a long prompt still prefilling could own in a slot engine: it runs
        # eagerly at its exact batch instead.
        bucket = self._bucket(rows) if step.kind == StepKind.decode and not step.verifies else None
        arrays, plain, width = self.host_arrays(step, pad_batch=bucket)
        logit_rows = plain.logits_index.shape[1]
        key = (bucket, step.seq_len, width)
        self.upload(arrays)
        context = self.contexts[step.kind]
        if bucket is not None and key in self.graphs:
            _ok(cudart.cudaGraphLaunch(self.graphs[key], self.stream))
        else:
            self._bind(context, arrays, step.first_slot)
            if not context.execute_async_v3(self.stream):
                raise RuntimeError("TensorRT execution failed")
            if bucket is not None:
                self.graphs[key] = self._capture(context)
        # To the host: the step's own rows (not a bucket's padding), the heads at one node each.
        logits = self._to_host(self.logits, (rows, logit_rows, self.dir.vocab_size))  # [B, R, V]
        medusa = None if self.medusa is None else self._to_host(self.medusa, (rows, 1, self.num_heads,
                                                                              self.dir.vocab_size))  # [B, 1, K, V]
        features = None if self.features is None else self._to_host(
            self.features, (rows, step.seq_len, self.hidden), self.element)  # [B, S, D]
        _ok(cudart.cudaStreamSynchronize(self.stream))
        return StepOutput(logits=logits, medusa=medusa,
                          draft_features=None if features is None else _float32(features, self.dir.dtype))

    def host_arrays(self, step: Step, pad_batch: int | None = None):
        """What ``upload`` and ``bind_inputs`` take for ``step``, the contract's plain arrays among
        them (shapes, logits rows), and the block table's width (0 for a slot engine)."""
        if not self.paged:
            arrays = step_arrays(step, self.dir.max_seq_len, pad_batch=pad_batch)
            return arrays, arrays, 0
        width = self.table_width(step)
        arrays = paged_step_arrays(step, self.block_size, width, pad_batch=pad_batch)
        return arrays, arrays.step, width

    def table_width(self, step) -> int:
        """A paged step's block-table width M: the most blocks a row holds (every position the step
        writes has one), rounded up to a power of two (so a bucket's CUDA graphs number log2 of the
        widest table), at most S_max/bs. Attention reads M·bs positions a row: the width follows
        the rows' lengths, not max_seq_len."""
        bs, tables = self.block_size, step.block_tables or ((),) * len(step.rids)
        # A greedy run's rows hold its blocks already; a timing step (speculation's calibration)
        # holds none, and reads and writes the scratch block over its positions' width.
        need = max(max(len(blocks), -(-(start + step.seq_len) // bs)) for blocks, start in zip(tables, step.starts))
        return min(1 << (need - 1).bit_length(), self.max_blocks)

    def _to_host(self, address: int, shape: tuple[int, ...], dtype=np.float32) -> np.ndarray:
        """The first ``shape`` elements (float32 unless ``dtype``) at ``address``, copied on the
        stream (read after a sync)."""
        out = np.empty(shape, dtype)
        self.ok(self.cudart.cudaMemcpyAsync(out.ctypes.data, address, out.nbytes,
                                            self.cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost, self.stream))
        return out

    def upload(self, arrays) -> None:
        """The step's arrays that this engine reads, host → its input buffers, on its stream."""
        for name, value in arrays.as_dict().items():
            if name in self.inputs:
                value = np.ascontiguousarray(value)
                self.ok(self.cudart.cudaMemcpyAsync(self.inputs[name], value.ctypes.data, value.nbytes,
                                                    self.cudart.cudaMemcpyKind.cudaMemcpyHostToDevice, self.stream))

    def bind_inputs(self, context, arrays, first_slot: int) -> None:
        """The step's inputs this engine has, and its caches at the slots from ``first_slot`` (in place)."""
        for name, value in arrays.as_dict().items():
            if name in self.inputs:
                context.set_input_shape(name, value.shape)
                context.set_tensor_address(name, self.inputs[name])
        if self.paged:  # one pool for every row, at one address
            shape = self.kv.shape.pool
            addresses = dict(self.kv.pools)
        else:
            batch = arrays.position_ids.shape[0]
            shape = (batch, self.dir.num_kv_heads, self.dir.max_seq_len, self.dir.head_dim)
            addresses = {name: self.kv.slot_address(name, first_slot) for name in self.kv.pools}
        for name, address in addresses.items():
            context.set_input_shape(f"past_{name}", shape)
            context.set_tensor_address(f"past_{name}", address)
            context.set_tensor_address(f"present_{name}", address)

    def _bind(self, context, arrays, first_slot: int) -> None:
        self.bind_inputs(context, arrays, first_slot)
        context.set_tensor_address(LOGITS, self.logits)
        if self.medusa is not None:
            context.set_tensor_address(MEDUSA_LOGITS, self.medusa)
        if self.features is not None:
            context.set_tensor_address(DRAFT_FEATURES, self.features)

    def _capture(self, context):
        """The step just run, recorded as an executable CUDA graph. The capture always ends (a
        refused enqueue must not leave the stream capturing) and the captured graph is freed
        once instantiated: the executable one keeps what it needs."""
        cudart, _ok = self.cudart, self.ok
        _ok(cudart.cudaStreamBeginCapture(self.stream, cudart.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal))
        enqueued = context.execute_async_v3(self.stream)
        graph = _ok(cudart.cudaStreamEndCapture(self.stream))
        try:
            if not enqueued:
                raise RuntimeError("TensorRT execution failed while capturing a CUDA graph")
            return _ok(cudart.cudaGraphInstantiate(graph, 0))
        finally:
            _ok(cudart.cudaGraphDestroy(graph))

    def copy_slot(self, src: int, dst: int, length: int) -> None:
        self.on_device()
        self.kv.copy_slot(src, dst, length)

    def keep_path(self, slot: int, start: int, nodes: tuple[int, ...]) -> None:
        self.on_device()
        self.kv.keep_path(slot, start, nodes)

    def save_block(self, slot: int, index: int, block: int) -> None:
        self.on_device()
        self.kv.save_block(slot, index, block)

    def load_block(self, block: int, slot: int, index: int) -> None:
        self.on_device()
        self.kv.load_block(block, slot, index)

    def keep_path_in_blocks(self, blocks: tuple[int, ...], start: int, nodes: tuple[int, ...]) -> None:
        self.on_device()
        self.kv.keep_path_in_blocks(blocks, start, nodes)

    def discard(self, slots: tuple[int, ...], blocks: tuple[int, ...]) -> None:
        """Nothing to return: device pools are reserved in full (cudaMalloc cannot demand-page)."""

    def close(self) -> None:
        for graph in self.graphs.values():
            self.cudart.cudaGraphExecDestroy(graph)
        self.kv.close()
        for ptr in [*self.inputs.values(), self.logits, self.medusa, self.features]:
            if ptr is not None:
                self.cudart.cudaFree(ptr)
        self.cudart.cudaStreamDestroy(self.stream)


def _float32(host: np.ndarray, dtype: str) -> np.ndarray:
    """Draft features copied from the device in the model's dtype, as float32 (bfloat16 arrives
    as its uint16 bits: the high half of a float32)."""
    if dtype == "bfloat16":
        return (host.astype(np.uint32) << 16).view(np.float32)
    return host.astype(np.float32, copy=False)

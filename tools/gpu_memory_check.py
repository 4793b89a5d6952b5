"""The TensorRT backend's device-memory code on a real GPU, without TensorRT (no TensorRT flavour
runs on every lent GPU): KV pools from cudaMalloc moved by ``copy_slot``, ``keep_path``,
``save_block`` and ``load_block`` (runtime/kv_pools.DevicePools) must equal the ONNX Runtime
backend's numpy moves (HostPools) byte for byte after a random sequence of moves, and a
stream capture → instantiate → launch of a move must do what the move does eagerly.

A paged engine's pools (runtime/core/paged_pools.py DeviceBlockPools) are checked the same way:
``keep_path_in_blocks`` on random rows of out-of-order blocks must equal the numpy moves of the
same positions.

A pipeline stage's hand-off (runtime/parallel/transport.py NcclTransport) is checked too where torch has
CUDA: a cudaMalloc'd region wrapped as a torch tensor shares its memory, and torch work issued with
the engine's cuda-python stream as torch's current stream runs after what that stream holds (NCCL
itself needs two GPUs: tests/test_tensorrt_runtime.py).

    python tools/gpu_memory_check.py          # prints one line per check, exit 1 on a mismatch

tests/test_simulated_device.py runs the same checks on the simulated device.
"""
from __future__ import annotations

import random
import sys

import numpy as np

from trtbuild.runtime.core.kv_pools import DevicePools, HostPools, PoolShape
from trtbuild.runtime.core.paged_pools import BlockPoolShape, DeviceBlockPools, pool_block
from trtbuild.runtime.backends.tensorrt.library import cuda_check


def _random_move(rng: random.Random, s: PoolShape):
    kind = rng.choice(("copy_slot", "keep_path", "save_block", "load_block"))
    slot = rng.randrange(s.capacity)
    index = rng.randrange(s.max_seq_len // s.block_size)
    if kind == "copy_slot":
        return kind, (slot, rng.randrange(s.capacity), rng.randint(1, s.max_seq_len))
    if kind == "keep_path":
        nodes = tuple(sorted(rng.sample(range(1, 10), rng.randint(1, 4))))  # nodes[i] ≥ i + 1
        return kind, (slot, rng.randrange(s.max_seq_len - 10), nodes)
    if kind == "save_block":
        return kind, (slot, index, rng.randrange(s.prefix_blocks))
    return kind, (rng.randrange(s.prefix_blocks), slot, index)


def check(cudart, dtype=np.float16, moves: int = 300, seed: int = 0) -> list[tuple[str, bool, str]]:
    """(check, passed, detail) for each check, on the device behind ``cudart``."""
    ok = cuda_check(cudart)
    shape = PoolShape(num_layers=2, capacity=5, num_kv_heads=2, max_seq_len=64, head_dim=16, dtype=np.dtype(dtype),
                      prefix_blocks=4, block_size=8)
    stream = ok(cudart.cudaStreamCreate())
    device, host = DevicePools(shape, cudart, stream, ok), HostPools(shape)
    rng, data = random.Random(seed), np.random.default_rng(seed)
    for name in shape.names:
        host.pools[name][:] = data.standard_normal(host.pools[name].shape).astype(dtype)
        device.write(name, host.pools[name])
    results = []
    try:
        counts: dict[str, int] = {}
        for _ in range(moves):
            kind, args = _random_move(rng, shape)
            getattr(device, kind)(*args)
            getattr(host, kind)(*args)
            counts[kind] = counts.get(kind, 0) + 1
        equal = all(np.array_equal(device.read(n).view(np.uint8), host.pools[n].view(np.uint8)) for n in shape.names)
        results.append(("random moves equal numpy", equal, ", ".join(f"{k} ×{v}" for k, v in sorted(counts.items()))))

        ok(cudart.cudaStreamBeginCapture(stream, cudart.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal))
        device.copy_slot(0, 3, 40)
        device.keep_path(3, 5, (2, 4))
        graph = ok(cudart.cudaStreamEndCapture(stream))
        replay = ok(cudart.cudaGraphInstantiate(graph, 0))
        captured_untouched = all(np.array_equal(device.read(n), host.pools[n]) for n in shape.names)
        ok(cudart.cudaGraphLaunch(replay, stream))
        host.copy_slot(0, 3, 40)
        host.keep_path(3, 5, (2, 4))
        replayed = all(np.array_equal(device.read(n).view(np.uint8), host.pools[n].view(np.uint8))
                       for n in shape.names)
        results.append(("capture does not run the moves", captured_untouched, "pools unchanged until launch"))
        results.append(("graph launch equals the moves", replayed, "copy_slot + keep_path replayed"))
        cudart.cudaGraphExecDestroy(replay)
    finally:
        device.close()
        cudart.cudaStreamDestroy(stream)
    return results


def block_pool_check(cudart, dtype=np.float16, moves: int = 200, seed: int = 0) -> list[tuple[str, bool, str]]:
    """(check, passed, detail): the paged pools' accepted-path moves against numpy's."""
    ok = cuda_check(cudart)
    shape = BlockPoolShape(names=("key_0", "value_0", "key_1", "value_1"), num_blocks=12, block_size=4,
                           num_kv_heads=2, head_dim=16, dtype=np.dtype(dtype))
    stream = ok(cudart.cudaStreamCreate())
    device = DeviceBlockPools(shape, cudart, stream, ok)
    rng, data = random.Random(seed), np.random.default_rng(seed)
    host = {name: data.standard_normal(shape.pool).astype(dtype) for name in shape.names}  # [N+1, bs, H, D]
    try:
        for name, values in host.items():
            ok(cudart.cudaMemcpy(device.pools[name], values.ctypes.data, values.nbytes,
                                 cudart.cudaMemcpyKind.cudaMemcpyHostToDevice))
        bs = shape.block_size
        for _ in range(moves):
            blocks = tuple(rng.sample(range(shape.num_blocks), 4))  # a row of 16 positions, blocks out of order
            nodes = tuple(sorted(rng.sample(range(1, 8), rng.randint(1, 4))))  # nodes[i] ≥ i + 1
            start = rng.randrange(16 - 8)
            device.keep_path_in_blocks(blocks, start, nodes)
            for values in host.values():
                for i, node in enumerate(nodes):
                    src, dst = start + node, start + 1 + i
                    values[pool_block(blocks[dst // bs]), dst % bs] = values[pool_block(blocks[src // bs]), src % bs]
        equal = all(np.array_equal(device.read(n).view(np.uint8), host[n].view(np.uint8)) for n in shape.names)
        return [("paged keep_path equals numpy", equal, f"{moves} accepted paths in rows of out-of-order blocks")]
    finally:
        device.close()
        cudart.cudaStreamDestroy(stream)


def hand_off_checks(cudart, mib: int = 64) -> list[tuple[str, bool, str]]:
    """(check, passed, detail) for the NCCL transport's device side on GPU 0."""
    import torch

    from trtbuild.runtime.parallel.transport import DeviceArray, torch_bytes

    if not torch.cuda.is_available():
        return [("hand-off through torch", True, "skipped: this torch has no CUDA")]
    ok = cuda_check(cudart)
    stream, nbytes = ok(cudart.cudaStreamCreate()), mib << 20
    source, target = int(ok(cudart.cudaMalloc(nbytes))), int(ok(cudart.cudaMalloc(nbytes)))
    values = np.random.default_rng(0).standard_normal(nbytes // 4).astype(np.float32)
    try:
        ok(cudart.cudaMemcpy(source, values.ctypes.data, nbytes, cudart.cudaMemcpyKind.cudaMemcpyHostToDevice))
        region = DeviceArray(target, values.shape, np.dtype(np.float32))
        wrapped = torch_bytes(region, torch.device("cuda", 0))
        shares = wrapped.data_ptr() == target and wrapped.numel() == nbytes
        # A large device copy on the engine's stream, then torch reads the target on that stream:
        # it must see the copy's bytes, not what was there before.
        ok(cudart.cudaMemcpyAsync(target, source, nbytes, cudart.cudaMemcpyKind.cudaMemcpyDeviceToDevice, stream))
        with torch.cuda.stream(torch.cuda.ExternalStream(int(stream), device=torch.device("cuda", 0))):
            seen = wrapped.clone()
        ok(cudart.cudaStreamSynchronize(stream))
        ordered = np.array_equal(seen.cpu().numpy().view(np.float32), values)
        return [("hand-off wraps device memory", shares, "torch_bytes: same address, no copy"),
                ("hand-off ordered on the stream", ordered, f"{mib} MiB copy, then a torch read under ExternalStream")]
    finally:
        for ptr in (source, target):
            cudart.cudaFree(ptr)
        cudart.cudaStreamDestroy(stream)


def main() -> int:
    from cuda.bindings import runtime as cudart

    err, props = cudart.cudaGetDeviceProperties(0)
    print(f"gpu {props.name.decode(errors='replace')} sm{props.major}{props.minor}")
    failed = False
    for dtype in (np.float16, np.float32):
        for name, passed, detail in check(cudart, dtype) + block_pool_check(cudart, dtype):
            print(f"{np.dtype(dtype).name:<8} {name:<32} {'ok' if passed else 'MISMATCH'}  ({detail})")
            failed |= not passed
    for name, passed, detail in hand_off_checks(cudart):
        print(f"{'bytes':<8} {name:<32} {'ok' if passed else 'MISMATCH'}  ({detail})")
        failed |= not passed
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

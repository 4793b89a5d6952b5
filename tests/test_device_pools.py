"""tools/gpu_memory_check.py on the simulated device: the TensorRT backend's KV moves in device
memory equal the ONNX Runtime backend's numpy moves, eagerly and replayed from a CUDA graph."""
from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from trtbuild.runtime.core.kv_pools import DevicePools

from conftest import REPO
from simulated_device import SimulatedDevice


def gpu_memory_check():
    spec = importlib.util.spec_from_file_location("gpu_memory_check", REPO / "tools" / "gpu_memory_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_device_moves_equal_host_moves(dtype):
    device = SimulatedDevice()
    results = gpu_memory_check().check(device.module(), dtype)
    assert [(name, passed) for name, passed, _ in results] == [
        ("random moves equal numpy", True), ("capture does not run the moves", True),
        ("graph launch equals the moves", True)]
    assert device.calls["cudaGraphLaunch"] == 1 and not device.buffers  # launched once; all freed


def test_the_check_catches_a_planted_block_offset(monkeypatch):
    save_block = DevicePools.save_block
    monkeypatch.setattr(DevicePools, "save_block", lambda self, slot, index, block: save_block(
        self, slot, max(0, index - 1), block))  # planted: saves the block before the one asked for
    results = gpu_memory_check().check(SimulatedDevice().module())
    assert results[0][:2] == ("random moves equal numpy", False)


def test_paged_pool_moves_equal_host_moves_and_a_planted_offset_is_caught(monkeypatch):
    from trtbuild.runtime.core.paged_pools import DeviceBlockPools

    device = SimulatedDevice()
    assert [r[:2] for r in gpu_memory_check().block_pool_check(device.module())] == [
        ("paged keep_path equals numpy", True)]
    assert not device.buffers
    token = DeviceBlockPools._token  # planted: positions one token further into their block
    monkeypatch.setattr(DeviceBlockPools, "_token", lambda self, name, blocks, position: token(
        self, name, blocks, position) + (self.token_bytes if position % self.shape.block_size < self.shape.block_size - 1
                                         else 0))
    assert [r[:2] for r in gpu_memory_check().block_pool_check(SimulatedDevice().module())] == [
        ("paged keep_path equals numpy", False)]

"""How pipeline stages hand values to each other: torch.distributed point-to-point, three ways.

A stage engine says where a hand-off lands (``stage_input``) and returns what its step wrote
(``stage_step``); a transport moves those buffers between ranks and brings rank 0 the logits
(rank 0's ``send_and_receive``: each micro-batch's send and its logits receives in one batch):

- ``HostTransport``: numpy arrays over the default (gloo) group. ONNX Runtime ranks.
- ``NcclTransport``: TensorRT ranks where torch has CUDA and NCCL, **the path real GPUs take**.
  The engine's device buffers themselves, wrapped as torch CUDA tensors through
  ``__cuda_array_interface__`` (no copy), go over an NCCL group; every NCCL call is issued with
  the engine's stream as torch's current stream, so the send waits for the step that wrote the
  buffer and the next step waits for the receive, all on the device (the host never waits).
- ``HostStagedTransport``: TensorRT ranks where torch has no CUDA (a CPU build of torch beside
  cuda-python; CI's simulated device): device → host copy, gloo, host → device copy.

Point-to-point moves bytes: the device transports send every buffer as uint8 (bfloat16 has no
``__cuda_array_interface__`` type string), the receiver knows the shape and dtype it expects.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class DeviceArray:
    """An array of ``shape`` and ``dtype`` in device memory at ``address`` (a region of one of the
    engine's buffers: the hand-off of one micro-batch)."""

    address: int
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * np.dtype(self.dtype).itemsize


class HostSending:
    """A gloo send in flight and the host buffer it reads, kept alive until it is done."""

    def __init__(self, work, buffer):
        self.work, self.buffer = work, buffer

    def wait(self) -> None:
        self.work.wait()


class HostReceiving:
    """A receive posted into ``buffer``; ``wait`` gives it, viewed as ``shape`` of ``dtype``."""

    def __init__(self, work, buffer: np.ndarray, shape: tuple[int, ...], dtype):
        self.work, self.buffer, self.shape, self.dtype = work, buffer, shape, dtype

    def wait(self) -> np.ndarray:
        self.work.wait()
        return self.buffer.view(self.dtype).reshape(self.shape)


class HostTransport:
    """numpy arrays over the default process group (gloo)."""

    def send(self, array: np.ndarray, dst: int) -> HostSending:
        import torch
        import torch.distributed as dist

        tensor = torch.from_numpy(np.ascontiguousarray(array))
        return HostSending(dist.isend(tensor, dst=dst), tensor)

    def recv_into(self, array: np.ndarray, src: int) -> None:
        import torch
        import torch.distributed as dist

        dist.recv(torch.from_numpy(array), src=src)  # shares the array's memory

    def send_and_receive(self, array: np.ndarray, dst: int, shapes: list[tuple[int, ...]], dtype,
                         src: int) -> tuple[HostSending, list[HostReceiving]]:
        """Sends ``array`` to ``dst`` and posts receives of ``shapes`` from ``src``, one batch
        (``batch_isend_irecv``); each receiving's ``wait`` gives its array."""
        import torch
        import torch.distributed as dist

        tensor = torch.from_numpy(np.ascontiguousarray(array))
        buffers = [np.empty(int(np.prod(shape)) * np.dtype(dtype).itemsize, np.uint8) for shape in shapes]
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, tensor, dst)] +
                                       [dist.P2POp(dist.irecv, torch.from_numpy(b), src) for b in buffers])
        return HostSending(works[0], tensor), [HostReceiving(work, buffer, shape, dtype)
                                               for work, buffer, shape in zip(works[1:], buffers, shapes)]


class HostStagedTransport:
    """Device buffers staged through host memory over gloo, for TensorRT ranks whose torch has no
    CUDA. Copies run on the engine's ``stream`` (cuda-python): a send first waits for the step
    that wrote the buffer; a receive's host → device copy is ordered before the next step."""

    def __init__(self, cudart, stream, ok):
        """``ok`` unwraps a cuda-python result tuple, raising on an error."""
        self.cudart, self.stream, self.ok = cudart, stream, ok
        self.host = HostTransport()

    def _staged(self, array: DeviceArray) -> np.ndarray:
        staged = np.empty(array.nbytes, np.uint8)
        self.ok(self.cudart.cudaMemcpyAsync(staged.ctypes.data, array.address, array.nbytes,
                                            self.cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost, self.stream))
        self.ok(self.cudart.cudaStreamSynchronize(self.stream))
        return staged

    def send(self, array: DeviceArray, dst: int) -> HostSending:
        return self.host.send(self._staged(array), dst)

    def recv_into(self, array: DeviceArray, src: int) -> None:
        staged = np.empty(array.nbytes, np.uint8)
        self.host.recv_into(staged, src)
        # From pageable memory the call returns once the bytes are staged: ``staged`` may go.
        self.ok(self.cudart.cudaMemcpyAsync(array.address, staged.ctypes.data, array.nbytes,
                                            self.cudart.cudaMemcpyKind.cudaMemcpyHostToDevice, self.stream))

    def send_and_receive(self, array: DeviceArray, dst: int, shapes: list[tuple[int, ...]], dtype,
                         src: int) -> tuple[HostSending, list[HostReceiving]]:
        return self.host.send_and_receive(self._staged(array), dst, shapes, dtype, src)


class _CudaBytes:
    """``nbytes`` of device memory at ``address`` as the CUDA array interface describes it. No
    ``stream`` entry: NcclTransport orders the work itself."""

    def __init__(self, address: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (address, False),
                                         "version": 3}


def torch_bytes(array: DeviceArray, device):
    """``array``'s device memory as a uint8 torch CUDA tensor that shares it (no copy)."""
    import torch

    return torch.as_tensor(_CudaBytes(array.address, array.nbytes), device=device)


class DeviceSending:
    """An NCCL send in flight; ``wait`` makes the engine's stream (not the host) wait for it, so
    the next step cannot overwrite the buffer before it is sent."""

    def __init__(self, work, tensor, stream):
        self.work, self.tensor, self.stream = work, tensor, stream

    def wait(self) -> None:
        import torch

        with torch.cuda.stream(self.stream):
            self.work.wait()


class NcclTransport:
    """Device buffers over an NCCL process group (every rank of the job, created by each rank in
    the same order), on CUDA device ``device``, ordered on the engine's cuda-python ``stream``."""

    def __init__(self, group, device: int, stream):
        import torch

        self.group, self.device = group, torch.device("cuda", device)
        # The engine's stream as torch's: NCCL work issued under it waits for what the stream
        # holds, and ``work.wait()`` under it makes the stream wait for the NCCL work.
        self.stream = torch.cuda.ExternalStream(int(stream), device=self.device)

    def send(self, array: DeviceArray, dst: int) -> DeviceSending:
        import torch
        import torch.distributed as dist

        tensor = torch_bytes(array, self.device)
        with torch.cuda.stream(self.stream):
            work = dist.isend(tensor, dst=dst, group=self.group)
        return DeviceSending(work, tensor, self.stream)

    def recv_into(self, array: DeviceArray, src: int) -> None:
        import torch
        import torch.distributed as dist

        with torch.cuda.stream(self.stream):
            dist.recv(torch_bytes(array, self.device), src=src, group=self.group)  # the stream waits, not the host

    def send_and_receive(self, array: DeviceArray, dst: int, shapes: list[tuple[int, ...]], dtype,
                         src: int) -> tuple[DeviceSending, list["DeviceReceiving"]]:
        """One NCCL batch: the send of ``array`` and receives of ``shapes`` (to host on ``wait``)."""
        import torch
        import torch.distributed as dist

        tensor = torch_bytes(array, self.device)
        buffers = [torch.empty(int(np.prod(shape)) * np.dtype(dtype).itemsize, dtype=torch.uint8, device=self.device)
                   for shape in shapes]
        with torch.cuda.stream(self.stream):
            works = dist.batch_isend_irecv([dist.P2POp(dist.isend, tensor, dst, group=self.group)] +
                                           [dist.P2POp(dist.irecv, b, src, group=self.group) for b in buffers])
        return DeviceSending(works[0], tensor, self.stream), [DeviceReceiving(work, buffer, shape, dtype)
                                                              for work, buffer, shape in zip(works[1:], buffers, shapes)]


class DeviceReceiving:
    """An NCCL receive posted into a device ``buffer``; ``wait`` brings it to the host."""

    def __init__(self, work, buffer, shape: tuple[int, ...], dtype):
        self.work, self.buffer, self.shape, self.dtype = work, buffer, shape, dtype

    def wait(self) -> np.ndarray:
        self.work.wait()  # torch's current stream waits for the receive; .cpu() waits for the stream
        return self.buffer.cpu().numpy().view(self.dtype).reshape(self.shape)


def nccl_usable() -> bool:
    """Whether torch here can move CUDA tensors over NCCL (a CUDA build on a machine with a GPU)."""
    import torch
    import torch.distributed as dist

    return torch.cuda.is_available() and dist.is_nccl_available()

"""A TensorRT rank engine as one pipeline stage: its hand-off stays in device memory.

The stage receives ``hidden_states`` [B, S, D] into a device buffer and writes
``hidden_states_out`` [B, S, D] (or, on the last stage, ``logits`` [B, R, V] and
``medusa_logits`` [B, 1, K, V]) into device buffers; a transport (transport.py)
moves them between ranks. Each buffer holds max_batch slots' worth, and a micro-batch uses the
region of its own slots (from ``first_slot``): the micro-batches of a step never share memory,
so a stage may start micro-batch m + 1 while m is still being sent. Stage steps run eagerly at
their exact batch (no CUDA graphs: a graph's padded rows would spill into the next
micro-batch's slots). A paged engine's stage binds its pools (its layers' caches, of its KV heads)
and the micro-batch's block_table and kv_slots: every stage reads and writes the same block ids.
"""
from __future__ import annotations

import numpy as np

from ...contract.pipeline import HIDDEN_STATES, HIDDEN_STATES_OUT
from ...contract.step import LOGITS, MEDUSA_LOGITS, step_shape
from ..backends.tensorrt.engine import TensorRTEngine
from ..core.engine import CacheOpsOfEngine
from ..core.kv_pools import device_alloc
from ..core.step import Step
from .transport import DeviceArray


class TensorRTStage(CacheOpsOfEngine):
    """``engine`` (a stage rank's TensorRTEngine) with the stage protocol StageRunner drives:
    ``stage_input``, ``stage_step``, and the engine's cache moves."""

    def __init__(self, engine: TensorRTEngine):
        self.engine = engine
        d = engine.dir
        self.hidden_size, self.vocab_size = d.model["hidden_size"], d.vocab_size
        # One slot's region of each hand-off buffer: the most a row can hold.
        self.slot_hidden = engine.max_seq * self.hidden_size * engine.element.itemsize
        self.slot_logits = engine.max_rows * self.vocab_size * 4
        self.slot_medusa = engine.num_heads * self.vocab_size * 4  # the heads at one node a row

        def buffer(name: str) -> int | None:
            if name not in engine.tensors:
                return None
            return device_alloc(engine.cudart, engine.ok, d.max_batch_size * self.slot_hidden)

        self.hidden_in, self.hidden_out = buffer(HIDDEN_STATES), buffer(HIDDEN_STATES_OUT)

    def stage_input(self, step: Step) -> DeviceArray:
        """Where ``step``'s hidden states [B, S, D] are received: its slots' region of the input buffer."""
        if self.hidden_in is None:
            raise ValueError("the first pipeline stage reads token ids, not hidden states")
        return self._hidden(self.hidden_in, step)

    def _hidden(self, base: int, step: Step) -> DeviceArray:
        batch, seq, _ = step_shape(step.tokens, trees=step.trees)
        return DeviceArray(base + step.first_slot * self.slot_hidden, (batch, seq, self.hidden_size),
                           self.engine.element)

    def stage_step(self, step: Step, hidden_states: DeviceArray | None) -> dict[str, DeviceArray]:
        """Enqueues ``step`` on the engine's stream; the caches update in place. ``hidden_states``:
        what stage_input gave, received (None on the first stage). Returns the outputs but the
        caches, in device memory: hidden_states_out, or logits (and medusa_logits) on the last stage."""
        if (hidden_states is None) != (self.hidden_in is None):
            raise ValueError(f"stage_step: hidden_states {'missing' if hidden_states is None else 'given'} for a "
                             f"stage that {'reads' if self.hidden_in is not None else 'does not read'} them")
        self.engine.on_device()
        e = self.engine
        arrays, plain, _ = e.host_arrays(step)
        batch, seq = plain.position_ids.shape
        rows = plain.logits_index.shape[1]
        e.upload(arrays)
        context = e.contexts[step.kind]
        e.bind_inputs(context, arrays, step.first_slot)
        if hidden_states is not None:
            context.set_input_shape(HIDDEN_STATES, hidden_states.shape)
            context.set_tensor_address(HIDDEN_STATES, hidden_states.address)
        outputs = {}
        if self.hidden_out is not None:
            outputs[HIDDEN_STATES_OUT] = self._hidden(self.hidden_out, step)
        if e.logits is not None:
            outputs[LOGITS] = DeviceArray(e.logits + step.first_slot * self.slot_logits,
                                          (batch, rows, self.vocab_size), np.dtype(np.float32))
        if e.medusa is not None:
            outputs[MEDUSA_LOGITS] = DeviceArray(e.medusa + step.first_slot * self.slot_medusa,
                                                 (batch, 1, e.num_heads, self.vocab_size), np.dtype(np.float32))
        for name, array in outputs.items():
            context.set_tensor_address(name, array.address)
        if not context.execute_async_v3(e.stream):
            raise RuntimeError("TensorRT execution failed")
        return outputs

    def close(self) -> None:
        for ptr in (self.hidden_in, self.hidden_out):
            if ptr is not None:
                self.engine.cudart.cudaFree(ptr)
        self.engine.close()

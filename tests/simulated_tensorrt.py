"""The TensorRT half of the simulated device (tests/simulated_device.py): a module with the
TensorRT Python API the runtime uses, whose engines run the rank's ONNX graph in ONNX Runtime
over the device memory bound to them. Same graph TensorRT compiles, same ONNX Runtime
configuration as the CPU backend; so the simulated GPU backend must give its tokens exactly.
"""
from __future__ import annotations

import hashlib
import json
import types
from pathlib import Path

import numpy as np
import onnxruntime as ort

from trtbuild.plugins.onnxruntime import session as ort_config
from trtbuild.contract.draft_head import DRAFT_FEATURES
from trtbuild.contract.pipeline import HIDDEN_STATES, HIDDEN_STATES_OUT
from trtbuild.contract.step import BLOCK_TABLE, CACHE_DTYPES, INPUT_NAMES, KV_SLOTS, LOGITS, MEDUSA_LOGITS
from trtbuild.plugins.onnxruntime import fp4
from trtbuild.plugins.onnxruntime.segments import SegmentedRank

INPUT_DTYPES = {"input_ids": np.int32, "position_ids": np.int32, "write_index": np.int64, "kv_length": np.int64,
                "attention_mask": np.bool_, "logits_index": np.int64, BLOCK_TABLE: np.int32, KV_SLOTS: np.int64}
assert set(INPUT_DTYPES) == {*INPUT_NAMES, BLOCK_TABLE, KV_SLOTS}


class Logger:
    ERROR, WARNING, INFO = 0, 1, 2

    def __init__(self, severity: int = 1):
        self.severity = severity


class SimulatedEngine:
    """One rank's engine: the ONNX graph TensorRT compiled (a paged engine's rankN.paged.onnx),
    its manifest's optimization profiles."""

    def __init__(self, device, engine_dir: Path, manifest: dict, rank: int):
        self.device, self.manifest = device, manifest
        entry = manifest["ranks"][rank]
        path = engine_dir / (entry.get("paged_onnx") or entry["onnx"])
        self.session, self.segments = None, None
        if manifest["tensor_parallel"] > 1:  # DistCollective: ONNX Runtime runs the pieces between them
            model = fp4.cpu_model(path)
            self.segments = SegmentedRank(model, path.parent, threads=1)
            self.outputs = [o.name for o in model.graph.output]
            self.inputs = [i.name for i in model.graph.input]
        else:
            self.session = ort_config.session(fp4.ort_source(path))
            self.outputs = [o.name for o in self.session.get_outputs()]
            self.inputs = [i.name for i in self.session.get_inputs()]
        self.dtype = CACHE_DTYPES[manifest["spec"]["model"]["dtype"]]
        self.hidden_size = manifest["model"]["hidden_size"]
        self.contexts: list[SimulatedContext] = []

    def create_execution_context(self) -> SimulatedContext:
        context = SimulatedContext(self)
        self.contexts.append(context)
        return context


class SimulatedContext:
    def __init__(self, engine: SimulatedEngine):
        self.engine, self.profile = engine, None
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.addresses: dict[str, int] = {}
        self.communicator = None
        self.executions = 0

    def set_optimization_profile_async(self, index: int, stream) -> bool:
        self.profile = index
        return 0 <= index < len(self.engine.manifest["profiles"])

    def set_communicator(self, communicator) -> bool:
        self.communicator = communicator
        return True

    def set_input_shape(self, name: str, shape) -> bool:
        if name not in self.engine.inputs:
            return False
        self.shapes[name] = tuple(int(d) for d in shape)
        return True

    def set_tensor_address(self, name: str, address: int) -> bool:
        if name not in self.engine.inputs and name not in self.engine.outputs:
            return False
        self.addresses[name] = int(address)
        return True

    def execute_async_v3(self, stream) -> bool:
        """Runs (or, while ``stream`` captures, records) the graph with the shapes and addresses
        bound now: a captured launch replays exactly these, as a CUDA graph does."""
        try:
            bound = self._bound()
        except ValueError as exc:
            self.engine.device.last_fault = f"TensorRT: {exc}"
            return False
        self.engine.device._enqueue(stream, lambda: self._run(bound))
        return True

    def _bound(self) -> dict:
        # The manifest records each profile's input_ids and logits_index bounds; a later pipeline
        # stage's hidden_states [B, S, D] is held to input_ids' [B, S].
        profile = self.engine.manifest["profiles"][self.profile]["shapes"]
        checks = [(name, name) for name in ("input_ids", "logits_index") if name in self.engine.inputs]
        checks += [(HIDDEN_STATES, "input_ids")] if HIDDEN_STATES in self.engine.inputs else []
        for name, recorded in checks:
            shape, (lo, _, hi) = self.shapes.get(name), profile[recorded]
            if shape is None or any(not a <= s <= b for s, a, b in zip(shape, lo, hi)):
                raise ValueError(f"{name} shape {shape} is outside profile {self.profile} ({lo} … {hi})")
        if HIDDEN_STATES in self.engine.inputs and self.shapes[HIDDEN_STATES][2:] != (self.engine.hidden_size,):
            raise ValueError(f"{HIDDEN_STATES} shape {self.shapes[HIDDEN_STATES]}: D must be {self.engine.hidden_size}")
        missing = [n for n in self.engine.inputs if n not in self.shapes or n not in self.addresses]
        missing += [n for n in self.engine.outputs if n not in self.addresses]
        if missing:
            raise ValueError(f"tensors without a shape or address: {', '.join(missing)}")
        return {"shapes": dict(self.shapes), "addresses": dict(self.addresses)}

    def _run(self, bound: dict) -> None:
        device, engine = self.engine.device, self.engine
        shapes, addresses = bound["shapes"], bound["addresses"]
        inputs = {}
        for name in engine.inputs:
            dtype = engine.dtype if name.startswith("past_") or name == HIDDEN_STATES else INPUT_DTYPES[name]
            inputs[name] = device.view(addresses[name], shapes[name], dtype)
        out_shapes = {HIDDEN_STATES_OUT: ((*shapes["position_ids"], engine.hidden_size), engine.dtype),
                      DRAFT_FEATURES: ((*shapes["position_ids"], engine.hidden_size), engine.dtype)}
        if "logits_index" in shapes:  # the last pipeline stage (or the whole model)
            batch, rows = shapes["logits_index"]
            vocab = engine.manifest["model"]["vocab_size"]
            out_shapes[LOGITS] = ((batch, rows, vocab), np.float32)
            if MEDUSA_LOGITS in engine.outputs:
                out_shapes[MEDUSA_LOGITS] = ((batch, 1, engine.manifest["medusa"]["num_heads"], vocab), np.float32)
        outputs = {}
        for name in engine.outputs:
            if name.startswith("present_"):  # same shape as its past; in place when aliased
                shape, dtype = shapes["past_" + name[len("present_"):]], engine.dtype
            else:
                shape, dtype = out_shapes[name]
            outputs[name] = device.view(addresses[name], shape, dtype)
        if engine.segments is None:
            binding = engine.session.io_binding()
            for name, view in inputs.items():
                binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(view))
            for name, view in outputs.items():
                binding.bind_ortvalue_output(name, ort.OrtValue.ortvalue_from_numpy(view))
            engine.session.run_with_iobinding(binding)
        else:
            self._run_segments(inputs, outputs)
        self.executions += 1

    def _run_segments(self, inputs: dict, outputs: dict) -> None:
        """A tensor-parallel rank: its graph's pieces, each DistCollective (all-reduce, all-gather) over the
        NCCL communicator set on this context (the device's NCCL stand-in, tests/simulated_nccl.py)."""
        if self.communicator is None:
            raise RuntimeError("a tensor-parallel rank ran without an NCCL communicator (set_communicator)")
        nccl = self.engine.device.nccl
        communicator = nccl.communicator(self.communicator)
        values = {name: np.array(view) for name, view in inputs.items()}  # copies: outputs may alias the pasts
        for segment, session in zip(self.engine.segments.segments, self.engine.segments.sessions):
            if session is not None:
                values.update(ort_config.run(session, values))
            if segment.collective is not None:
                values[segment.collective.output] = nccl.fabric.collective(
                    communicator, values[segment.collective.input], segment.collective.reference)
        for name, view in outputs.items():
            view[...] = values[name]


def tensorrt_module(device, module_name: str, version: str, engine_dirs: list[Path]) -> types.ModuleType:
    """A stand-in for ``tensorrt``/``tensorrt_rtx`` serving the rank engines of ``engine_dirs``."""
    known: dict[str, tuple[Path, dict, int]] = {}
    for path in map(Path, engine_dirs):
        manifest = json.loads((path / "manifest.json").read_text())
        for rank in manifest["ranks"]:
            digest = hashlib.sha256((path / rank["engine"]).read_bytes()).hexdigest()
            known[digest] = (path, manifest, rank["rank"])

    class Runtime:
        def __init__(self, logger: Logger):
            self.logger = logger

        def deserialize_cuda_engine(self, data: bytes):
            found = known.get(hashlib.sha256(bytes(data)).hexdigest())
            return None if found is None else SimulatedEngine(device, *found)

    module = types.ModuleType(module_name)
    module.__version__ = version
    module.Logger, module.Runtime = Logger, Runtime
    module.simulated = True
    return module

"""CPU backend: runs the rank ONNX (the graph compiled into the engine) in ONNX Runtime.

The KV pools (runtime/core/kv_pools.py) are numpy arrays [capacity + 1, H_kv, S_max, D] per layer,
demand-paged (a row costs the positions written; discarded slots give their pages back).
Each step binds ``pool[a:b]`` as both the ``past_*`` input and the ``present_*`` output through
IO binding, so the graph writes the new K/V into the pool itself: no per-step copy of the cache.
Plain decode steps reuse one binding per shape (``_bind``) and run the CPU decode graph
(GroupQueryAttention per layer, packed QKV, fused residual norms) where the engine dir has one:
``rankN.cpu.onnx``, built and checked by the build's CPU stage, one session holding it and the
rank graph (runtime/backends/onnxruntime/step_graph.py); a verification of up to the model's
VERIFY_ROWS rows runs its CPU verification graph where it has one (built with any draft source),
the caches bound with their rows folded into heads and every row writing from one start
(runtime/backends/onnxruntime/one_write_start.py). Nothing is rewritten at load.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnxruntime as ort

from ....plugins.onnxruntime import session as ort_config
from ....plugins.onnxruntime.session import Spinning
from ....contract.draft_head import DRAFT_FEATURES
from ....contract.pipeline import HIDDEN_STATES
from ....contract.step import (CACHE_DTYPES, DRAFT_HEADS, LOGITS, MEDUSA_LOGITS, NEXT_INPUTS, PLAIN_DECODE, TREE_VERIFY,
                             VERIFY_ROWS, StepArrays, fill_step_arrays, step_shape)
from ....plugins.onnxruntime import fp4
from ....plugins.onnxruntime.segments import CollectiveFn, SegmentedRank
from .one_write_start import move_back, write_from_one_start
from .step_graph import cpu_graph, fill_decode_inputs
from ...core.engine import GreedyRun, StepOutput, StepwiseGreedyRun, step_arrays
from ...engine_dir import EngineDir
from ...core.kv_pools import HostPools, PoolShape
from ...core.step import Step, StepKind


# The Ifs' conditions; bindings point at these arrays, so they live as long as the module.
_TRUE, _FALSE = np.array(True), np.array(False)


@dataclass(frozen=True)
class _Bound:
    arrays: StepArrays
    binding: object              # onnxruntime.IOBinding
    logits: np.ndarray           # [B, R, V]
    medusa: np.ndarray | None    # [B, 1, K, V]
    draft: np.ndarray | None     # the bound DRAFT_HEADS (a bool scalar), where the model has it
    features: np.ndarray | None  # [B, S, D] in the model's dtype: DRAFT_FEATURES, where the model has it

    @property
    def draft_features(self) -> np.ndarray | None:
        return _float32(self.features)


class OnnxRuntimeEngine:
    name = "onnxruntime"

    def __init__(self, engine_dir: EngineDir, threads: int = 0, prefix_blocks: int = 0, block_size: int = 16,
                 rank: int = 0, collective: CollectiveFn | None = None, spinning: Spinning = Spinning.always,
                 use_decode_graph: bool = True):
        """``collective``: how this rank joins the others (a tensor-parallel engine dir's rank
        graphs hold DistCollective nodes; ONNX Runtime runs the pieces between them).
        ``spinning``: whether ONNX Runtime's threads spin between runs (a server's sleep);
        ``use_decode_graph`` False runs every step on the rank graph, as on a dir built without the
        CPU decode graph (benchmarks/cpu_decode.py, tests)."""
        if engine_dir.dtype not in CACHE_DTYPES:
            raise ValueError(f"the onnxruntime backend runs float32 and float16 engine dirs; this one is "
                             f"{engine_dir.dtype}: use --backend tensorrt on a GPU")
        self.engine_dir, self.block_size = engine_dir, block_size
        path = engine_dir.rank_file(rank, "onnx")
        self.segments, self.decode, self.verifies_on_cpu_graph, self.drafts_on_demand = None, None, False, False
        self.verify_rows = 0  # the most rows one verification on the CPU verification graph holds
        if engine_dir.world_size > 1:  # DistCollective nodes, or a pipeline stage: run in segments
            if collective is None:
                raise ValueError(f"{path} is one rank of a tensor/pipeline-parallel engine: run it through the "
                                 "tensor-parallel engine (trtbuild.runtime.parallel.tensor_parallel)")
            model = fp4.cpu_model(path)
            self.segments = SegmentedRank(model, path.parent, threads, engine_dir.cpu_activations)
            self.collective = collective
            outputs = [o.name for o in model.graph.output]
        else:
            source, self.decode = cpu_graph(engine_dir, rank, use_decode_graph)  # self.decode: rankN.cpu.onnx or None
            self.session = ort_config.session(source, threads, path.parent, spinning, engine_dir.cpu_activations,
                                              huge_pages=True)
            outputs = [o.name for o in self.session.get_outputs()]
            # A step model built with any draft source verifies up to VERIFY_ROWS rows on its CPU
            # verification graph (a dir built before it said how many: one row).
            names = {i.name for i in self.session.get_inputs()}
            self.verifies_on_cpu_graph = TREE_VERIFY in names
            if self.verifies_on_cpu_graph:
                self.verify_rows = int(self.session.get_modelmeta().custom_metadata_map.get(VERIFY_ROWS, 1))
            self.drafts_on_demand = DRAFT_HEADS in names  # a greedy run's steps skip the heads
        self.kv = HostPools(PoolShape.of(engine_dir, CACHE_DTYPES[engine_dir.dtype], prefix_blocks, block_size, rank))
        self.has_medusa = MEDUSA_LOGITS in outputs
        self.has_features = DRAFT_FEATURES in outputs  # built with a draft head
        self._bound: dict[tuple[int, int, int], _Bound] = {}  # (first slot, B, S) → reused binding

    def step(self, step: Step) -> StepOutput:
        if self.segments is not None:
            values = self.stage_step(step, None)
            return StepOutput(logits=values[LOGITS], medusa=values[MEDUSA_LOGITS] if self.has_medusa else None,
                              draft_features=_float32(values.get(DRAFT_FEATURES)))
        _, seq, _ = step_shape(step.tokens, trees=step.trees)
        if step.kind == StepKind.decode and seq == 1:  # the steady state: one token a row, step after step
            draft = step.draft_heads
            bound = self._filled(step, draft=draft)
            self.session.run_with_iobinding(bound.binding)
            skipped = self.drafts_on_demand and not draft  # the heads' logits are zeros: none to give
            return StepOutput(logits=bound.logits, medusa=None if skipped else bound.medusa,
                              draft_features=bound.draft_features)
        if (step.verifies and len(step.rids) <= self.verify_rows
                and max(step.starts) + seq <= self.engine_dir.max_seq_len):  # the rows' drafts, step after step
            key = (step.first_slot, len(step.rids), seq)
            bound = self._bound.get(key) or self._bind(key)
            fill_step_arrays(bound.arrays, step.tokens, step.starts, self.engine_dir.max_seq_len, step.trees)
            shifted = write_from_one_start(bound.arrays)
            self.session.run_with_iobinding(bound.binding)
            move_back(self.kv.pools, step.first_slot, shifted, seq)
            return StepOutput(logits=bound.logits, medusa=bound.medusa, draft_features=bound.draft_features)
        arrays = step_arrays(step, self.engine_dir.max_seq_len)
        binding = self.session.io_binding()
        for name, value in arrays.as_dict().items():
            binding.bind_cpu_input(name, value)
        if self.decode is not None:
            binding.bind_cpu_input(PLAIN_DECODE, _FALSE)
        if self.verifies_on_cpu_graph:  # more rows than the verification graph holds: the rank graph
            binding.bind_cpu_input(TREE_VERIFY, _FALSE)
        if self.drafts_on_demand:  # read by the decode graph only
            binding.bind_cpu_input(DRAFT_HEADS, _TRUE)
        named = [LOGITS, *([MEDUSA_LOGITS] if self.has_medusa else []),
                 *([DRAFT_FEATURES] if self.has_features else [])]
        for name in named:  # get_outputs() gives them in this order
            binding.bind_output(name)
        rows = slice(step.first_slot, step.first_slot + len(step.rids))
        for name, pool in self.kv.pools.items():
            view = ort.OrtValue.ortvalue_from_numpy(pool[rows])  # shares the pool's memory
            binding.bind_ortvalue_input(f"past_{name}", view)
            binding.bind_ortvalue_output(f"present_{name}", view)
        self.session.run_with_iobinding(binding)
        outputs = dict(zip(named, (value.numpy() for value in binding.get_outputs())))
        return StepOutput(logits=outputs[LOGITS],  # [B, R, V]
                          medusa=outputs.get(MEDUSA_LOGITS),  # [B, 1, K, V]
                          draft_features=_float32(outputs.get(DRAFT_FEATURES)))  # [B, S, D]

    def greedy_run(self, step: Step) -> GreedyRun:
        if self.segments is not None:
            return StepwiseGreedyRun(self, step)
        # Nobody drafts from a run's steps: their heads are skipped where the model can.
        return _BoundGreedyRun(self.session, self._filled(step, draft=False),
                               feeds_itself=self.decode is not None)

    def _filled(self, step: Step, draft: bool) -> _Bound:
        """The reused binding of a plain decode step's shape, its inputs filled for ``step``;
        ``draft``: whether the step computes the Medusa heads' logits (where it can skip them)."""
        key = (step.first_slot, len(step.rids), 1)
        bound = self._bound.get(key) or self._bind(key)
        if bound.draft is not None:
            bound.draft[...] = draft
        arrays = bound.arrays
        if self.decode is not None:
            fill_decode_inputs(arrays.input_ids, arrays.write_index, arrays.kv_length, step.tokens, step.starts)
        else:
            fill_step_arrays(arrays, step.tokens, step.starts, self.engine_dir.max_seq_len, step.trees)
        return bound

    def _bind(self, key: tuple[int, int, int]) -> _Bound:
        """Buffers and an IO binding for steps of one shape, reused every such step: plain decode
        steps (S = 1) and, on the CPU verification graph, verifications (S > 1, logits at every
        node; the caches bound [1, B·H_kv, S_max, D], the rows folded into heads). Inputs are numpy buffers the step fills in place, caches are views
        of the pools, the outputs land in preallocated arrays (valid until the next step, as
        StepOutput says)."""
        first_slot, batch, seq = key
        d = self.engine_dir
        arrays = StepArrays.empty(batch, seq, seq, d.max_seq_len)  # R = S: 1, or every node of a tree
        binding = self.session.io_binding()
        for name, value in arrays.as_dict().items():
            binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(value))
        if self.decode is not None:
            binding.bind_cpu_input(PLAIN_DECODE, _TRUE if seq == 1 else _FALSE)
        if self.verifies_on_cpu_graph:
            binding.bind_cpu_input(TREE_VERIFY, _FALSE if seq == 1 else _TRUE)
        draft = np.array(True) if self.drafts_on_demand else None  # set by _filled before each plain step
        if draft is not None:
            binding.bind_ortvalue_input(DRAFT_HEADS, ort.OrtValue.ortvalue_from_numpy(draft))
        if self.decode is not None and seq == 1:
            for name, value in arrays.as_dict().items():  # the next step's inputs, over this one's
                if name in NEXT_INPUTS:
                    binding.bind_ortvalue_output(NEXT_INPUTS[name], ort.OrtValue.ortvalue_from_numpy(value))
        logits = np.empty((batch, seq, d.vocab_size), np.float32)  # [B, R, V]
        binding.bind_ortvalue_output(LOGITS, ort.OrtValue.ortvalue_from_numpy(logits))
        medusa = None
        if self.has_medusa:  # the heads: at one node a row (StepOutput)
            medusa = np.empty((batch, 1, d.medusa["num_heads"], d.vocab_size), np.float32)  # [B, 1, K, V]
            binding.bind_ortvalue_output(MEDUSA_LOGITS, ort.OrtValue.ortvalue_from_numpy(medusa))
        features = None
        if self.has_features:  # every new position's: [B, S, D]
            features = np.empty((batch, seq, d.model["hidden_size"]), CACHE_DTYPES[d.dtype])
            binding.bind_ortvalue_output(DRAFT_FEATURES, ort.OrtValue.ortvalue_from_numpy(features))
        for name, pool in self.kv.pools.items():
            rows = pool[first_slot:first_slot + batch]  # [B, H_kv, S_max, D]
            if seq > 1:  # a view, as the pool rows are contiguous: nothing is copied
                rows = rows.reshape(1, -1, *rows.shape[2:])
            view = ort.OrtValue.ortvalue_from_numpy(rows)
            binding.bind_ortvalue_input(f"past_{name}", view)
            binding.bind_ortvalue_output(f"present_{name}", view)
        self._bound[key] = _Bound(arrays, binding, logits, medusa, draft, features)
        return self._bound[key]

    def stage_input(self, step: Step) -> np.ndarray:
        """Where a pipeline stage receives ``step``'s hidden states: [B, S, D] in the model's dtype."""
        batch, seq, _ = step_shape(step.tokens, trees=step.trees)
        return np.empty((batch, seq, self.engine_dir.model["hidden_size"]), CACHE_DTYPES[self.engine_dir.dtype])

    def stage_step(self, step: Step, hidden_states: np.ndarray | None) -> dict[str, np.ndarray]:
        """The rank graph piece by piece, this rank's collective between pieces; caches in place.
        ``hidden_states`` [B, S, D]: what the pipeline stage before wrote (None on the first stage).
        Returns the graph's outputs but the caches: logits [B, R, V] (and medusa_logits
        [B, 1, K, V]) on the last stage, hidden_states_out [B, S, D] on the others."""
        rows = slice(step.first_slot, step.first_slot + len(step.rids))
        views = {name: ort.OrtValue.ortvalue_from_numpy(pool[rows]) for name, pool in self.kv.pools.items()}
        values: dict[str, object] = dict(step_arrays(step, self.engine_dir.max_seq_len).as_dict())
        if hidden_states is not None:
            values[HIDDEN_STATES] = hidden_states
        for segment, session in zip(self.segments.segments, self.segments.sessions):
            if session is not None:
                values.update(self._run_segment(segment, session, values, views))
            collective = segment.collective
            if collective is not None:
                values[collective.output] = self.collective(collective, values[collective.input].numpy())
        return {name: _host(values[name]) for name in self.segments.outputs if not name.startswith("present_")}

    @staticmethod
    def _run_segment(segment, session, values: dict, views: dict) -> dict:
        binding = session.io_binding()
        for name in segment.inputs:
            if name.startswith("past_"):
                binding.bind_ortvalue_input(name, views[name[len("past_"):]])
            elif isinstance(values[name], np.ndarray):
                binding.bind_cpu_input(name, values[name])
            else:
                binding.bind_ortvalue_input(name, values[name])
        for name in segment.outputs:
            if name.startswith("present_"):  # written in place into the pool, like the whole graph
                binding.bind_ortvalue_output(name, views[name[len("present_"):]])
            else:
                binding.bind_output(name)
        session.run_with_iobinding(binding)
        return dict(zip(segment.outputs, binding.get_outputs()))

    def close(self) -> None:
        """Nothing to release: the pools are numpy arrays."""

    def keep_path(self, slot: int, start: int, nodes: tuple[int, ...]) -> None:
        self.kv.keep_path(slot, start, nodes)

    def copy_slot(self, src: int, dst: int, length: int) -> None:
        self.kv.copy_slot(src, dst, length)

    def save_block(self, slot: int, index: int, block: int) -> None:
        self.kv.save_block(slot, index, block)

    def load_block(self, block: int, slot: int, index: int) -> None:
        self.kv.load_block(block, slot, index)

    def discard(self, slots: tuple[int, ...], blocks: tuple[int, ...]) -> None:
        self.kv.discard(slots, blocks)


class _BoundGreedyRun:
    """Decode steps on one reused binding, each fed the previous step's argmax. On the step model
    the graph writes the next step's inputs over this one's (NEXT_INPUTS), so nothing but the
    run and reading the tokens happens between runs; on the rank graph alone the host takes the
    argmax and advances write_index, kv_length, positions and the mask. ``features``: the last
    step's draft features [B, 1, D] float32 (GreedyRun), None without a draft head."""

    def __init__(self, session, bound: _Bound, feeds_itself: bool):
        self.run, self.binding, arrays = session.run_with_iobinding, bound.binding, bound.arrays
        self.bound = bound
        self.ids = arrays.input_ids[:, 0]   # int32 [B]
        self.feeds_itself = feeds_itself
        self.logits = bound.logits[:, 0]    # [B, V]
        self.write, self.length, self.positions = arrays.write_index, arrays.kv_length, arrays.position_ids
        self.mask, self.rows = arrays.attention_mask[:, 0, 0], np.arange(len(self.ids))  # [B, S_max]

    def advance(self) -> list[int]:
        self.run(self.binding)
        if not self.feeds_itself:
            self.ids[:] = self.logits.argmax(axis=-1)
            self.write += 1
            self.length += 1
            self.positions += 1
            self.mask[self.rows, self.write] = True  # the new position is visible
        return self.ids.tolist()

    @property
    def features(self) -> np.ndarray | None:
        return self.bound.draft_features


def _float32(features: np.ndarray | None) -> np.ndarray | None:
    """Draft features as StepOutput gives them: float32 (a float16 model's, widened)."""
    return features if features is None or features.dtype == np.float32 else features.astype(np.float32)


def _host(value) -> np.ndarray:
    """A step output as numpy: a segment's OrtValue, or a collective's array as it is."""
    return value if isinstance(value, np.ndarray) else value.numpy()

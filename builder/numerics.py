"""Numerics checks: run an ONNX graph in ONNX Runtime on seeded inputs and compare.

One comparator with named statistics (max_abs, max_rel = max_abs / max|reference|) per output.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
import torch

from ..plugins.onnxruntime import session as ort_config
from ..plugins.onnxruntime.session import CpuActivations
from ..contract.step import CACHE_DTYPES, CacheShape, cache_names, step_arrays
from .spec.dtype import DType
from .spec.model import Spec

# The check runs each pass's graph in ONNX Runtime, which holds a copy of its weights, and the
# torch reference holds another: up to passes.numerics_whole_max_mib the graph checked is the
# model built; above it, the same passes run on a depth-truncated copy (the first
# TRUNCATED_LAYERS decoder layers, the final norm and lm_head, with the real weights) and the
# model built gets structural checks (passes/structure_check.py).
TRUNCATED_LAYERS = 2
# ... and of the embedding and lm_head only their first rows (the seeded tokens are drawn from
# them): the check then holds two layers, not two vocabulary-sized tables (2 GB at Llama-3-8B).
TRUNCATED_VOCAB = 8192


@dataclass(frozen=True)
class CheckPlan:
    """Which numerics check a build runs: on the built graph itself (``whole``), or on a graph of
    the first ``layers`` decoder layers exported apart; ``dtype`` is what ONNX Runtime runs
    (float32 for a bfloat16 model: its CPU kernels lack bfloat16; the same weights, widened)."""

    whole: bool
    layers: int
    of_layers: int
    dtype: DType
    vocab_rows: int  # of the embedding and lm_head

    def record(self) -> dict:
        """What the pass log says about the check."""
        return {"check": "whole model" if self.whole else "truncated", "layers": self.layers,
                "of_layers": self.of_layers, "dtype": self.dtype.value, "vocab_rows": self.vocab_rows}

    def describe(self) -> str:
        what = ("the built graph" if self.whole else
                f"a graph of the first {self.layers} of {self.of_layers} decoder layers and the first "
                f"{self.vocab_rows} vocabulary rows (real weights)")
        return f"numerics check on {what}, in {self.dtype.value}"


def check_plan(spec: Spec, weight_bytes: int) -> CheckPlan | None:
    """The check a spec gets for a model of ``weight_bytes`` (None: passes.numerics is off)."""
    if not spec.passes.numerics:
        return None
    layers = spec.arch.num_layers
    small = weight_bytes <= spec.passes.numerics_whole_max_mib * 2**20
    bf16 = spec.model.dtype == DType.bfloat16
    world, vocab = spec.parallel.tensor, spec.arch.vocab_size  # vocab rows split over the tensor ranks
    # Quantized lm_head/embedding codes come for the whole vocabulary: those keep it.
    q = spec.quantization
    whole_vocab = small or (q.bits is not None and (q.quantize_embeddings or not any(p in "lm_head" for p in q.exclude)))
    # A truncated check still has a layer for each pipeline stage.
    truncated = min(max(TRUNCATED_LAYERS, spec.parallel.pipeline), layers)
    return CheckPlan(whole=small and not bf16, layers=layers if small else truncated,
                     of_layers=layers, dtype=DType.float32 if bf16 else spec.model.dtype,
                     vocab_rows=vocab if whole_vocab else min(vocab, world * (TRUNCATED_VOCAB // world)))


@dataclass(frozen=True)
class Stats:
    max_abs: float
    max_rel: float

    def within(self, atol: float, rtol: float) -> bool:
        return self.max_abs <= atol or self.max_rel <= rtol


def seeded_inputs(spec: Spec, plan: CheckPlan, seed: int = 0) -> dict[str, np.ndarray]:
    """Two sequences mid-generation, logits at every position: one at position 0, one with
    random K/V already cached (causal masks), for the step the check ``plan`` runs."""
    num_layers, dtype = plan.layers, plan.dtype
    arch, s_max = spec.arch, spec.build.max_seq_len
    rng = np.random.default_rng(seed)
    seq = max(1, min(4, spec.max_step_tokens, s_max // 2))
    starts = [0, min(3, s_max - seq)]
    tokens = rng.integers(0, plan.vocab_rows, size=(len(starts), seq)).tolist()
    inputs = step_arrays(tokens, starts, s_max, all_logits=True).as_dict()
    shape = CacheShape(arch.num_kv_heads, s_max, arch.head_dim)
    for name in cache_names(num_layers):
        cache = shape.zeros(len(starts), CACHE_DTYPES[dtype.value])
        for b, start in enumerate(starts):
            cache[b, :, :start] = rng.standard_normal((arch.num_kv_heads, start, arch.head_dim))
        inputs[f"past_{name}"] = cache
    return inputs


def run_onnx(model: onnx.ModelProto | Path, inputs: dict[str, np.ndarray], threads: int = 0,
             activations: CpuActivations = CpuActivations.float) -> dict[str, np.ndarray]:
    """Runs a model (in memory, or a file whose external weights lie beside it) on ``inputs``,
    in the ONNX Runtime configuration the runtime and ``trtbuild eval`` use."""
    return ort_config.run(ort_config.session(model, threads, activations=activations), inputs)


def decode_inputs(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The seeded step cut to a plain decode step: each row's first new token only (one row at
    position 0, one after random cached K/V), logits at it."""
    write = inputs["write_index"]
    out = dict(inputs)
    out.update(input_ids=inputs["input_ids"][:, :1], position_ids=inputs["position_ids"][:, :1],
               kv_length=write + 1, attention_mask=np.ascontiguousarray(inputs["attention_mask"][:, :, :1]),
               logits_index=np.zeros((len(write), 1), np.int64))
    return out


# The tree the verification check scores: a root, two guesses for the next token and one after
# the first (parents by node; every prefix is a tree, for steps of fewer tokens). The check makes
# the path root → 1 → 3 the one greedy acceptance keeps: each token its parent's argmax.
VERIFY_TREE_PARENTS = (-1, 0, 0, 1)
VERIFY_ACCEPTED = (1, 3)


def verify_inputs(inputs: dict[str, np.ndarray], run: Callable[[dict], dict]) -> dict[str, np.ndarray]:
    """The seeded step's row with cached K/V, its tokens scored as a Medusa tree: positions by
    depth, each node sees the cache and its ancestors, logits at every node (one row: the CPU
    verification graph's batch). ``run`` (the rank graph) picks the accepted path's tokens."""
    row = slice(1, 2)
    out = {name: np.ascontiguousarray(value[row]) for name, value in inputs.items()}
    seq, start = out["input_ids"].shape[1], int(out["write_index"][0])
    parents = VERIFY_TREE_PARENTS[:seq]
    depths, ancestors = np.zeros(seq, np.int32), np.eye(seq, dtype=bool)  # [T], [T, T]
    for node in range(1, seq):
        depths[node] = depths[parents[node]] + 1
        ancestors[node] |= ancestors[parents[node]]
    out["position_ids"] = (start + depths)[None, :]
    out["attention_mask"][0, 0, :, start:start + seq] = ancestors
    out["logits_index"] = np.arange(seq, dtype=np.int64)[None, :]
    ids = out["input_ids"][0]
    for node in (n for n in VERIFY_ACCEPTED if n < seq):
        ids[node] = int(np.argmax(run(out)["logits"][0, parents[node]]))
    for node in range(1, seq):  # siblings hold distinct tokens, as top-k guesses do
        while any(ids[other] == ids[node] for other in range(1, node) if parents[other] == parents[node]):
            ids[node] += 1
    return out


def greedy_path_end(inputs: dict[str, np.ndarray], logits: np.ndarray) -> int:
    """The last node greedy acceptance keeps on verify_inputs' tree, from logits [1, T, V]."""
    return int(greedy_path_ends(inputs, logits)[0])


def greedy_path_ends(inputs: dict[str, np.ndarray], logits: np.ndarray) -> np.ndarray:
    """Each row's deepest logits row that greedy acceptance keeps (builder/passes/heads_at_path_end),
    walked down the tree the step's mask draws: from row 0, to the row whose parent (the latest
    row before it that it sees) is the current one and whose token is the current one's argmax.
    logits [B, R, V] → [B]."""
    index, ids, mask = inputs["logits_index"], inputs["input_ids"], inputs["attention_mask"][:, 0]
    ends = np.zeros(len(index), np.int64)
    for b, rows in enumerate(index):
        start, count = int(inputs["write_index"][b]), int(inputs["kv_length"][b] - inputs["write_index"][b])
        sees = mask[b][rows][:, start + rows]  # [R, R]
        parent = [max((j for j in range(i) if sees[i, j]), default=-1) for i in range(len(rows))]
        node = 0
        while True:
            target = int(np.argmax(logits[b, node]))
            node = next((c for c in range(len(rows)) if parent[c] == node and rows[c] < count
                         and ids[b, rows[c]] == target), None)
            if node is None:
                break
            ends[b] = node
    return ends


def run_torch(step: torch.nn.Module, inputs: dict[str, np.ndarray], output_names: list[str]) -> dict[str, np.ndarray]:
    args = [torch.from_numpy(np.ascontiguousarray(v)) for v in inputs.values()]
    with torch.no_grad():
        outputs = step(*args)
    return {name: out.float().numpy() for name, out in zip(output_names, outputs)}


class DroppedOutput(ValueError):
    """A graph lacks an output its reference has and the graph before it produced."""


def compare(actual: dict[str, np.ndarray], reference: dict[str, np.ndarray],
            not_yet: frozenset[str] = frozenset()) -> dict[str, Stats]:
    """Stats per output of ``reference``. ``not_yet``: outputs the graph does not make yet
    (medusa_logits before attach_medusa), skipped; any other the graph lacks was dropped."""
    dropped = sorted(name for name in reference if name not in actual and name not in not_yet)
    if dropped:
        raise DroppedOutput(f"the graph lost the output(s) {', '.join(dropped)}")
    out = {}
    for name, ref in reference.items():
        if name not in actual:
            continue
        got = actual[name].astype(np.float64)
        ref = ref.astype(np.float64)
        diff = float(np.max(np.abs(got - ref))) if ref.size else 0.0
        scale = float(np.max(np.abs(ref))) if ref.size else 0.0
        out[name] = Stats(max_abs=diff, max_rel=diff / scale if scale else diff)
    return out


def worst(stats: dict[str, Stats]) -> dict:
    """The worst output by max_abs, as a log record."""
    name, stat = max(stats.items(), key=lambda kv: kv[1].max_abs)
    return {"output": name, **asdict(stat)}

"""``trtbuild plan``: memory and roofline figures for a model on a GPU, before building.

Every figure is arithmetic on the checkpoint's config.json and the GPU table
(builder/data/gpus.json); nothing is loaded or run. Conventions:
- weights: builder/plan/model_size.py (embeddings stay 16-bit in every mode; scales added);
- compute: int8 and int4 are weight-only (GEMMs in 16-bit after dequantization), w8a8 runs int8
  GEMMs, fp8 and fp4 their own tensor cores where the GPU has them;
- KV cache in the engine's dtype (16-bit; 32-bit for float32 specs);
- decode reads every weight once per step (shared by the batch) and each sequence's KV at a
  mean context of half of max_seq_len (a sequence grows to it); the floor time is the larger
  of bytes / bandwidth and FLOPs / peak;
- a rank fits when weights + its KV heads' cache + workspace ≤ 90 % of its memory; a GPU count
  is considered only where the spec would accept it as parallel.tensor.
"""
from __future__ import annotations

from dataclasses import dataclass

from ...contract.kv_budget import (DEFAULT_BLOCK_SIZE, KvBudget, blocks_for_tokens, budget_bytes,
                                   num_blocks)
from ...contract.medusa_acceptance import MIN_GAIN, best_tree_prefix, expected_accepted, path_probability
from ..sharding import kv_heads_per_rank
from ..frontend.checkpoint import ArchConfig
from ..gpus import GB, Gpu, find_gpu, gpu_table  # noqa: F401  (find_gpu, gpu_table: the plan API)
from .build_cost import BuildPlan, medusa_heads_bytes, medusa_shares_lm_head
from .model_size import PRECISIONS, ParamCounts, kv_bytes_per_token, weight_bytes
from ..spec.checks import tensor_parallel_ok

HEADROOM = 0.9


@dataclass(frozen=True)
class Workload:
    max_batch: int
    max_seq_len: int
    max_input_len: int
    kv_element_bytes: int
    prefix_cache: bool
    kv_budget: KvBudget | None = None   # runtime.kv_cache_memory (None: every row's whole context)
    kv_block_size: int = DEFAULT_BLOCK_SIZE


TYPICAL_TREE = 8  # tokens per Medusa verification when no heads are given (the advice's example)

@dataclass(frozen=True)
class MedusaPlan:
    """The spec's heads and tree, with the heads' per-rank accuracy (the runtime's prior)."""
    num_heads: int
    num_layers: int
    choices: tuple[tuple[int, ...], ...]
    rank_accuracy: list[list[float]]
    shares_lm_head: bool = False  # the heads' projections are the LM head's weight (build_cost.medusa_shares_lm_head)
    element_bytes: int = 2        # the spec's float dtype: the heads' constants are never quantized

    def expected_accepted(self) -> list[float]:
        """Expected accepted guesses with the first n choices, n = 0..N (paths' products of accuracy)."""
        return expected_accepted([path_probability(path, self.rank_accuracy) for path in self.choices])


@dataclass(frozen=True)
class SpeculationPlan:
    """The spec's draft sources (their order: the default a request gets) and the largest
    verification S the engine is built for."""
    sources: tuple[str, ...]
    verify_tokens: int


@dataclass(frozen=True)
class Plan:
    arch: ArchConfig
    gpu: Gpu
    gpus: int
    tp: int
    precision: str
    workload: Workload
    counts: ParamCounts
    medusa: MedusaPlan | None = None
    speculation: SpeculationPlan | None = None
    backend: str | None = None        # the spec's build.backend (None: planning a bare checkpoint)
    targets: tuple[str, ...] = ()     # the spec's build.targets
    draft_bytes: int = 0              # the spec's draft head in the engine dir (build_cost.draft_head_bytes)

    # -- memory ------------------------------------------------------------------------------
    def weights(self, precision: str | None = None) -> float:
        return weight_bytes(self.counts, precision or self.precision)

    @property
    def kv_per_token(self) -> int:
        return kv_bytes_per_token(self.arch, self.workload.kv_element_bytes)

    @property
    def kv_total(self) -> float:
        return self.kv_per_token * self.workload.max_batch * self.workload.max_seq_len

    @property
    def workspace(self) -> float:
        w, a = self.workload, self.arch
        tokens = w.max_batch * w.max_input_len
        return tokens * (4 * a.hidden_size + 2 * a.intermediate_size) * 2 + w.max_batch * a.vocab_size * 4

    def kv_share(self, tp: int) -> float:
        """The share of the model's KV heads a rank holds: split, or replicated where N exceeds them."""
        return kv_heads_per_rank(tp, self.arch.num_kv_heads) / self.arch.num_kv_heads

    def per_rank(self, precision: str | None = None, tp: int | None = None) -> float:
        tp = tp or self.tp
        return self.weights(precision) / tp + self.kv_total * self.kv_share(tp) + self.workspace

    def fits(self, precision: str | None = None, tp: int | None = None) -> bool:
        return self.per_rank(precision, tp) <= HEADROOM * self.gpu.memory_bytes

    # -- the KV budget (runtime.kv_cache_memory) ----------------------------------------------------
    @property
    def kv_per_token_rank(self) -> float:
        return self.kv_per_token * self.kv_share(self.tp)

    @property
    def kv_free_at_load(self) -> float:
        """What a rank has free once its weights and workspace are loaded (within the headroom):
        what a share-of-free-memory budget is a share of."""
        return HEADROOM * self.gpu.memory_bytes - self.weights() / self.tp - self.workspace

    @property
    def kv_budget_bytes(self) -> float:
        """One rank's KV budget: the spec's bytes, its share of the memory free at load, or (unset)
        every row's whole context, as slots reserved."""
        budget = self.workload.kv_budget
        if budget is None:
            return self.kv_total * self.kv_share(self.tp)
        return budget_bytes(budget, max(0, int(self.kv_free_at_load)))

    @property
    def kv_blocks(self) -> int:
        return num_blocks(int(self.kv_budget_bytes), self.workload.kv_block_size, int(self.kv_per_token_rank))

    def requests_in_budget(self, tokens: int) -> tuple[int, int]:
        """(paged, slots): how many requests of ``tokens`` positions the budget holds at once when
        blocks are given out as tokens arrive, and when each request reserves max_seq_len."""
        paged = self.kv_blocks // blocks_for_tokens(tokens, self.workload.kv_block_size)
        slots = int(self.kv_budget_bytes // (self.workload.max_seq_len * self.kv_per_token_rank))
        return paged, slots

    def min_gpus(self, precision: str) -> int | None:
        """Fewest GPUs (a tensor parallelism the spec accepts, up to 64) whose ranks fit."""
        return next((n for n in range(1, 65) if tensor_parallel_ok(self.arch, n) and self.fits(precision, n)), None)

    # -- roofline -------------------------------------------------------------------------------
    @property
    def prefill_flops_per_token(self) -> float:
        """2 FLOPs per matmul parameter; attention adds attention_flops_per_context_token × context."""
        return 2.0 * self.counts.matmul

    @property
    def attention_flops_per_context_token(self) -> float:
        return 4.0 * self.arch.num_layers * self.arch.num_heads * self.arch.head_dim

    @property
    def mean_context(self) -> int:
        return self.workload.max_seq_len // 2

    def decode_bytes(self, batch: int) -> float:
        """Bytes one decode step reads on one rank: its weights once, each sequence's KV heads."""
        return self.weights() / self.tp + batch * self.mean_context * self.kv_per_token * self.kv_share(self.tp)

    def decode_flops(self, batch: int) -> float:
        per_token = self.prefill_flops_per_token + self.attention_flops_per_context_token * self.mean_context
        return batch * per_token / self.tp

    def decode_floor_s(self, batch: int) -> float:
        peak = self.gpu.peak_flops(self.precision)
        return max(self.decode_bytes(batch) / self.gpu.bandwidth, self.decode_flops(batch) / peak)

    # -- tensor-parallel communication ---------------------------------------------------------
    def allreduce_bytes(self, batch: int) -> int:
        """Activations all-reduced per decode step: 2 per layer (after o_proj and down_proj) × batch
        × hidden × activation bytes (the KV element size: the model dtype)."""
        return 2 * self.arch.num_layers * batch * self.arch.hidden_size * self.workload.kv_element_bytes

    def comm_s(self, batch: int, tp: int | None = None) -> float:
        """Ring all-reduce floor: each rank sends and receives 2 (N − 1) / N of the bytes over the
        GPU's interconnect (gpus.json; latency per collective not counted)."""
        tp = tp or self.tp
        if tp == 1:
            return 0.0
        link = self.gpu.interconnect["gbps"] * 1e9
        return 2 * (tp - 1) / tp * self.allreduce_bytes(batch) / link

    def weights_floor_s(self) -> float:
        """Batch-1 decode floor: streaming this rank's weights once at peak bandwidth."""
        return self.weights() / self.tp / self.gpu.bandwidth

    def ridge_batch(self) -> int | None:
        """Smallest decode batch whose step is compute-bound, or None if KV reads keep it memory-bound."""
        peak, bw = self.gpu.peak_flops(self.precision), self.gpu.bandwidth
        flops_per_seq = self.decode_flops(1) * self.tp
        kv_per_seq = self.mean_context * self.kv_per_token
        margin = flops_per_seq / peak - kv_per_seq / bw
        if margin <= 0:
            return None
        return max(1, int(-(-(self.weights() / bw) // margin)))

    def prefill_compute_bound_from(self) -> int:
        """Tokens per step from which prefill is compute-bound (weights amortized over the chunk)."""
        peak, bw = self.gpu.peak_flops(self.precision), self.gpu.bandwidth
        return max(1, int(self.weights() / bw * peak / self.prefill_flops_per_token) + 1)

    def prefill_s(self, tokens: int) -> float:
        peak = self.gpu.peak_flops(self.precision)
        flops = tokens * self.prefill_flops_per_token + self.attention_flops_per_context_token * tokens * tokens / 2
        return max(flops / peak, self.weights() / self.gpu.bandwidth) / self.tp

    # -- Medusa -------------------------------------------------------------------------------
    def medusa_params(self) -> int:
        m, a = self.medusa, self.arch
        return m.num_heads * (m.num_layers * (a.hidden_size ** 2 + a.hidden_size) + a.hidden_size * a.vocab_size)

    def verify_floor_s(self, batch: int, tokens: int) -> float:
        """Roofline of a step scoring ``tokens`` per row with logits and head logits at each:
        weights (and heads) read once, KV per sequence, FLOPs for batch × tokens."""
        peak = self.gpu.peak_flops(self.precision)
        heads = self.medusa_params() if self.medusa else 0
        head_bytes = heads * self.weights() / max(1, self.counts.total)
        read = (self.weights() + head_bytes + batch * self.mean_context * self.kv_per_token) / self.tp
        per_token = (self.prefill_flops_per_token + 2.0 * heads
                     + self.attention_flops_per_context_token * self.mean_context)
        return max(read / self.gpu.bandwidth, batch * tokens * per_token / self.tp / peak)

    def tree_cost(self, batch: int, tokens: int = TYPICAL_TREE) -> float:
        """How many plain decode steps' time a verification of ``tokens`` per row costs."""
        return self.verify_floor_s(batch, tokens) / self.verify_floor_s(batch, 1)

    def medusa_choice(self, batch: int) -> tuple[int, float, float]:
        """(tree choices, expected tokens per step, predicted decode speed-up) that maximise
        tokens per second at ``batch`` — the runtime's rule, with roofline step times."""
        expected = self.medusa.expected_accepted()
        best, speedup = best_tree_prefix(expected, lambda tokens: self.verify_floor_s(batch, tokens))
        return best, 1 + expected[best], speedup

    def verification(self, batch: int) -> tuple[float, float]:
        """(cost of the spec's largest verification in plain decode steps, accepted guesses per step
        at which it pays by the runtime's MIN_GAIN) at ``batch``: what any draft source must reach."""
        cost = self.tree_cost(batch, self.speculation.verify_tokens)
        return cost, MIN_GAIN * cost - 1

    def build_side(self) -> BuildPlan:
        """RAM per process, engine-dir disk and time of building this plan (builder/plan/build_cost.py)."""
        m, a = self.medusa, self.arch
        heads = 0
        if m is not None:  # in the plan's float precision, or under a quantized one the spec's dtype
            float_bytes = {"fp32": 4, "fp16": 2, "bf16": 2}.get(self.precision, m.element_bytes)
            heads = medusa_heads_bytes(m.num_heads, m.num_layers, a.hidden_size, a.vocab_size, self.tp, float_bytes,
                                       m.shares_lm_head)
        return BuildPlan(parameters=self.counts.total, model_bytes=self.weights(), tp=self.tp, cpu_graphs=True,
                         export_bytes=self.weights() if self.precision == "fp32" else 2.0 * self.counts.total,
                         draft_bytes=self.draft_bytes,
                         medusa_bytes=heads, medusa_ranks=self.tp)

    def as_dict(self) -> dict:
        return {
            "model": self.arch.architecture, "gpu": self.gpu.name, "gpus": self.gpus, "tp": self.tp,
            "precision": self.precision, "parameters": self.counts.total,
            "weight_bytes": {p: round(self.weights(p)) for p in PRECISIONS},
            "kv_bytes_per_token": self.kv_per_token, "kv_bytes_total": round(self.kv_total),
            "workspace_bytes": round(self.workspace),
            "kv_budget": {"bytes_per_rank": round(self.kv_budget_bytes), "block_size": self.workload.kv_block_size,
                          "blocks": self.kv_blocks,
                          "requests": {str(n): dict(zip(("paged", "slots"), self.requests_in_budget(n)))
                                       for n in typical_lengths(self.workload.max_seq_len)}},
            "per_rank_bytes": {p: round(self.per_rank(p)) for p in PRECISIONS},
            "fits": {p: self.fits(p) for p in PRECISIONS},
            "min_gpus": {p: self.min_gpus(p) for p in PRECISIONS},
            "prefill_flops_per_token": self.prefill_flops_per_token,
            "attention_flops_per_context_token": self.attention_flops_per_context_token,
            "decode_bytes_per_token_batch1": round(self.decode_bytes(1)),
            "weights_read_ms": round(self.weights_floor_s() * 1e3, 4),
            "decode_floor_ms": round(self.decode_floor_s(1) * 1e3, 4),
            "allreduce_bytes_per_decode_step_batch1": self.allreduce_bytes(1),
            "allreduce_ms_batch1": round(self.comm_s(1) * 1e3, 4),
            "allreduce_ms_max_batch": round(self.comm_s(self.workload.max_batch) * 1e3, 4),
            "decode_floor_ms_max_batch": round(self.decode_floor_s(self.workload.max_batch) * 1e3, 4),
            "ridge_batch": self.ridge_batch(),
            "prefill_compute_bound_from_tokens": self.prefill_compute_bound_from(),
            "workload": self.workload.__dict__,
            "build": self.build_side().as_dict(),
            "medusa": None if self.medusa is None else {
                str(b): dict(zip(("tree_choices", "tokens_per_step", "speedup"),
                                 (lambda c: (c[0], round(c[1], 3), round(c[2], 3)))(self.medusa_choice(b))))
                for b in sorted({1, self.workload.max_batch})},
            "speculation": None if self.speculation is None else {
                "sources": list(self.speculation.sources), "verify_tokens": self.speculation.verify_tokens,
                "verification": {str(b): dict(zip(("cost_in_decode_steps", "pays_above_accepted"),
                                                  (round(v, 3) for v in self.verification(b))))
                                 for b in sorted({1, self.workload.max_batch})}},
        }


def medusa_plan(spec) -> MedusaPlan:
    m = spec.medusa
    return MedusaPlan(num_heads=m.num_heads, num_layers=m.num_layers, choices=m.choices,
                      rank_accuracy=m.rank_accuracy, shares_lm_head=medusa_shares_lm_head(spec),
                      element_bytes=spec.model.dtype.numpy.itemsize)


def speculation_plan(spec) -> SpeculationPlan:
    config = spec.speculation
    return SpeculationPlan(sources=tuple(source.value for source in config.sources),
                           verify_tokens=config.verify_tokens)


def typical_lengths(max_seq_len: int) -> list[int]:
    """Request lengths (prompt + output) the plan's KV table shows: short chat to the limit."""
    return sorted({n for n in (512, 2048, 8192) if n < max_seq_len} | {max_seq_len})


def workload_for(spec=None, arch: ArchConfig | None = None, batch: int | None = None,
                 seq_len: int | None = None, precision: str = "fp16", kv_budget: KvBudget | None = None) -> Workload:
    """The spec's limits, or for a bare checkpoint one sequence of its full context; ``kv_budget``
    (--kv-cache-memory) overrides the spec's runtime.kv_cache_memory."""
    kv_bytes = 4 if precision == "fp32" else 2
    if spec is not None:
        b, r = spec.build, spec.runtime
        return Workload(max_batch=batch or b.max_batch_size, max_seq_len=seq_len or b.max_seq_len,
                        max_input_len=min(b.max_input_len, seq_len or b.max_seq_len), kv_element_bytes=kv_bytes,
                        prefix_cache=r.prefix_cache, kv_budget=kv_budget if kv_budget is not None else r.kv_cache_memory,
                        kv_block_size=r.kv_block_size)
    seq = seq_len or arch.max_position_embeddings
    return Workload(max_batch=batch or 1, max_seq_len=seq, max_input_len=min(512, seq), kv_element_bytes=kv_bytes,
                    prefix_cache=True, kv_budget=kv_budget)



"""``trtbuild plan``'s pipeline side: T × P ranks (P stages of contiguous layers, each split over
T tensor ranks) laid out over nodes of ``Gpu.node_gpus``, rank = stage · T + tensor rank.

Conventions, beyond builder/plan/estimate.py's:
- layers are split as the build splits them (contract/pipeline.py: the spec's
  ``parallel.layers_per_stage`` where it gives one for this P, else balanced); the embedding
  lives on the first stage (replicated over its tensor ranks, as sharding leaves it), the final
  norm and lm_head on the last (vocab-parallel); a tied table is held by both;
- between stages every tensor rank sends its copy of the hidden states [B, S, D] (model dtype) to
  the same tensor rank of the next stage: over NVLink inside a node, over the network (one NIC
  per GPU, builder/data/gpus.json) between nodes; a hop costs latency + bytes / bandwidth;
- bubble: the runtime (runtime/parallel/pipeline_parallel.py) splits each step's rows into M micro-batches
  that follow each other through the stages, and the pipeline fills and drains within every step
  (rank 0 samples before the next one starts), so each stage idles (P − 1) / (M + P − 1) of a step.
  Without micro-batching M = 1; with it, M = min(batch, P) (each micro-batch holds ≥ 1 sequence).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from ...contract.pipeline import balanced_layers
from ..gpus import GB, Network
from .estimate import Plan
from ..spec.checks import tensor_parallel_ok


@dataclass(frozen=True)
class PipelinePlan:
    plan: Plan          # the model, GPU, precision, workload and T (plan.tp)
    pp: int
    network: Network
    layers_per_stage: tuple[int, ...] = ()  # the spec's split; () balances the layers

    def __post_init__(self):
        if self.layers_per_stage and (len(self.layers_per_stage) != self.pp
                                      or sum(self.layers_per_stage) != self.plan.arch.num_layers):
            raise ValueError(f"layers_per_stage {list(self.layers_per_stage)}: {self.pp} stages summing to "
                             f"{self.plan.arch.num_layers} layers")

    @property
    def tp(self) -> int:
        return self.plan.tp

    @property
    def layers(self) -> tuple[int, ...]:
        return self.layers_per_stage or balanced_layers(self.plan.arch.num_layers, self.pp)

    @property
    def nodes(self) -> int:
        return -(-self.tp * self.pp // self.plan.gpu.node_gpus)

    # -- memory per rank of each stage ---------------------------------------------------------
    @property
    def _element(self) -> int:
        return 4 if self.plan.precision == "fp32" else 2  # embeddings and norms stay 16-bit (32 for fp32)

    @property
    def embedding_bytes(self) -> float:
        return self._element * self.plan.counts.embedding

    @property
    def head_bytes(self) -> float:
        counts = self.plan.counts
        return self._element * (counts.head or counts.embedding)

    @property
    def layer_bytes(self) -> float:
        """One decoder layer's weights (all tensor ranks together), at the plan's precision."""
        counts, a = self.plan.counts, self.plan.arch
        untied_head = self._element * counts.head
        return (self.plan.weights() - self.embedding_bytes - untied_head - self._element * a.hidden_size) / a.num_layers

    def stage_weights(self, stage: int) -> float:
        """Weight bytes one tensor rank of ``stage`` holds."""
        weights = self.layers[stage] * self.layer_bytes / self.tp
        if stage == 0:
            weights += self.embedding_bytes
        if stage == self.pp - 1:
            weights += self.head_bytes / self.tp + self._element * self.plan.arch.hidden_size
        return weights

    def stage_kv(self, stage: int) -> float:
        return self.plan.kv_total * self.layers[stage] / self.plan.arch.num_layers * self.plan.kv_share(self.tp)

    def stage_rank_bytes(self, stage: int) -> float:
        return self.stage_weights(stage) + self.stage_kv(stage) + self.plan.workspace

    def fits(self) -> bool:
        limit = 0.9 * self.plan.gpu.memory_bytes
        return all(self.stage_rank_bytes(s) <= limit for s in range(self.pp))

    # -- activations between stages -----------------------------------------------------------
    def activation_bytes(self, batch: int, tokens: int) -> int:
        """Bytes one tensor rank sends at one stage boundary: hidden states [B, S, D]."""
        return batch * tokens * self.plan.arch.hidden_size * self.plan.workload.kv_element_bytes

    def crosses_node(self, boundary: int) -> bool:
        """Whether the hand-off from stage ``boundary`` to ``boundary + 1`` leaves a node."""
        node = self.plan.gpu.node_gpus
        return (boundary * self.tp + self.tp - 1) // node != ((boundary + 1) * self.tp) // node

    def hop_s(self, batch: int, tokens: int, boundary: int) -> float:
        size = self.activation_bytes(batch, tokens)
        if self.crosses_node(boundary):
            return self.network.latency_s + size / self.network.bandwidth
        return size / (self.plan.gpu.interconnect["gbps"] * GB)

    def network_bytes_per_step(self, batch: int, tokens: int) -> int:
        """Bytes a step sends over the network between nodes, all tensor ranks together."""
        crossings = sum(self.crosses_node(b) for b in range(self.pp - 1))
        return crossings * self.tp * self.activation_bytes(batch, tokens)

    def stage_decode_floor_s(self, stage: int, batch: int) -> float:
        """Roofline of one stage's share of a decode step: its weights and KV read once."""
        p = self.plan
        read = self.stage_weights(stage) + batch * p.mean_context * p.kv_per_token * p.kv_share(self.tp) \
            * self.layers[stage] / p.arch.num_layers
        flops = p.decode_flops(batch) * p.tp / self.tp * self.layers[stage] / p.arch.num_layers
        return max(read / p.gpu.bandwidth, flops / p.gpu.peak_flops(p.precision))

    def decode_latency_s(self, batch: int) -> float:
        """One token of one sequence through every stage and hop (what pipelining adds to a step)."""
        return sum(self.stage_decode_floor_s(s, batch) for s in range(self.pp)) + \
            sum(self.hop_s(batch, 1, b) for b in range(self.pp - 1))

    def bubble(self, batch: int, micro_batching: bool) -> float:
        micro = min(batch, self.pp) if micro_batching else 1
        return (self.pp - 1) / (micro + self.pp - 1)

    def as_dict(self) -> dict:
        batch = self.plan.workload.max_batch
        return {
            "tp": self.tp, "pp": self.pp, "ranks": self.tp * self.pp, "nodes": self.nodes,
            "node_gpus": self.plan.gpu.node_gpus, "network": self.network.kind,
            "stages": [{"stage": s, "layers": self.layers[s], "weights_bytes_per_rank": round(self.stage_weights(s)),
                        "kv_bytes_per_rank": round(self.stage_kv(s)), "per_rank_bytes": round(self.stage_rank_bytes(s)),
                        "decode_floor_ms": round(self.stage_decode_floor_s(s, batch) * 1e3, 4)}
                       for s in range(self.pp)],
            "fits": self.fits(),
            "activation_bytes_per_hop_decode": self.activation_bytes(batch, 1),
            "activation_bytes_per_hop_prefill": self.activation_bytes(batch, self.plan.workload.max_input_len),
            "network_bytes_per_decode_step": self.network_bytes_per_step(batch, 1),
            "decode_latency_ms": round(self.decode_latency_s(batch) * 1e3, 4),
            "bubble": {"without_micro_batching": round(self.bubble(batch, False), 4),
                       "with_micro_batching": round(self.bubble(batch, True), 4)},
        }


def recommend_layout(plan: Plan, network: Network) -> PipelinePlan | None:
    """The T × P layout that fits on the fewest nodes, tensor parallelism kept inside a node
    (T ≤ node_gpus, a T the spec accepts) and stages across nodes: then the fewest stages (each
    adds a hop and a bubble to every step), then the smallest T. None if nothing up to 64 nodes fits."""
    arch, node = plan.arch, plan.gpu.node_gpus
    best = None
    for tp in (t for t in range(1, node + 1) if tensor_parallel_ok(arch, t)):
        for pp in range(1, min(arch.num_layers, 64 * node // tp) + 1):
            candidate = PipelinePlan(replace(plan, tp=tp, gpus=tp * pp), pp, network)
            if candidate.fits():
                if best is None or (candidate.nodes, pp, tp) < (best.nodes, best.pp, best.tp):
                    best = candidate
                break
    return best

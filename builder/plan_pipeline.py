"""``trtbuild plan``'s pipeline side: T GPUs per stage inside a node, P stages on P nodes.

Arithmetic on plan.py's figures. A stage holds its layers' weights (balanced by layer count,
contract.pipeline), the embedding on the first stage, the final norm and lm_head on the last
(a tied lm_head reads the embedding table, so with P > 1 both ends hold it); its T ranks split
them as tensor parallelism does. Per decode step each stage boundary carries the batch's
hidden states [B, 1, D] in the activation dtype over the network between nodes, where tensor
parallelism across the same nodes would all-reduce 2 × layers of them. With M = min(P, B)
micro-batches a step keeps each stage idle (P − 1) / (M + P − 1) of the time (the bubble).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..contract.pipeline import balanced_layers, stage_layers
from .gpus import GB, Network
from .plan import HEADROOM, ParamCounts, Plan, weight_bytes
from .progress import table
from .spec_checks import tensor_parallel_ok


@dataclass(frozen=True)
class PipelinePlan:
    plan: Plan            # its tp: the tensor ranks of each stage
    pp: int
    network: Network
    gpus_per_node: int

    @property
    def stages(self) -> tuple[range, ...]:
        return stage_layers(balanced_layers(self.plan.arch.num_layers, self.pp))

    def stage_counts(self, stage: int, pp: int | None = None) -> ParamCounts:
        pp = pp or self.pp
        c, layers = self.plan.counts, stage_layers(balanced_layers(self.plan.arch.num_layers, pp))[stage]
        share = len(layers) / self.plan.arch.num_layers
        first, last = stage == 0, stage == pp - 1
        head = (c.head if c.head or first else c.embedding) if last else 0
        return ParamCounts(embedding=c.embedding if first else 0, head=head, linear=round(c.linear * share),
                           other=round(c.other * share), linear_rows=round(c.linear_rows * share))

    def per_rank(self, stage: int, precision: str | None = None, tp: int | None = None, pp: int | None = None) -> float:
        """Weights of the stage / T + its layers' share of the KV cache on one rank + workspace."""
        p, tp, pp = self.plan, tp or self.plan.tp, pp or self.pp
        share = len(stage_layers(balanced_layers(p.arch.num_layers, pp))[stage]) / p.arch.num_layers
        return (weight_bytes(self.stage_counts(stage, pp), precision or p.precision) / tp
                + p.kv_total * share * p.kv_share(tp) + p.workspace)

    def fits(self, precision: str | None = None, tp: int | None = None, pp: int | None = None) -> bool:
        pp = pp or self.pp
        return all(self.per_rank(s, precision, tp, pp) <= HEADROOM * self.plan.gpu.memory_bytes for s in range(pp))

    def handoff_bytes(self, batch: int) -> int:
        """Hidden states one stage boundary carries per decode step."""
        return batch * self.plan.arch.hidden_size * self.plan.workload.kv_element_bytes

    def handoff_s(self, batch: int) -> float:
        """Every boundary of a decode step in turn, over the network (latency not counted)."""
        return (self.pp - 1) * self.handoff_bytes(batch) / self.network.bandwidth

    def bubble(self, batch: int) -> float:
        micro = min(self.pp, batch)
        return (self.pp - 1) / (micro + self.pp - 1)

    def recommendation(self, precision: str | None = None) -> tuple[int, int] | None:
        """T × P for this GPU: one node (P = 1) at the smallest T that fits, else the largest valid T
        of a node and the fewest stages (nodes) whose ranks fit; None if no P up to the layer count does."""
        arch, precision = self.plan.arch, precision or self.plan.precision
        valid = [t for t in range(1, self.gpus_per_node + 1) if tensor_parallel_ok(arch, t)]
        one_node = next((t for t in valid if self.plan.fits(precision, t)), None)
        if one_node is not None:
            return one_node, 1
        tp = valid[-1]
        pp = next((p for p in range(2, arch.num_layers + 1) if self.fits(precision, tp, p)), None)
        return None if pp is None else (tp, pp)

    def as_dict(self) -> dict:
        b = self.plan.workload.max_batch
        best = self.recommendation()
        return {"tp": self.plan.tp, "pp": self.pp, "gpus_per_node": self.gpus_per_node, "network": self.network.name,
                "stages": [[s.start, s.stop] for s in self.stages],
                "per_rank_bytes": [round(self.per_rank(s)) for s in range(self.pp)], "fits": self.fits(),
                "handoff_bytes_per_boundary_batch1": self.handoff_bytes(1),
                "handoff_ms_per_step": {str(batch): round(self.handoff_s(batch) * 1e3, 4) for batch in sorted({1, b})},
                "bubble": {str(batch): round(self.bubble(batch), 4) for batch in sorted({1, b})},
                "recommended": None if best is None else {"tp": best[0], "pp": best[1]}}


def render_pipeline(pipe: PipelinePlan) -> list[str]:
    p, n = pipe.plan, pipe.network
    b = p.workload.max_batch
    lines = [f"pipeline (T × P = {p.tp} × {pipe.pp}: {p.tp} GPU(s) per stage, a stage per node of "
             f"{pipe.gpus_per_node} × {p.gpu.name}; stage boundaries over {n.kind}, {n.bandwidth / GB:.1f} GB/s)"]
    rows = [[s, f"{layers.start}–{layers.stop - 1}",
             f"{weight_bytes(pipe.stage_counts(s), p.precision) / p.tp / GB:.2f}", f"{pipe.per_rank(s) / GB:.2f}",
             "yes" if pipe.per_rank(s) <= HEADROOM * p.gpu.memory_bytes else "no"]
            for s, layers in enumerate(pipe.stages)]
    lines += ["  " + line for line in table(rows, ["stage", "layers", "weights/rank GB", "per rank GB", "fits"]).splitlines()]
    across = p.allreduce_bytes(1)
    at_b = f" ({pipe.handoff_bytes(b) / 1e3:.1f} kB at batch {b})" if b > 1 else ""
    lines.append(f"  hand-off per decode step: {pipe.handoff_bytes(1) / 1e3:.1f} kB per boundary at batch 1{at_b}; "
                 f"{pipe.handoff_s(b) * 1e6:.1f} µs per step over "
                 f"{pipe.pp - 1} boundar{'y' if pipe.pp == 2 else 'ies'} at batch {b}; tensor parallelism across the "
                 f"same nodes would all-reduce {across / 1e3:.1f} kB per step at batch 1 "
                 f"({across // max(1, pipe.handoff_bytes(1))}× the hand-off)")
    lines.append(f"  bubble: {100 * pipe.bubble(1):.0f} % of each stage's time at batch 1"
                 + (f", {100 * pipe.bubble(b):.0f} % at batch {b}" if b > 1 else "")
                 + " (min(P, batch) micro-batches per step)")
    best = pipe.recommendation()
    lines.append("  recommended: " + ("no T × P up to the layer count fits" if best is None else
                                      f"T × P = {best[0]} × {best[1]}" + (" (one node)" if best[1] == 1 else
                                                                         f" ({best[1]} nodes of {pipe.gpus_per_node})")))
    lines.append(f"  network figure: {n.source}")
    return lines

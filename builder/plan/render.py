"""``trtbuild plan``'s text output."""
from __future__ import annotations

from ..gpus import GB
from .estimate import Plan, typical_lengths
from .model_size import PRECISIONS
from .advice import deployment, recommendations
from ..progress import table


def _regime(plan: Plan) -> str:
    ridge, batch = plan.ridge_batch(), plan.workload.max_batch
    if ridge is None:
        return "decode is bandwidth-bound at every batch size (each sequence's KV reads grow with the batch)"
    if batch < ridge:
        return f"decode is bandwidth-bound at batch {batch}; it turns compute-bound from batch {ridge}"
    return f"decode is compute-bound at batch {batch} (from batch {ridge})"


def render(plan: Plan) -> str:
    a, g, w = plan.arch, plan.gpu, plan.workload
    lines = [
        f"model      {a.architecture}: {plan.counts.total / 1e9:.3f} B parameters, {a.num_layers} layers, "
        f"hidden {a.hidden_size}, heads {a.num_heads}/{a.num_kv_heads} kv, vocab {a.vocab_size}",
        f"gpu        {plan.gpus} × {g.name} ({g.sm}): {g.memory_bytes / GB:.0f} GB, {g.bandwidth / GB:.0f} GB/s, "
        f"{g.peak_flops(plan.precision) / 1e12:.0f} TFLOP/s {plan.precision}; tensor parallel {plan.tp}",
        f"workload   batch {w.max_batch} × {w.max_seq_len} tokens (prefill chunks ≤ {w.max_input_len})",
        f"engines    {deployment(plan)}",
        *([f"note       {g.name} has no {plan.precision} tensor cores; compute figures use its fp16 peak"]
          if not g.supports(plan.precision) else []),
        "",
        "memory (per rank: weights/tp + its KV heads' cache + workspace; fits = within 90 % of the GPU)",
    ]
    rows = [[p, f"{plan.weights(p) / GB:.2f}", f"{plan.per_rank(p) / GB:.2f}", "yes" if plan.fits(p) else "no",
             str(plan.min_gpus(p) or "> 64")] for p in PRECISIONS]
    lines += ["  " + line for line in table(rows, ["precision", "weights GB", "per rank GB", "fits", "min GPUs"]).splitlines()]
    lines += [
        f"KV cache: {plan.kv_per_token / 1024:.1f} KiB per token; {plan.kv_total / GB:.2f} GB for "
        f"{w.max_batch} × {w.max_seq_len}; workspace ≈ {plan.workspace / GB:.2f} GB",
        *render_kv_budget(plan),
        "",
        "roofline",
        f"  prefill: {plan.prefill_flops_per_token / 1e9:.3f} GFLOP per token (+ "
        f"{plan.attention_flops_per_context_token / 1e6:.3f} MFLOP per context token); compute-bound for "
        f"chunks of ≥ {plan.prefill_compute_bound_from()} tokens",
        f"  decode:  {plan.decode_bytes(1) / GB:.3f} GB read per step at batch 1 (mean context {plan.mean_context}); "
        f"floor {plan.decode_floor_s(1) * 1e3:.3f} ms at batch 1 (weights alone {plan.weights_floor_s() * 1e3:.3f} ms), "
        f"{plan.decode_floor_s(w.max_batch) * 1e3:.3f} ms at batch {w.max_batch}",
        "  " + _regime(plan),
        "",
        "recommendations",
    ]
    lines += [f"  - {r['recommendation']} [{r['figure']}]" for r in recommendations(plan)]
    lines += ["", *render_build(plan.build_side())]
    if plan.medusa is not None:
        lines += ["", f"medusa ({plan.medusa.num_heads} heads, tree of {len(plan.medusa.choices)}; acceptance from "
                      "the heads' held-out accuracy, step times from the roofline)"]
        for batch in sorted({1, w.max_batch}):
            n, tokens, speedup = plan.medusa_choice(batch)
            lines.append(f"  batch {batch}: " + (f"verify {n} guesses per step, {tokens:.2f} tokens/step, "
                                                 f"predicted {speedup:.2f}x decode speed-up" if n else
                                                 "speculation does not pay (a bigger step costs more than it saves)"))
    if plan.speculation is not None:
        spec = plan.speculation
        lines += ["", f"speculation ({', '.join(spec.sources)}; verification S = {spec.verify_tokens}, step times "
                      "from the roofline; the runtime speculates a step only where it pays)"]
        for batch in sorted({1, w.max_batch}):
            cost, needed = plan.verification(batch)
            lines.append(f"  batch {batch}: a verification of {spec.verify_tokens} tokens a row costs {cost:.2f}x a "
                         f"plain decode step; it pays above {needed:.2f} accepted guesses per step")
    return "\n".join(lines)


def render_kv_budget(plan: Plan) -> list[str]:
    """What the KV budget buys on a rank: blocks, and requests of typical lengths at once when blocks
    are given out as tokens arrive, against slots that each reserve max_seq_len."""
    w = plan.workload
    if w.kv_budget is None:
        source = f"unset: {w.max_batch} × {w.max_seq_len} tokens"
    elif isinstance(w.kv_budget, float):
        source = f"{w.kv_budget:g} of the {max(plan.kv_free_at_load, 0) / GB:.2f} GB free at load"
    else:
        source = f"{w.kv_budget} bytes"
    lines = [f"KV budget: {plan.kv_budget_bytes / GB:.2f} GB a rank ({source}) = {plan.kv_blocks} blocks of "
             f"{w.kv_block_size} tokens ({plan.kv_blocks * w.kv_block_size} tokens in flight)"]
    rows = [[str(n), str(paged), str(slots), str(min(paged, w.max_batch))]
            for n in typical_lengths(w.max_seq_len) for paged, slots in [plan.requests_in_budget(n)]]
    lines += ["  " + line for line in table(rows, ["request tokens", "at once (blocks)", "at once (slots)",
                                                   f"rows a step (max_batch_size {w.max_batch})"]).splitlines()]
    return lines


def render_build(b) -> list[str]:
    """The build side (builder/plan/build_cost.py): what building these engines takes on the build machine."""
    seconds = b.seconds
    return [
        f"build (the build machine: {b.tp} rank engine{'s' if b.tp > 1 else ''}, built one process at a time)",
        f"  RAM per process: export, numerics check and passes within {b.stages_peak_bytes / GB:.1f} GB (the bound: "
        f"0.25 × {b.model_bytes / GB:.1f} GB of weights + 1.5 GiB; they stream one tensor at a time); each rank's "
        f"engine ≈ {b.engine_peak_bytes / GB:.1f} GB (0.2 GB + 2 × {b.rank_bytes / GB:.1f} GB); per-process peak "
        f"≤ {b.per_process_peak_bytes / GB:.1f} GB",
        f"  engine dir ≈ {b.dir_bytes / GB:.1f} GB (engines + the CPU graphs' weights"
        f"{' + the draft head' if b.draft_bytes else ''}{' + the Medusa heads' if b.medusa_bytes else ''}); "
        f"free disk at the build's peak ≈ {b.disk_peak_bytes / GB:.1f} GB",
        f"  time on 2 cores ≈ {seconds['export'] / 60:.0f} min export + {seconds['passes'] / 60:.0f} min passes + "
        f"{seconds['engines'] / 60:.0f} min engines (benchmarks/build_scale.py rates)",
    ]


def render_pipeline(pipe, layout) -> list[str]:
    """The pipeline side (builder/plan/pipeline.py): per-stage memory, the hand-offs between
    stages, the bubble; then the T × P layout this model needs on these nodes."""
    p, batch = pipe.plan, pipe.plan.workload.max_batch
    lines = []
    if pipe.pp > 1:
        lines += [f"pipeline ({pipe.tp} × {pipe.pp} = {pipe.tp * pipe.pp} ranks on {pipe.nodes} node"
                  f"{'s' if pipe.nodes > 1 else ''} of {p.gpu.node_gpus} × {p.gpu.name}; between nodes "
                  f"{pipe.network.kind}, {pipe.network.bandwidth / GB:.1f} GB/s per GPU)"]
        rows = [[str(s), str(pipe.layers[s]), f"{pipe.stage_weights(s) / GB:.2f}", f"{pipe.stage_kv(s) / GB:.2f}",
                 f"{pipe.stage_rank_bytes(s) / GB:.2f}", f"{pipe.stage_decode_floor_s(s, batch) * 1e3:.3f}"]
                for s in range(pipe.pp)]
        lines += ["  " + line for line in table(rows, ["stage", "layers", "weights GB/rank", "KV GB/rank",
                                                       "per rank GB", f"decode floor ms (batch {batch})"]).splitlines()]
        decode, prefill = pipe.activation_bytes(batch, 1), pipe.activation_bytes(batch, p.workload.max_input_len)
        crossing = next((b for b in range(pipe.pp - 1) if pipe.crosses_node(b)), None)
        hop = pipe.hop_s(batch, 1, crossing if crossing is not None else 0)
        lines += [
            f"  {'fits' if pipe.fits() else 'does NOT fit'} (each rank within 90 % of {p.gpu.memory_bytes / GB:.0f} GB)",
            f"  hand-off per stage boundary and tensor rank: {decode / 1024:.1f} KiB per decode step, "
            f"{prefill / 1e6:.2f} MB per prefill chunk of {p.workload.max_input_len}; over the network "
            f"{pipe.network_bytes_per_step(batch, 1) / 1024:.1f} KiB per decode step ({hop * 1e6:.1f} µs a hop"
            f"{' between nodes' if crossing is not None else ' inside a node'})",
            f"  a token's latency through the stages ≈ {pipe.decode_latency_s(batch) * 1e3:.3f} ms at batch {batch}; "
            f"bubble {pipe.bubble(batch, False) * 100:.0f} % without micro-batching, "
            f"{pipe.bubble(batch, True) * 100:.0f} % with {min(batch, pipe.pp)} micro-batch"
            f"{'es' if min(batch, pipe.pp) > 1 else ''} in flight",
        ]
    if layout is None:
        lines.append(f"layout: no T × P up to 64 nodes of {p.gpu.node_gpus} × {p.gpu.name} fits at {p.precision}")
    elif layout.pp == 1 and layout.tp <= p.gpu.node_gpus:
        lines.append(f"layout: fits one node at {p.precision}: parallel.tensor {layout.tp}, no pipeline "
                     f"({layout.stage_rank_bytes(0) / GB:.1f} GB per rank)")
    else:
        lines.append(f"layout: {layout.tp} × {layout.pp} at {p.precision} (parallel.tensor {layout.tp} inside "
                     f"each node, parallel.pipeline {layout.pp} across {layout.nodes} node"
                     f"{'s' if layout.nodes > 1 else ''}): the fewest nodes, then stages, whose ranks fit; "
                     f"{max(layout.stage_rank_bytes(s) for s in range(layout.pp)) / GB:.1f} GB on the fullest rank")
    return lines

"""``trtbuild plan``'s recommendations: smallest TP, a quantization that fits, batch regime,
Medusa, whether tensor parallelism pays, prefix caching; each with the figure behind it."""
from __future__ import annotations

from ...contract.gpu_targets import RTX_TARGETS, TENSORRT_ONLY
from ...contract.medusa_acceptance import MIN_GAIN
from ..gpus import GB
from .estimate import TYPICAL_TREE, Plan


def plan_report(plan: Plan) -> dict:
    """The plan's figures with the advice on them (``trtbuild plan --json``)."""
    return {**plan.as_dict(), "deployment": deployment(plan), "recommendations": recommendations(plan)}


def deployment(plan: Plan) -> str:
    """Which engines run on the planned GPU, and whether this spec builds them."""
    g, backend = plan.gpu, plan.backend
    if g.sm in TENSORRT_ONLY:
        if backend == "tensorrt":
            return f"{g.name} ({g.sm}) runs engines TensorRT builds on an {g.sm} GPU: build this spec on one"
        why = {"tensorrt-rtx": "; this spec's backend tensorrt-rtx builds engines it cannot run",
               "auto": "; this spec's backend auto builds TensorRT-RTX engines on a machine without a GPU"}
        return (f"{g.name} ({g.sm}) cannot run TensorRT-RTX engines (its runtime refuses {g.sm}): build with "
                f"build.backend: tensorrt on an {g.sm} GPU" + why.get(backend or "", ""))
    if backend in ("tensorrt-rtx", "auto") and plan.targets and g.sm not in plan.targets:
        return (f"{g.name} ({g.sm}) is not among this spec's build.targets ({', '.join(plan.targets)}): "
                f"add {g.sm}" + ("" if g.sm in RTX_TARGETS else ", or build with backend tensorrt on it"))
    return (f"{g.name} ({g.sm}) runs TensorRT-RTX engines built anywhere (targets including {g.sm}, or "
            f"portable) and TensorRT engines built on an {g.sm} GPU")


def recommendations(self: Plan) -> list[dict]:
    """What to do, each with the figure it rests on."""
    out = []
    fp = self.precision if self.precision in ("fp32", "bf16") else "fp16"
    tp_fp = self.min_gpus(fp)
    out.append(_rec(
        f"smallest tensor parallelism that fits at {fp}: "
        + (f"{tp_fp} × {self.gpu.name}" if tp_fp else f"none up to 64 × {self.gpu.name}"),
        f"{self.per_rank(fp, tp_fp or 64) / GB:.1f} GB per rank of {self.gpu.memory_bytes / GB:.0f} GB"))
    if self.fits(fp, 1):
        out.append(_rec("fits one GPU unquantized: quantize only to speed up bandwidth-bound decode",
                        f"{self.per_rank(fp, 1) / GB:.1f} GB of {self.gpu.memory_bytes / GB:.0f} GB"))
    else:
        one = next((p for p in ("fp8", "int8", "int4") if self.fits(p, 1) and self.gpu.supports(p)), None)
        out.append(_rec(f"quantization that fits one {self.gpu.name}: {one}" if one else
                        f"no quantization fits one {self.gpu.name}; int4 needs {self.min_gpus('int4')}",
                        f"{self.per_rank(one or 'int4', 1) / GB:.1f} GB per GPU"))
    ridge = self.ridge_batch()
    batch = self.workload.max_batch
    if ridge is None:
        out.append(_rec("decode stays bandwidth-bound at every batch size (KV reads grow with the batch)",
                        f"{self.kv_per_token * self.mean_context / 1e6:.1f} MB of KV per sequence per step"))
    else:
        out.append(_rec(f"decode stops being bandwidth-bound at batch {ridge}",
                        f"{self.weights() / GB:.1f} GB of weights per step vs "
                        f"{self.gpu.peak_flops(self.precision) / 1e12:.0f} TFLOP/s"))
    out.append(_medusa(self, batch))
    if self.tp > 1:
        link = self.gpu.interconnect
        one = self.decode_floor_s(batch) * self.tp  # the same work on one rank (roofline ∝ 1/N)
        gain = one - self.decode_floor_s(batch)
        comm = self.comm_s(batch)
        out.append(_rec(
            (f"tensor parallelism {self.tp} costs more in all-reduces than it saves at batch {batch}"
             if comm > gain else f"tensor parallelism {self.tp} pays at batch {batch}: all-reduces cost "
             f"{comm / max(gain, 1e-12) * 100:.0f} % of the step time it saves"),
            f"{self.allreduce_bytes(batch) / 1e6:.2f} MB all-reduced per decode step over {link['kind']} "
            f"({link['gbps']} GB/s): {comm * 1e6:.1f} µs vs {gain * 1e6:.1f} µs saved"))
    saved = self.prefill_s(512)
    out.append(_rec(
        ("prefix caching pays: " if self.workload.prefix_cache else
         "prefix caching is off in the runtime config; turn it on if prompts share prefixes: ")
        + "a cached 512-token prefix skips its prefill", f"{saved * 1e3:.2f} ms of prefill per request"))
    return out


def _medusa(self: Plan, batch: int) -> dict:
    """The runtime's rule (and the tree-size choice's): speculate when expected tokens per step
    over the step's cost beat plain decoding by MIN_GAIN."""
    if self.medusa is not None:
        n, tokens, speedup = self.medusa_choice(batch)
        cost = self.tree_cost(batch, 1 + n) if n else self.tree_cost(batch, 2)
        if n:
            return _rec(f"Medusa helps at max_batch_size {batch}: verify {n} guesses per step for a predicted "
                        f"{speedup:.2f}x decode speed-up", f"{tokens:.2f} tokens per step for {cost:.2f}x a plain "
                        "step's time (roofline, the heads' held-out accuracy)")
        return _rec(f"Medusa does not help at max_batch_size {batch}: no tree of this spec's heads gains "
                    f"{MIN_GAIN:.2f}x", f"even one guess costs {cost:.2f}x a plain step's time")
    tree = TYPICAL_TREE
    cost = self.tree_cost(batch, tree)
    needed = MIN_GAIN * cost - 1  # accepted guesses per step at which a tree of `tree` tokens pays
    if needed >= tree - 1:
        return _rec(f"Medusa does not help at max_batch_size {batch}: scoring a tree costs more than its "
                    "guesses can return", f"a tree of {tree} tokens costs {cost:.2f}x a plain step; it would need "
                    f"{needed:.1f} accepted guesses of {tree - 1}")
    return _rec(f"Medusa can help at max_batch_size {batch} if heads accept ≥ {needed:.2f} guesses per step "
                "(train heads, then plan the spec for the predicted speed-up)",
                f"a tree of {tree} tokens costs {cost:.2f}x a plain step")


def _rec(text: str, figure: str) -> dict:
    return {"recommendation": text, "figure": figure}

"""``trtbuild plan``'s recommendations: smallest TP, a quantization that fits, batch regime,
Medusa, whether tensor parallelism pays, prefix caching; each with the figure behind it."""
from __future__ import annotations

from typing import TYPE_CHECKING

from .gpus import GB

if TYPE_CHECKING:
    from .plan import Plan


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
    bound = ridge is None or batch < ridge
    step = self.decode_floor_s(batch)
    out.append(_rec(
        (f"Medusa helps at max_batch_size {batch}: decode is bandwidth-bound, so scoring a tree of "
         f"candidates costs little more than one token") if bound else
        (f"Medusa does not help at max_batch_size {batch}: decode is compute-bound; keep it for small batches"),
        f"decode floor {step * 1e3:.2f} ms/step at batch {batch}, compute "
        f"{self.decode_flops(batch) / self.gpu.peak_flops(self.precision) * 1e3:.2f} ms of it"))
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


def _rec(text: str, figure: str) -> dict:
    return {"recommendation": text, "figure": figure}

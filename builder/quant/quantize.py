"""Quantize a checkpoint's linear layers as the spec asks, streaming from its weight map.

RTN, FP8 and NVFP4 read one weight at a time; AWQ, GPTQ and SmoothQuant (and any mode given
calibration text, for the output-error report) calibrate one decoder layer at a time
(calibrate.layer_by_layer). Each block's codes, scales and AWQ/SmoothQuant input scales are
written as soon as it is done (store.QuantizedWriter), with each layer's relative weight error
and (when there is calibration data) relative output error on calibration rows: memory holds
one layer's weights and codes, never the model's.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from ...checkpoint.model import checkpoint_key
from ...checkpoint.weight_map import WeightMap
from ..spec.model import Spec, linear_names
from .algorithms import QuantizedLinear, awq_shared, fp8_per_tensor, gptq, nvfp4, rtn, smoothquant
from .gguf_codes import kept_codes
from .calibrate import InputStats, block_of, calibration_batches, layer_by_layer
from .store import QuantizedWriter, load_quantized  # noqa: F401  (load_quantized: re-exported for callers)

RTN_ROWS = 8192  # rows quantized at once by RTN (row-independent): bounds lm_head's and the embedding's copies


def selected_layers(spec: Spec) -> list[str]:
    return [n for n in linear_names(spec.arch) if not any(p in n for p in spec.quantization.exclude)]


def linear_key(spec: Spec, name: str) -> str:
    """The checkpoint tensor of a linear (or ``embed_tokens``)."""
    parameter = "lm_head.weight" if name == "lm_head" else f"model.{name}.weight"
    return checkpoint_key(parameter, spec.arch.tie_word_embeddings)


def quantize_checkpoint(weights: WeightMap, spec: Spec, out: Path, progress=print) -> dict[str, dict]:
    """Writes the quantized layers to the directory ``out`` (store.py's layout); returns the
    per-layer error report."""
    q = spec.quantization
    names = selected_layers(spec)
    dtype = spec.model.dtype.torch
    writer = QuantizedWriter(out)
    report: dict[str, dict] = {}
    weight_of = lambda name: weights.tensor(linear_key(spec, name), dtype).float()  # noqa: E731 [out, in]
    done = 0
    for block, stats in _blocks(weights, spec, names, progress):
        members = [n for n in names if block_of(n) == block]
        results = {}
        shared = _shared_scale_layers(members, stats, weight_of, spec)
        for name in members:
            group = q.group_size if q.bits == 4 else None
            result, source = kept_codes(weights, linear_key(spec, name), q, q.bits, group,
                                        tensor_parallel=spec.parallel.tensor)
            if result is None and q.mode in ("int8_weight_only", "int4_weight_only") and q.algorithm == "rtn":
                result = _rtn_by_rows(weights, spec, name, q.bits, group)
            elif result is None:
                result = _quantize(name, weight_of(name), stats, shared, spec)
            report[name] = _errors(weights, spec, name, result, stats[name].sample_rows if name in stats else None)
            if source is not None:  # a GGUF block tensor: its codes kept, or why not
                report[name]["source"] = source
            results[name] = result
            done += 1
            progress(f"  quantized {name} ({done}/{len(names)}, {q.mode}, {q.algorithm}){'; ' + source if source else ''}")
        writer.write(block, results)
    if q.quantize_embeddings:  # int8 per vocabulary row, whatever the linears' mode
        result, source = kept_codes(weights, "model.embed_tokens.weight", q, 8, None, embedding=True)
        if result is None:
            result = _rtn_by_rows(weights, spec, "embed_tokens", 8, None)
        report["embed_tokens"] = _errors(weights, spec, "embed_tokens", result, None)
        if source is not None:
            report["embed_tokens"]["source"] = source
        writer.write("embed_tokens", {"embed_tokens": result})
    writer.finish(report)
    return report


def _blocks(weights: WeightMap, spec: Spec, names: list[str],
            progress) -> Iterator[tuple[str, dict[str, InputStats]]]:
    """The blocks holding selected linears, in order, with calibration statistics when the spec has data."""
    q = spec.quantization
    if q.calibration is None:
        for block in dict.fromkeys(block_of(n) for n in names):
            yield block, {}
        return
    batches = calibration_batches(spec.model.checkpoint, q.calibration.data, q.calibration.samples,
                                  q.calibration.seq_len)
    # Only GPTQ reads Σ xᵀx: [in, in] float32 per linear (822 MB for a Llama-3-8B down_proj).
    yield from layer_by_layer(spec.model.checkpoint, weights, spec.model.dtype.torch, names, batches, progress,
                              hessian=q.algorithm == "gptq")


def _quantize(name: str, weight: torch.Tensor, stats: dict[str, InputStats], shared: dict,
              spec: Spec) -> QuantizedLinear:
    q = spec.quantization
    group = q.group_size if q.bits == 4 else None
    if name in shared:
        return shared[name]
    if q.mode == "nvfp4":
        return nvfp4(weight)
    if q.mode == "fp8":
        return fp8_per_tensor(weight, float(stats[name].abs_max.max()) if name in stats else None)
    if q.algorithm == "gptq":
        return gptq(weight, stats[name].hessian, q.bits, group)
    return rtn(weight, q.bits, group)


def _row_chunks(rows: int) -> Iterator[tuple[int, int]]:
    for start in range(0, rows, RTN_ROWS):
        yield start, min(start + RTN_ROWS, rows)


def _rtn_by_rows(weights: WeightMap, spec: Spec, name: str, bits: int, group: int | None) -> QuantizedLinear:
    """RTN a block of rows at a time: each row's scales and codes depend on that row only, so
    this equals ``rtn`` of the whole weight, holding one block of it as float."""
    key, dtype = linear_key(spec, name), spec.model.dtype.torch
    parts = [rtn(weights.rows(key, start, stop, dtype).float(), bits, group)
             for start, stop in _row_chunks(weights.entry(key).shape[0])]
    return QuantizedLinear(codes=torch.cat([p.codes for p in parts]), scales=torch.cat([p.scales for p in parts]),
                           bits=bits, group=group)


def shared_input_groups(names: list[str]) -> list[list[str]]:
    """``names`` grouped by the input they read: q/k/v of one layer (its input norm's output),
    gate/up (the post-attention norm's); every other linear alone."""
    groups: dict[str, list[str]] = {}
    for name in names:
        leaf = name.rsplit(".", 1)[-1]
        shared = leaf in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
        key = f"{name.rsplit('.', 2)[0]}.{'attn_in' if leaf in ('q_proj', 'k_proj', 'v_proj') else 'mlp_in'}" if shared else name
        groups.setdefault(key, []).append(name)
    return list(groups.values())


def _shared_scale_layers(names, stats, weight_of, spec: Spec) -> dict[str, QuantizedLinear]:
    """W8A8 (SmoothQuant) and AWQ: linears that read one input share one input scale, which the
    quantize_weights pass folds into the norm producing that input; {} for other algorithms."""
    q = spec.quantization
    if q.mode == "w8a8":
        quantize = lambda weights, x: smoothquant(weights, x.abs_max, q.smoothquant_alpha)[0]  # noqa: E731
    elif q.mode == "int4_weight_only" and q.algorithm == "awq":
        quantize = lambda weights, x: awq_shared(weights, x.abs_mean, x.sample_rows, q.bits, q.group_size)  # noqa: E731
    else:
        return {}
    out = {}
    for members in shared_input_groups(names):
        out.update(zip(members, quantize([weight_of(n) for n in members], stats[members[0]])))
    return out


def _errors(weights: WeightMap, spec: Spec, name: str, result: QuantizedLinear, x: torch.Tensor | None) -> dict:
    """Relative errors of the weight and (on calibration rows x) of the layer's output, summed
    over blocks of output rows so no more than a block of the weight is float at once."""
    key, dtype = linear_key(spec, name), spec.model.dtype.torch
    sums = torch.zeros(4, dtype=torch.float64)  # ‖ΔW‖², ‖W‖², ‖Δy‖², ‖y‖²
    x_quantized = result.fake_quantize_input(x) if x is not None else None
    for start, stop in _row_chunks(weights.entry(key).shape[0]):
        weight = weights.rows(key, start, stop, dtype).float()
        dequantized = result.rows(start, stop).dequantize()
        sums[0] += (dequantized - weight).pow(2).sum().item()
        sums[1] += weight.pow(2).sum().item()
        if x is not None:
            reference = x @ weight.T
            sums[2] += (x_quantized @ dequantized.T - reference).pow(2).sum().item()
            sums[3] += reference.pow(2).sum().item()
    errors = {"weight_rel_error": round((sums[0] / sums[1]).sqrt().item(), 6)}
    if x is not None:
        errors["output_rel_error"] = round((sums[2] / sums[3]).sqrt().item(), 6)
    return errors


def apply_dequantized(model: torch.nn.Module, layers: Mapping[str, QuantizedLinear]) -> None:
    """Makes the model compute what the engine will (simulated quantization): dequantized
    weights, and for W8A8 fake-quantized inputs. Layers the model does not have (a
    depth-truncated model) are skipped, and each layer is read only when it is applied."""
    modules = dict(model.named_modules())
    for name in layers:
        module = modules.get(name if name == "lm_head" else f"model.{name}")
        if module is None:
            continue
        layer = layers[name]
        # A new parameter, not a copy into the old one: that may be a read-only mapping of the
        # checkpoint (skeleton.assign_weights), or a tied embedding the engine keeps float.
        module.weight = torch.nn.Parameter(layer.dequantize().to(module.weight.dtype), requires_grad=False)
        if layer.activation_scale is not None:
            module.register_forward_pre_hook(
                lambda mod, args, layer=layer: (layer.fake_quantize_input(args[0].float()).to(args[0].dtype),))

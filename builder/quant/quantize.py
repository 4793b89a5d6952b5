"""Quantize a checkpoint's linear layers as the spec asks; runs where the torch model lives.

The result is written with safetensors (codes, scales, AWQ input scales, per layer) for the
``quantize_weights`` graph pass, with each layer's relative weight error and (when there is
calibration data) relative output error on a calibration batch.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..spec import Spec, linear_names
from .algorithms import QuantizedLinear, awq, fp8_per_tensor, gptq, nvfp4, rtn, smoothquant
from .calibrate import calibration_batches, collect


def selected_layers(spec: Spec) -> list[str]:
    return [n for n in linear_names(spec.arch) if not any(p in n for p in spec.quantization.exclude)]


def quantize_checkpoint(model: torch.nn.Module, spec: Spec, out: Path, progress=print) -> dict[str, dict]:
    q = spec.quantization
    names = selected_layers(spec)
    stats = {}
    if q.calibration is not None:
        batches = calibration_batches(spec.model.checkpoint, q.calibration.data, q.calibration.samples,
                                      q.calibration.seq_len)
        stats = collect(model, names, batches, progress)
    modules = dict(model.named_modules())
    tensors, report = {}, {}
    group = q.group_size if q.bits == 4 else None
    weight_of = lambda n: modules[n if n == "lm_head" else f"model.{n}"].weight.detach().float()  # noqa: E731 [out, in]
    smoothed = _smoothquant_groups(names, stats, weight_of, q.smoothquant_alpha) if q.mode == "w8a8" else {}
    for index, name in enumerate(names):
        weight = weight_of(name)
        if name in smoothed:
            result = smoothed[name]
        elif q.mode == "nvfp4":
            result = nvfp4(weight)
        elif q.mode == "fp8":
            result = fp8_per_tensor(weight, float(stats[name].abs_max.max()) if name in stats else None)
        elif q.algorithm == "gptq":
            result = gptq(weight, stats[name].hessian, q.bits, group)
        elif q.algorithm == "awq":
            result = awq(weight, stats[name].abs_mean, stats[name].sample_rows, q.bits, group)
        else:
            result = rtn(weight, q.bits, group)
        report[name] = _errors(weight, result, stats[name].sample_rows if name in stats else None)
        tensors[f"{name}.codes"] = result.codes.contiguous()
        tensors[f"{name}.scales"] = result.scales.contiguous()
        if result.input_scale is not None:
            tensors[f"{name}.input_scale"] = result.input_scale.clone()  # layers may share one s
        if result.activation_scale is not None:
            tensors[f"{name}.activation_scale"] = torch.tensor([result.activation_scale])
        if result.global_scale is not None:
            tensors[f"{name}.global_scale"] = torch.tensor([result.global_scale], dtype=torch.float64)
        progress(f"  quantized {name} ({index + 1}/{len(names)}, {q.mode}, {q.algorithm})")
    if q.quantize_embeddings:  # int8 per vocabulary row, whatever the linears' mode
        table = modules["model.embed_tokens"].weight.detach().float()  # [V, D]
        result = rtn(table, 8, None)
        report["embed_tokens"] = _errors(table, result, None)
        tensors["embed_tokens.codes"], tensors["embed_tokens.scales"] = result.codes.contiguous(), result.scales
    group = 16 if q.mode == "nvfp4" else group
    save_file(tensors, str(out), metadata={"bits": str(q.bits or 8), "group": str(group or 0),
                                           "report": json.dumps(report)})
    return report


def load_quantized(path: Path) -> tuple[dict[str, QuantizedLinear], dict[str, dict]]:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as handle:
        meta = handle.metadata()
    tensors = load_file(str(path))
    bits, group = int(meta["bits"]), int(meta["group"]) or None
    layers = {}
    for key in tensors:
        if key.endswith(".codes"):
            name = key[: -len(".codes")]
            activation = tensors.get(f"{name}.activation_scale")
            global_scale = tensors.get(f"{name}.global_scale")
            embedding = name == "embed_tokens"  # int8 per row in every mode
            layers[name] = QuantizedLinear(codes=tensors[key], scales=tensors[f"{name}.scales"],
                                           bits=8 if embedding else bits, group=None if embedding else group,
                                           input_scale=tensors.get(f"{name}.input_scale"),
                                           activation_scale=None if activation is None else float(activation[0]),
                                           global_scale=None if global_scale is None else float(global_scale[0]))
    return layers, json.loads(meta["report"])


def _smoothquant_groups(names, stats, weight_of, alpha: float) -> dict[str, QuantizedLinear]:
    """W8A8 for every layer: linears fed by the same RMSNorm (q/k/v; gate/up) share one
    smoothing scale, which the quantize_weights pass folds into that norm's weight."""
    groups: dict[str, list[str]] = {}
    for name in names:
        parent, leaf = name.rsplit(".", 1) if "." in name else ("", name)
        shared = leaf in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
        key = f"{name.rsplit('.', 2)[0]}.{'attn_in' if leaf in ('q_proj', 'k_proj', 'v_proj') else 'mlp_in'}" if shared else name
        groups.setdefault(key, []).append(name)
    out = {}
    for members in groups.values():
        layers, _ = smoothquant([weight_of(n) for n in members], stats[members[0]].abs_max, alpha)
        out.update(zip(members, layers))
    return out


def _errors(weight: torch.Tensor, result: QuantizedLinear, x: torch.Tensor | None) -> dict:
    dequantized = result.dequantize()
    errors = {"weight_rel_error": round(((dequantized - weight).norm() / weight.norm()).item(), 6)}
    if x is not None:
        reference = x @ weight.T
        output = result.fake_quantize_input(x) @ dequantized.T
        errors["output_rel_error"] = round(((output - reference).norm() / reference.norm()).item(), 6)
    return errors


def apply_dequantized(model: torch.nn.Module, layers: dict[str, QuantizedLinear]) -> None:
    """Makes the model compute what the engine will (simulated quantization): dequantized
    weights, and for W8A8 fake-quantized inputs."""
    modules = dict(model.named_modules())
    for name, layer in layers.items():
        module = modules[name if name == "lm_head" else f"model.{name}"]
        with torch.no_grad():
            module.weight.copy_(layer.dequantize().to(module.weight.dtype))
        if layer.activation_scale is not None:
            module.register_forward_pre_hook(
                lambda mod, args, layer=layer: (layer.fake_quantize_input(args[0].float()).to(args[0].dtype),))

"""The build's export stage, run in a subprocess: the step graph from the checkpoint, the numerics
check's graph and torch reference, and the weight quantization the spec asks for."""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from . import numerics
from ..checkpoint.errors import CheckpointError
from ..checkpoint.source import open_weights
from ..checkpoint.weight_map import WeightMap
from .errors import UserError
from .frontend.export import export_step
from .frontend.skeleton import truncated_model
from .frontend.step_model import LlamaStep
from .medusa.heads import MedusaHeads, load_heads
from .progress import ProcessPeak, sample_peak
from .quant.quantize import apply_dequantized, load_quantized, quantize_checkpoint
from .spec.model import Spec


@dataclass(frozen=True)
class Exported:
    """What the export subprocess hands back: paths, the numerics check and its reference."""

    path: Path
    data_path: Path
    output_names: list[str]
    check_path: Path | None                  # the truncated graph the check runs (None: the built graph)
    reference: tuple[dict, dict] | None      # seeded inputs, torch eager's outputs
    peak: ProcessPeak
    quantized_path: Path | None = None       # codes and scales per layer (safetensors)
    quantized_reference: dict | None = None  # torch eager outputs with the dequantized weights


def weight_map(spec: Spec) -> WeightMap:
    try:
        return open_weights(spec.model.checkpoint)
    except CheckpointError as exc:
        raise UserError(str(exc)) from None


def weight_bytes(spec: Spec) -> int:
    """The model's weight bytes in the spec's dtype, from the safetensors headers."""
    return sum(entry.numel for entry in weight_map(spec).entries.values()) * spec.model.dtype.torch.itemsize


def export_stage(spec: Spec, workdir: Path, check: numerics.CheckPlan | None) -> Exported:
    """Runs in a subprocess: the step's structure from a meta-device model with the weights
    streamed from the checkpoint, the numerics check's graph and torch reference (the model
    itself when small, else its first layers), and the weight quantization the spec asks for.
    A checkpoint refused while its tensors are read (one changed since its header was read)
    is the user's one-line error, as one refused when opened is."""
    try:
        return _export_stage(spec, workdir, check)
    except CheckpointError as exc:
        raise UserError(str(exc)) from None


def _export_stage(spec: Spec, workdir: Path, check: numerics.CheckPlan | None) -> Exported:
    with sample_peak("export") as peak:
        weights = weight_map(spec)
        exported = export_step(spec, workdir, weights, spec.arch.num_layers, spec.model.dtype,
                               spec.arch.vocab_size)
        checked, reference, model, inputs, heads = exported, None, None, None, None
        if check is not None:
            if not check.whole:
                (workdir / "check").mkdir()
                checked = export_step(spec, workdir / "check", weights, check.layers, check.dtype,
                                      check.vocab_rows)
            inputs = numerics.seeded_inputs(spec, check)
            heads = load_heads(spec.medusa.heads) if spec.medusa is not None else None
            model = truncated_model(spec.model.checkpoint, weights, check.dtype.torch, check.layers, check.vocab_rows)
            reference = (inputs, torch_outputs(spec, model, check.layers, checked.output_names, inputs, heads))
        quantized_path, quantized_reference = None, None
        if spec.quantization.bits:
            quantized_path = workdir / "quantized"  # one file per layer (builder/quant/store.py)
            say = lambda message: print(message, file=sys.stderr, flush=True)  # noqa: E731  (stdout may be JSON)
            quantize_checkpoint(weights, spec, quantized_path, progress=say)
            if model is not None:  # layers the truncated model lacks are skipped, unread
                apply_dequantized(model, load_quantized(quantized_path)[0])
                quantized_reference = torch_outputs(spec, model, check.layers, checked.output_names, inputs, heads)
        del model
    return Exported(path=exported.path, data_path=exported.data_path, output_names=exported.output_names,
                     check_path=None if check is None or check.whole else checked.path,
                     reference=reference, peak=peak.result(), quantized_path=quantized_path,
                     quantized_reference=quantized_reference)


def torch_outputs(spec: Spec, model, num_layers: int, output_names: list[str], inputs: dict,
                   heads: MedusaHeads | None) -> dict:
    """Torch eager's outputs of the step over ``model`` (its first ``num_layers`` layers, real
    weights) on ``inputs``; with Medusa, the heads' logits (numpy reference) on the final-norm
    hidden state the step computed, so attach_medusa is checked too."""
    step = LlamaStep(model, spec.arch.model_copy(update={"num_layers": num_layers}), spec.build.max_seq_len).eval()
    captured = {}
    handle = step.norm.register_forward_hook(lambda module, args, out: captured.update(hidden=out))
    try:
        outputs = numerics.run_torch(step, inputs, output_names)
    finally:
        handle.remove()
    if heads is not None:
        outputs["medusa_logits"] = heads.logits(captured["hidden"].float().numpy())
    return outputs

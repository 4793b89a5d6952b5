"""The build's export stage, run in a subprocess: the step graph from the checkpoint, the numerics
check's graph and torch reference, and the weight quantization the spec asks for."""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch

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
    draft_graph: Path | None = None          # draft.onnx, written into the engine dir (with a draft head)


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
        fuse, draft_graph = None, None
        if spec.draft_head is not None:  # its graph beside the rank graphs; its fuse inside the target's
            from .draft_head.build import target_draft_head, write_draft_graph

            draft = target_draft_head(spec, weights)
            fuse = draft.fuse.weight.detach().clone()  # [D, 3D]
            draft_graph = write_draft_graph(spec, draft, workdir.parent)
            del draft
        exported = export_step(spec, workdir, weights, spec.arch.num_layers, spec.model.dtype,
                               spec.arch.vocab_size, fuse)
        checked, reference, model, inputs, heads = exported, None, None, None, None
        if check is not None:
            if not check.whole:
                (workdir / "check").mkdir()
                checked = export_step(spec, workdir / "check", weights, check.layers, check.dtype,
                                      check.vocab_rows)
            inputs = numerics.seeded_inputs(spec, check)
            heads = load_heads(spec.medusa.heads) if spec.medusa is not None else None
            model = truncated_model(spec.model.checkpoint, weights, check.dtype.torch, check.layers, check.vocab_rows)
            # A truncated check's graph has not every tapped layer: it checks no draft features.
            check_fuse = fuse if check.whole else None
            reference = (inputs, torch_outputs(spec, model, check.layers, checked.output_names, inputs, heads,
                                               check_fuse))
        quantized_path, quantized_reference = None, None
        if spec.quantization.bits:
            quantized_path = workdir / "quantized"  # one file per layer (builder/quant/store.py)
            say = lambda message: print(message, file=sys.stderr, flush=True)  # noqa: E731  (stdout may be JSON)
            quantize_checkpoint(weights, spec, quantized_path, progress=say)
            if model is not None:  # layers the truncated model lacks are skipped, unread
                apply_dequantized(model, load_quantized(quantized_path)[0])
                quantized_reference = torch_outputs(spec, model, check.layers, checked.output_names, inputs, heads,
                                                    check_fuse)
        del model
    return Exported(path=exported.path, data_path=exported.data_path, output_names=exported.output_names,
                     check_path=None if check is None or check.whole else checked.path,
                     reference=reference, peak=peak.result(), quantized_path=quantized_path,
                     quantized_reference=quantized_reference, draft_graph=draft_graph)


def torch_outputs(spec: Spec, model, num_layers: int, output_names: list[str], inputs: dict,
                   heads: MedusaHeads | None, draft_fuse: torch.Tensor | None = None) -> dict:
    """Torch eager's outputs of the step over ``model`` (its first ``num_layers`` layers, real
    weights) on ``inputs``; with Medusa, the heads' logits (numpy reference) on the final-norm
    hidden state the step computed, so attach_medusa is checked too; with ``draft_fuse`` (the
    draft head's fuse weight) the draft features too."""
    taps, fuse = None, None
    if draft_fuse is not None:
        dtype = next(model.parameters()).dtype
        taps = spec.draft_head.config.taps
        fuse = torch.nn.Linear(draft_fuse.shape[1], draft_fuse.shape[0], bias=False, dtype=dtype)
        fuse.weight.data.copy_(draft_fuse)
    step = LlamaStep(model, spec.arch.model_copy(update={"num_layers": num_layers}), spec.build.max_seq_len,
                     taps, fuse).eval()
    captured = {}
    handle = step.norm.register_forward_hook(lambda module, args, out: captured.update(hidden=out))
    try:
        outputs = numerics.run_torch(step, inputs, output_names)
    finally:
        handle.remove()
    if heads is not None:
        outputs["medusa_logits"] = heads.logits(captured["hidden"].float().numpy())
    return outputs

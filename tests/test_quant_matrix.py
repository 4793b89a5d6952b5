"""Every quantization mode × {the bundled model's shape, a Qwen2 with biased q/k/v} × {TP 1, 2}
through the pass pipeline and the CPU stage, in-process: each builds with the numerics gate on
(every pass checked as `trtbuild build` checks it), with the fusion counts a build expects, and at
TP 1 the rank graph generates the greedy tokens of transformers running the same quantization.

Kept cheap: one-layer models (the bundled model's first decoder layer and embeddings; a random
Qwen2), one export per model shared by all 16 of its builds, one quantization per mode shared by
both TP sizes; no TensorRT engine (test_build.py builds those)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import onnx
import onnx_graphsurgeon as gs
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from trtbuild.builder import export_stage as export_module
from trtbuild.builder import numerics
from trtbuild.builder.frontend.export import load_graph
from trtbuild.builder.frontend.skeleton import truncated_model
from trtbuild.checkpoint.weight_map import WeightMap
from trtbuild.builder.passes import PIPELINE, PassContext
from trtbuild.builder.passes.manager import PassManager
from trtbuild.builder.passes.numerics_gate import NumericsGate
from trtbuild.builder.quant.quantize import apply_dequantized, load_quantized, quantize_checkpoint
from trtbuild.builder.spec.resolve import spec_from_dict
from trtbuild.plugins.onnxruntime import fp4

from conftest import REPO, TINY_CODE, make_checkpoint
from ort_greedy import greedy

pytestmark = pytest.mark.slow

CALIB = REPO / "tools" / "train_tiny_model.py"
MODES = {
    "none": {"mode": "none"},
    "int8": {"mode": "int8_weight_only"},
    "int4-rtn": {"mode": "int4_weight_only", "group_size": 32},
    "int4-awq": {"mode": "int4_weight_only", "algorithm": "awq", "group_size": 32, "calibrate": True},
    "int4-gptq": {"mode": "int4_weight_only", "algorithm": "gptq", "group_size": 32, "calibrate": True},
    "w8a8": {"mode": "w8a8", "calibrate": True},
    "fp8": {"mode": "fp8", "calibrate": True},
    "nvfp4": {"mode": "nvfp4"},
}
PROMPTS = [[5, 17, 300, 41], [9, 8, 7]]


def first_layer_of(source: Path, directory: Path) -> Path:
    """``source`` cut to its first decoder layer (its own weights, config and tokenizer)."""
    directory.mkdir()
    with safe_open(str(source / "model.safetensors"), "pt") as f:
        kept = {k: f.get_tensor(k) for k in f.keys() if not k.startswith("model.layers.") or k.startswith("model.layers.0.")}
    save_file(kept, str(directory / "model.safetensors"))
    config = json.loads((source / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(source / name, directory / name)
    return directory


def spec_for(checkpoint: Path, mode: str, tensor: int):
    fields = {k: v for k, v in MODES[mode].items() if k != "calibrate"}
    if MODES[mode].get("calibrate"):
        fields["calibration"] = {"data": str(CALIB), "samples": 2, "seq_len": 32}
    return spec_from_dict({"model": {"checkpoint": str(checkpoint), "dtype": "float32"},
                           "build": {"max_batch_size": 4, "max_input_len": 32, "max_seq_len": 128,
                                     "targets": ["sm120"] if mode == "nvfp4" else ["sm89"]},
                           "parallel": {"tensor": tensor}, "quantization": fields})


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Per model: its checkpoint, the exported step graph (the export stage `trtbuild build` runs,
    in this process) and its check plan; built on first use."""
    root = tmp_path_factory.mktemp("quant-matrix")
    made = {}

    def get(model: str):
        if model not in made:
            checkpoint = (first_layer_of(TINY_CODE, root / "tiny-code-1") if model == "tiny-code"
                          else make_checkpoint(root / "qwen2", "qwen2", layers=1))
            spec = spec_for(checkpoint, "none", 1)
            check = numerics.check_plan(spec, export_module.weight_bytes(spec))
            workdir = root / f"{model}-export"
            workdir.mkdir()
            made[model] = checkpoint, export_module.export_stage(spec, workdir, check), check, workdir
        return made[model]
    return get


@pytest.fixture(scope="module")
def quantized(exported, tmp_path_factory):
    """Per (model, mode): the quantized layers, their report and torch's outputs with them."""
    made = {}

    def get(model: str, mode: str):
        if (model, mode) not in made:
            checkpoint, export, check, _ = exported(model)
            spec = spec_for(checkpoint, mode, 1)
            if not spec.quantization.bits:
                made[model, mode] = None, None, None
                return made[model, mode]
            weights = WeightMap.from_checkpoint(checkpoint)
            out = tmp_path_factory.mktemp(f"{model}-{mode}") / "quantized"
            quantize_checkpoint(weights, spec, out, progress=lambda message: None)
            layers, report = load_quantized(out)
            torch_model = truncated_model(checkpoint, weights, check.dtype.torch, check.layers, check.vocab_rows)
            apply_dequantized(torch_model, layers)
            reference = export_module.torch_outputs(spec, torch_model, check.layers, export.output_names,
                                                    export.reference[0], None)
            made[model, mode] = layers, report, (torch_model, reference)
        return made[model, mode]
    return get


def simulated_greedy(torch_model, prompts, tokens: int) -> list[list[int]]:
    """transformers' greedy tokens with the quantized layers applied (apply_dequantized)."""
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            for _ in range(tokens):
                ids = torch.cat([ids, torch_model(input_ids=ids).logits[:, -1:].argmax(-1)], dim=1)
            out.append(ids[0, len(prompt):].tolist())
    return out


@pytest.mark.parametrize("tensor", [1, 2])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("model", ["tiny-code", "qwen2"])
def test_every_mode_builds_through_the_cpu_stage_and_generates(exported, quantized, tmp_path, model, mode, tensor,
                                                               request):
    checkpoint, export, check, export_dir = exported(model)
    spec = spec_for(checkpoint, mode, tensor)
    layers, report, simulated = quantized(model, mode)
    run_dir = tmp_path / "run"  # the export's files, which quantize_weights' data file joins
    shutil.copytree(export_dir, run_dir, ignore=shutil.ignore_patterns("check", "quantized"))
    gate = NumericsGate(*export.reference, spec.passes.atol, spec.passes.rtol, workdir=run_dir,
                        quantized_reference=simulated[1] if simulated else None,
                        quantized_rtol=spec.passes.quantized_rtol, num_kv_heads=spec.arch.num_kv_heads,
                        activations=spec.quantization.activations, label=check.record(), tensor_size=tensor)
    context = PassContext.for_spec(spec, layers, report, weights_dir=run_dir)
    run = PassManager(PIPELINE, numerics=gate, weights_dir=run_dir).run(load_graph(run_dir / export.path.name), context)
    records = {}
    for record in run.records:
        records.setdefault(record["pass"], []).append(record)
    quantized_count = 0 if layers is None else len(layers)
    assert [r["matches"] for r in records["quantize_weights"]] == [quantized_count]
    assert quantized_count == {"none": 0}.get(mode, 7)  # q, k, v, o, gate, up, down (lm_head excluded)
    assert [r["modified"] for r in records["shard_tensor_parallel"]] == [tensor > 1] * tensor
    assert all(r["numerics"]["ok"] for rs in records.values() for r in rs if "numerics" in r)
    cpu_stage = tensor == 1 and mode != "nvfp4"  # base.cpu_stage_skipped: TP ranks and FP4 run the rank graph
    assert ("cpu_pack_qkv" in records) == cpu_stage
    if cpu_stage:
        counts = {name: records[name][0]["matches"] for name in
                  ("cpu_group_query_attention", "cpu_pack_qkv", "cpu_drop_row_gather", "cpu_skip_norm")}
        # Qwen2's biased q/k/v (MatMul → Add) stay three MatMuls; FP8's per-tensor weight scales
        # differ per projection, so one DequantizeLinear cannot hold the three (cpu_pack_qkv.PACKED_MODES).
        packed = 0 if model == "qwen2" or mode == "fp8" else 1
        assert counts == {"cpu_group_query_attention": 1, "cpu_pack_qkv": packed, "cpu_drop_row_gather": 1,
                          "cpu_skip_norm": 2}
    if tensor == 1:
        rank = gs.export_onnx(run.graphs[0])
        onnx.save_model(fp4.simulate(rank) if fp4.has_fp4(rank) else rank, run_dir / "rank0.onnx")
        arch = spec.arch
        ours = greedy(run_dir / "rank0.onnx", PROMPTS, 6, arch.num_layers, arch.num_kv_heads, arch.head_dim, 128)
        torch_model = simulated[0] if simulated else truncated_model(checkpoint, WeightMap.from_checkpoint(checkpoint),
                                                                     torch.float32, 1, arch.vocab_size)
        assert ours == simulated_greedy(torch_model, PROMPTS, 6)

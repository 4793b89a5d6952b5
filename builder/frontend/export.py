"""torch.export → ONNX (opset 24) of the engine step, with stable hierarchical node names."""
from __future__ import annotations

import contextlib
import io
import logging
import warnings
from collections import Counter
from dataclasses import dataclass

from pathlib import Path

import onnx
import onnx_graphsurgeon as gs
import torch
from onnx.external_data_helper import load_external_data_for_tensor

from ..spec import Spec
from .checkpoint import load_model
from ...contract.step import INPUT_NAMES, io_cache_names
from .step_model import LlamaStep

OPSET = 24
NAME_SCOPES_KEY = "pkg.torch.onnx.name_scopes"


@dataclass
class ExportedStep:
    """The exported graph on disk (weights as external data beside it) and the torch module
    it came from (the numerics reference, dropped once that is computed)."""

    path: Path
    step: LlamaStep | None
    output_names: list[str]
    weight_bytes: int
    hf_model: torch.nn.Module | None = None  # the transformers model the step's modules belong to

    @property
    def data_path(self) -> Path:
        return self.path.with_name(self.path.name + ".data")


def example_inputs(spec: Spec, batch: int, seq: int, rows: int) -> tuple[torch.Tensor, ...]:
    """Step inputs of the given sizes: a causal prefill at position 0 (caches zero)."""
    arch, s_max = spec.arch, spec.build.max_seq_len
    positions = torch.arange(seq, dtype=torch.int32)[None].repeat(batch, 1)
    mask = torch.ones(seq, s_max, dtype=torch.bool).tril()[None, None].repeat(batch, 1, 1, 1)
    past = [torch.zeros(batch, arch.num_kv_heads, s_max, arch.head_dim, dtype=spec.model.dtype.torch)
            for _ in range(2 * arch.num_layers)]
    return (torch.zeros(batch, seq, dtype=torch.int32), positions,
            torch.zeros(batch, dtype=torch.int64), torch.full((batch,), seq, dtype=torch.int64),
            mask, torch.full((batch, rows), seq - 1, dtype=torch.int64), *past)


def export_step(spec: Spec, workdir: Path) -> ExportedStep:
    """Exports the step to ``workdir/step.onnx``; weights stream to ``step.onnx.data`` so the
    graph never holds a second in-memory copy of them."""
    arch = spec.arch
    hf_model = load_model(spec.model.checkpoint, spec.model.dtype.torch)
    step = LlamaStep(hf_model, arch, spec.build.max_seq_len).eval()
    max_batch, max_seq = spec.build.max_batch_size, spec.max_step_tokens
    # Sizes of 2+ keep torch.export from specialising a dynamic dim to 1.
    args = example_inputs(spec, batch=2, seq=min(3, max_seq) if max_seq > 1 else 1, rows=2)
    batch = torch.export.Dim("batch", min=1, max=max(2, max_batch))
    seq = torch.export.Dim("seq", min=1, max=max(3, max_seq))
    rows = torch.export.Dim("rows", min=1, max=max(3, max_seq))
    dynamic = ({0: batch, 1: seq}, {0: batch, 1: seq}, {0: batch}, {0: batch},
               {0: batch, 2: seq}, {0: batch, 1: rows}, tuple({0: batch} for _ in range(2 * arch.num_layers)))
    with torch.no_grad(), warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), \
            _quiet_logger("torch.onnx"):
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            step, args, dynamo=True, dynamic_shapes=dynamic, opset_version=OPSET, optimize=True,
            input_names=list(INPUT_NAMES) + io_cache_names(arch.num_layers, "past"),
            output_names=["logits"] + io_cache_names(arch.num_layers, "present"), verbose=False)
        path = Path(workdir) / "step.onnx"
        program.save(path, external_data=True)
    del program
    model = onnx.load(path, load_external_data=False)  # structure only: a few MB at most
    name_nodes(model.graph)
    onnx.save_model(model, path)
    weights = sum(p.numel() * p.element_size() for p in step.parameters())
    return ExportedStep(path=path, step=step, output_names=[o.name for o in model.graph.output], weight_bytes=weights,
                        hf_model=hf_model)


def load_graph(path: Path, inline_below: int = 1 << 20) -> gs.Graph:
    """The graph at ``path`` for passes: large weights stay external (read lazily by whoever
    needs them), tensors under ``inline_below`` bytes (scalars, shapes, rotary tables) are
    read in so passes can inspect them."""
    model = onnx.load(path, load_external_data=False)
    for tensor in model.graph.initializer:
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            length = int({e.key: e.value for e in tensor.external_data}.get("length", inline_below))
            if length < inline_below:
                load_external_data_for_tensor(tensor, str(Path(path).parent))
                tensor.data_location = onnx.TensorProto.DEFAULT
                del tensor.external_data[:]
    return gs.import_onnx(model)


@contextlib.contextmanager
def _quiet_logger(name: str):
    """The exporter logs registry warnings (e.g. torchvision ops) that are noise for us."""
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def scope_of(node: onnx.NodeProto) -> str:
    """``/model/layers.3/self_attn/q_proj`` from the exporter's module-scope metadata."""
    scopes = next((p.value for p in node.metadata_props if p.key == NAME_SCOPES_KEY), "")
    modules = [s.strip(" '\"") for s in scopes.strip("[]").split(",")][:-1]  # last one is the op's own name
    deepest = next((m for m in reversed(modules) if m), "")
    parts: list[str] = []
    for piece in deepest.split(".") if deepest else []:
        if piece.isdigit() and parts:
            parts[-1] = f"{parts[-1]}.{piece}"
        else:
            parts.append(piece)
    return "/".join(["/model", *parts])


def name_nodes(graph: onnx.GraphProto) -> None:
    """Rename every node ``<scope>/<OpType>[_k]``, deterministic in graph order; drop exporter metadata."""
    seen: Counter[str] = Counter()
    for node in graph.node:
        base = f"{scope_of(node)}/{node.op_type}"
        node.name = base if seen[base] == 0 else f"{base}_{seen[base]}"
        seen[base] += 1
        del node.metadata_props[:]

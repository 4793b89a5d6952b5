"""torch.export → ONNX (opset 24) of the engine step, from a meta-device model: the graph's
structure is traced without any weight bytes, then the weights stream from the checkpoint into
the step's external-data file one tensor at a time (frontend/weights_file.py).

The exporter's own optimizer folds constants by reading their values, which a meta model does
not have: it runs here with the weights marked unknown, so it folds everything else (shape
arithmetic, casts, small tables) and leaves ``Transpose(W)`` in front of each Linear's MatMul.
Those transposes are folded by storing the weight transposed ([in, out]) as it is written,
which is what the passes expect of a Linear (``MatMul(x, W[in, out])``).
"""
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

from ...contract.draft_head import DRAFT_FEATURES
from ...contract.step import INPUT_NAMES, STEP_INPUTS, io_cache_names
from ..spec.dtype import DType
from ..spec.model import Spec
from .skeleton import meta_model, checkpoint_key
from .step_model import LlamaStep
from ...checkpoint.weight_map import WeightMap
from .weights_file import GraphWeight, fold_weight_transposes, write_weights

OPSET = 24
NAME_SCOPES_KEY = "pkg.torch.onnx.name_scopes"


@dataclass(frozen=True)
class ExportedStep:
    """The exported graph on disk, its weights as external data beside it."""

    path: Path
    output_names: list[str]
    weight_bytes: int
    num_layers: int

    @property
    def data_path(self) -> Path:
        return self.path.with_name(self.path.name + ".data")


def example_inputs(spec: Spec, num_layers: int, dtype: torch.dtype, sizes: dict[str, int]) -> tuple[torch.Tensor, ...]:
    """Meta tensors of the step's inputs (contract.step.STEP_INPUTS) at ``sizes`` of the dynamic dims."""
    arch = spec.arch
    known = {**sizes, "S_max": spec.build.max_seq_len, "H_kv": arch.num_kv_heads, "D": arch.head_dim}
    dtypes = {"float": dtype, "int32": torch.int32, "int64": torch.int64, "bool": torch.bool}
    shaped = lambda kind, dims: torch.empty([known[d] if isinstance(d, str) else d for d in dims],  # noqa: E731
                                            dtype=dtypes[kind], device="meta")
    inputs = [shaped(*STEP_INPUTS[name]) for name in INPUT_NAMES]
    return (*inputs, *(shaped(*STEP_INPUTS["past"]) for _ in range(2 * num_layers)))


def _dynamic_shapes(spec: Spec, num_layers: int) -> tuple:
    """torch.export dims for B, S and R, read off the same table."""
    max_seq = spec.max_step_tokens
    dims = {"B": torch.export.Dim("batch", min=1, max=max(2, spec.build.max_batch_size)),
            "S": torch.export.Dim("seq", min=1, max=max(3, max_seq)),
            "R": torch.export.Dim("rows", min=1, max=max(3, max_seq))}
    of = lambda entry: {axis: dims[d] for axis, d in enumerate(entry[1]) if d in dims}  # noqa: E731
    return (*(of(STEP_INPUTS[name]) for name in INPUT_NAMES),
            tuple(of(STEP_INPUTS["past"]) for _ in range(2 * num_layers)))


def export_step(spec: Spec, workdir: Path, weights: WeightMap, num_layers: int, dtype: DType,
                vocab_rows: int, draft_fuse: torch.Tensor | None = None) -> ExportedStep:
    """Exports the step of the checkpoint's first ``num_layers`` decoder layers and ``vocab_rows``
    vocabulary rows (all of them for the engine; fewer for the numerics check of a large model)
    in ``dtype`` to ``workdir/step.onnx``, its weights streamed from ``weights`` into ``step.onnx.data``.
    ``draft_fuse``: the draft head's fuse weight [D, 3D] (its taps are ``spec.draft_head``'s): the
    step then outputs DRAFT_FEATURES too."""
    arch = spec.arch.model_copy(update={"num_layers": num_layers, "vocab_size": vocab_rows})
    model = meta_model(spec.model.checkpoint, dtype.torch, num_layers, vocab_rows)
    taps, fuse = None, None
    if draft_fuse is not None:
        taps = spec.draft_head.config.taps
        fuse = torch.nn.Linear(draft_fuse.shape[1], draft_fuse.shape[0], bias=False, device="meta", dtype=dtype.torch)
    step = LlamaStep(model, arch, spec.build.max_seq_len, taps, fuse).eval()
    # The rotary tables are computed, not stored: keep their values, trace them as meta. So is
    # the draft's fuse weight, which is the draft dir's, not the checkpoint's.
    tables = {"cos_table": step.cos_table, "sin_table": step.sin_table}
    step.cos_table, step.sin_table = (table.to("meta") for table in tables.values())
    if draft_fuse is not None:
        tables["draft_fuse.weight"] = draft_fuse
    sources = _checkpoint_keys(step, model)
    # Sizes of 2+ keep torch.export from specialising a dynamic dim to 1.
    seq = min(3, spec.max_step_tokens) if spec.max_step_tokens > 1 else 1
    args = example_inputs(spec, num_layers, dtype.torch, {"B": 2, "S": seq, "R": 2})
    with torch.no_grad(), warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), \
            _quiet_logger("torch.onnx"), _quiet_logger("onnxscript"), _quiet_logger("onnx_ir"):
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            step, args, dynamo=True, dynamic_shapes=_dynamic_shapes(spec, num_layers), opset_version=OPSET,
            optimize=False, input_names=list(INPUT_NAMES) + io_cache_names(num_layers, "past"),
            output_names=["logits", *([DRAFT_FEATURES] if draft_fuse is not None else [])]
            + io_cache_names(num_layers, "present"), verbose=False)
        graph_weights = _take_weights(program, sources, tables)
        program.optimize()  # folds all but the weights, whose values it is told it does not know
        for name in graph_weights:
            program.model.graph.initializers.pop(name, None)
        path = Path(workdir) / "step.onnx"
        program.save(path, external_data=False)
    del program
    proto = onnx.load(path, load_external_data=False)  # structure only: a few MB at most
    name_nodes(proto.graph)
    transposed = fold_weight_transposes(proto.graph, set(graph_weights))
    written = write_weights(proto.graph, graph_weights, transposed, weights, dtype, path.with_name("step.onnx.data"))
    onnx.save_model(proto, path)
    return ExportedStep(path=path, output_names=[o.name for o in proto.graph.output], weight_bytes=written,
                        num_layers=num_layers)


def _checkpoint_keys(step: LlamaStep, model: torch.nn.Module) -> dict[str, str]:
    """The step's parameter names (what the exporter names initializers) → checkpoint keys."""
    hf_names = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        hf_names.setdefault(id(param), name)
    return {name: checkpoint_key(hf_names[id(param)], model.config.tie_word_embeddings)
            for name, param in step.named_parameters(remove_duplicate=False)
            if id(param) in hf_names}  # the draft's fuse weight is not the checkpoint's


def _take_weights(program, sources: dict[str, str], tables: dict[str, torch.Tensor]) -> dict[str, GraphWeight]:
    """The graph's weight initializers, marked unknown for the optimizer, with where each comes from."""
    out = {}
    for name, value in program.model.graph.initializers.items():
        if name not in sources and name not in tables:
            continue
        shape = tuple(int(d) for d in value.shape)
        out[name] = GraphWeight(name=name, shape=shape, key=sources.get(name),
                                values=tables[name] if name in tables else None)
        value.const_value = None
    missing = set(sources.values()) - {w.key for w in out.values()}
    if missing:
        raise ValueError(f"the exported graph lacks initializers for {sorted(missing)[:4]}")
    return out


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

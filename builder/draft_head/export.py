"""torch.export → ONNX of the draft head's step (DraftHeadStep): ``draft.onnx`` with its weights,
the target's token embedding among them, in ``draft.onnx.data`` beside it (the build then points
the embedding into the rank's own data file: builder/emit/draft_graph.py)."""
from __future__ import annotations

import contextlib
import io
import warnings
from pathlib import Path

import onnx
import torch

from ...contract.draft_head import DRAFT_HIDDEN, DRAFT_LOGITS, FEATURES, NUM_HEADS, NUM_KV_HEADS
from ...contract.step import INPUT_NAMES, STEP_INPUTS
from ..frontend.export import OPSET, _quiet_logger
from .model import DraftHead, DraftHeadStep

CACHE_INPUTS = ("past_key_0", "past_value_0")
CACHE_OUTPUTS = ("present_key_0", "present_value_0")


def draft_input_names() -> list[str]:
    return [*INPUT_NAMES, FEATURES, *CACHE_INPUTS]


def export_draft_graph(draft: DraftHead, max_seq_len: int, max_batch: int, max_step_tokens: int, path: Path,
                       dtype: torch.dtype = torch.float32) -> Path:
    """Writes the draft's step graph to ``path`` (external data at ``path`` + ".data"); B up to
    ``max_batch``, S and R up to ``max_step_tokens`` (a prefill's catch-up runs in chunks of it)."""
    shape = draft.config.layer
    step = DraftHeadStep(draft.to(dtype), max_seq_len).eval()
    batch, seq = torch.export.Dim("batch", min=1, max=max(2, max_batch)), \
        torch.export.Dim("seq", min=1, max=max(3, max_step_tokens))
    rows = torch.export.Dim("rows", min=1, max=max(3, max_step_tokens))
    dims = {"B": batch, "S": seq, "R": rows}
    known = {"B": 2, "S": 3, "R": 2, "S_max": max_seq_len, "H_kv": shape.num_kv_heads, "D": shape.head_dim}
    kinds = {"float": dtype, "int32": torch.int32, "int64": torch.int64, "bool": torch.bool}

    def example(kind: str, axes: tuple) -> torch.Tensor:
        size = [known[a] if isinstance(a, str) else a for a in axes]
        return torch.zeros(size, dtype=kinds[kind]) if kind != "bool" else torch.ones(size, dtype=torch.bool)

    def dynamic(axes: tuple) -> dict:
        return {i: dims[a] for i, a in enumerate(axes) if a in dims}

    features = ("float", ("B", "S", shape.hidden_size))
    entries = [STEP_INPUTS[name] for name in INPUT_NAMES] + [features, STEP_INPUTS["past"], STEP_INPUTS["past"]]
    args = tuple(example(*entry) for entry in entries)
    args[INPUT_NAMES.index("logits_index")].zero_()
    path = Path(path)
    with torch.no_grad(), warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), \
            _quiet_logger("torch.onnx"), _quiet_logger("onnxscript"), _quiet_logger("onnx_ir"):
        warnings.simplefilter("ignore")
        program = torch.onnx.export(step, args, dynamo=True, opset_version=OPSET,
                                    dynamic_shapes=tuple(dynamic(entry[1]) for entry in entries),
                                    input_names=draft_input_names(),
                                    output_names=[DRAFT_LOGITS, DRAFT_HIDDEN, *CACHE_OUTPUTS], verbose=False)
        program.optimize()
        program.save(path, external_data=True)
    # The heads are what the CPU form's attention fusion needs (builder/draft_head/cpu_graph.py).
    model = onnx.load(path, load_external_data=False)
    model.metadata_props.extend(onnx.StringStringEntryProto(key=k, value=str(v)) for k, v in
                                ((NUM_HEADS, shape.num_heads), (NUM_KV_HEADS, shape.num_kv_heads)))
    onnx.save_model(model, path)
    onnx.checker.check_model(str(path))
    return path

"""The draft head in a build: its dir checked against the target before any work, and in the
export stage its fuse weight (built into the target's step graph) and ``draft.onnx``."""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ...checkpoint.weight_map import WeightMap
from ...contract.draft_head import DRAFT_GRAPH, DRAFT_MAP_FILE, MAP_TENSOR
from ..spec.model import Spec
from .export import export_draft_graph
from .model import DraftHead, load_draft_head

EMBEDDING = "model.embed_tokens.weight"


def check_draft_dir(spec: Spec) -> None:
    """Every tensor of the spec's draft dir, and its map's ids, checked against the target
    (UserError, one line) — with a meta embedding: nothing of the target is read."""
    if spec.draft_head is None:
        return
    arch = spec.arch
    load_draft_head(spec.draft_head.path, nn.Embedding(arch.vocab_size, arch.hidden_size, device="meta"))


def target_draft_head(spec: Spec, weights: WeightMap) -> DraftHead:
    """The spec's draft head over the target's token embedding (float32), every tensor checked."""
    embedding = weights.for_shape(EMBEDDING, (spec.arch.vocab_size, spec.arch.hidden_size), torch.float32)
    return load_draft_head(spec.draft_head.path, nn.Embedding.from_pretrained(embedding, freeze=True))


def write_draft_graph(spec: Spec, draft: DraftHead, out: Path) -> Path:
    """``out``/draft.onnx (+ .data) in the model's dtype, for the spec's batch and step sizes, and
    the draft-to-target ids the runtime maps its tokens through (``out``/DRAFT_MAP_FILE)."""
    from safetensors.torch import save_file

    save_file({MAP_TENSOR: getattr(draft, MAP_TENSOR).detach().to(torch.int64).contiguous()},
              str(Path(out) / DRAFT_MAP_FILE))
    return export_draft_graph(draft, spec.build.max_seq_len, spec.build.max_batch_size, spec.max_step_tokens,
                              Path(out) / DRAFT_GRAPH, dtype=spec.model.dtype.torch)

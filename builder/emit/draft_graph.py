"""draft.onnx's token embedding read from the rank's data file: the draft embeds with the target's
own table (contract/draft_head.py), whose bytes rank0.onnx.data already holds (49152 × 576 float32
= 113 MB for SmolLM2-135M). Shared only where the bytes are the same (a quantized embedding is
not); draft.onnx.data keeps the draft's other tensors."""
from __future__ import annotations

import os
from pathlib import Path

import onnx


EMBEDDING = "draft.embed.weight"  # the draft step's initializer of the target's table [V, D]
ALIGN = 64


def share_target_embedding(draft_path: Path, rank_path: Path) -> int:
    """Points ``draft_path``'s embedding at the identical tensor of ``rank_path``'s data file and
    rewrites the draft's data file without it; returns the bytes saved (0: nothing identical)."""
    draft_path, rank_path = Path(draft_path), Path(rank_path)
    root = draft_path.parent
    draft = onnx.load(draft_path, load_external_data=False)
    embed = next((t for t in draft.graph.initializer if t.name == EMBEDDING), None)
    if embed is None or embed.data_location != onnx.TensorProto.EXTERNAL:
        return 0
    own = _read(root, embed)
    rank = onnx.load(rank_path, load_external_data=False)
    same = next((t for t in rank.graph.initializer
                 if t.data_location == onnx.TensorProto.EXTERNAL and t.data_type == embed.data_type
                 and list(t.dims) == list(embed.dims) and _read(root, t) == own), None)
    if same is None:
        return 0
    data_name = _location(embed)
    del embed.external_data[:]
    embed.external_data.extend(same.external_data)
    _repack(draft, root, data_name)
    onnx.save_model(draft, draft_path)
    return len(own)


def _location(tensor: onnx.TensorProto) -> str:
    return {e.key: e.value for e in tensor.external_data}["location"]


def _read(root: Path, tensor: onnx.TensorProto) -> bytes:
    entries = {e.key: e.value for e in tensor.external_data}
    with open(root / entries["location"], "rb") as handle:
        handle.seek(int(entries.get("offset", 0)))
        return handle.read(int(entries["length"]))


def _repack(model: onnx.ModelProto, root: Path, data_name: str) -> None:
    """``data_name`` rewritten with only the tensors that still read it (offsets updated, in place)."""
    staged = root / f".{data_name}.repack"
    offset = 0
    with open(staged, "wb") as out:
        for tensor in model.graph.initializer:
            if tensor.data_location != onnx.TensorProto.EXTERNAL or _location(tensor) != data_name:
                continue
            data = _read(root, tensor)
            pad = -offset % ALIGN
            out.write(b"\0" * pad)
            offset += pad
            out.write(data)
            for entry in tensor.external_data:
                if entry.key == "offset":
                    entry.value = str(offset)
            if not any(e.key == "offset" for e in tensor.external_data):
                entry = tensor.external_data.add()
                entry.key, entry.value = "offset", str(offset)
            offset += len(data)
    os.replace(staged, root / data_name)

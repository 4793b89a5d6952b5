"""Write a graph whose large weights live in the export's external-data file.

The weights are never re-serialized: external tensors are re-pointed at ``<name>.data``
beside the new file, which is a hard link to (or, across file systems, a copy of) the
export's weight file. Graphs with only in-memory tensors (hand-built ones) save as they are.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import onnx


def save_graph(model: onnx.ModelProto, path: Path, weights: Path | None) -> None:
    path = Path(path)
    data_name = f"{path.name}.data"
    external = [t for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    for tensor in external:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = data_name
    path.parent.mkdir(parents=True, exist_ok=True)
    if external:
        if weights is None:
            raise ValueError(f"{path}: the graph has external weights but no weight file was given")
        _link_or_copy(Path(weights), path.parent / data_name)
    onnx.save_model(model, path)


def _link_or_copy(src: Path, dst: Path) -> None:
    dst.unlink(missing_ok=True)
    try:
        os.link(src, dst)
    except OSError:  # another file system
        shutil.copyfile(src, dst)

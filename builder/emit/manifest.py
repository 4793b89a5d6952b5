"""manifest.json: what the runtime needs to trust and drive an engine dir.

The schema (trtbuild.contract) is the only thing builder and runtime share; bump its
SCHEMA_VERSION on any incompatible change.
"""
from __future__ import annotations

import json
from importlib import metadata
from pathlib import Path

import onnx
from onnx.helper import tensor_dtype_to_np_dtype

from ...contract.manifest import SCHEMA_VERSION, sha256_file



def file_table(root: Path) -> dict[str, dict]:
    """sha256 and size of every file under ``root`` (but the manifest), by relative path."""
    return {str(p.relative_to(root)): {"sha256": sha256_file(p), "bytes": p.stat().st_size}
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != "manifest.json"}


def io_table(model: onnx.ModelProto) -> list[dict]:
    """Engine inputs/outputs: name, dtype, shape with symbolic dims, and which outputs alias inputs."""
    rows = []
    for direction, values in (("input", model.graph.input), ("output", model.graph.output)):
        for value in values:
            tensor = value.type.tensor_type
            shape = [d.dim_param if d.dim_param else d.dim_value for d in tensor.shape.dim]
            row = {"name": value.name, "direction": direction,
                   "dtype": tensor_dtype_to_np_dtype(tensor.elem_type).name,  # float32, bfloat16, int64, bool
                   "shape": shape}
            if value.name.startswith("present_"):
                row["aliases"] = value.name.replace("present_", "past_", 1)
            rows.append(row)
    return rows


def tool_versions() -> dict[str, str]:
    versions = {}
    for dist in ("trtbuild", "torch", "transformers", "onnx", "onnxruntime", "onnx-graphsurgeon"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = "not installed"
    return versions


def write_manifest(root: Path, body: dict) -> dict:
    manifest = {"schema_version": SCHEMA_VERSION, **body, "files": file_table(root)}
    (root / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=False) + "\n")
    return manifest


def graph_metadata(model: onnx.ModelProto) -> dict[str, str]:
    """What passes recorded in the graph (model metadata_props), e.g. the CUDA-graph plan."""
    return {entry.key: entry.value for entry in model.metadata_props}

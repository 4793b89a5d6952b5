"""Write a graph with its large tensors in one external-data file beside it.

Tensors still external (the export's weight file) are copied range by range, tensors made in
memory by passes (quantized weights) are written out, small ones stay inline: memory holds one
tensor at a time, and the data file holds what the graph references (so the same graph gives
the same bytes).

A weight file that only this graph reads, and reads all but at most 1 % of (alignment padding,
small tensors the passes took inline), is *adopted*: renamed to be the data file, its tensors
left at their offsets, the rest appended. Copying it would hold the rank's weights on disk twice
at the build's peak (Llama-3-8B at TP=2: 16 GB more than the rename).
"""
from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import onnx

INLINE_BELOW = 1024  # bytes


def save_graph(model: onnx.ModelProto, path: Path, weights_dir: Path | None,
               adoptable: frozenset[str] = frozenset()) -> None:
    """``weights_dir``: where the external-data files the graph's tensors name lie; ``adoptable``:
    names of those files no other graph will read (the largest one the graph reads whole is moved,
    not copied)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data_name = f"{path.name}.data"
    data_path = path.parent / data_name
    adopted = _adoptable_file(model, weights_dir, adoptable)
    offset = 0
    if adopted is not None:
        (Path(weights_dir) / adopted).rename(data_path)
        offset = data_path.stat().st_size
    sources: dict[str, object] = {}
    with open(data_path, "ab" if adopted else "wb") as out, ExitStack() as stack:
        for tensor in model.graph.initializer:
            if tensor.data_location == onnx.TensorProto.EXTERNAL:
                info = _info(tensor)
                if info["location"] == adopted:
                    info["location"] = data_name
                    _point(tensor, info)
                    continue
                if weights_dir is None:
                    raise ValueError(f"{path}: tensor {tensor.name} is external but no weights dir was given")
                if info["location"] not in sources:
                    sources[info["location"]] = stack.enter_context(open(Path(weights_dir) / info["location"], "rb"))
                source = sources[info["location"]]
                source.seek(int(info.get("offset", 0)))
                data = source.read(int(info["length"]))
            elif tensor.HasField("raw_data") and len(tensor.raw_data) >= INLINE_BELOW:
                data = tensor.raw_data
                tensor.ClearField("raw_data")
            else:
                continue
            out.write(data)
            _point(tensor, {"location": data_name, "offset": str(offset), "length": str(len(data))})
            tensor.data_location = onnx.TensorProto.EXTERNAL
            offset += len(data)
    if offset == 0:
        data_path.unlink()
    onnx.save_model(model, path)


def _adoptable_file(model: onnx.ModelProto, weights_dir: Path | None, adoptable: frozenset[str]) -> str | None:
    """The largest adoptable file the graph reads in ranges that do not overlap and leave at most
    1 % of it unread (so adopting it leaves almost no dead bytes in the data file), or None."""
    if weights_dir is None or not adoptable:
        return None
    ranges: dict[str, list[tuple[int, int]]] = {}
    for tensor in model.graph.initializer:
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            info = _info(tensor)
            if info["location"] in adoptable:
                start = int(info.get("offset", 0))
                ranges.setdefault(info["location"], []).append((start, start + int(info["length"])))
    whole = []
    for name, spans in ranges.items():
        spans.sort()
        size = (Path(weights_dir) / name).stat().st_size
        disjoint = all(a[1] <= b[0] for a, b in zip(spans, spans[1:])) and spans[-1][1] <= size
        unread = size - sum(stop - start for start, stop in spans)
        if disjoint and unread <= size // 100:
            whole.append((size, name))
    return max(whole)[1] if whole else None


def _info(tensor: onnx.TensorProto) -> dict[str, str]:
    return {e.key: e.value for e in tensor.external_data}


def _point(tensor: onnx.TensorProto, info: dict[str, str]) -> None:
    del tensor.external_data[:]
    for key in ("location", "offset", "length"):
        if key in info:
            entry = tensor.external_data.add()
            entry.key, entry.value = key, info[key]

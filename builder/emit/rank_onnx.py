"""Write a graph with its large tensors in one external-data file beside it.

Tensors still external (the export's weight file) are copied range by range, tensors made in
memory by passes (quantized weights) are written out, small ones stay inline: memory holds one
tensor at a time, and the data file holds exactly what the graph references, in graph order
(so the same graph gives the same bytes).
"""
from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import onnx

INLINE_BELOW = 1024  # bytes


def save_graph(model: onnx.ModelProto, path: Path, weights_dir: Path | None) -> None:
    """``weights_dir``: where the external-data files the graph's tensors name lie."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data_name = f"{path.name}.data"
    data_path = path.parent / data_name
    offset = 0
    sources: dict[str, object] = {}
    with open(data_path, "wb") as out, ExitStack() as stack:
        for tensor in model.graph.initializer:
            if tensor.data_location == onnx.TensorProto.EXTERNAL:
                info = {e.key: e.value for e in tensor.external_data}
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
            del tensor.external_data[:]
            for key, value in (("location", data_name), ("offset", str(offset)), ("length", str(len(data)))):
                entry = tensor.external_data.add()
                entry.key, entry.value = key, value
            tensor.data_location = onnx.TensorProto.EXTERNAL
            offset += len(data)
    if offset == 0:
        data_path.unlink()
    onnx.save_model(model, path)

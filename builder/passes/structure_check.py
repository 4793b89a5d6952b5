"""Structural checks of a graph too large to run in the numerics check: after each pass that
changed it, every decoder layer has the same ops with constants of the same shapes as the last
(layer 0 may hold more: what the exporter computes once for every layer), and every weight kept
on disk resolves inside its file with the size its shape and dtype imply.

"Every decoder layer" is every layer of one quantized form: a GGUF file's codes are kept in the
form of each tensor's type, and llama.cpp's mixes give layers different ones (its Q4_K_M of
SmolLM2 keeps some down projections in Q6_K, int8 blocks of 16, and the others in Q4_K, int4 with
block offsets), so a layer is compared with the last layer of its own form.

Its numerics are checked on a depth-truncated copy that went through the same passes
(numerics.CheckPlan); this instrument checks the model built is that copy repeated.
"""
from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx import helper
from onnx_graphsurgeon.ir.tensor import LazyValues

from .base import PassError, after
from .instruments import Instrument

_LAYER = re.compile(r"^/model/layers\.(\d+)/")


def layer_signatures(graph: gs.Graph) -> dict[int, Counter]:
    """Per decoder layer: how many nodes of each (op, shapes of its constant inputs)."""
    out: dict[int, Counter] = {}
    for node in graph.nodes:
        found = _LAYER.match(node.name or "")
        if found is None:
            continue
        constants = tuple(tuple(t.shape or ()) for t in node.inputs if isinstance(t, gs.Constant))
        out.setdefault(int(found.group(1)), Counter())[(node.op, constants)] += 1
    return out


def layer_forms(quantized: dict | None, num_layers: int) -> list[tuple]:
    """Per decoder layer: the form (bits, group, with offsets) of each of its quantized linears,
    by module; layers of one form must be alike."""
    forms: list[dict] = [{} for _ in range(num_layers)]
    for name, layer in (quantized or {}).items():
        parts = name.split(".", 2)
        if len(parts) == 3 and parts[0] == "layers" and parts[1].isdigit() and int(parts[1]) < num_layers:
            forms[int(parts[1])][parts[2]] = (layer.bits, layer.group, layer.offsets is not None)
    return [tuple(sorted(f.items())) for f in forms]


def external_weights(graph: gs.Graph, weights_dir: Path) -> tuple[int, int]:
    """(tensors, bytes) of the constants kept on disk; each must lie inside its file and hold
    exactly its shape's bytes."""
    count = total = 0
    sizes: dict[str, int] = {}
    for tensor in graph.tensors().values():
        values = tensor._values if isinstance(tensor, gs.Constant) else None  # not .values: that loads them
        proto = values.tensor if isinstance(values, LazyValues) else None
        if proto is None or proto.data_location != onnx.TensorProto.EXTERNAL:
            continue
        info = {e.key: e.value for e in proto.external_data}
        location = info["location"]
        if location not in sizes:
            path = Path(weights_dir) / location
            if Path(location).name != location or not path.is_file():
                raise ValueError(f"{tensor.name} reads {location!r}, which is not a file of the build")
            sizes[location] = path.stat().st_size
        offset, length = int(info.get("offset", 0)), int(info["length"])
        element = np.dtype(helper.tensor_dtype_to_np_dtype(proto.data_type)).itemsize
        numel = int(np.prod(proto.dims)) if proto.dims else 1
        packed = proto.data_type in (onnx.TensorProto.INT4, onnx.TensorProto.UINT4, onnx.TensorProto.FLOAT4E2M1)
        expected = (numel + 1) // 2 if packed else numel * element
        if length != expected or offset + length > sizes[location]:
            raise ValueError(f"{tensor.name}: {length} bytes at {offset} of {location} ({sizes[location]} bytes); "
                             f"its shape {list(proto.dims)} needs {expected}")
        count += 1
        total += length
    return count, total


class StructureCheck(Instrument):
    def __init__(self, num_layers: int, weights_dir: Path, label: dict, stages: tuple[range, ...] = (),
                 tensor_size: int = 1, forms: list[tuple] | None = None):
        """``stages``: each pipeline stage's layers (() for one stage); rank graphs come stage by
        stage, ``tensor_size`` of each. ``forms``: each layer's quantized form (layer_forms; None:
        one form for all)."""
        self.num_layers, self.weights_dir, self.label = num_layers, Path(weights_dir), label
        self.stages, self.tensor_size = stages or (range(num_layers),), tensor_size
        self.forms = forms or [()] * num_layers
        self.first = True

    def after_all(self, p, graphs, results, records, ran):
        if not (self.first or any(r.modified for r in results)):
            return
        self.first = False
        for index, (graph, record) in enumerate(zip(graphs, records)):
            layers = self.stages[index // self.tensor_size] if len(graphs) > 1 else range(self.num_layers)
            signatures = layer_signatures(graph)
            if layers.start > 0:  # a later stage keeps layer 0's shape arithmetic only
                signatures.pop(0, None)
            if sorted(signatures) != list(layers):
                raise PassError(f"after pass {p.name} the graph has decoder layers {sorted(signatures)[:4]}…; "
                                f"it holds {len(layers)} from layer {layers.start}{after(ran)}")
            # The first layer also holds what the exporter computes once for all layers (shape arithmetic
            # named by its first use): it must hold the reference layer's ops; the others, exactly
            # them. In the CPU decode graph the residual Add fuses into the next layer's norm
            # (cpu_skip_norm), so its first and last layers differ by design: the interior ones
            # are compared there.
            compared = range(layers.start + 1, layers.stop - 1) if p.cpu else layers
            reference = {self.forms[layer]: layer for layer in compared}  # each form's last layer
            # A layer whose form no other compared layer has is compared with nothing: said below.
            per_form = Counter(self.forms[layer] for layer in compared)
            alone = [layer for layer in compared if len(compared) > 1 and per_form[self.forms[layer]] == 1]
            for layer in compared:
                reference_layer = reference[self.forms[layer]]
                signature, last = signatures[layer], signatures[reference_layer]
                missing, extra = last - signature, signature - last
                if missing or (extra and layer > layers.start):
                    diff = sorted(str(k) for k in missing + extra)[:2]
                    raise PassError(f"after pass {p.name} decoder layer {layer} differs from layer "
                                    f"{reference_layer}: {diff}{after(ran)}")
            last = signatures[compared[-1] if len(compared) else layers.stop - 1]
            try:
                tensors, size = external_weights(graph, self.weights_dir)
            except ValueError as exc:
                raise PassError(f"after pass {p.name} a weight does not resolve: {exc}{after(ran)}") from None
            # The truncated numerics check runs the first label["layers"] layers: forms only later
            # layers have were checked by structure alone.
            checked = set(self.forms[:self.label.get("layers", 0)])
            record["structure"] = {**self.label, "layers_alike": len(layers),
                                   "ops_per_layer": sum(last.values()),
                                   "layer_forms": len({self.forms[layer] for layer in layers}),
                                   "layers_of_forms_not_in_the_check": [layer for layer in layers
                                                                        if self.forms[layer] not in checked],
                                   "layers_compared_with_none": alone,
                                   "weights_on_disk": tensors, "weight_bytes_on_disk": size}

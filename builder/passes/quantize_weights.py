"""quantize_weights: MatMul(x, W) → MatMul(x', DequantizeLinear(W_q, scale)) for each layer
the spec quantizes (codes and scales come from trtbuild.builder.quant, computed on the
checkpoint). INT8: per output channel (axis 1), or (codes kept from a GGUF file) blocks of
``group`` input rows; INT4: blocks of ``group`` input rows (axis 0, block_size). A per-input-channel scale ``s`` (AWQ, SmoothQuant) is folded into the
producing RMSNorm's weight when every consumer shares it, else x' = x / s by a Mul; W8A8 adds
a QuantizeLinear/DequantizeLinear pair on x' (int8, static per-tensor scale). FP8: E4M3 codes
with one per-tensor weight scale, and a float8 Q/DQ pair on x (static per-tensor scale from
calibration amax); TensorRT runs those as FP8 GEMMs on sm89+, ONNX Runtime literally (which is
the simulated quantization `trtbuild eval` measures). NVFP4 (weight-only): FLOAT4E2M1 codes,
block_size 16, whose scales are themselves DequantizeLinear(FP8 block scales, global scale);
ONNX Runtime cannot run FP4, so CPU paths fold the chain into float weights (plugins/onnxruntime/fp4.py).
INT4 or INT8 kept from a GGUF file with offsets (Q4_1, Q4_K, Q5_1, Q5_K) also has one offset per block (W = DQ(codes, scales) + offsets):
TensorRT's int4 DequantizeLinear takes no zero point, so y = MatMul(x, DQ) + MatMul(S(x), Oᵀ), S(x)
summing x over each block of inputs (Reshape → ReduceSum; one per input tensor, shared by the
linears reading it).

``ctx.quantized`` may be lazy (quant/store.py: layers memory-mapped from disk). With a weights
dir, codes and scales are appended to an external-data file there as each layer is rewritten
(``quantize_weights.data``), so the pass holds one layer's codes at a time; NVFP4's stay in the
graph (plugins/onnxruntime/fp4.py folds them for ONNX Runtime from in-memory values). Hand-built graphs
without a weights dir get in-memory constants.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx_graphsurgeon as gs
import torch
from onnx import numpy_helper
from onnx_graphsurgeon.ir.tensor import LazyValues

from . import weights
from .base import PassContext, PassError, PassResult
from .fusion import new_node

DATA_FILE = "quantize_weights.data"


def module_of(node_name: str) -> str:
    """``/model/layers.0/self_attn/q_proj/MatMul`` → ``layers.0.self_attn.q_proj``."""
    return node_name.removeprefix("/model/").rsplit("/", 1)[0].replace("/", ".")


def _constant(name: str, values: np.ndarray) -> gs.Constant:
    """A constant whose TensorProto is made by onnx itself: it packs int4 two to a byte
    (onnx-graphsurgeon's own export would write one byte per element)."""
    return gs.Constant(name, LazyValues(numpy_helper.from_array(values, name)))


def _sink(ctx: PassContext):
    """Where codes and scales go: ``name, values → Constant``; scalars (FP8's per-tensor scale)
    stay in the graph as scalars."""
    if ctx.weights_dir is None:
        return _constant
    writer = weights.WeightWriter(ctx.weights_dir / DATA_FILE)
    return lambda name, values: writer.constant(name, values) if values.ndim else _constant(name, values)


def _foldable(node: gs.Node, layer, layers) -> bool:
    """SmoothQuant's migration applies when x comes from an RMSNormalization whose every consumer
    is a quantized MatMul with this same input scale s (decided on the graph before any rewrite)."""
    x = node.inputs[0]
    norm = x.inputs[0] if len(x.inputs) == 1 else None
    if layer.input_scale is None or norm is None or norm.op != "RMSNormalization" \
            or not isinstance(norm.inputs[1], gs.Constant):
        return False
    for consumer in x.outputs:
        other = layers.get(module_of(consumer.name)) if consumer.op == "MatMul" else None
        if other is None or other.input_scale is None or not np.array_equal(other.input_scale.numpy(),
                                                                           layer.input_scale.numpy()):
            return False
    return True


def _fold_into_norm(node: gs.Node, layer, folded: set[int], dtype, weights_dir) -> None:
    """Divides the producing norm's weight by s (once per norm) instead of scaling x at run time."""
    norm = node.inputs[0].inputs[0]
    if id(norm) not in folded:
        weight = norm.inputs[1]
        norm.inputs[1] = gs.Constant(f"{weight.name}.smoothed",
                                     (weights.read(weight, weights_dir) / layer.input_scale.numpy()).astype(dtype))
        folded.add(id(norm))


def _fake_quantized(graph: gs.Graph, x, scale: float, dtype, scope: str, shared: dict,
                    code_dtype=np.int8) -> gs.Variable:
    """QuantizeLinear → DequantizeLinear of ``x`` (int8, zero point 0), one pair per tensor and scale."""
    key = (x.name, scale)
    if key not in shared:
        a = gs.Constant(f"{x.name}.act_scale", np.array(scale, dtype=dtype))
        zero = gs.Constant(f"{x.name}.act_zero", np.array(0, dtype=code_dtype))
        q = gs.Variable(f"{x.name}.act_q", dtype=code_dtype)
        dq = gs.Variable(f"{x.name}.act_dq", dtype=dtype)
        graph.nodes.append(new_node("QuantizeLinear", f"{scope}/QuantizeLinear_act", [x, a, zero], outputs=[q]))
        graph.nodes.append(new_node("DequantizeLinear", f"{scope}/DequantizeLinear_act", [q, a, zero], outputs=[dq]))
        shared[key] = dq
    return shared[key]


def _quantize_embedding(graph: gs.Graph, layer, ctx: PassContext, constant) -> dict:
    """Gather(table) → Gather(DequantizeLinear(int8 codes, per-row scales)): TensorRT only takes
    int8 constants that feed a DequantizeLinear, so the table is dequantized, then gathered."""
    gather = next((n for n in graph.nodes if n.op == "Gather" and module_of(n.name) == "embed_tokens"
                   and isinstance(n.inputs[0], gs.Constant)), None)
    if gather is None or tuple(gather.inputs[0].shape) != tuple(layer.codes.shape):
        raise PassError(f"quantize_weights: no embedding Gather over a constant of shape {tuple(layer.codes.shape)}")
    dtype = np.dtype(gather.inputs[0].dtype)
    table = gs.Variable("embed_tokens.weight_dq", dtype=dtype, shape=list(layer.codes.shape))
    graph.nodes.append(new_node("DequantizeLinear", "/model/embed_tokens/DequantizeLinear",
                                [constant("embed_tokens.weight_q", layer.codes.numpy()),
                                 constant("embed_tokens.weight_scale", layer.scales.numpy().astype(dtype))],
                                {"axis": 0}, [table]))
    gather.inputs[0] = table
    return (ctx.quant_report or {}).get("embed_tokens", {})


def _block_sums(graph: gs.Graph, x: gs.Variable, group: int, scope: str, shared: dict) -> gs.Variable:
    """S(x) [..., in / group]: x [..., in] summed over each block of ``group`` inputs."""
    key = (x.name, group)
    if key not in shared:
        if x.shape is None or not isinstance(x.shape[-1], int):
            raise PassError(f"quantize_weights: {x.name} has no known last dimension to sum blocks of")
        rank, width = len(x.shape), x.shape[-1]
        blocks = gs.Variable(f"{x.name}.blocks", dtype=x.dtype)
        sums = gs.Variable(f"{x.name}.block_sums", dtype=x.dtype)
        shape = gs.Constant(f"{x.name}.blocks_shape", np.array([0] * (rank - 1) + [width // group, group], np.int64))
        graph.nodes.append(new_node("Reshape", f"{scope}/BlockSplit", [x, shape], outputs=[blocks]))
        graph.nodes.append(new_node("ReduceSum", f"{scope}/BlockSum",
                                    [blocks, gs.Constant(f"{x.name}.blocks_axis", np.array([-1], np.int64))],
                                    {"keepdims": 0}, [sums]))
        shared[key] = sums
    return shared[key]


def _add_offsets(graph: gs.Graph, node: gs.Node, name: str, layer, dtype, scope: str, shared: dict, constant) -> None:
    """The MatMul's output becomes MatMul + S(x)·Oᵀ: the block offsets' share of x·Wᵀ."""
    sums = _block_sums(graph, node.inputs[0], layer.group, scope, shared)
    offsets = constant(f"{name}.weight_offsets", np.ascontiguousarray(layer.offsets.T.numpy()).astype(dtype))  # [in/g, out]
    output = node.outputs[0]
    main, correction = gs.Variable(f"{name}.dq_matmul", dtype=output.dtype), gs.Variable(f"{name}.offset_matmul",
                                                                                        dtype=output.dtype)
    node.outputs[0] = main
    graph.nodes.append(new_node("MatMul", f"{scope}/OffsetMatMul", [sums, offsets], outputs=[correction]))
    graph.nodes.append(new_node("Add", f"{scope}/AddOffsets", [main, correction], outputs=[output]))


def _weight_table(weight, shape: tuple[int, ...]) -> gs.Constant | None:
    """The constant behind a MatMul's [in, out] weight of ``shape``: the weight itself, or a
    constant [out, in] it transposes (the LM head as exported: ``Transpose(lm_head.weight)``, the
    table a tied embedding shares); None if neither. The codes replace the weight either way; the
    Transpose and a table nothing else reads go with the cleanup."""
    if isinstance(weight, gs.Constant):
        return weight if tuple(weight.shape) == shape else None
    producer = weight.inputs[0] if len(weight.inputs) == 1 else None
    if (producer is not None and producer.op == "Transpose" and list(producer.attrs.get("perm", [1, 0])) == [1, 0]
            and isinstance(producer.inputs[0], gs.Constant) and tuple(producer.inputs[0].shape) == shape[::-1]):
        return producer.inputs[0]
    return None


def quantize_weights(graph: gs.Graph, ctx: PassContext) -> PassResult:
    layers = ctx.quantized or {}
    if not layers:
        return PassResult(graph=graph, modified=False, stats={"matches": 0, "mode": "none"})
    done, skipped = {}, {}
    folded: set[int] = set()
    shared_qdq: dict[tuple[str, float], gs.Variable] = {}
    shared_sums: dict[tuple[str, int], gs.Variable] = {}
    constant = _sink(ctx)
    if "embed_tokens" in layers:
        done["embed_tokens"] = _quantize_embedding(graph, layers["embed_tokens"], ctx, constant)
    targets = [(node, module_of(node.name)) for node in graph.nodes
               if node.op == "MatMul" and module_of(node.name) in layers]
    fold = {id(node): _foldable(node, layers[name], layers) for node, name in targets}
    for node, name in targets:
        layer = layers[name]
        shape = tuple(layer.codes.shape[::-1])  # [in, out]
        table = _weight_table(node.inputs[1], shape)
        if table is None:
            skipped[node.name] = f"weight is not a constant of shape {shape} (nor the transpose of one)"
            continue
        dtype = np.dtype(table.dtype)
        codes = None if layer.fp8 or layer.nvfp4 else layer.codes.T.contiguous().numpy()  # [in, out]
        scales = None if layer.nvfp4 else layer.scales.numpy().astype(dtype)
        if layer.nvfp4:  # FP4 codes in blocks of 16 inputs; FP8 block scales × a global scale
            codes = layer.codes.T.contiguous().numpy().astype(ml_dtypes.float4_e2m1fn)       # [in, out]
            blocks = np.ascontiguousarray(layer.scales.T.numpy()).astype(ml_dtypes.float8_e4m3fn)  # [in/16, out]
            scales = gs.Variable(f"{name}.weight_scale", dtype=dtype)
            graph.nodes.append(new_node("DequantizeLinear", f"{node.name.rsplit('/', 1)[0]}/DequantizeLinear_scale",
                                        [_constant(f"{name}.weight_block_scale", blocks),
                                         gs.Constant(f"{name}.weight_global_scale",
                                                     np.array(layer.global_scale, dtype))], {}, [scales]))
            attrs = {"axis": 0, "block_size": layer.group}
        elif layer.fp8:  # per-tensor: a scalar scale, no axis
            codes = layer.codes.T.contiguous().view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)
            scales, attrs = np.array(layer.scales[0].item(), dtype), {}
        elif layer.bits == 4:
            codes, scales = codes.astype(ml_dtypes.int4), np.ascontiguousarray(scales.T)  # scales [in/g, out]
            attrs = {"axis": 0, "block_size": layer.group}
        elif layer.group is not None:  # int8 codes kept from a GGUF file with their block scales
            scales = np.ascontiguousarray(scales.T)                               # [in/g, out]
            attrs = {"axis": 0, "block_size": layer.group}
        else:
            attrs = {"axis": 1}                                  # scales [out]
        scope = node.name.rsplit("/", 1)[0]
        dequantized = gs.Variable(f"{name}.weight_dq", dtype=dtype, shape=list(shape))
        graph.nodes.append(new_node("DequantizeLinear", f"{scope}/DequantizeLinear",
                                    [_constant(f"{name}.weight_q", codes) if layer.nvfp4 else constant(f"{name}.weight_q", codes),
                                     scales if layer.nvfp4 else constant(f"{name}.weight_scale", np.asarray(scales))],
                                    attrs, [dequantized]))
        node.inputs[1] = dequantized
        if fold[id(node)]:
            _fold_into_norm(node, layer, folded, dtype, ctx.weights_dir)
        elif layer.input_scale is not None:
            # AWQ (or a smoothing scale with no norm to absorb it): x / s feeds the scaled weights
            scaled = gs.Variable(f"{name}.input_scaled", dtype=dtype)
            inverse = gs.Constant(f"{name}.input_scale_inv", (1.0 / layer.input_scale.numpy()).astype(dtype))
            graph.nodes.append(new_node("Mul", f"{scope}/ActivationScale", [node.inputs[0], inverse], outputs=[scaled]))
            node.inputs[0] = scaled
        if layer.activation_scale is not None:  # W8A8 / FP8: activations with a static per-tensor scale
            node.inputs[0] = _fake_quantized(graph, node.inputs[0], layer.activation_scale, dtype, scope, shared_qdq,
                                             ml_dtypes.float8_e4m3fn if layer.fp8 else np.int8)
        if layer.offsets is not None:
            _add_offsets(graph, node, name, layer, dtype, scope, shared_sums, constant)
        done[name] = (ctx.quant_report or {}).get(name, {})
    graph.cleanup(remove_unused_graph_inputs=False).toposort()
    if len(done) != len(layers):
        missing = sorted(set(layers) - set(done))[:4]
        raise PassError(f"quantize_weights matched {len(done)} of the {len(layers)} layers to quantize; "
                        f"not found: {missing}{'; skipped: ' + str(skipped) if skipped else ''}")
    return PassResult(graph=graph, modified=True, stats={"matches": len(done), "expected": len(layers),
                                                         "layers": done})

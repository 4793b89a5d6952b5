"""attach_medusa: add the Medusa heads to the graph and the ``medusa_logits`` output.

With pipeline stages the heads live on the last stage. With tensor parallelism each rank holds its vocabulary slice of every head's output
projection (like lm_head) and the stacked rows are all-gathered. The heads read what the LM head reads: the final-norm hidden state at ``logits_index``
[B, R, D], so they too run only on the rows that need logits. Head k is
``h = x + SiLU(x W_j + b_j)`` per residual block, then ``h W_out`` [B, R, V]; the heads are
stacked on axis 2 into ``medusa_logits`` [B, R, K, V] (float32, like ``logits``).

Heads whose vocabulary projections all are the LM head's own weight (``trtbuild medusa train
--freeze-out``) share that weight: their hidden states are stacked [B, R, K, D] and go through one
MatMul with the LM head's constant. On a real vocabulary each projection is as large as a sizeable
part of the model (49152 × 576 fp32 = 113 MB for SmolLM2-135M), and a CPU step's time is mostly
reading weights, so K copies would cost a verification K such reads where one does.
"""
from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs


from ..sharding import vocab_range
from ...plugins.collectives import all_gather_last_axis
from ..medusa.heads import load_heads
from . import weights
from .base import PassContext, PassError, PassResult
from .fusion import new_node


LM_HEAD = "/model/lm_head/MatMul"


def _lm_head_matmul(graph: gs.Graph) -> gs.Node:
    node = next((n for n in graph.nodes if n.name == LM_HEAD), None)
    if node is None or node.op != "MatMul":
        raise PassError(f"attach_medusa: the graph has no LM head MatMul {LM_HEAD}")
    return node


def attach_medusa(graph: gs.Graph, ctx: PassContext) -> PassResult:
    medusa = ctx.spec.medusa if ctx.spec is not None else None
    if medusa is None or not ctx.last_stage:  # the heads live beside lm_head, on the last pipeline stage
        return PassResult(graph=graph, modified=False, stats={"medusa_heads": 0})
    heads = load_heads(medusa.heads)
    lm_head = _lm_head_matmul(graph)
    hidden = lm_head.inputs[0]  # [B, R, D] after the final norm
    logits = next(o for o in graph.outputs if o.name == "logits")
    dtype = ctx.spec.model.dtype.numpy
    columns = vocab_range(ctx.tensor_rank, ctx.tensor_size, heads.vocab_size)  # vocab-parallel like lm_head
    shared = _shared_lm_head(lm_head, heads, columns, dtype, ctx.weights_dir)
    per_head = []
    for k in range(heads.num_heads):  # one checkpoint tensor read at a time (each becomes a constant)
        h = hidden
        for j in range(heads.num_layers):
            scope = f"/medusa_head.{k}/{j}"
            w = gs.Constant(f"medusa_head.{k}.{j}.linear.weight", np.ascontiguousarray(heads.weight(k, j).T, dtype))
            b = gs.Constant(f"medusa_head.{k}.{j}.linear.bias", heads.bias(k, j).astype(dtype))
            z, pre, gate, act, res = (gs.Variable(f"{scope}/{n}", dtype=dtype)
                                      for n in ("MatMul_out", "Add_out", "Sigmoid_out", "Mul_out", "Residual_out"))
            graph.nodes += [new_node("MatMul", f"{scope}/MatMul", [h, w], outputs=[z]),
                            new_node("Add", f"{scope}/Add", [z, b], outputs=[pre]),
                            new_node("Sigmoid", f"{scope}/Sigmoid", [pre], outputs=[gate]),
                            new_node("Mul", f"{scope}/SiLU", [pre, gate], outputs=[act]),
                            new_node("Add", f"{scope}/Residual", [h, act], outputs=[res])]
            h = res
        scope = f"/medusa_head.{k}/out"
        if shared is None:
            w_out = gs.Constant(f"medusa_head.{k}.{heads.num_layers}.weight",
                                np.ascontiguousarray(heads.out(k, columns.start, columns.stop).T, dtype))
            head_out = gs.Variable(f"{scope}/MatMul_out", dtype=dtype)  # [B, R, V']
            graph.nodes.append(new_node("MatMul", f"{scope}/MatMul", [h, w_out], outputs=[head_out]))
        else:
            head_out = h  # [B, R, D], projected below with the others
        expanded = gs.Variable(f"{scope}/Unsqueeze_out", dtype=dtype)
        axes = gs.Constant(f"medusa_head.{k}.unsqueeze_axes", np.array([2], np.int64))
        graph.nodes.append(new_node("Unsqueeze", f"{scope}/Unsqueeze", [head_out, axes], outputs=[expanded]))
        per_head.append(expanded)
    batch, rows, vocab = logits.shape
    shape = [batch, rows, heads.num_heads, vocab]
    stacked = gs.Variable("/medusa/Concat_out", dtype=dtype)  # [B, R, K, V'], or [B, R, K, D] to project
    graph.nodes.append(new_node("Concat", "/medusa/Concat", per_head, {"axis": 2}, outputs=[stacked]))
    if shared is not None:
        projected = gs.Variable("/medusa/MatMul_out", dtype=dtype)  # [B, R, K, V']
        graph.nodes.append(new_node("MatMul", "/medusa/MatMul", [stacked, shared], outputs=[projected]))
        stacked = projected
    if ctx.tensor_size > 1:
        stacked = all_gather_last_axis(graph, stacked, ctx.tensor_size, "/medusa/AllGather", dims=4)  # [B, R, K, V/N]
    output = gs.Variable("medusa_logits", dtype=np.float32, shape=shape)
    if dtype == np.float32:
        graph.nodes.append(new_node("Identity", "/medusa/Output", [stacked], outputs=[output]))
    else:
        graph.nodes.append(new_node("Cast", "/medusa/Output", [stacked], {"to": 1}, outputs=[output]))
    graph.outputs.insert(1, output)
    return PassResult(graph=graph, modified=True, stats={
        "medusa_heads": heads.num_heads, "medusa_layers": heads.num_layers, "medusa_params": heads.params,
        "shares_lm_head": shared is not None, "tree_size": medusa.tree_size})


def _shared_lm_head(lm_head: gs.Node, heads, columns: range, dtype: np.dtype, weights_dir) -> gs.Tensor | None:
    """What the LM head multiplies by, [D, V'], where every head's projection (this rank's vocabulary
    slice) equals it exactly, else None. That is a constant [D, V'], or with tied embeddings the
    Transpose of the embedding's [V', D] (ONNX Runtime folds it once); a quantized LM head is
    neither: never shared."""
    weight = lm_head.inputs[1]
    if isinstance(weight, gs.Constant):
        source, transposed = weight, True
    elif (len(weight.inputs) == 1 and weight.inputs[0].op == "Transpose"
          and list(weight.inputs[0].attrs.get("perm", [1, 0])) == [1, 0]
          and isinstance(weight.inputs[0].inputs[0], gs.Constant)):
        source, transposed = weight.inputs[0].inputs[0], False
    else:
        return None
    if source.dtype != dtype:
        return None
    values = weights.read(source, weights_dir)  # memory-mapped; [D, V'] or, transposed, [V', D]
    if values.shape != ((heads.hidden_size, len(columns)) if transposed else (len(columns), heads.hidden_size)):
        return None
    for k in range(heads.num_heads):
        if not np.array_equal(heads.out(k, columns.start, columns.stop).astype(dtype), values.T if transposed else values):
            return None
    return weight

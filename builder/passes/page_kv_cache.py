"""The paged TensorRT step (contract/step.py PAGED_INPUTS) from a finished rank graph: each layer's
K and V cache becomes one pool of blocks [N, block_size, H_kv, D] that every row shares, written
and read through the step's ``kv_slots`` and ``block_table`` instead of the row's slot.

Per cache (two a layer), the slot form's
    present = TensorScatter(past [B, H_kv, S_max, D], U [B, H_kv, S, D], write_index)  (axis -2)
becomes
    write: present = ScatterND(pool, kv_slots as [B·S, 2], U as [B·S, H_kv, D])  (the pool in place)
    read:  Gather(present, block_table, axis 0) [B, M, bs, H_kv, D] → [B, H_kv, M·bs, D]
and what read the slot cache (the Slice to the longest kv_length before Attention) reads the
gathered rows: position p of row b is at pool[block_table[b, p // bs], p % bs]. ``attention_mask``
becomes [B, 1, S, M·bs]; ``kv_length`` keeps its meaning; ``write_index`` goes (Medusa's path end,
which reads it, gets it from position_ids[:, 0], which the contract makes equal). The batch size the
exporter read from a cache's Shape comes from kv_length.

Only TensorScatters between a graph input ``past_*`` and the graph output ``present_*`` match: a
pipeline stage's graph has its own layers' caches, a tensor-parallel rank its own KV heads, and
Medusa heads touch no cache.

    fusion: pattern (TensorScatter(past input, U, write_index), output the graph's present) +
    replacement (ScatterND write, Gather read) + check (tests/test_paged_graph.py: the same steps'
    logits against the slot graph in ONNX Runtime, and the pool's blocks against the slot caches)
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ...contract.step import BLOCK_TABLE, KV_SLOTS
from .base import PassContext, PassError
from .onnx_rewrite import Rewritten, attribute, reads, replace_nodes

# The paged graph's dynamic dims beside batch/seq: the pool's blocks N, the table's width M, and
# the positions M·bs the attention mask covers.
POOL_BLOCKS, TABLE_BLOCKS, KV_POSITIONS = "pool_blocks", "table_blocks", "kv_positions"
KV_SLOT_ROWS = "kv_slots_rows"  # [B·S, 2]: kv_slots as ScatterND's indices, shared by every layer
# Recorded in the paged graph's metadata: the layout and block size its pools have.
LAYOUT_KEY, BLOCK_SIZE_KEY = "kv_cache_layout", "kv_block_size"


def _dims(value: onnx.ValueInfoProto) -> list:
    return [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]


def _set_dims(value: onnx.ValueInfoProto, dims: list) -> None:
    shape = value.type.tensor_type.shape
    del shape.dim[:]
    for size in dims:
        dim = shape.dim.add()
        if isinstance(size, str):
            dim.dim_param = size
        else:
            dim.dim_value = size


def _site_problem(node: onnx.NodeProto, inputs: dict, outputs: set[str]) -> str | None:
    """Why a TensorScatter is not a slot cache's update, or None."""
    past, present = node.input[0], node.output[0]
    if attribute(node, "axis", -2) != -2 or attribute(node, "mode", b"linear") != b"linear":
        return "not a linear update on axis -2"
    if past not in inputs or not past.startswith("past_") or len(_dims(inputs[past])) != 4:
        return f"its cache {past} is not a [B, H_kv, S_max, D] graph input past_*"
    if present not in outputs or present != past.replace("past_", "present_", 1):
        return f"its output {present} is not the graph output present_* of {past}"
    if len(node.input) < 3 or node.input[2] != "write_index":
        return "its write index is not the write_index input"
    return None


def _batch_from_kv_length(node: onnx.NodeProto) -> onnx.NodeProto:
    """A node that read a slot cache besides its update: the exporter takes the batch size from a
    cache's Shape (dim 0), which in the paged form is the pool's block count; kv_length's dim 0 is
    the batch. Any other reader has no paged equivalent."""
    if node.op_type != "Shape" or attribute(node, "start", 0) != 0 or attribute(node, "end", None) != 1:
        raise PassError(f"page_kv_cache: {node.op_type} {node.name} reads the slot cache {node.input[0]} "
                        "(only its batch dim, Shape [0, 1), has a paged equivalent)")
    batch = onnx.NodeProto()
    batch.CopyFrom(node)
    batch.input[0] = "kv_length"  # [B]
    return batch


def page_kv_cache(model: onnx.ModelProto, block_size: int) -> Rewritten:
    """``model`` with every slot cache paged in blocks of ``block_size`` positions."""
    graph = model.graph
    inputs = {value.name: value for value in graph.input}
    outputs = {value.name for value in graph.output}
    sites, unmatched = [], {}
    for node in graph.node:
        if node.op_type == "TensorScatter":
            problem = _site_problem(node, inputs, outputs)
            if problem is None:
                sites.append(node)
            else:
                unmatched[node.name] = problem
    if not sites:
        return Rewritten(model, 0, unmatched)
    constants: dict[tuple, str] = {}

    def shape(*dims: int) -> str:
        name = f"/paged_kv/shape_{'_'.join(str(d).replace('-', 'm') for d in dims)}"
        constants.setdefault(dims, name)
        return name

    replacement: dict[int, list[onnx.NodeProto]] = {}
    readers: dict[str, str] = {}  # present_* → the gathered [B, H_kv, M·bs, D] its readers take
    new_names: set[str] = set()
    for index, node in enumerate(sites):
        past, update, present = node.input[0], node.input[1], node.output[0]
        _, heads, _, dim = _dims(inputs[past])
        scope = node.name.rsplit("/", 1)[0] if "/" in node.name else ""
        tag = present.removeprefix("present_")
        nodes = [] if index else [helper.make_node("Reshape", [KV_SLOTS, shape(-1, 2)], [KV_SLOT_ROWS],
                                                   name="/paged_kv/kv_slots_rows")]
        nodes += [
            # U [B, H_kv, S, D] → [B, S, H_kv, D] → one row per new token [B·S, H_kv, D]
            helper.make_node("Transpose", [update], [f"{present}_tokens"], perm=[0, 2, 1, 3],
                             name=f"{scope}/paged_{tag}/tokens"),
            helper.make_node("Reshape", [f"{present}_tokens", shape(-1, heads, dim)], [f"{present}_rows"],
                             name=f"{scope}/paged_{tag}/rows"),
            # pool [N, bs, H_kv, D]: each token's row at its (block, offset)
            helper.make_node("ScatterND", [past, KV_SLOT_ROWS, f"{present}_rows"], [present],
                             name=f"{scope}/paged_{tag}/write"),
            helper.make_node("Gather", [present, BLOCK_TABLE], [f"{present}_blocks"], axis=0,
                             name=f"{scope}/paged_{tag}/gather"),  # [B, M, bs, H_kv, D]
            helper.make_node("Reshape", [f"{present}_blocks", shape(0, -1, heads, dim)], [f"{present}_positions"],
                             name=f"{scope}/paged_{tag}/positions"),  # [B, M·bs, H_kv, D]
            helper.make_node("Transpose", [f"{present}_positions"], [f"{present}_paged"], perm=[0, 2, 1, 3],
                             name=f"{scope}/paged_{tag}/read"),  # [B, H_kv, M·bs, D]
        ]
        replacement[id(node)] = nodes
        readers[present] = f"{present}_paged"
        new_names |= {n.name for n in nodes}
    pools = {node.input[0] for node in sites}
    shapes = [node for node in graph.node if node.op_type != "TensorScatter" and pools & set(node.input)]
    for node in shapes:  # (held in a list: replace_nodes finds nodes by id)
        replacement[id(node)] = [_batch_from_kv_length(node)]
    out = replace_nodes(model, replacement)
    for node in out.graph.node:
        if node.name not in new_names:
            for i, name in enumerate(node.input):
                node.input[i] = readers.get(name, name)
    out.graph.initializer.extend(numpy_helper.from_array(np.array(dims, np.int64), name)
                                 for dims, name in constants.items())
    _page_io(out, block_size, pools)
    return Rewritten(out, len(sites), unmatched, metadata={LAYOUT_KEY: "paged", BLOCK_SIZE_KEY: block_size})


def _page_io(model: onnx.ModelProto, block_size: int, pools: set[str]) -> None:
    """The graph's inputs and outputs in the paged form (in place): pools [N, bs, H_kv, D],
    block_table and kv_slots where write_index was (what else reads it computes it from
    position_ids), the mask over M·bs."""
    graph = model.graph
    changed = pools | {name.replace("past_", "present_", 1) for name in pools}
    for value in (*graph.input, *graph.output):
        if value.name in changed:
            _, heads, _, dim = _dims(value)
            _set_dims(value, [POOL_BLOCKS, block_size, heads, dim])
        elif value.name == "attention_mask":
            _set_dims(value, [*_dims(value)[:3], KV_POSITIONS])
    kept = [v for v in graph.value_info if v.name not in changed]
    del graph.value_info[:]
    graph.value_info.extend(kept)
    names = [value.name for value in graph.input]
    at = names.index("write_index") if "write_index" in names else len(names)
    batch = _dims(graph.input[names.index("kv_length")])[0] if "kv_length" in names else "batch"
    seq = next((_dims(v)[1] for v in graph.input if v.name in ("input_ids", "hidden_states")), "seq")
    added = [helper.make_tensor_value_info(BLOCK_TABLE, TensorProto.INT32, [batch, TABLE_BLOCKS]),
             helper.make_tensor_value_info(KV_SLOTS, TensorProto.INT64, [batch, seq, 2])]
    if any("write_index" in reads(node) for node in graph.node):
        # Medusa's path end (heads_at_path_end) reads it: each row's first position is where it writes
        # (step_arrays: position_ids[b, 0] = write_index[b], a tree's root at depth 0, padding too).
        first = numpy_helper.from_array(np.array(0, np.int64), "/paged_kv/first_position")
        graph.initializer.append(first)
        derived = [helper.make_node("Gather", ["position_ids", first.name], ["/paged_kv/write_position"], axis=1,
                                    name="/paged_kv/write_position"),  # [B]
                   helper.make_node("Cast", ["/paged_kv/write_position"], ["write_index"], to=TensorProto.INT64,
                                    name="/paged_kv/write_index")]
        nodes = [*derived, *graph.node]
        del graph.node[:]
        graph.node.extend(nodes)
    values = list(graph.input)
    values[at:at + (0 if at == len(values) else 1)] = added
    del graph.input[:]
    graph.input.extend(values)


def rewrite(model: onnx.ModelProto, ctx: PassContext) -> Rewritten:
    return page_kv_cache(model, ctx.spec.runtime.kv_block_size)


def expected(ctx: PassContext) -> int:
    return 2 * len(ctx.layers)  # a K and a V cache for each decoder layer of this rank's stage


def step_bytes_per_layer(batch: int, seq: int, max_seq_len: int, table_blocks: int, block_size: int, heads: int,
                    head_dim: int, itemsize: int) -> dict[str, int]:
    """What one step moves per layer and per cache (K or V), in bytes, in each form: the slot
    form's attention reads B·S_max positions; the paged form's Gather copies B·M·bs positions and
    its ScatterND writes B·S (in place in ONNX Runtime; TensorRT's Scatter layer is documented as
    copying its input before updating, so it may copy the pool: not measured here)."""
    position = heads * head_dim * itemsize
    return {"slot_attention_reads": batch * max_seq_len * position,
            "paged_gather_copies": batch * table_blocks * block_size * position,
            "paged_scatter_writes": batch * seq * position}

"""The paged TensorRT rank graph (builder/passes/page_kv_cache.py): the spec's layout and its
refusals, a paged step's host arrays, the rewrite against the slot graph in ONNX Runtime (the same
logits, the pool's blocks holding the slot cache's positions), stage/tensor-rank/Medusa graphs, the
engine's profiles, and the TensorRT-RTX build of a paged engine dir."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import pytest

from conftest import TINY_CODE
from trtbuild.builder.errors import SpecError
from trtbuild.builder.spec.document import KVCacheLayout
from trtbuild.builder.spec.resolve import spec_from_dict
from trtbuild.contract.step import paged_step_arrays, step_arrays

BLOCK = 4        # positions per block in the numerics test
S_MAX = 128


def _spec(build: dict | None = None, runtime: dict | None = None, **sections):
    return spec_from_dict({"model": {"checkpoint": str(TINY_CODE), "dtype": "float32"},
                           "build": {"max_batch_size": 4, "max_input_len": 32, "max_seq_len": S_MAX, **(build or {})},
                           "passes": {"numerics": False}, "runtime": {"kv_block_size": BLOCK, **(runtime or {})},
                           **sections})


# -- the spec ------------------------------------------------------------------------------------

def test_layout_is_paged_unless_slots_are_asked_for():
    assert _spec().kv_cache_layout == KVCacheLayout.paged
    assert _spec(parallel={"tensor": 2}).kv_cache_layout == KVCacheLayout.paged
    assert _spec(parallel={"pipeline": 2}).kv_cache_layout == KVCacheLayout.paged
    assert _spec({"kv_cache_layout": "slots"}).kv_cache_layout == KVCacheLayout.slots
    assert _spec({"kv_cache_layout": "slots"}, parallel={"tensor": 2}).kv_cache_layout == KVCacheLayout.slots


@pytest.mark.parametrize("parallel, heads", [({"tensor": 2}, [1, 1]), ({"pipeline": 2}, [2, 2])])
def test_paged_with_several_ranks_gives_each_rank_its_pool(parallel, heads):
    from trtbuild.builder.manifest_entries import kv_cache_entry

    entry = kv_cache_entry(_spec({"kv_cache_layout": "paged"}, parallel=parallel))
    assert entry == {"layout": "paged", "block_size": BLOCK, "pool": [[BLOCK, h, 32] for h in heads]}


@pytest.mark.parametrize("size, problem", [(48, "is not a power of two"), (256, "does not divide max_seq_len 128")])
def test_a_block_size_the_pools_cannot_take_is_refused(size, problem):
    with pytest.raises(SpecError, match=rf"^runtime\.kv_block_size: {size} {problem}; valid: "):
        _spec(runtime={"kv_block_size": size})


def test_an_unknown_layout_is_refused_naming_the_field():
    with pytest.raises(SpecError, match=r"^build\.kv_cache_layout: 'blocks' is not valid; valid: 'slots' or 'paged'$"):
        _spec({"kv_cache_layout": "blocks"})


# -- a paged step's host arrays -----------------------------------------------------------------

def test_paged_step_arrays_place_each_token_in_its_rows_block():
    # Row 0: KV-manager blocks [4, 1] (pool blocks 5, 2), 5 tokens cached, 2 new: positions 5, 6.
    # Row 1: block [2] (pool 3), a 3-token prefill: positions 0-2 (its 3rd slot in S pads it).
    # Row 2: padding up to the batch bucket.
    arrays = paged_step_arrays([[4, 1], [2]], [5, 0], [[11, 12], [21, 22, 23]], block_size=4, table_blocks=3,
                               pad_batch=3)
    assert arrays.block_table.dtype == np.int32 and arrays.kv_slots.dtype == np.int64
    assert arrays.block_table.tolist() == [[5, 2, 0], [3, 0, 0], [0, 0, 0]]
    assert arrays.kv_slots.tolist() == [
        [[2, 1], [2, 2], [0, 3]],   # positions 5, 6 in pool block 2; the pad token (position 7) to scratch
        [[3, 0], [3, 1], [3, 2]],
        [[0, 1], [0, 2], [0, 3]],   # a padding row writes positions M·bs - S .. into the scratch block
    ]
    # The rest is step_arrays over the table's M·bs = 12 positions, less write_index.
    inputs = arrays.as_dict()
    want = step_arrays([[11, 12], [21, 22, 23]], [5, 0], 12, pad_batch=3).as_dict()
    assert set(inputs) == {"input_ids", "position_ids", "kv_length", "attention_mask", "logits_index",
                           "block_table", "kv_slots"}
    for name in ("input_ids", "position_ids", "kv_length", "attention_mask", "logits_index"):
        np.testing.assert_array_equal(inputs[name], want[name])
    assert inputs["attention_mask"].shape == (3, 1, 3, 12)


def test_paged_step_arrays_send_positions_past_the_rows_blocks_to_scratch():
    # One block (4 positions) for a row writing positions 2..5: 4 and 5 have no block of the row.
    arrays = paged_step_arrays([[7]], [2], [[1, 2, 3, 4]], block_size=4, table_blocks=2)
    assert arrays.block_table.tolist() == [[8, 0]]
    assert arrays.kv_slots.tolist() == [[[8, 2], [8, 3], [0, 0], [0, 1]]]


def test_paged_step_arrays_refuse_a_row_wider_than_the_table():
    with pytest.raises(ValueError, match="a row holds 3 blocks, over the table's 2"):
        paged_step_arrays([[0, 1, 2]], [0], [[5]], block_size=4, table_blocks=2)


# -- the engine's profiles ----------------------------------------------------------------------

def test_paged_profiles_cover_the_table_the_slots_and_pools_under_the_scatter_limit():
    from trtbuild.builder.emit.tensorrt import optimization_profiles, pool_blocks_range

    spec = _spec()
    decode, prefill = optimization_profiles(spec)
    most = (2**31 - 1) // (BLOCK * 2 * 32)  # pool [N, 4, 2, 32] stays under TensorRT's Scatter volume
    assert pool_blocks_range(spec) == (2, 4 * S_MAX // BLOCK + 1, most)
    assert decode["past_key_0"] == ((2, BLOCK, 2, 32), (129, BLOCK, 2, 32), (most, BLOCK, 2, 32))
    assert decode["block_table"] == ((1, 1), (spec.cuda_graph_batch_sizes[-1], 16), (4, 32))
    assert decode["kv_slots"] == ((1, 1, 2), (4, 1, 2), (4, 1, 2))
    assert decode["attention_mask"] == ((1, 1, 1, 4), (4, 1, 1, 64), (4, 1, 1, 128))
    assert prefill["kv_slots"] == ((1, 1, 2), (1, 16, 2), (4, 32, 2))
    assert prefill["attention_mask"] == ((1, 1, 1, 4), (1, 1, 16, 64), (4, 1, 32, 128))
    slots = optimization_profiles(_spec({"kv_cache_layout": "slots"}))[0]
    assert "block_table" not in slots and slots["past_key_0"][2] == (4, 2, S_MAX, 32)


# -- the rewrite on the bundled model (one export, then the passes per spec) ----------------------

@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    from trtbuild.builder.export_stage import export_stage

    workdir = tmp_path_factory.mktemp("paged_export")
    return export_stage(_spec(), workdir, None), workdir


def _rank_graphs(exported, spec, out: Path) -> list[onnx.ModelProto]:
    """The spec's finished rank graphs (the CPU stage left out), saved as rankN.onnx under ``out``."""
    from trtbuild.builder.emit.rank_onnx import save_graph
    from trtbuild.builder.frontend.export import load_graph
    from trtbuild.builder.passes import PIPELINE, PassContext
    from trtbuild.builder.passes.instruments import to_onnx
    from trtbuild.builder.passes.manager import PassManager

    result, workdir = exported
    run = PassManager(tuple(p for p in PIPELINE if not p.cpu)).run(
        load_graph(result.path), PassContext.for_spec(spec, weights_dir=workdir))
    models = []
    for rank, graph in enumerate(run.graphs):
        model = to_onnx(graph, run.provenance[rank])
        save_graph(model, out / f"rank{rank}.onnx", workdir)
        models.append(model)
    return models


def _session(path: Path):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def _inputs(model: onnx.ModelProto) -> dict[str, list]:
    return {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in model.graph.input}


@pytest.mark.slow  # one export of the bundled model (~25 s)
def test_paged_graph_gives_the_slot_graphs_logits_and_holds_its_positions(exported, tmp_path):
    from trtbuild.builder.emit.paged_onnx import save_paged_graph

    spec = _spec()
    (model,) = _rank_graphs(exported, spec, tmp_path)
    paged, record = save_paged_graph(model, spec, 0, tmp_path)
    assert record["matches"] == record["expected"] == 12  # K and V of 6 layers
    inputs = _inputs(paged)
    assert "write_index" not in inputs and inputs["block_table"] == ["batch", "table_blocks"]
    assert inputs["kv_slots"] == ["batch", "seq", 2] and inputs["attention_mask"] == ["batch", 1, "seq", "kv_positions"]
    assert inputs["past_value_5"] == ["pool_blocks", BLOCK, 2, 32]
    slot, pool = _session(tmp_path / "rank0.onnx"), _session(tmp_path / "rank0.paged.onnx")
    names = [f"{kind}_{layer}" for layer in range(6) for kind in ("key", "value")]
    slot_caches = {f"past_{n}": np.zeros((2, 2, S_MAX, 32), np.float32) for n in names}
    pools = {f"past_{n}": np.zeros((8, BLOCK, 2, 32), np.float32) for n in names}
    # Blocks out of order: row 0 → pool blocks [5, 2, 7], row 1 → [3, 6] (KV-manager ids one less).
    blocks = [[4, 1, 6], [2, 5]]
    rng = np.random.default_rng(0)
    tokens, starts, diffs = [rng.integers(1, 4096, 7).tolist(), rng.integers(1, 4096, 4).tolist()], [0, 0], []
    for _ in range(4):  # a prefill of 7 and 4 tokens, then 3 greedy decode steps
        got = dict(zip([o.name for o in slot.get_outputs()],
                       slot.run(None, {**step_arrays(tokens, starts, S_MAX).as_dict(), **slot_caches})))
        paged_got = dict(zip([o.name for o in pool.get_outputs()],
                             pool.run(None, {**paged_step_arrays(blocks, starts, tokens, BLOCK, 3).as_dict(), **pools})))
        diffs.append(float(np.abs(got["logits"] - paged_got["logits"]).max()))
        slot_caches = {f"past_{n}": got[f"present_{n}"] for n in names}
        pools = {f"past_{n}": paged_got[f"present_{n}"] for n in names}
        starts = [start + len(row) for start, row in zip(starts, tokens)]
        tokens = [[int(t)] for t in got["logits"][:, -1].argmax(-1)]
    assert max(diffs) <= 1e-5, diffs  # logits max abs diff, float32
    assert starts == [10, 7]
    for row, length in enumerate(starts):
        for position in range(length):
            block = blocks[row][position // BLOCK] + 1
            for name in names:
                np.testing.assert_array_equal(pools[f"past_{name}"][block, position % BLOCK],
                                              slot_caches[f"past_{name}"][row, :, position])


@pytest.mark.slow  # one export of the bundled model (~25 s)
@pytest.mark.parametrize("parallel, layers, heads", [({"pipeline": 2}, [range(0, 3), range(3, 6)], 2),
                                                     ({"tensor": 2}, [range(0, 6)] * 2, 1)])
def test_stage_and_tensor_rank_graphs_page_their_own_caches(exported, tmp_path, parallel, layers, heads):
    from trtbuild.builder.passes.page_kv_cache import page_kv_cache

    spec = _spec({"kv_cache_layout": "slots"}, parallel=parallel)
    for rank, model in enumerate(_rank_graphs(exported, spec, tmp_path)):
        done = page_kv_cache(model, BLOCK)
        assert done.matches == 2 * len(layers[rank])
        pools = {name: dims for name, dims in _inputs(done.model).items() if name.startswith("past_")}
        assert pools == {f"past_{kind}_{layer}": ["pool_blocks", BLOCK, heads, 32]
                         for layer in layers[rank] for kind in ("key", "value")}


@dataclass(frozen=True)
class _Tree:
    """A root and two children (TreeRows)."""

    size: int = 3
    depths: np.ndarray = field(default_factory=lambda: np.array([0, 1, 1]))
    ancestors: np.ndarray = field(default_factory=lambda: np.array([[1, 0, 0], [1, 1, 0], [1, 0, 1]], bool))


@pytest.mark.slow  # one export of the bundled model (~25 s)
def test_medusa_heads_are_untouched_by_the_paging(exported, tmp_path):
    """The heads at each row's path end (which reads the rows' write positions) agree with the slot
    graph's at a prefill and at a verification of a tree beside a plain decode row."""
    from trtbuild.builder.passes.page_kv_cache import page_kv_cache

    spec = _spec(speculative={"medusa": {"heads": str(TINY_CODE / "medusa"), "num_heads": 4, "tree": [[0], [1]]}})
    (model,) = _rank_graphs(exported, spec, tmp_path)
    done = page_kv_cache(model, BLOCK)
    assert done.matches == 12 and "write_index" not in _inputs(done.model)
    onnx.save_model(done.model, tmp_path / "rank0.paged.onnx")
    slot, pool = _session(tmp_path / "rank0.onnx"), _session(tmp_path / "rank0.paged.onnx")
    outputs = ["logits", "medusa_logits", *(f"present_{n}" for n in _names())]
    slot_caches = {f"past_{n}": np.zeros((2, 2, S_MAX, 32), np.float32) for n in _names()}
    pools = {f"past_{n}": np.zeros((6, BLOCK, 2, 32), np.float32) for n in _names()}
    blocks = [[3, 1], [0]]  # pool blocks [4, 2] and [1]
    steps = [([[5, 6, 7], [8, 9]], [0, 0], ()), ([[10, 11, 12], [13]], [3, 2], (_Tree(), None))]
    for tokens, starts, trees in steps:
        want = slot.run(outputs, {**step_arrays(tokens, starts, S_MAX, trees=trees).as_dict(), **slot_caches})
        got = pool.run(outputs, {**paged_step_arrays(blocks, starts, tokens, BLOCK, 2, trees=trees).as_dict(), **pools})
        for name, a, b in zip(outputs[:2], want, got):
            assert np.abs(a - b).max() <= 1e-5, name  # logits / heads max abs diff, float32
        slot_caches = {f"past_{n}": a for n, a in zip(_names(), want[2:])}
        pools = {f"past_{n}": b for n, b in zip(_names(), got[2:])}


def _names() -> list[str]:
    return [f"{kind}_{layer}" for layer in range(6) for kind in ("key", "value")]


# -- the TensorRT-RTX build of a paged engine dir ------------------------------------------------

def test_paged_engine_dir_lists_its_graph_and_layout_and_inspects(tiny_engine, tmp_path):
    """specs/tiny-code.yaml is single-rank, so paged: the engine comes from rank0.paged.onnx, which
    reads rank0.onnx.data (no second copy of the weights) and is listed and hashed."""
    from trtbuild.contract.manifest import sha256_file
    from trtbuild.runtime.engine_dir import EngineDirError, load

    manifest = json.loads((tiny_engine / "manifest.json").read_text())
    assert manifest["kv_cache"] == {"layout": "paged", "block_size": 16, "pool": [[16, 2, 32]]}
    rank = manifest["ranks"][0]
    assert rank["paged_onnx"] == "rank0.paged.onnx" and rank["onnx_data"] == "rank0.onnx.data"
    for name in ("rank0.paged.onnx", "rank0.onnx", "rank0.onnx.data", "rank0.engine"):
        assert manifest["files"][name]["sha256"] == sha256_file(tiny_engine / name), name
    graph = onnx.load(tiny_engine / "rank0.paged.onnx", load_external_data=False)
    locations = {e.value for t in graph.graph.initializer for e in t.external_data if e.key == "location"}
    assert locations == {"rank0.onnx.data"}
    assert not any(name.startswith("rank0.paged.onnx.data") for name in manifest["files"])
    record = next(r for r in map(json.loads, (tiny_engine / "passes.jsonl").read_text().splitlines())
                  if r["pass"] == "page_kv_cache")
    assert record["matches"] == 12 and record["kv_bytes_per_layer"]["paged_scatter_writes"] == 2 * 8 * 1 * 2 * 32 * 4
    assert load(tiny_engine).kv_cache.paged
    shown = subprocess.run([sys.executable, "-m", "trtbuild.cli", "inspect", str(tiny_engine)],
                           capture_output=True, text=True)
    assert shown.returncode == 0, shown.stderr
    assert "all hashes verify" in shown.stdout and "paged: a pool of 16-position blocks" in shown.stdout
    # A manifest claiming slots for this engine is refused at load, as is a graph that differs from the I/O table.
    copy = tmp_path / "claims-slots"
    shutil.copytree(tiny_engine, copy)
    edited = {**manifest, "kv_cache": {"layout": "slots", "block_size": 16, "pool": None}}
    (copy / "manifest.json").write_text(json.dumps(edited))
    with pytest.raises(EngineDirError, match="rank 0's engine I/O is not the slots layout the manifest claims"):
        load(copy, verify_hashes=False)
    io = [row for row in rank["io"] if row["name"] != "block_table"]
    edited = {**manifest, "ranks": [{**rank, "io": io}]}
    (copy / "manifest.json").write_text(json.dumps(edited))
    with pytest.raises(EngineDirError, match="rank0.paged.onnx: its inputs and outputs differ from the manifest's I/O "
                                             r"table \(block_table\)"):
        load(copy, verify_hashes=False)



@pytest.mark.slow  # builds specs/tiny-code-tp2.yaml
def test_a_tensor_parallel_engine_dir_is_paged_with_each_ranks_pool(tp2_engine, tmp_path):
    """Paged is the default for several ranks too: each rank's engine comes from its rankN.paged.onnx
    and its pool holds its own KV head; a manifest whose pools are not the ranks' is refused at load."""
    from trtbuild.runtime.engine_dir import EngineDirError, load

    manifest = json.loads((tp2_engine / "manifest.json").read_text())
    assert manifest["kv_cache"] == {"layout": "paged", "block_size": 16, "pool": [[16, 1, 32], [16, 1, 32]]}
    assert [rank["paged_onnx"] for rank in manifest["ranks"]] == ["rank0.paged.onnx", "rank1.paged.onnx"]
    assert load(tp2_engine).kv_cache.paged
    copy = tmp_path / "claims-other-pools"
    shutil.copytree(tp2_engine, copy)
    for pools, refusal in [([[16, 1, 32], [16, 2, 32]], "rank 1's engine I/O is not the paged layout the manifest claims"),
                           ([[16, 1, 32]], "kv_cache.pool must give each of the 2 ranks' pool")]:
        (copy / "manifest.json").write_text(json.dumps({**manifest, "kv_cache": {**manifest["kv_cache"], "pool": pools}}))
        with pytest.raises(EngineDirError, match=re.escape(refusal)):
            load(copy, verify_hashes=False)

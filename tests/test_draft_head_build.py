"""A draft head built into the engine dir (spec ``speculative.draft_head``): the refusals at build
(one line, exit 2, nothing written), the manifest's ``draft_head`` entry and its files, the
target's ``draft_features`` in every graph, and ONNX Runtime's features of each step kind against
a torch reference (the draft's fuse over transformers' hidden states)."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from click.testing import CliRunner

from trtbuild.builder.draft_head.model import load_draft_head, random_draft_head, save_draft_head
from trtbuild.builder.emit.cpu_step_model import decode_branch, verify_branch
from trtbuild.cli.main import main
from trtbuild.contract.draft_head import (CONFIG_FILE, DRAFT_FEATURES, DRAFT_GRAPH, WEIGHTS_FILE, DraftHeadConfig,
                                          DraftLayerShape, default_taps)
from trtbuild.contract.speculation import DraftHeadSourceConfig, Source
from trtbuild.runtime.backends.onnxruntime.engine import OnnxRuntimeEngine
from trtbuild.runtime.core.step import Step, StepKind
from trtbuild.runtime.core.tree import Tree
from trtbuild.runtime.engine_dir import EngineDirError, load

from conftest import TINY_CODE, write_spec

DRAFT_VOCAB = 64
PROMPTS = ([17, 2050, 311, 99, 4001, 7, 1234], [5, 600, 3100, 42, 42, 8, 901])  # 7 tokens each
CHAIN = Tree(((0,), (0, 0), (0, 0, 0)))  # a root and three guesses in a row


def _target_config() -> dict:
    return json.loads((TINY_CODE / "config.json").read_text())


def _draft_config(**changes) -> DraftHeadConfig:
    """A draft head config of the bundled model's shapes (its default taps), with ``changes``."""
    c = _target_config()
    layer = DraftLayerShape(hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
                            num_heads=c["num_attention_heads"], num_kv_heads=c["num_key_value_heads"],
                            head_dim=c["head_dim"], rms_norm_eps=c["rms_norm_eps"], rope_theta=10000.0)
    fields = dict(taps=default_taps(c["num_hidden_layers"]), target_vocab_size=c["vocab_size"],
                  target_num_layers=c["num_hidden_layers"], draft_vocab_size=DRAFT_VOCAB, layer=layer,
                  accuracy={"top1": 0.25, "top5": 0.5})
    return DraftHeadConfig(**{**fields, **changes})


def make_draft_dir(out: Path, map_ids: np.ndarray | None = None) -> Path:
    """A draft head of small random weights (seeded) over the bundled model's shapes."""
    ids = np.arange(DRAFT_VOCAB) * 7 if map_ids is None else map_ids
    save_draft_head(random_draft_head(_draft_config(), std=0.05, draft_to_target=ids), out)
    return out


def _spec(tmp_path: Path, draft: Path | str, **sections) -> Path:
    speculative = {"draft_head": {"path": str(draft), "num_tokens": 4}}
    return write_spec(tmp_path / "spec.yaml", TINY_CODE, speculative=speculative, **sections)


def _cli_build(spec: Path, out: Path):
    return CliRunner().invoke(main, ["build", str(spec), "-o", str(out)])


# --- refusals at build: one line, exit 2, nothing written ----------------------------------------

def _refused(tmp_path: Path, spec: Path) -> str:
    out = tmp_path / "engine"
    result = _cli_build(spec, out)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert not out.exists() and not any(p.name.startswith(".engine") for p in tmp_path.iterdir())
    return lines[0]


@pytest.mark.parametrize("changes, says", [
    ({"layer": DraftLayerShape(128, 768, 4, 2, 32, 1e-5, 10000.0)}, "the draft's hidden size 128 != the target's 256"),
    ({"target_num_layers": 8, "taps": (2, 4, 5)},
     "trained on a target of 8 layers (taps [2, 4, 5]); this target has 6"),
    ({"target_vocab_size": 5000}, "the draft's target vocabulary 5000 != the target's 4096"),
])
def test_a_draft_that_does_not_fit_the_target_is_refused_naming_both_sides(tmp_path, changes, says):
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / CONFIG_FILE).write_text(json.dumps(_draft_config(**changes).to_json()))
    line = _refused(tmp_path, _spec(tmp_path, draft))
    assert line.startswith("error: speculative.draft_head.path: ") and line.endswith(says)


def test_the_plan_counts_the_draft_heads_weights_in_the_engine_dir(tmp_path):
    from trtbuild.builder.plan.build_cost import spec_build_plan
    from trtbuild.builder.spec.resolve import load_spec

    draft = make_draft_dir(tmp_path / "draft")
    size = (draft / WEIGHTS_FILE).stat().st_size
    with_draft = _spec(tmp_path, draft)
    plain = write_spec(tmp_path / "plain.yaml", TINY_CODE)
    assert spec_build_plan(load_spec(with_draft)).dir_bytes == spec_build_plan(load_spec(plain)).dir_bytes + size
    shown = {name: CliRunner().invoke(main, ["plan", str(spec), "--json"]) for name, spec in
             (("draft", with_draft), ("plain", plain))}
    assert all(r.exit_code == 0 for r in shown.values()), shown
    builds = {name: json.loads(r.stdout)["build"] for name, r in shown.items()}
    assert builds["draft"]["draft_bytes"] == size and builds["plain"]["draft_bytes"] == 0
    assert builds["draft"]["dir_bytes"] == builds["plain"]["dir_bytes"] + size
    text = CliRunner().invoke(main, ["plan", str(with_draft)]).stdout
    assert "(engines + the CPU graphs' weights + the draft head)" in text


def test_a_missing_draft_dir_is_refused(tmp_path):
    line = _refused(tmp_path, _spec(tmp_path, tmp_path / "nowhere"))
    assert line == (f"error: speculative.draft_head.path: {tmp_path / 'nowhere'}: draft head dir does not exist "
                    "(make one with `trtbuild draft train`)")


def test_a_draft_dir_linking_outside_itself_is_refused(tmp_path):
    outside = make_draft_dir(tmp_path / "outside")
    draft = tmp_path / "draft"
    draft.mkdir()
    shutil.copy(outside / CONFIG_FILE, draft / CONFIG_FILE)
    os.symlink(outside / WEIGHTS_FILE, draft / WEIGHTS_FILE)
    line = _refused(tmp_path, _spec(tmp_path, draft))
    assert line == f"error: {draft / WEIGHTS_FILE}: missing, or a link leading outside the draft dir"


def test_a_map_with_ids_outside_the_target_vocabulary_is_refused(tmp_path):
    ids = np.arange(DRAFT_VOCAB)
    ids[5] = 4096  # the target's vocabulary is [0, 4096)
    draft = make_draft_dir(tmp_path / "draft", map_ids=ids)
    line = _refused(tmp_path, _spec(tmp_path, draft))
    assert line == (f"error: {draft / WEIGHTS_FILE}: draft_to_target holds ids outside the target's vocabulary "
                    "[0, 4096)")


@pytest.mark.parametrize("parallel", [{"tensor": 2}, {"pipeline": 2}])
def test_a_draft_head_with_tensor_or_pipeline_parallelism_is_refused(tmp_path, parallel):
    draft = make_draft_dir(tmp_path / "draft")
    line = _refused(tmp_path, _spec(tmp_path, draft, parallel=parallel))
    tensor, pipeline = parallel.get("tensor", 1), parallel.get("pipeline", 1)
    assert line == (f"error: speculative.draft_head: not built with parallel.tensor {tensor} × parallel.pipeline "
                    f"{pipeline} yet; a draft head engine is single-rank (tensor: 1, pipeline: 1)")


def test_num_tokens_out_of_range_is_refused(tmp_path):
    draft = make_draft_dir(tmp_path / "draft")
    spec = write_spec(tmp_path / "spec.yaml", TINY_CODE,
                      speculative={"draft_head": {"path": str(draft), "num_tokens": 65}})
    assert _refused(tmp_path, spec) == "error: speculative.draft_head.num_tokens: 65: valid 1 to 64"


# --- the built engine dir (one build, slow) ------------------------------------------------------

@pytest.fixture(scope="module")
def draft_engine(tmp_path_factory) -> tuple[Path, Path]:
    """The bundled model built with a random draft head: (engine dir, draft dir)."""
    root = tmp_path_factory.mktemp("draft_head")
    draft = make_draft_dir(root / "draft")
    result = _cli_build(_spec(root, draft), root / "engine")
    assert result.exit_code == 0, result.output
    return root / "engine", draft


@pytest.fixture(scope="module")
def reference(draft_engine):
    """features(tokens) [S, D]: the draft's fuse over transformers' hidden states after its taps."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(TINY_CODE, dtype=torch.float32).eval()
    draft = load_draft_head(draft_engine[1], model.model.embed_tokens)

    def features(tokens: list[int]) -> np.ndarray:
        with torch.no_grad():
            hidden = model(torch.tensor([tokens]), output_hidden_states=True).hidden_states
            taps = torch.cat([hidden[t + 1] for t in draft.config.taps], dim=-1)  # after layer t: [1, S, 3D]
            return draft.fuse_taps(taps)[0].numpy()
    return features


def _max_abs(got: np.ndarray, want: np.ndarray) -> float:
    assert got.shape == want.shape, (got.shape, want.shape)
    return float(np.abs(got.astype(np.float64) - want).max())


@pytest.mark.slow
def test_manifest_records_the_draft_head_and_hashes_its_graph(draft_engine):
    engine, draft = draft_engine
    manifest = json.loads((engine / "manifest.json").read_text())
    taps = list(default_taps(6))
    assert manifest["draft_head"] == {"graph": DRAFT_GRAPH, "taps": taps, "draft_vocab_size": DRAFT_VOCAB,
                                      "hidden": 256, "accuracy": {"top1": 0.25, "top5": 0.5}, "num_tokens": 4}
    assert manifest["speculation"]["sources"] == ["draft_head"] and manifest["speculation"]["verify_tokens"] == 5
    for name in (DRAFT_GRAPH, DRAFT_GRAPH + ".data"):
        data = (engine / name).read_bytes()
        assert manifest["files"][name] == {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    d = load(engine)
    assert d.draft_head.taps == tuple(taps) and d.draft_head.num_tokens == 4
    assert d.speculation.sources == (Source.draft_head,)
    assert d.speculation.draft_head == DraftHeadSourceConfig(4)
    shown = CliRunner().invoke(main, ["inspect", str(engine)]).output.splitlines()
    assert ("draft head   draft.onnx: features of layers [2, 3, 4], draft vocabulary 64, chains of up to 4; "
            "held-out top1 0.250, top5 0.500") in shown


@pytest.mark.slow
def test_every_graph_outputs_draft_features_and_the_fusions_keep_their_counts(draft_engine):
    engine, _ = draft_engine
    graphs = {name: onnx.load(engine / name, load_external_data=False)
              for name in ("rank0.onnx", "rank0.paged.onnx", "rank0.cpu.onnx")}
    step = graphs["rank0.cpu.onnx"]
    graphs.update(decode=decode_branch(step), verify=verify_branch(step))
    (if_node,) = [n for n in step.graph.node if n.op_type == "If"]
    branches = [a.g for a in if_node.attribute]
    inner = [n for g in branches for n in g.node if n.op_type == "If"]
    branches += [a.g for n in inner for a in n.attribute]  # the verification graph and the rank graph
    assert len(branches) == 4
    for branch in branches:  # every If-branch outputs the features (renamed by its tag)
        assert any(o.name.endswith(DRAFT_FEATURES) for o in branch.output), branch.name
    for name, model in graphs.items():
        (out,) = [o for o in model.graph.output if o.name == DRAFT_FEATURES]
        dims = [d.dim_param or d.dim_value for d in out.type.tensor_type.shape.dim]
        assert out.type.tensor_type.elem_type == onnx.TensorProto.FLOAT and dims[2] == 256, (name, dims)
    records = {r["pass"]: r for r in map(json.loads, (engine / "passes.jsonl").read_text().splitlines())}
    matches = {name: records[name]["matches"] for name in (
        "fuse_rmsnorm", "fuse_rotary", "fuse_attention", "cpu_group_query_attention", "cpu_pack_qkv",
        "cpu_skip_norm", "cpu_verify_attention", "cpu_verify_skip_norm", "page_kv_cache")}
    # 6 layers: two norms each and the final one, q and k rotated, one attention, 2 caches each.
    assert matches == {"fuse_rmsnorm": 13, "fuse_rotary": 12, "fuse_attention": 6, "cpu_group_query_attention": 6,
                       "cpu_pack_qkv": 6, "cpu_skip_norm": 12, "cpu_verify_attention": 6,
                       "cpu_verify_skip_norm": 12, "page_kv_cache": 12}
    assert all(r["numerics"]["ok"] for r in records.values() if isinstance(r.get("numerics"), dict))


@pytest.mark.slow
def test_onnxruntime_features_equal_the_torch_reference_at_every_step_kind(draft_engine, reference):
    """Prefill of 7 (two rows), a plain decode step, a 4-token chain verified: the features at
    each new position equal the reference over the sequence so far (max abs ≤ 1e-4)."""
    d = load(draft_engine[0])
    engine = OnnxRuntimeEngine(d, threads=2)
    rids, rows = ("a", "b"), len(PROMPTS)
    out = engine.step(Step(kind=StepKind.prefill, first_slot=0, rids=rids, tokens=tuple(map(tuple, PROMPTS)),
                           starts=(0,) * rows, samples=(True,) * rows))
    assert out.draft_features.dtype == np.float32
    prefill = np.stack([reference(p) for p in PROMPTS])  # [2, 7, D]
    assert _max_abs(out.draft_features, prefill) <= 1e-4
    nexts = [int(t) for t in out.logits[:, -1].argmax(-1)]
    out = engine.step(Step(kind=StepKind.decode, first_slot=0, rids=rids, tokens=tuple((t,) for t in nexts),
                           starts=(7,) * rows, samples=(True,) * rows))
    decoded = np.stack([reference(p + [t])[7:] for p, t in zip(PROMPTS, nexts)])  # [2, 1, D]
    assert _max_abs(out.draft_features, decoded) <= 1e-4
    chains = [[int(t), 88, 1500, 9] for t in out.logits[:, 0].argmax(-1)]
    out = engine.step(Step(kind=StepKind.decode, first_slot=0, rids=rids, tokens=tuple(map(tuple, chains)),
                           starts=(8,) * rows, samples=(True,) * rows, trees=(CHAIN,) * rows))
    verified = np.stack([reference(p + [t] + c)[8:] for p, t, c in zip(PROMPTS, nexts, chains)])  # [2, 4, D]
    assert _max_abs(out.draft_features, verified) <= 1e-4
    one = engine.step(Step(kind=StepKind.decode, first_slot=0, rids=("a",), tokens=(tuple(chains[0]),),
                           starts=(8,), samples=(True,), trees=(CHAIN,)))  # one row: the CPU verification graph
    assert engine.verifies_on_cpu_graph and _max_abs(one.draft_features, verified[:1]) <= 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("decode_graph", [True, False])
def test_a_greedy_runs_steps_expose_their_features(draft_engine, reference, decode_graph):
    d = load(draft_engine[0])
    engine = OnnxRuntimeEngine(d, threads=2, use_decode_graph=decode_graph)
    prompt = PROMPTS[0]
    out = engine.step(Step(kind=StepKind.prefill, first_slot=0, rids=("a",), tokens=(tuple(prompt),),
                           starts=(0,), samples=(True,)))
    tokens = [int(out.logits[0, -1].argmax())]
    run = engine.greedy_run(Step(kind=StepKind.decode, first_slot=0, rids=("a",), tokens=((tokens[0],),),
                                 starts=(len(prompt),), samples=(True,)))
    features = []
    for _ in range(4):
        tokens += run.advance()
        features.append(run.features.copy())  # [1, 1, D]: the position the step consumed
    want = reference(prompt + tokens)[len(prompt):len(prompt) + 4]  # [4, D]
    assert _max_abs(np.concatenate(features, axis=1)[0], want) <= 1e-4


@pytest.mark.slow
def test_a_plain_engine_gives_no_features(tiny_engine):
    engine = OnnxRuntimeEngine(load(tiny_engine), threads=2)
    out = engine.step(Step(kind=StepKind.prefill, first_slot=0, rids=("a",), tokens=(tuple(PROMPTS[0]),),
                           starts=(0,), samples=(True,)))
    assert out.draft_features is None
    run = engine.greedy_run(Step(kind=StepKind.decode, first_slot=0, rids=("a",), tokens=((5,),), starts=(7,),
                                 samples=(True,)))
    run.advance()
    assert run.features is None


def _edited(engine: Path, tmp_path: Path, edit) -> Path:
    copy = tmp_path / "edited"
    shutil.copytree(engine, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    edit(manifest)
    (copy / "manifest.json").write_text(json.dumps(manifest))
    return copy


@pytest.mark.slow
@pytest.mark.parametrize("edit, says", [
    (lambda m: m.update(draft_head=None),
     "speculation.sources lists draft_head exactly when the engine has a draft head"),
    (lambda m: m["draft_head"].update(graph="../draft.onnx"),
     "draft_head.graph '../draft.onnx': a file name in the engine dir's top folder expected"),
    (lambda m: m["draft_head"].update(graph="sub/draft.onnx"),
     "draft_head.graph 'sub/draft.onnx': a file name in the engine dir's top folder expected"),
    (lambda m: m["draft_head"].update(graph="missing.onnx"),
     "draft_head.graph 'missing.onnx' is not a file the manifest lists"),
    (lambda m: m["draft_head"].update(graph="rank0.onnx.data"), "rank0.onnx.data"),
    (lambda m: m["draft_head"].update(taps=[2, 3, 6]), "draft_head.taps [2, 3, 6]: 3 layer indices in [0, 6) expected"),
    (lambda m: m["draft_head"].update(hidden=128), "draft_head.hidden 128 != the model's hidden_size 256"),
    (lambda m: m["draft_head"].pop("accuracy"), "draft_head. must be an object with accuracy"),
])
def test_a_bad_draft_head_entry_is_refused_at_load(draft_engine, tmp_path, edit, says):
    with pytest.raises(EngineDirError) as refused:
        load(_edited(draft_engine[0], tmp_path, edit))
    assert says in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.slow
def test_a_draft_map_naming_one_token_twice_is_refused(draft_engine, tmp_path):
    """Two draft ids for one target id would split that token's draft probability (the
    full-distribution rule reads q per target id): refused in one line at load."""
    from safetensors.numpy import save_file

    from trtbuild.contract.draft_head import DRAFT_MAP_FILE, MAP_TENSOR
    from trtbuild.runtime.speculation.draft_head_source import read_draft_map

    copy = _edited(draft_engine[0], tmp_path, lambda m: None)
    ids = np.arange(DRAFT_VOCAB, dtype=np.int64) * 7
    ids[1] = ids[0]
    save_file({MAP_TENSOR: ids}, str(copy / DRAFT_MAP_FILE))
    with pytest.raises(ValueError, match="maps two draft ids to one target id") as refused:
        read_draft_map(load(copy, verify_hashes=False))
    assert "\n" not in str(refused.value)


def test_skip_norm_keeps_the_graph_sorted_where_the_sum_has_a_reader_before_the_norm():
    """The residual sum read by a node between the Add and its norm (a draft head's tap): the fused
    node produces the sum where the Add did, so the model stays topologically sorted (a subgraph of
    rankN.cpu.onnx must be) and computes what it did."""
    from onnx import TensorProto, helper

    from trtbuild.builder.passes.cpu_skip_norm import skip_norm

    x = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 2, 4]) for n in ("a", "b")]
    weight = helper.make_tensor("w", TensorProto.FLOAT, [4], [1.0, 0.5, 2.0, 1.5])
    nodes = [helper.make_node("Add", ["a", "b"], ["sum"], name="add"),
             helper.make_node("Mul", ["sum", "sum"], ["tapped"], name="tap"),  # reads the sum before the norm
             helper.make_node("RMSNormalization", ["sum", "w"], ["normed"], name="norm", axis=-1, epsilon=1e-5)]
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 2, 4]) for n in ("tapped", "normed")]
    model = helper.make_model(helper.make_graph(nodes, "g", x, outputs, [weight]),
                              opset_imports=[helper.make_opsetid("", 24), helper.make_opsetid("com.microsoft", 1)])
    done = skip_norm(model)
    assert done.matches == 1
    onnx.checker.check_model(done.model)  # raises on a node reading a value produced after it
    import onnxruntime as ort

    feeds = {"a": np.arange(8, dtype=np.float32).reshape(1, 2, 4), "b": np.ones((1, 2, 4), np.float32)}
    want = ort.InferenceSession(model.SerializeToString()).run(None, feeds)
    got = ort.InferenceSession(done.model.SerializeToString()).run(None, feeds)
    assert all(np.abs(g - w).max() <= 1e-6 for g, w in zip(got, want))


@pytest.mark.slow
def test_tensorrt_engine_returns_the_features_as_onnxruntime_does(monkeypatch, draft_engine):
    """TensorRTEngine on a simulated device (tests/simulated_device.py), the paged engine built
    with the extra output: prefill and a verified chain give ONNX Runtime's features."""
    from trtbuild.runtime.backends.tensorrt.engine import TensorRTEngine

    from simulated_device import SimulatedDevice

    SimulatedDevice(compute_capability="sm89").install(monkeypatch, [draft_engine[0]])
    d = load(draft_engine[0])

    def features(engine) -> list[np.ndarray]:
        # No block tables: a paged engine's row reads and writes its scratch block (11 positions fit).
        out = engine.step(Step(kind=StepKind.prefill, first_slot=0, rids=("a",), tokens=(tuple(PROMPTS[0]),),
                               starts=(0,), samples=(True,)))
        first = out.draft_features.copy()
        out = engine.step(Step(kind=StepKind.decode, first_slot=0, rids=("a",), tokens=((5, 88, 1500, 9),),
                               starts=(7,), samples=(True,), trees=(CHAIN,)))
        return [first, out.draft_features.copy()]

    engine = TensorRTEngine(d)
    try:
        got = features(engine)
    finally:
        engine.close()
    want = features(OnnxRuntimeEngine(d, threads=2))
    assert [g.shape for g in got] == [(1, 7, 256), (1, 4, 256)]
    assert all(_max_abs(g, w) <= 1e-4 for g, w in zip(got, want))


@pytest.mark.slow
def test_the_engine_dirs_draft_graph_runs_as_the_draft_step_and_shares_the_rank_embedding(draft_engine):
    """draft.onnx from the engine dir in ONNX Runtime: the torch draft step's logits and hidden
    (max abs ≤ 1e-4) on a batch of 2 rows of 3 tokens; its token embedding read from
    rank0.onnx.data (the rank's bytes), not written twice."""
    import onnxruntime as ort
    from transformers import AutoModelForCausalLM

    from trtbuild.builder.draft_head.model import DraftHeadStep

    engine, draft_dir = draft_engine
    graph = onnx.load(engine / DRAFT_GRAPH, load_external_data=False)
    (embed,) = [t for t in graph.graph.initializer if list(t.dims) == [4096, 256]]
    assert {e.key: e.value for e in embed.external_data}["location"] == "rank0.onnx.data"
    embed_bytes = 4096 * 256 * 4
    assert (engine / (DRAFT_GRAPH + ".data")).stat().st_size < embed_bytes  # the layer and the K-row head only

    model = AutoModelForCausalLM.from_pretrained(TINY_CODE, dtype=torch.float32).eval()
    step = DraftHeadStep(load_draft_head(draft_dir, model.model.embed_tokens), max_seq_len=128).eval()
    rng = np.random.default_rng(0)
    batch, seq, s_max = 2, 3, 128
    mask = np.zeros((batch, 1, seq, s_max), bool)
    mask[:, 0, :, :seq] = np.tril(np.ones((seq, seq), bool))
    feeds = {"input_ids": rng.integers(0, 4096, (batch, seq)).astype(np.int32),
             "position_ids": np.tile(np.arange(seq, dtype=np.int32), (batch, 1)),
             "write_index": np.zeros(batch, np.int64), "kv_length": np.full(batch, seq, np.int64),
             "attention_mask": mask, "logits_index": np.tile(np.arange(seq, dtype=np.int64), (batch, 1)),
             "features": rng.standard_normal((batch, seq, 256)).astype(np.float32),
             "past_key_0": np.zeros((batch, 2, s_max, 32), np.float32),
             "past_value_0": np.zeros((batch, 2, s_max, 32), np.float32)}
    got = ort.InferenceSession(str(engine / DRAFT_GRAPH)).run(["draft_logits", "draft_hidden"], feeds)
    with torch.no_grad():
        want = step(*(torch.from_numpy(v) for v in feeds.values()))
    assert got[0].shape == (batch, seq, DRAFT_VOCAB)
    assert _max_abs(got[0], want[0].numpy()) <= 1e-4 and _max_abs(got[1], want[1].numpy()) <= 1e-4

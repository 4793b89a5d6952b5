"""Pipeline parallelism: stage arithmetic, the manifest's rank grid and its trust check, stage
builds at P=2 and T×P = 2×2 (numerics gate, exact per-rank weight bytes, inspect's grid) and a
broken pass on stage 1 named by the numerics gate."""
from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import onnx_graphsurgeon as gs
import pytest
import yaml
from safetensors import safe_open

from conftest import REPO, TINY_CODE
from trtbuild.builder.spec.resolve import spec_from_dict
from trtbuild.contract.manifest import ManifestError, check_rank_grid
from trtbuild.contract.pipeline import (HIDDEN_STATES, HIDDEN_STATES_OUT, balanced_layers, cache_layer,
                                       stage_cache_names, stage_layers)

CONFIG = json.loads((TINY_CODE / "config.json").read_text())


def _spec(**parallel):
    return spec_from_dict({"model": {"checkpoint": str(TINY_CODE), "dtype": "float32"},
                           "build": {"max_seq_len": 1024, "max_input_len": 256}, "parallel": parallel})


def test_stages_are_balanced_or_as_listed():
    assert balanced_layers(6, 4) == (2, 2, 1, 1)
    assert stage_layers((2, 2, 1, 1)) == (range(0, 2), range(2, 4), range(4, 5), range(5, 6))
    assert _spec(pipeline=4).stages == (range(0, 2), range(2, 4), range(4, 5), range(5, 6))
    assert _spec(pipeline=2, layers_per_stage=[1, 5]).stages == (range(0, 1), range(1, 6))
    spec = _spec(tensor=2, pipeline=3)
    assert spec.world_size == 6 and spec.kv_heads_per_rank == 1  # KV heads split over T, not T·P
    grid = [(r.rank, r.stage, r.tensor_rank, r.layers, r.first, r.last) for r in spec.ranks]
    assert grid == [(0, 0, 0, range(0, 2), True, False), (1, 0, 1, range(0, 2), True, False),
                    (2, 1, 0, range(2, 4), False, False), (3, 1, 1, range(2, 4), False, False),
                    (4, 2, 0, range(4, 6), False, True), (5, 2, 1, range(4, 6), False, True)]


def test_stage_caches_keep_their_global_layer_names():
    assert stage_cache_names(range(3, 5)) == ["key_3", "value_3", "key_4", "value_4"]
    assert [cache_layer(n) for n in ("past_key_12", "present_value_0", "logits", "hidden_states")] == [12, 0, None, None]


def test_micro_batches_split_rows_into_contiguous_slot_runs():
    from trtbuild.runtime.parallel.pipeline_parallel import micro_batches
    from trtbuild.runtime.core.step import Step, StepKind

    step = Step(kind=StepKind.decode, first_slot=2, rids=("a", "b", "c", "d", "e"),
                tokens=((1,), (2,), (3,), (4,), (5,)), starts=(7, 8, 9, 10, 11), samples=(True,) * 5)
    parts = micro_batches(step, 2)
    assert [(p.first_slot, p.rids, p.tokens, p.starts) for p in parts] == [
        (2, ("a", "b", "c"), ((1,), (2,), (3,)), (7, 8, 9)), (5, ("d", "e"), ((4,), (5,)), (10, 11))]
    assert [len(p.rids) for p in micro_batches(step, 8)] == [1, 1, 1, 1, 1]  # never an empty micro-batch
    assert micro_batches(step, 1) == [step]


# -- the manifest's rank grid ---------------------------------------------------------------------

def _grid_manifest(tensor: int, stages: list[list[int]]) -> dict:
    ranks = [{"rank": s * tensor + t, "stage": s, "tensor_rank": t, "layers": layers}
             for s, layers in enumerate(stages) for t in range(tensor)]
    return {"tensor_parallel": tensor, "pipeline_parallel": len(stages), "ranks": ranks,
            "model": {"num_layers": stages[-1][1]}}


@pytest.mark.parametrize("edit, message", [
    (lambda m: m.update(pipeline_parallel=3), "4 ranks, but tensor_parallel 2 × pipeline_parallel 3 = 6"),
    (lambda m: m.update(tensor_parallel=True), "tensor_parallel True is not an integer ≥ 1"),
    (lambda m: m["ranks"][2].update(stage=0), "ranks[2].stage is 0; the grid says 1"),
    (lambda m: m["ranks"][3].update(tensor_rank=0), "ranks[3].tensor_rank is 0; the grid says 1"),
    (lambda m: m["ranks"][1].update(rank=3), "ranks[1].rank is 3; the grid says 1"),
    (lambda m: m["ranks"][2].update(layers=[4, 6]), "ranks[2].layers [4, 6] does not start where stage 0's end (3)"),
    (lambda m: m["ranks"][3].update(layers=[3, 5]), "ranks[3].layers [3, 5] differs from its stage's tensor rank 0"),
    (lambda m: m["ranks"][0].update(layers=[0, "3"]), "ranks[0].layers [0, '3'] is not [start, stop)"),
    (lambda m: m["model"].update(num_layers=7), "the stages' layers end at 6; model.num_layers is 7"),
])
def test_rank_grid_refusals_name_the_field(edit, message):
    manifest = _grid_manifest(2, [[0, 3], [3, 6]])
    check_rank_grid(Path("manifest.json"), copy.deepcopy(manifest))  # the grid as built passes
    edit(manifest)
    with pytest.raises(ManifestError) as info:
        check_rank_grid(Path("manifest.json"), manifest)
    assert message in str(info.value) and "\n" not in str(info.value)


# -- built stages ---------------------------------------------------------------------------------

def _build(tmp_path_factory, name: str, base: str = "tiny-code.yaml", quantization: dict | None = None,
           **parallel) -> Path:
    from trtbuild.builder.build import BuildOptions, build
    from trtbuild.builder.progress import Progress, Verbosity
    from trtbuild.builder.spec.resolve import load_spec

    spec = yaml.safe_load((REPO / "specs" / base).read_text())
    spec["model"]["checkpoint"] = str(TINY_CODE)
    if "medusa" in spec.get("speculative", {}):
        spec["speculative"]["medusa"]["heads"] = str(TINY_CODE / "medusa")
    if quantization is not None:
        spec["quantization"] = quantization
    spec["parallel"] = parallel
    root = tmp_path_factory.mktemp(name)
    (root / "spec.yaml").write_text(yaml.safe_dump(spec))
    build(load_spec(root / "spec.yaml"), BuildOptions(out=root / "engine"), Progress(Verbosity.error))
    return root / "engine"


@pytest.fixture(scope="module")
def pp_engines(tmp_path_factory):
    """(T, P) → engine dir."""
    return {(1, 2): _build(tmp_path_factory, "pp2", pipeline=2),
            (2, 2): _build(tmp_path_factory, "tp2pp2", tensor=2, pipeline=2),
            (1, 4): _build(tmp_path_factory, "pp4", pipeline=4)}


def _checkpoint_bytes(prefixes: tuple[str, ...]) -> int:
    """fp32 bytes of the checkpoint tensors whose names start with one of ``prefixes``."""
    total = 0
    with safe_open(str(TINY_CODE / "model.safetensors"), framework="numpy") as f:
        for key in f.keys():
            if key.startswith(prefixes):
                shape = f.get_slice(key).get_shape()
                numel = 1
                for dim in shape:
                    numel *= dim
                total += 4 * numel
    return total


def _layer_bytes(layer: int, tensor: int) -> int:
    """One decoder layer's fp32 bytes on one of ``tensor`` ranks (norms and KV projections past
    T = H_kv replicated; q/o by heads, MLP by columns split)."""
    d, inter = CONFIG["hidden_size"], CONFIG["intermediate_size"]
    heads, kv, dh = CONFIG["num_attention_heads"], CONFIG["num_key_value_heads"], CONFIG["head_dim"]
    if tensor == 1:
        return _checkpoint_bytes((f"model.layers.{layer}.",))
    kv_rank = max(1, kv // tensor)
    return 4 * (2 * d + 2 * d * heads * dh // tensor + 2 * d * kv_rank * dh + 3 * d * inter // tensor)


@pytest.mark.slow
def test_stage_weight_files_hold_exactly_their_layers(pp_engines, tiny_engine):
    """rank bytes = the stage's layers (its tensor rank's share) + the embedding on the first stage
    + the final norm and lm_head (vocab slice) on the last + what every graph replicates (rotary tables)."""
    d, vocab = CONFIG["hidden_size"], CONFIG["vocab_size"]
    whole = json.loads((tiny_engine / "manifest.json").read_text())["ranks"][0]["weight_bytes"]
    replicated = whole - _checkpoint_bytes(("model.", "lm_head."))
    assert 0 <= replicated < 1 << 20
    for (tensor, pipeline), engine in pp_engines.items():
        if pipeline != 2:
            continue
        manifest = json.loads((engine / "manifest.json").read_text())
        assert (manifest["tensor_parallel"], manifest["pipeline_parallel"]) == (tensor, pipeline)
        assert len(manifest["ranks"]) == tensor * pipeline
        for entry in manifest["ranks"]:
            start, stop = entry["layers"]
            assert (start, stop) == ((0, 3) if entry["stage"] == 0 else (3, 6))
            expected = replicated + sum(_layer_bytes(layer, tensor) for layer in range(start, stop))
            if entry["stage"] == 0:
                expected += 4 * vocab * d                   # the embedding
            if entry["stage"] == pipeline - 1:
                expected += 4 * d + 4 * d * vocab // tensor  # the final norm, lm_head's vocab slice
            assert entry["weight_bytes"] == expected, (tensor, entry["rank"])
            assert (engine / entry["onnx_data"]).stat().st_size == expected
            assert (engine / entry["engine"]).is_file()
            io = {row["name"]: row for row in entry["io"]}
            caches = sorted(name for name in io if name.startswith("past_"))
            assert caches == sorted(f"past_{k}_{layer}" for layer in range(start, stop) for k in ("key", "value"))
            # The engine's pools of blocks [N, block_size, H_kv, D] hold the rank's own KV heads.
            assert io[caches[0]]["shape"][2] == entry["num_kv_heads"] == max(1, CONFIG["num_key_value_heads"] // tensor)
            first, last = entry["stage"] == 0, entry["stage"] == pipeline - 1
            assert ("input_ids" in io, HIDDEN_STATES in io) == (first, not first)
            assert ("logits" in io, "logits_index" in io, HIDDEN_STATES_OUT in io) == (last, last, not last)
            if not first:
                assert io[HIDDEN_STATES]["shape"] == ["batch", "seq", d]
                assert io[HIDDEN_STATES]["dtype"] == "float32"


@pytest.mark.slow
def test_stage_builds_pass_the_numerics_gate_and_log_the_grid(pp_engines):
    for (tensor, pipeline), engine in pp_engines.items():
        if pipeline != 2:
            continue
        records = [json.loads(line) for line in (engine / "passes.jsonl").read_text().splitlines()]
        split = [r for r in records if r["pass"] == "split_pipeline_stages"]
        assert [(r["rank"], r["stage"], r["tensor_rank"]) for r in split] == \
            [(s * tensor + t, s, t) for s in range(pipeline) for t in range(tensor)]
        for r in split:
            assert (r["matches"], r["expected"], r["boundary_cuts"]) == (3, 3, 1)
            assert (r["embedding"], r["lm_head"]) == (r["stage"] == 0, r["stage"] == 1)
            assert r["numerics"]["ok"] and r["numerics"]["stages_in_sequence"] == pipeline
            assert r["numerics"]["vs_torch"]["max_abs"] < 1e-3
        shard = [r for r in records if r["pass"] == "shard_tensor_parallel"]
        if tensor > 1:  # each stage's layers only, lm_head on the last stage
            assert [r["matches"] for r in shard] == [21, 21, 22, 22]
            assert [r["all_gather"] for r in shard] == [0, 0, 1, 1]
            assert all(r["numerics"]["ok"] and r["numerics"]["ranks_together"] == 4 for r in shard)
        proc = subprocess.run([sys.executable, "-m", "trtbuild.cli", "inspect", str(engine)],
                              capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        grid = f"ranks        {tensor * pipeline} = 2 pipeline stages × {tensor} tensor rank"
        assert grid in proc.stdout
        lines = proc.stdout.splitlines()
        stage1 = next(line for line in lines if line.strip().startswith("1  ") and "layers 3–5" in line)
        assert f"rank{tensor}:" in stage1 and (tensor == 1 or "rank3:" in stage1)
        assert f"{tensor}:s1/t0  split_pipeline_stages" in proc.stdout


@pytest.mark.slow
def test_a_pass_that_breaks_stage_1_is_named(tmp_path):
    """A planted pass that turns layer 4's MLP residual Add (stage 1 of 2) into a Sub: the gate,
    running stage 0 then stage 1, fails the build naming that pass."""
    from trtbuild.builder import build as building, numerics
    from trtbuild.builder.export_stage import export_stage, weight_bytes
    from trtbuild.builder.frontend.export import load_graph
    from trtbuild.builder.passes import PIPELINE, Pass, PassContext, PassError, PassResult
    from trtbuild.builder.passes.manager import PassManager

    spec = _spec(pipeline=2)
    check = numerics.check_plan(spec, weight_bytes(spec))
    exported = export_stage(spec, tmp_path, check)
    gate = building._numerics_gate(spec, check, exported, tmp_path)

    def break_stage_1(graph: gs.Graph, ctx: PassContext) -> PassResult:
        if ctx.stage != 1:
            return PassResult(graph=graph, modified=False)
        node = next(n for n in graph.nodes if n.name == "/model/layers.4/Add_1")
        node.op = "Sub"
        return PassResult(graph=graph, modified=True)

    split = [p.name for p in PIPELINE].index("split_pipeline_stages")
    passes = (*PIPELINE[:split + 1], Pass("break_stage_1", break_stage_1, per_rank=True), *PIPELINE[split + 1:])
    with pytest.raises(PassError, match=r"^pass break_stage_1 broke numerics: logits max_abs .* vs torch exceeds "
                                        r"atol 0.001 / rtol 0.01 \(after canonicalize, .*split_pipeline_stages\)$"):
        PassManager(passes, numerics=gate).run(load_graph(exported.path), PassContext.for_spec(spec, weights_dir=tmp_path))


# -- the runtime ----------------------------------------------------------------------------------

PROMPTS = ["def fibonacci(n):", "import os\nimport sys", "class Stack:", "    def __init__(self, items):"]


@pytest.mark.slow
def test_stage_greedy_tokens_equal_one_rank_and_transformers(pp_engines, tiny_engine):
    """P=2, P=4 and T×P = 2×2 over torch.distributed (gloo send/recv between stages), with the prefix
    cache on: the same tokens as the single-rank engine and transformers."""
    from tokenizers import Tokenizer

    from ort_greedy import transformers_greedy
    from trtbuild.runtime.llm import LLM
    from trtbuild.runtime.core.sampling import SamplingParams

    tokenizer = Tokenizer.from_file(str(TINY_CODE / "tokenizer.json"))
    shared = "import os\nimport sys\nimport json\nimport time\nfrom pathlib import Path\n" * 2  # 2 blocks
    prompts = [*PROMPTS, shared + "def main():", shared + "class Config:"]
    expected = transformers_greedy(TINY_CODE, [tokenizer.encode(p).ids for p in prompts], 24)
    for (tensor, pipeline), engine in {(1, 1): tiny_engine, **pp_engines}.items():
        with LLM(engine, backend="onnxruntime", prefix_cache=True) as llm:
            tokens = [c.token_ids for c in llm.generate(prompts, SamplingParams(max_tokens=24))]
            assert (llm.engine_dir.tensor_parallel, llm.engine_dir.pipeline_parallel) == (tensor, pipeline)
            if pipeline > 1:
                assert llm.engine.name == f"onnxruntime ({pipeline} pipeline stages × {tensor} tensor ranks)"
                assert llm.engine.local.sent_bytes > 0  # rank 0 handed hidden states on
        assert tokens == expected, (tensor, pipeline)


@pytest.mark.slow
def test_a_killed_stage_fails_the_request_by_name(pp_engines):
    import os
    import signal
    import time

    from trtbuild.runtime.llm import LLM
    from trtbuild.runtime.core.sampling import SamplingParams
    from trtbuild.runtime.parallel.tensor_parallel import RankFailure

    llm = LLM(pp_engines[1, 4], backend="onnxruntime")
    workers = dict(llm.engine.processes)
    llm.submit("def fibonacci(n):", SamplingParams(max_tokens=200))
    for _ in range(3):
        llm.step()
    os.kill(workers[2].pid, signal.SIGKILL)  # stage 2 of 4
    start = time.monotonic()
    with pytest.raises(RankFailure, match=r"^rank 2 \(pipeline stage 2, tensor rank 0\) killed by signal 9; "
                                          r"the request was not completed$"):
        llm.run_until_done()
    assert time.monotonic() - start < 15
    for process in workers.values():  # every other stage stopped too: no orphan
        assert process.poll() is not None


@pytest.mark.slow
def test_two_torchrun_nodes_generate_the_same_tokens(pp_engines):
    """Across machines: one torchrun per node, --nnodes 2 with a c10d rendezvous; here both "nodes"
    on this machine (loopback). Rank 0 (stage 0) serves and prints; the other node's rank serves it."""
    import socket

    from tokenizers import Tokenizer

    from ort_greedy import transformers_greedy

    tokenizer = Tokenizer.from_file(str(TINY_CODE / "tokenizer.json"))
    expected = transformers_greedy(TINY_CODE, [tokenizer.encode("def fibonacci(n):").ids], 16)[0]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                               "--node-rank", str(node), "--rdzv-backend", "c10d", "--rdzv-id", "pp-test",
                               "--rdzv-endpoint", f"127.0.0.1:{port}", "-m", "trtbuild.cli", "run",
                               str(pp_engines[1, 2]), "--prompt", "def fibonacci(n):", "--max-tokens", "16", "--json"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for node in (0, 1)]
    try:
        outputs = [node.communicate(timeout=240) for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    assert [node.returncode for node in nodes] == [0, 0], [err[-1500:] for _, err in outputs]
    printed = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs if out.strip()]
    assert len(printed) == 1 and printed[0]["token_ids"] == expected


def _greedy(engine: Path, prompts=PROMPTS, max_tokens: int = 24, **kwargs):
    from trtbuild.runtime.llm import LLM
    from trtbuild.runtime.core.sampling import SamplingParams

    with LLM(engine, backend="onnxruntime", **kwargs) as llm:
        return [c.token_ids for c in llm.generate(prompts, SamplingParams(max_tokens=max_tokens))], llm


@pytest.mark.slow
def test_medusa_on_the_last_stage_gives_plain_greedy_tokens(tmp_path_factory, medusa_engine):
    """Medusa heads live on the last stage; verification steps (tree masks, keep_path on every
    stage's caches) give the tokens of plain greedy decoding at P=2."""
    staged = _build(tmp_path_factory, "medusa-pp2", base="tiny-code-medusa.yaml", pipeline=2)
    records = [json.loads(line) for line in (staged / "passes.jsonl").read_text().splitlines()]
    attach = {r["rank"]: r for r in records if r["pass"] == "attach_medusa"}
    assert (attach[0]["medusa_heads"], attach[1]["medusa_heads"]) == (0, 4) and attach[1]["numerics"]["ok"]
    plain, _ = _greedy(medusa_engine, max_tokens=32, medusa_tree_size=0)
    speculative, llm = _greedy(staged, max_tokens=32, medusa_tree_size=8)
    assert speculative == plain
    assert llm.speculation.stats.verify_steps > 0 and llm.speculation.stats.mean_accepted_per_step > 1.2


@pytest.mark.slow
def test_host_drafts_verified_by_the_last_stage_give_plain_greedy_tokens(tmp_path_factory, tiny_engine):
    """Prompt-lookup and suffix chains at P=2: every stage runs the verification step, the last
    stage's logits decide, keep_path moves each stage's caches."""
    from trtbuild.contract.speculation import Source
    from trtbuild.runtime.speculation.host import SpeculationMode

    staged = _build(tmp_path_factory, "host-pp2", base="tiny-code-speculation.yaml", pipeline=2)
    plain, _ = _greedy(tiny_engine, max_tokens=48)
    for source in (Source.prompt_lookup, Source.suffix):
        drafted, llm = _greedy(staged, max_tokens=48, speculation=(source,), speculation_mode=SpeculationMode.always)
        assert drafted == plain, source
        assert llm.speculation.stats.verify_steps > 0 and llm.speculation.stats.accepted_tokens > 0


@pytest.mark.slow
def test_int4_stages_give_the_tokens_of_one_rank(tmp_path_factory):
    quant = {"mode": "int4_weight_only", "algorithm": "rtn", "group_size": 64}
    one = _build(tmp_path_factory, "int4-pp1", quantization=quant)
    two = _build(tmp_path_factory, "int4-pp2", quantization=quant, pipeline=2)
    assert _greedy(two)[0] == _greedy(one)[0]
    whole = json.loads((one / "manifest.json").read_text())["ranks"][0]["weight_bytes"]
    ranks = json.loads((two / "manifest.json").read_text())["ranks"]
    assert all(r["weight_bytes"] < 0.75 * whole for r in ranks)  # each stage holds its layers' codes only


@pytest.mark.slow
def test_stage_eval_scores_like_one_rank(pp_engines, tiny_engine):
    from trtbuild.runtime.evaluate import evaluate

    data = TINY_CODE / "heldout.txt"
    one = evaluate(tiny_engine, data, 256, 1024)
    for grid, engine in pp_engines.items():
        result = evaluate(engine, data, 256, 1024, reference=tiny_engine)
        assert abs(result.perplexity - one.perplexity) / one.perplexity < 1e-4 and result.agreement == 1.0, grid


@pytest.mark.slow
def test_stages_with_the_truncated_check(tmp_path_factory):
    """A model above passes.numerics_whole_max_mib: the passes run on a graph of its first layers
    split into the same P stages (one layer each here) with the numerics gate, and every stage of
    the built graph gets the structural check over its own layers."""
    from trtbuild.builder.build import BuildOptions, build
    from trtbuild.builder.progress import Progress, Verbosity
    from trtbuild.builder.spec.resolve import load_spec

    spec = yaml.safe_load((REPO / "specs" / "tiny-code.yaml").read_text())
    spec["model"]["checkpoint"] = str(TINY_CODE)
    spec["parallel"] = {"tensor": 2, "pipeline": 2}
    spec["passes"] = {"numerics": True, "numerics_whole_max_mib": 0}
    root = tmp_path_factory.mktemp("pp-truncated")
    (root / "spec.yaml").write_text(yaml.safe_dump(spec))
    summary = build(load_spec(root / "spec.yaml"), BuildOptions(out=root / "engine"), Progress(Verbosity.error))
    for name in ("split_pipeline_stages", "shard_tensor_parallel"):
        records = [r for r in summary.pass_records if r["pass"] == name]
        assert len(records) == 4
        for r in records:
            assert r["numerics"]["check"] == "truncated" and r["numerics"]["layers"] == 2 and r["numerics"]["ok"]
            assert r["numerics"]["stages_in_sequence"] == 2
            assert r["structure"]["layers_alike"] == 3  # the built stage's layers: 0–2 or 3–5


@pytest.mark.slow
@pytest.mark.parametrize("family, tensor", [("qwen2", 2), ("qwen3", 1), ("mistral", 2)])
def test_other_families_in_stages_match_transformers(family, tensor, checkpoints, tmp_path):
    """Tied embeddings on both ends (qwen2, with q/k/v biases; qwen3 with q/k norms) and one KV
    head replicated over the tensor ranks (mistral): P=2 stages of one layer each."""
    from conftest import write_spec
    from ort_greedy import transformers_greedy
    from trtbuild.builder.build import BuildOptions, build
    from trtbuild.builder.progress import Progress, Verbosity
    from trtbuild.builder.spec.resolve import load_spec
    from trtbuild.runtime.llm import LLM
    from trtbuild.runtime.core.sampling import SamplingParams

    spec = load_spec(write_spec(tmp_path / "spec.yaml", checkpoints[family], parallel={"tensor": tensor, "pipeline": 2}))
    summary = build(spec, BuildOptions(out=tmp_path / "out"), Progress(Verbosity.error))
    split = [r for r in summary.pass_records if r["pass"] == "split_pipeline_stages"]
    assert [r["layers"] for r in split] == [[0, 1]] * tensor + [[1, 2]] * tensor
    assert all(r["numerics"]["ok"] for r in split)
    prompts = [[5, 17, 300, 41], [9, 8, 7]]
    with LLM(tmp_path / "out", backend="onnxruntime") as llm:
        tokens = [c.token_ids for c in llm.generate(prompts, SamplingParams(max_tokens=8))]
    assert tokens == transformers_greedy(checkpoints[family], prompts, 8)

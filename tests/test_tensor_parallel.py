"""Tensor parallelism: head assignment, collectives on CPU, spec refusals, sharded builds whose
greedy tokens equal one rank's and transformers', per-rank weight bytes, rank failures."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
import yaml
from onnx import TensorProto, helper, numpy_helper

from conftest import REPO, TINY_CODE
from trtbuild.builder.errors import SpecError
from trtbuild.builder.spec.resolve import spec_from_dict
from trtbuild.builder.sharding import gather_caches, kv_heads, query_heads, shard_caches
from trtbuild.plugins.onnxruntime.segments import run_ranks, split

PROMPTS = ["def fibonacci(n):", "import os\nimport sys", "class Stack:", "    def __init__(self, items):"]


def test_heads_split_or_replicate():
    assert [list(query_heads(r, 2, 8)) for r in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [list(kv_heads(r, 2, 2)) for r in range(2)] == [[0], [1]]
    # TP=4 over 2 KV heads: each KV head on two ranks, beside the query heads of its group
    assert [list(kv_heads(r, 4, 2)) for r in range(4)] == [[0], [0], [1], [1]]
    assert [list(kv_heads(r, 2, 4)) for r in range(2)] == [[0, 1], [2, 3]]


def test_cache_shards_round_trip():
    caches = {"past_key_0": np.arange(2 * 2 * 3 * 4, dtype=np.float32).reshape(2, 2, 3, 4), "kv_length": np.ones(2)}
    shards = shard_caches(caches, 4, 2)
    assert [s["past_key_0"].shape for s in shards] == [(2, 1, 3, 4)] * 4
    np.testing.assert_array_equal(shards[3]["past_key_0"], caches["past_key_0"][:, 1:2])
    presents = [{"present_key_0": s["past_key_0"]} for s in shards]
    np.testing.assert_array_equal(gather_caches(presents, 2)["present_key_0"], caches["past_key_0"])


def _row_parallel_model(weight: np.ndarray, world: int) -> onnx.ModelProto:
    """x [2, K/N] @ W [K/N, 3] → all-reduce → + 1, then all-gather on axis 0."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["partial"]),
             helper.make_node("DistCollective", ["partial"], ["summed"], domain="trtbuild",
                              collective_operation="all_reduce", reduce_op="sum", root=-1, nb_rank=world),
             helper.make_node("Add", ["summed", "one"], ["y"]),
             helper.make_node("DistCollective", ["y"], ["gathered"], domain="trtbuild",
                              collective_operation="all_gather", reduce_op="none", root=-1, nb_rank=world)]
    f = TensorProto.FLOAT
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", f, [2, weight.shape[0]])],
                              [helper.make_tensor_value_info("gathered", f, None)],
                              [numpy_helper.from_array(weight, "w"), numpy_helper.from_array(np.ones(1, np.float32), "one")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 24), helper.make_opsetid("trtbuild", 1)])


def test_segments_run_ranks_with_numpy_collectives():
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((2, 8)).astype(np.float32), rng.standard_normal((8, 3)).astype(np.float32)
    models = [_row_parallel_model(w[r * 4:(r + 1) * 4], 2) for r in range(2)]
    assert [None if s.model is None else len(s.model.graph.node) for s in split(models[0])] == [1, 1, None]
    outputs = run_ranks(models, [{"x": x[:, :4]}, {"x": x[:, 4:]}], None)
    expected = x @ w + 1
    for out in outputs:  # every rank ends with the same gathered value
        np.testing.assert_allclose(out["gathered"], np.concatenate([expected, expected]), rtol=1e-5, atol=1e-5)


def _config_dir(tmp_path, **fields):
    config = json.loads((TINY_CODE / "config.json").read_text())
    config.update(fields)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize("fields, tensor, message", [
    ({}, 3, "parallel.tensor: 3 does not divide num_attention_heads=8; valid: 1, 2, 4, 8"),
    ({"num_attention_heads": 12, "num_key_value_heads": 4, "hidden_size": 384}, 3,
     "parallel.tensor: 3 neither divides nor is a multiple of num_key_value_heads=4"),
    ({"intermediate_size": 770}, 4, "parallel.tensor: 4 does not divide intermediate_size=770"),
    ({"vocab_size": 4098}, 4, "parallel.tensor: 4 does not divide vocab_size=4098"),
])
def test_tensor_parallel_refusals_name_the_field(tmp_path, fields, tensor, message):
    checkpoint = _config_dir(tmp_path, **fields)
    with pytest.raises(SpecError) as info:
        spec_from_dict({"model": {"checkpoint": str(checkpoint)}, "parallel": {"tensor": tensor}})
    assert str(info.value).startswith(message), str(info.value)


def test_int4_group_may_not_straddle_ranks():
    spec = {"model": {"checkpoint": str(TINY_CODE)}, "parallel": {"tensor": 2}, "build": {"max_seq_len": 1024},
            "quantization": {"mode": "int4_weight_only", "group_size": 256}}
    with pytest.raises(SpecError, match=r"quantization.group_size: 256 does not divide intermediate_size / "
                                        r"parallel.tensor 2=384"):
        spec_from_dict(spec)
    spec_from_dict({**spec, "parallel": {"tensor": 1}})  # 768 is whole groups on one rank


# -- built engines ------------------------------------------------------------------------------

def _build(tmp_path_factory, name: str, base: str = "tiny-code.yaml", dump_after=frozenset(), **sections) -> Path:
    from trtbuild.builder.build import BuildOptions, build
    from trtbuild.builder.progress import Progress, Verbosity
    from trtbuild.builder.spec.resolve import load_spec

    spec = yaml.safe_load((REPO / "specs" / base).read_text())
    spec["model"]["checkpoint"] = str(TINY_CODE)
    if "speculative" in spec:
        spec["speculative"]["medusa"]["heads"] = str(TINY_CODE / "medusa")
    for section, values in sections.items():
        spec.setdefault(section, {}).update(values)
    root = tmp_path_factory.mktemp(name)
    (root / "spec.yaml").write_text(yaml.safe_dump(spec))
    out = root / "engine"
    build(load_spec(root / "spec.yaml"), BuildOptions(out=out, dump_after=dump_after), Progress(Verbosity.error))
    return out


@pytest.fixture(scope="module")
def tp_engines(tmp_path_factory, tiny_engine):
    return {1: tiny_engine, 2: _build(tmp_path_factory, "tp2", dump_after=frozenset({"fuse_rotary", "shard_tensor_parallel"}),
                                      parallel={"tensor": 2}),
            4: _build(tmp_path_factory, "tp4", parallel={"tensor": 4})}


def _greedy(engine_dir, prompts=PROMPTS, max_tokens=24, **kwargs):
    from trtbuild.runtime.llm import LLM
    from trtbuild.runtime.core.sampling import SamplingParams

    with LLM(engine_dir, backend="onnxruntime", **kwargs) as llm:
        return [c.token_ids for c in llm.generate(prompts, SamplingParams(max_tokens=max_tokens))], llm


@pytest.mark.slow
def test_tp_greedy_tokens_equal_one_rank_and_transformers(tp_engines):
    from tokenizers import Tokenizer

    from ort_greedy import transformers_greedy

    tokenizer = Tokenizer.from_file(str(TINY_CODE / "tokenizer.json"))
    # A shared 2-block prefix: the second request loads it from the prefix cache.
    shared = "import os\nimport sys\nimport json\nimport time\nfrom pathlib import Path\n" * 2
    prompts = [*PROMPTS, shared + "def main():", shared + "class Config:"]
    expected = transformers_greedy(TINY_CODE, [tokenizer.encode(p).ids for p in prompts], 24)
    for world, engine in tp_engines.items():
        tokens, llm = _greedy(engine, prompts, prefix_cache=True)
        assert tokens == expected, f"TP={world}"
        assert llm.engine_dir.tensor_parallel == world


@pytest.mark.slow
def test_rank_weight_files_hold_their_slice(tp_engines):
    """rank bytes = replicated + sharded / N, exactly (fp32; KV projections replicate past N = H_kv)."""
    config = json.loads((TINY_CODE / "config.json").read_text())
    d, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    heads, kv, layers = config["num_attention_heads"], config["num_key_value_heads"], config["num_hidden_layers"]
    dh = d // heads
    whole = json.loads((tp_engines[1] / "manifest.json").read_text())["ranks"][0]["weight_bytes"]
    linear = 4 * (layers * (2 * d * heads * dh + 2 * d * kv * dh + 3 * d * inter) + d * vocab)
    for world in (2, 4):
        manifest = json.loads((tp_engines[world] / "manifest.json").read_text())
        kv_rank = max(1, kv // world)
        per_rank = 4 * (layers * (2 * d * heads * dh // world + 2 * d * kv_rank * dh + 3 * d * inter // world)
                        + d * vocab // world)
        for entry in manifest["ranks"]:
            assert entry["weight_bytes"] == whole - linear + per_rank, (world, entry["rank"])
            assert (tp_engines[world] / entry["onnx_data"]).stat().st_size == entry["weight_bytes"]
            assert entry["num_kv_heads"] == kv_rank
            cache = next(r for r in entry["io"] if r["name"] == "past_key_0")
            assert manifest["kv_cache"]["layout"] == "paged"
            assert cache["shape"][2] == kv_rank  # the engine's pool of blocks [N, block_size, H_kv, D]
        assert (tp_engines[world] / "rank0.engine").is_file()   # DistCollective built by TensorRT-RTX
        records = [json.loads(line) for line in (tp_engines[world] / "passes.jsonl").read_text().splitlines()]
        shard = [r for r in records if r["pass"] == "shard_tensor_parallel"]
        assert [r["rank"] for r in shard] == list(range(world))
        assert all(r["all_reduce"] == 2 * layers and r["all_gather"] == 1 and r["numerics"]["ok"] for r in shard)
        assert shard[0]["numerics"]["ranks_together"] == world
        assert {r["rank"] for r in records if r["pass"] == "fuse_attention"} == {None}  # ran once, before the split
    dumps = tp_engines[2] / "dumps"  # --dump-after: the whole model before the split, each rank after
    assert sorted(str(p.relative_to(dumps)) for p in dumps.rglob("*.onnx")) == [
        "all/003_fuse_rotary.onnx", "rank0/007_shard_tensor_parallel.onnx", "rank1/007_shard_tensor_parallel.onnx"]


@pytest.mark.slow
def test_a_killed_rank_fails_the_request_by_name(tp_engines):
    from trtbuild.runtime.llm import LLM
    from trtbuild.runtime.core.sampling import SamplingParams
    from trtbuild.runtime.parallel.tensor_parallel import RankFailure

    llm = LLM(tp_engines[2], backend="onnxruntime")
    worker = llm.engine.processes[1]
    llm.submit("def fibonacci(n):", SamplingParams(max_tokens=200))
    for _ in range(3):
        llm.step()
    os.kill(worker.pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(RankFailure, match=r"tensor-parallel rank 1 killed by signal 9; the request was not completed"):
        llm.run_until_done()
    assert time.monotonic() - start < 15
    assert worker.poll() is not None  # nothing left behind


def _rank_processes() -> list[int]:
    """Live processes this one started to serve ranks (python -m trtbuild.runtime.parallel.tensor_parallel)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            stat, cmdline = (entry / "stat").read_text(), (entry / "cmdline").read_bytes()
        except OSError:  # not a process, or gone meanwhile
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if int(ppid) == os.getpid() and state != "Z" and b"trtbuild.runtime.parallel.tensor_parallel" in cmdline:
            found.append(int(entry.name))
    return found


@pytest.mark.slow
@pytest.mark.parametrize("broken_rank", [0, 1])
def test_a_rank_that_cannot_load_fails_the_constructor_by_name_and_leaves_no_process(tp_engines, tmp_path,
                                                                                     broken_rank):
    import shutil

    from trtbuild.runtime.llm import LLM
    from trtbuild.runtime.parallel.tensor_parallel import RankFailure

    engine = shutil.copytree(tp_engines[2], tmp_path / "tp2")
    weights = engine / f"rank{broken_rank}.onnx.data"
    with open(weights, "r+b") as handle:  # the dir's checks pass without hashes; loading the rank fails
        handle.truncate(weights.stat().st_size // 2)
    start = time.monotonic()
    with pytest.raises(RankFailure, match=rf"^tensor-parallel rank {broken_rank} failed: [\w.]+: .+; the engine was not loaded$"):
        LLM(engine, backend="onnxruntime", verify=False)
    assert time.monotonic() - start < 30  # not the collective timeout
    assert _rank_processes() == []


@pytest.mark.slow
def test_a_failing_rank_0_step_is_named_with_its_error(tp_engines):
    from trtbuild.runtime.llm import LLM
    from trtbuild.runtime.core.sampling import SamplingParams
    from trtbuild.runtime.parallel.tensor_parallel import RankFailure

    llm = LLM(tp_engines[2], backend="onnxruntime")

    def broken_step(step):
        raise ValueError("planted on rank 0")

    llm.engine.local.step = broken_step
    with pytest.raises(RankFailure, match=r"^tensor-parallel rank 0 failed: ValueError: planted on rank 0; "
                                          r"the request was not completed$"):
        llm.generate(["def fibonacci(n):"], SamplingParams(max_tokens=4))
    assert _rank_processes() == []


@pytest.mark.slow
def test_closing_releases_rank_0s_own_engine_too(tp_engines):
    """close() stops the started ranks and releases rank 0's engine (on a GPU its device memory
    stayed allocated until the process ended)."""
    from trtbuild.runtime.llm import LLM

    llm = LLM(tp_engines[2], backend="onnxruntime")
    closed, local_close = [], llm.engine.local.close
    llm.engine.local.close = lambda: (closed.append(True), local_close())
    llm.close()
    assert closed == [True] and _rank_processes() == []


@pytest.mark.slow
@pytest.mark.parametrize("streamed", [False, True])
def test_tp_stop_strings_end_at_the_stop(tp_engines, streamed):
    from stop_cases import check_stop, greedy_steps, stop_cases
    from trtbuild.runtime.llm import LLM

    with LLM(tp_engines[2], backend="onnxruntime") as llm:
        for case in stop_cases(llm.tokenizer, greedy_steps(llm)):
            check_stop(llm, case, streamed)


@pytest.mark.slow
def test_torchrun_launches_the_ranks(tp_engines):
    """Across machines torchrun starts the ranks; here on one machine with --nproc-per-node 2."""
    expected, _ = _greedy(tp_engines[1], ["def fibonacci(n):"], 16)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--standalone", "-m", "trtbuild.cli", "run",
                           str(tp_engines[2]), "--prompt", "def fibonacci(n):", "--max-tokens", "16", "--json"],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["token_ids"] == expected[0]


@pytest.mark.slow
def test_tp_eval_scores_like_one_rank(tp_engines):
    from trtbuild.runtime.evaluate import evaluate

    data = TINY_CODE / "heldout.txt"
    one = evaluate(tp_engines[1], data, 256, 1024)
    for world in (2, 4):
        result = evaluate(tp_engines[world], data, 256, 1024, reference=tp_engines[1])
        assert abs(result.perplexity - one.perplexity) / one.perplexity < 1e-4 and result.agreement == 1.0


@pytest.mark.slow
def test_tp_medusa_gives_plain_greedy_tokens(tmp_path_factory, medusa_engine):
    tp2 = _build(tmp_path_factory, "medusa-tp2", base="tiny-code-medusa.yaml", parallel={"tensor": 2})
    plain, _ = _greedy(medusa_engine, max_tokens=32, medusa_tree_size=0)
    speculative, llm = _greedy(tp2, max_tokens=32, medusa_tree_size=8)
    assert speculative == plain
    assert llm.speculation.stats.verify_steps > 0 and llm.speculation.stats.mean_accepted_per_step > 1.2
    records = [json.loads(line) for line in (tp2 / "passes.jsonl").read_text().splitlines()]
    attach = [r for r in records if r["pass"] == "attach_medusa"]
    assert [r["rank"] for r in attach] == [0, 1] and attach[-1]["numerics"]["ok"]


@pytest.mark.slow
def test_tp_host_drafts_give_plain_greedy_tokens(tmp_path_factory, tiny_engine):
    """Prompt-lookup and suffix chains verified across two tensor ranks (rank 0 accepts)."""
    from trtbuild.contract.speculation import Source
    from trtbuild.runtime.speculation.host import SpeculationMode

    tp2 = _build(tmp_path_factory, "host-tp2", parallel={"tensor": 2},
                 speculative={"prompt_lookup": {}, "suffix": {}})
    plain, _ = _greedy(tiny_engine, max_tokens=48)
    for source in (Source.prompt_lookup, Source.suffix):
        drafted, llm = _greedy(tp2, max_tokens=48, speculation=(source,), speculation_mode=SpeculationMode.always)
        assert drafted == plain, source
        assert llm.speculation.stats.verify_steps > 0 and llm.speculation.stats.accepted_tokens > 0


@pytest.mark.slow
def test_int4_gptq_tp2_gives_the_tokens_of_tp1(tmp_path_factory):
    calib = tmp_path_factory.mktemp("calib") / "calib.txt"
    calib.write_text((REPO / "tools" / "train_tiny_model.py").read_text() * 4)
    quant = {"mode": "int4_weight_only", "algorithm": "gptq", "group_size": 64,
             "calibration": {"data": str(calib), "samples": 4, "seq_len": 128}}
    one = _build(tmp_path_factory, "gptq-tp1", quantization=quant)
    two = _build(tmp_path_factory, "gptq-tp2", quantization=quant, parallel={"tensor": 2})
    assert _greedy(two)[0] == _greedy(one)[0]
    manifest = json.loads((two / "manifest.json").read_text())
    whole = json.loads((one / "manifest.json").read_text())["ranks"][0]["weight_bytes"]
    assert all(r["weight_bytes"] < 0.75 * whole for r in manifest["ranks"])  # codes and scales sharded


@pytest.mark.slow
def test_tp2_greedy_constrained_tokens_equal_one_rank(tiny_engine, tp2_engine):
    """Rank 0 masks the gathered logits: greedy constrained tokens (a JSON schema, a regex) and a
    free row beside them in the same batch are TP=1's, plain steps and multi-step runs alike."""
    from test_structured import LONG_PROMPT, REGEX, SCHEMA
    from trtbuild.runtime.llm import LLM
    from trtbuild.runtime.core.sampling import SamplingParams
    from trtbuild.runtime.structured import JsonSchema, Regex

    prompts = [LONG_PROMPT, "class A:", "def f(x):"]
    params = [SamplingParams(max_tokens=60, constraint=JsonSchema(SCHEMA)), SamplingParams(max_tokens=30, ignore_eos=True),
              SamplingParams(max_tokens=60, constraint=Regex(REGEX))]
    with LLM(tiny_engine, backend="onnxruntime", multi_step=1) as one:
        expected = [o.token_ids for o in one.generate(prompts, params)]
        alone = [one.generate([p], c)[0] for p, c in zip(prompts[::2], params[::2])]
    assert [o.token_ids for o in alone] == expected[::2] and [o.finish_reason for o in alone] == ["stop", "stop"]
    for multi_step in (1, 4):
        with LLM(tp2_engine, backend="onnxruntime", multi_step=multi_step) as two:
            got = two.generate(prompts, params)
            assert two.engine_dir.tensor_parallel == 2
        assert [o.token_ids for o in got] == expected, f"multi_step={multi_step}"
    assert json.loads(got[0].text)["kind"] in ("cat", "dog")

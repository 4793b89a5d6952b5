"""Medusa end to end: heads format, training CLI, the attach_medusa build, and greedy equality
of speculative decoding with plain decoding on the bundled model."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import onnx
import pytest

from trtbuild.builder.medusa.heads import MedusaHeads, load_heads, save_heads
from trtbuild.builder.errors import UserError
from trtbuild.runtime.llm import LLM
from trtbuild.runtime.core.sampling import SamplingParams

from conftest import TINY_CODE


@pytest.fixture(scope="session")
def prompts():
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(TINY_CODE / "tokenizer.json"))
    ids = tokenizer.encode((TINY_CODE / "heldout.txt").read_text()[:200_000]).ids
    windows = [ids[i * 997:i * 997 + 16 + 3 * i] for i in range(8)]   # held-out, lengths 16..37
    shared = ids[50_000:50_040]                                        # a 40-token shared prefix
    return windows + [shared + ids[60_000 + 7 * i:60_000 + 7 * i + 5] for i in range(4)]


def test_heads_round_trip_in_the_public_layout(tmp_path):
    from safetensors.numpy import load_file

    rng = np.random.default_rng(0)
    heads = MedusaHeads.from_arrays(blocks=tuple(((rng.standard_normal((8, 8)), rng.standard_normal(8)),
                                      (rng.standard_normal((8, 8)), rng.standard_normal(8))) for _ in range(3)),
                        out=tuple(rng.standard_normal((20, 8)) for _ in range(3)),
                        topk_accuracy=((0.5, 0.6),) * 3)
    save_heads(heads, tmp_path / "heads")
    keys = set(load_file(str(tmp_path / "heads" / "medusa_lm_head.safetensors")))
    assert {"0.0.linear.weight", "0.1.linear.bias", "2.2.weight"} <= keys and len(keys) == 15
    config = json.loads((tmp_path / "heads" / "config.json").read_text())
    assert config["medusa_num_heads"] == 3 and config["medusa_num_layers"] == 2
    loaded = load_heads(tmp_path / "heads")
    x = rng.standard_normal((2, 8)).astype(np.float32)
    np.testing.assert_allclose(loaded.logits(x), heads.logits(x), rtol=1e-5)
    assert loaded.logits(x).shape == (2, 3, 20)
    # public checkpoints have only these two keys in config.json
    (tmp_path / "heads" / "config.json").write_text('{"medusa_num_heads": 3, "medusa_num_layers": 2}')
    assert load_heads(tmp_path / "heads").topk_accuracy is None
    (tmp_path / "heads" / "config.json").write_text('{"medusa_num_heads": 4, "medusa_num_layers": 2}')
    with pytest.raises(UserError, match=r"holds 15 tensors; medusa_num_heads=4 × \(2 × medusa_num_layers=2 \+ 1\) = 20"):
        load_heads(tmp_path / "heads")
    # A count that would name billions of tensors is refused before any is named.
    (tmp_path / "heads" / "config.json").write_text('{"medusa_num_heads": 3, "medusa_num_layers": 1000000000}')
    with pytest.raises(UserError, match=r"medusa_num_layers=1000000000"):
        load_heads(tmp_path / "heads")


def test_heads_reference_matches_torch_medusa_block(tmp_path):
    import torch

    heads = load_heads(TINY_CODE / "medusa")
    x = np.random.default_rng(1).standard_normal((3, heads.hidden_size)).astype(np.float32)
    assert heads.num_layers == 1
    h = torch.from_numpy(x)
    h = h + torch.nn.functional.silu(h @ torch.from_numpy(heads.weight(2, 0)).T + torch.from_numpy(heads.bias(2, 0)))
    expected = (h @ torch.from_numpy(heads.out(2)).T).numpy()
    np.testing.assert_allclose(heads.logits(x)[:, 2], expected, rtol=1e-4, atol=1e-4)


@pytest.mark.slow  # trains / scores thousands of tokens
def test_medusa_train_cli_end_to_end(tmp_path):
    data = tmp_path / "train.txt"
    data.write_text((TINY_CODE / "heldout.txt").read_text()[:40_000])
    proc = subprocess.run([sys.executable, "-m", "trtbuild.cli", "medusa", "train", str(TINY_CODE),
                           "--data", str(data), "--heads", "2", "-o", str(tmp_path / "heads"), "--steps", "20",
                           "--sequences", "24", "--seq-len", "64"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "head 1 (t+3)" in proc.stdout and "top-10" in proc.stdout
    assert "self-distill" in proc.stderr and "step 20/20" in proc.stderr  # progress
    heads = load_heads(tmp_path / "heads")
    assert heads.num_heads == 2 and heads.vocab_size == 4096 and len(heads.topk_accuracy[0]) == 10
    bad = subprocess.run([sys.executable, "-m", "trtbuild.cli", "medusa", "train", str(TINY_CODE),
                          "--data", str(tmp_path / "missing.txt"), "-o", str(tmp_path / "x")],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.strip().endswith("missing.txt: not a file")
    assert not (tmp_path / "x").exists()


def test_engine_dir_records_heads_and_tree(medusa_engine):
    manifest = json.loads((medusa_engine / "manifest.json").read_text())
    medusa = manifest["medusa"]
    assert medusa["num_heads"] == 4 and medusa["tree_size"] == 64 and len(medusa["tree"]) == 63
    assert medusa["tree"][0] == [0] and len(medusa["rank_accuracy"]) == 4
    decode = manifest["profiles"][0]["shapes"]
    assert decode["input_ids"][2] == [8, 64] and decode["logits_index"][2] == [8, 64]
    outputs = [o.name for o in onnx.load(medusa_engine / "rank0.onnx", load_external_data=False).graph.output]
    assert outputs[:2] == ["logits", "medusa_logits"]
    records = [json.loads(line) for line in (medusa_engine / "passes.jsonl").read_text().splitlines()]
    attach = next(r for r in records if r["pass"] == "attach_medusa")
    assert attach["medusa_heads"] == 4 and attach["numerics"]["ok"]  # vs torch + the heads' numpy reference
    shown = subprocess.run([sys.executable, "-m", "trtbuild.cli", "inspect", str(medusa_engine)],
                           capture_output=True, text=True).stdout
    assert "medusa       4 heads × 1 block(s); tree of 63 guesses (verification S = 64)" in shown
    # The draft sources: Medusa alone, verifying up to its tree's 64 tokens.
    assert manifest["speculation"] == {"sources": ["medusa"], "verify_tokens": 64, "prompt_lookup": None, "suffix": None,
                                       "draft_head": None}
    assert "speculation  medusa (verification S = 64)" in shown.splitlines()


@pytest.mark.parametrize("batch", [1, 4, 8])
def test_greedy_output_is_identical_with_and_without_medusa(medusa_engine, prompts, batch):
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    outputs = {}
    for size in (0, 63, None):  # plain, the full tree, the adaptive choice
        llm = LLM(medusa_engine, backend="onnxruntime", medusa_tree_size=size, threads=2)
        assert llm.scheduler.kv.prefix_caching
        assert llm.engine.verifies_on_cpu_graph  # batch 1 verifies on rank0.cpu.onnx's verification graph
        outputs[size] = [c.token_ids for i in range(0, len(prompts), batch)
                         for c in llm.generate(prompts[i:i + batch], params)]
        stats = llm.speculation.stats
        if size == 63:
            assert stats.verify_steps > 0 and stats.mean_accepted_per_step > 1.5
            assert stats.tree_sizes.keys() <= {64} and len(stats.head_acceptance()) == 4
        # Stepping aside (tree size 0, or the adaptive policy where a tree does not pay) decodes
        # in multi-step runs, as a plain engine dir does.
        if size == 0:
            assert stats.verify_steps == 0 and 0 < llm.stats.greedy_runs < llm.stats.decode_steps
    assert outputs[63] == outputs[0]
    assert outputs[None] == outputs[0]


def test_a_multi_step_run_skips_the_heads_and_a_single_step_computes_them(medusa_engine):
    """Nobody drafts from a greedy run's steps (speculation stepped aside, or off), so they skip
    the heads' four vocabulary projections; a single plain step computes them for the next tree."""
    from trtbuild.runtime.engine_dir import load
    from trtbuild.runtime.backends.onnxruntime.engine import OnnxRuntimeEngine
    from trtbuild.runtime.core.step import Step, StepKind

    engine = OnnxRuntimeEngine(load(medusa_engine), threads=2)
    assert engine.drafts_on_demand
    step = Step(kind=StepKind.decode, first_slot=0, rids=("a", "b"), tokens=((5,), (9,)), starts=(3, 7),
                samples=(True, True))
    single = engine.step(step)
    logits, heads = single.logits.copy(), single.medusa.copy()  # [B, 1, V], [B, 1, K, V]
    assert heads.shape[:3] == (2, 1, 4) and heads.any(axis=-1).all()
    run = engine.greedy_run(step)  # the same positions again: the same logits
    assert run.advance() == logits[:, 0].argmax(-1).tolist()
    assert not single.medusa.any()  # the run's step wrote the shared buffer: zeros, its heads skipped
    again = engine.step(step)
    assert np.array_equal(again.medusa, heads) and np.array_equal(again.logits, logits)
    from dataclasses import replace
    unwanted = engine.step(replace(step, draft_heads=False))  # nobody drafts from it: heads skipped
    assert unwanted.medusa is None and np.array_equal(unwanted.logits, logits)


def test_the_core_asks_for_heads_only_where_it_will_draft(medusa_engine, prompts):
    """Plain single steps (sampled rows decode step by step) compute the heads only when the
    policy will verify a tree next: never with speculation off, before each tree with it on."""
    from trtbuild.runtime.core.step import StepKind

    for size in (0, 8):
        llm = LLM(medusa_engine, backend="onnxruntime", medusa_tree_size=size, threads=2)
        asked, engine_step = [], llm.engine.step

        def spy(step):
            if step.kind == StepKind.decode and not step.verifies:
                asked.append(step.draft_heads)
            return engine_step(step)

        llm.engine.step = spy
        # Sampled rows: an accepted path that ends off the greedy path drafts nothing, so plain
        # steps come between verifications.
        params = SamplingParams(max_tokens=24, ignore_eos=True, temperature=1.0, seed=1)
        llm.generate(prompts[:2], params)
        if size == 0:
            assert asked and not any(asked)  # every plain step of sampled rows skipped the heads
        else:
            assert asked and all(asked) and llm.speculation.stats.verify_steps > 0


def test_cpu_verification_graph_matches_the_rank_graph_on_trees(medusa_engine):
    """rank0.cpu.onnx's verification graph (GroupQueryAttention over one row's tree, the heads at
    the end of the greedy path only) scores a tree as the rank graph does: logits within max_abs
    1e-4 (float32; logits are O(10)), the heads' logits equal to the rank graph's at the node
    greedy acceptance ends at (max_abs 1e-4; trees whose path is accepted 0 to 3 deep), and the
    tree's K/V written to the same cache positions (max_abs 1e-5), for trees of 2 to 64 nodes."""
    from trtbuild.builder.emit.cpu_step_model import verify_branch
    from trtbuild.plugins.onnxruntime import session as ort_config
    from trtbuild.contract.step import step_arrays
    from trtbuild.runtime.core.tree import Tree
    from trtbuild.runtime.speculation.medusa import accept_greedy

    manifest = json.loads((medusa_engine / "manifest.json").read_text())
    tree = Tree(tuple(tuple(path) for path in manifest["medusa"]["tree"]))
    verify = ort_config.session(verify_branch(onnx.load(medusa_engine / "rank0.cpu.onnx", load_external_data=False)),
                                1, medusa_engine)
    rank = ort_config.session(medusa_engine / "rank0.onnx", 1, medusa_engine)
    records = [json.loads(line) for line in (medusa_engine / "passes.jsonl").read_text().splitlines()]
    checked = [r for r in records if r["pass"].startswith("cpu_verify_")]
    assert [r["pass"] for r in checked] == ["cpu_verify_attention", "cpu_verify_drop_row_gather", "cpu_verify_skip_norm"]
    assert all(r["numerics"]["step"] == "verify" and r["numerics"]["ok"] for r in checked)
    assert checked[-1]["numerics"]["greedy_path_end"] == 3  # the build's check accepts root → 1 → 3
    rng = np.random.default_rng(5)
    depths = set()
    for choices, start, follow in ((1, 0, 0), (4, 17, 1), (63, 300, 3), (63, 40, 0)):
        prefix = tree.prefix(choices)
        tokens = rng.integers(0, manifest["model"]["vocab_size"], prefix.size).tolist()
        feeds = step_arrays([tokens], [start], 1024, trees=[prefix]).as_dict()
        for layer in range(manifest["model"]["num_layers"]):
            for kind in ("key", "value"):
                cache = np.zeros((1, 2, 1024, 32), np.float32)  # [B, H_kv, S_max, D]
                cache[:, :, :start] = rng.standard_normal((1, 2, start, 32))
                feeds[f"past_{kind}_{layer}"] = cache
        run = lambda session: ort_config.run(session, {k: v.copy() for k, v in feeds.items()})  # noqa: E731
        for depth in range(1, follow + 1):  # the rank-0 chain follows the base model's argmax
            parent = prefix.choices.index((0,) * (depth - 1)) + 1 if depth > 1 else 0
            node = prefix.choices.index((0,) * depth) + 1
            feeds["input_ids"][0, node] = run(rank)["logits"][0, parent].argmax()
        got, want = run(verify), run(rank)
        assert got["logits"].shape == want["logits"].shape
        assert np.abs(got["logits"] - want["logits"]).max() <= 1e-4, choices
        path = accept_greedy(prefix, feeds["input_ids"][0].tolist(), want["logits"][0])
        depths.add(len(path.nodes))
        assert got["medusa_logits"].shape == want["medusa_logits"].shape == (1, 1, 4, manifest["model"]["vocab_size"])
        assert np.abs(got["medusa_logits"] - want["medusa_logits"]).max() <= 1e-4, choices  # both at the path end
        for layer in range(manifest["model"]["num_layers"]):
            written = slice(0, start + prefix.size)
            for kind in ("key", "value"):
                name = f"present_{kind}_{layer}"
                assert np.abs(got[name][:, :, written] - want[name][:, :, written]).max() <= 1e-5
    assert max(depths) >= 3 and min(depths) == 0


def test_requests_with_and_without_speculation_share_steps(medusa_engine, prompts):
    plain = LLM(medusa_engine, backend="onnxruntime", medusa_tree_size=0).generate(
        prompts[:4], SamplingParams(max_tokens=32, ignore_eos=True))
    llm = LLM(medusa_engine, backend="onnxruntime", medusa_tree_size=8)
    params = [SamplingParams(max_tokens=32, ignore_eos=True, speculation=None if i % 2 == 0 else ()) for i in range(4)]
    mixed = llm.generate(prompts[:4], params)
    assert [c.token_ids for c in mixed] == [c.token_ids for c in plain]
    assert [c.accepted_tokens > 0 for c in mixed] == [True, False, True, False]
    assert mixed[1].decode_steps == 31 and mixed[0].decode_steps < 31  # plain rows: one token per step


def test_near_max_seq_len_falls_back_and_stays_exact(medusa_engine, prompts):
    long_prompt = (prompts[0] * 80)[:1024 - 30]
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    plain = LLM(medusa_engine, backend="onnxruntime", medusa_tree_size=0).generate([long_prompt], params)
    llm = LLM(medusa_engine, backend="onnxruntime", medusa_tree_size=8)
    spec = llm.generate([long_prompt], params)
    assert spec[0].token_ids == plain[0].token_ids and len(spec[0].token_ids) == 30
    assert llm.speculation.stats.plain_steps > 0 and llm.speculation.stats.verify_steps > 0


def test_sampled_trees_give_plain_samplings_tokens(medusa_engine, prompts):
    """Seeded sampled requests verifying trees (exact acceptance, from the seeded per-position
    draws) produce plain sampling's tokens for the same seeds, batched and one at a time."""
    params = [SamplingParams(max_tokens=48, temperature=0.7, seed=3 + i, ignore_eos=True, logprobs=True)
              for i in range(4)]
    plain = LLM(medusa_engine, backend="onnxruntime", medusa_tree_size=0).generate(prompts[:4], params)
    first = LLM(medusa_engine, backend="onnxruntime", medusa_tree_size=16).generate(prompts[:4], params)
    assert [c.token_ids for c in first] == [c.token_ids for c in plain]
    for completion in first:
        assert len(completion.token_ids) == 48 and len(completion.logprobs) == 48
        assert all(lp <= 0 for lp in completion.logprobs) and min(completion.logprobs) > -30
    assert sum(c.accepted_tokens for c in first) > 0
    # One request at a time: its trees verify on the CPU verification graph, whose heads ran at
    # the greedy path's end; a row whose sampled path ends elsewhere drafts after a plain step.
    alone = [LLM(medusa_engine, backend="onnxruntime", medusa_tree_size=16).generate([p], params[i])[0]
             for i, p in enumerate(prompts[:2])]
    assert [c.token_ids for c in alone] == [c.token_ids for c in plain[:2]]
    assert sum(c.accepted_tokens for c in alone) > 0


def test_plain_engine_refuses_a_medusa_tree_size(tiny_engine):
    with pytest.raises(ValueError, match="built without Medusa heads"):
        LLM(tiny_engine, backend="onnxruntime", medusa_tree_size=4)

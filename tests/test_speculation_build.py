"""A build with draft sources that need no training (specs/tiny-code-speculation.yaml: prompt
lookup and suffix, no Medusa heads): the manifest's speculation entry, the runtime reading it
back, `trtbuild inspect`, and the verification path (the CPU verify graph, TensorRT's rows)
built for them as for Medusa."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import onnx
import pytest

from trtbuild.contract.speculation import PromptLookupConfig, Source, SpeculationConfig, SuffixConfig
from trtbuild.contract.step import TREE_VERIFY
from trtbuild.runtime.backends.onnxruntime.engine import OnnxRuntimeEngine
from trtbuild.runtime.core.step import Step, StepKind
from trtbuild.runtime.engine_dir import load
from trtbuild.runtime.core.tree import Tree


pytestmark = pytest.mark.slow  # builds an engine dir

EXPECTED = SpeculationConfig((Source.prompt_lookup, Source.suffix), 17, PromptLookupConfig(8, 1, 4),
                             SuffixConfig(16, 16, 32, 0.1, 16))
CHAIN = Tree(((0,), (0, 0), (0, 0, 0)))  # a prompt-lookup proposal: three guesses in a row
PROMPT = [17, 2050, 311, 99, 4001, 7, 7, 1234, 560, 42, 3000, 12]
GUESSES = [88, 1500, 9]


def test_manifest_records_the_sources_and_the_runtime_reads_them(speculation_engine):
    manifest = json.loads((speculation_engine / "manifest.json").read_text())
    assert manifest["schema_version"] == 8 and manifest["medusa"] is None
    assert manifest["speculation"] == {
        "sources": ["prompt_lookup", "suffix"], "verify_tokens": 17,
        "prompt_lookup": {"num_tokens": 8, "min_ngram": 1, "max_ngram": 4},
        "suffix": {"num_tokens": 16, "max_depth": 16, "max_match": 32, "min_probability": 0.1, "cross_request": 16},
        "draft_head": None}
    assert load(speculation_engine).speculation == EXPECTED
    decode = manifest["profiles"][0]["shapes"]  # the decode profile takes a verification of 17 rows
    assert decode["input_ids"][2] == [8, 17] and decode["logits_index"][2] == [8, 17]
    inputs = [i.name for i in onnx.load(speculation_engine / "rank0.cpu.onnx", load_external_data=False).graph.input]
    assert TREE_VERIFY in inputs
    outputs = [o.name for o in onnx.load(speculation_engine / "rank0.onnx", load_external_data=False).graph.output]
    assert "medusa_logits" not in outputs
    records = [json.loads(line) for line in (speculation_engine / "passes.jsonl").read_text().splitlines()]
    checked = [r for r in records if r["pass"].startswith("cpu_verify_")]
    assert [r["pass"] for r in checked] == ["cpu_verify_attention", "cpu_verify_drop_row_gather", "cpu_verify_skip_norm"]
    assert all(r["numerics"]["step"] == "verify" and r["numerics"]["ok"] for r in checked)


def test_inspect_shows_the_speculation_line(speculation_engine):
    shown = subprocess.run([sys.executable, "-m", "trtbuild.cli", "inspect", str(speculation_engine)],
                           capture_output=True, text=True, check=True).stdout
    assert ("speculation  prompt_lookup, suffix (verification S = 17); prompt_lookup (num_tokens 8, min_ngram 1, "
            "max_ngram 4); suffix (num_tokens 16, max_depth 16, max_match 32, min_probability 0.1, "
            "cross_request 16)") in shown.splitlines()
    assert not any(line.startswith("medusa ") for line in shown.splitlines())


def _verify_logits(engine, batch: int) -> np.ndarray:
    """``batch`` rows of PROMPT but its last token prefilled, then the chain verified after it:
    row 0's logits at the root and each guess [4, V]."""
    rids = tuple(f"r{i}" for i in range(batch))
    engine.step(Step(kind=StepKind.prefill, first_slot=0, rids=rids, tokens=(tuple(PROMPT[:-1]),) * batch,
                     starts=(0,) * batch, samples=(True,) * batch))
    out = engine.step(Step(kind=StepKind.decode, first_slot=0, rids=rids,
                           tokens=((PROMPT[-1], *GUESSES),) * batch, starts=(len(PROMPT) - 1,) * batch,
                           samples=(True,) * batch, trees=(CHAIN,) * batch))
    return out.logits[0].copy()  # [S, V]


def test_cpu_verify_graph_scores_a_chain_as_the_rank_graph_and_plain_decoding_do(speculation_engine):
    """One row's chain runs on rank0.cpu.onnx's verification graph: the rank graph's logits
    (max_abs ≤ 1e-4, float32), and those of decoding the chain one token a step."""
    d = load(speculation_engine)
    one = OnnxRuntimeEngine(d, threads=2)
    assert one.verifies_on_cpu_graph and not one.has_medusa
    verified = _verify_logits(one, batch=1)
    ranked = _verify_logits(OnnxRuntimeEngine(d, threads=2, use_decode_graph=False), batch=1)
    assert verified.shape == ranked.shape == (4, d.vocab_size)
    assert np.abs(verified - ranked).max() <= 1e-4
    plain = OnnxRuntimeEngine(d, threads=2)
    plain.step(Step(kind=StepKind.prefill, first_slot=0, rids=("a",), tokens=(tuple(PROMPT[:-1]),), starts=(0,),
                    samples=(True,)))
    stepped = [plain.step(Step(kind=StepKind.decode, first_slot=0, rids=("a",), tokens=((token,),),
                               starts=(len(PROMPT) - 1 + i,), samples=(True,))).logits[0, 0].copy()
               for i, token in enumerate([PROMPT[-1], *GUESSES])]
    assert np.abs(verified - np.stack(stepped)).max() <= 1e-4


def test_cpu_verify_graph_verifies_rows_of_different_lengths_as_the_rank_graph(speculation_engine):
    """Three rows in one verification, each at its own cache length (a 3-guess chain after 40
    cached tokens, a plain row after 75, a 2-guess chain after 58), run on the CPU verification
    graph (rows folded into heads, every row written from the longest row's start and moved back):
    the rank graph's logits at every real token (max_abs ≤ 1e-4) and the same caches at every
    position a row has filled."""
    d = load(speculation_engine)
    folded, ranked = OnnxRuntimeEngine(d, threads=2), OnnxRuntimeEngine(d, threads=2, use_decode_graph=False)
    assert folded.verify_rows == 8 and ranked.verify_rows == 0  # the spec's max_batch_size
    rng = np.random.default_rng(3)
    for name, pool in folded.kv.pools.items():  # caches as if three prompts were cached
        pool[:] = rng.standard_normal(pool.shape).astype(pool.dtype)
        ranked.kv.pools[name][:] = pool
    tokens = ((PROMPT[-1], *GUESSES), (PROMPT[3],), (PROMPT[5], *GUESSES[:2]))
    trees = (CHAIN, None, Tree(((0,), (0, 0))))
    starts = (40, 75, 58)
    step = Step(kind=StepKind.decode, first_slot=0, rids=("a", "b", "c"), tokens=tokens, starts=starts,
                samples=(True,) * 3, trees=trees)
    got, want = folded.step(step).logits.copy(), ranked.step(step).logits
    for row, row_tokens in enumerate(tokens):
        assert np.abs(got[row, :len(row_tokens)] - want[row, :len(row_tokens)]).max() <= 1e-4
    for name, pool in folded.kv.pools.items():
        for row, start in enumerate(starts):
            filled = start + len(tokens[row])
            assert np.abs(pool[row, :, :filled] - ranked.kv.pools[name][row, :, :filled]).max() <= 1e-4, (name, row)


def test_tensorrt_engine_sizes_its_rows_by_verify_tokens(monkeypatch, speculation_engine):
    """TensorRTEngine on a simulated device (tests/simulated_device.py): rows for a 17-token
    verification with no Medusa heads, and a chain verified as the ONNX Runtime backend does."""
    from trtbuild.runtime.backends.tensorrt.engine import TensorRTEngine

    from simulated_device import SimulatedDevice

    SimulatedDevice(compute_capability="sm89").install(monkeypatch, [speculation_engine])
    d = load(speculation_engine)
    engine = TensorRTEngine(d)
    try:
        assert engine.max_rows == 17 and engine.max_seq == 256 and engine.medusa is None
        got = _verify_logits(engine, batch=1)
    finally:
        engine.close()
    want = _verify_logits(OnnxRuntimeEngine(d, threads=2), batch=2)
    assert np.abs(got - want).max() <= 1e-4


def test_a_bad_speculation_entry_is_refused_at_load(speculation_engine, tmp_path):
    import shutil

    from trtbuild.runtime.engine_dir import EngineDirError

    copy = tmp_path / "copy"
    shutil.copytree(speculation_engine, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["speculation"]["verify_tokens"] = 5  # fewer than prompt lookup's 1 + 8
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(EngineDirError) as info:
        load(copy, verify_hashes=False)
    assert str(info.value) == (f"{copy / 'manifest.json'}: speculation.prompt_lookup num_tokens 8 + 1 exceeds "
                               "verify_tokens 5; rebuild the engine dir")

"""Seeded mutation fuzzing of the spec and config.json loaders: every mutated document is either
a valid spec / architecture or refused with one line (UserError) — never another exception."""
from __future__ import annotations

import copy
import json
import random

import pytest
import yaml

from conftest import REPO, TINY_CODE
from trtbuild.builder.errors import UserError
from trtbuild.builder.frontend.checkpoint import arch_config
from trtbuild.builder.plan.estimate import Plan, find_gpu, workload_for
from trtbuild.builder.plan.model_size import param_counts
from trtbuild.builder.spec.resolve import spec_from_dict

VALUES = [None, True, False, 0, -1, 1, 2, 3, 7, 2**40, 0.5, 1.5, -2.0, float("nan"), "", "x", "float16", "sm89",
          "int4_weight_only", "gptq", [], [1], ["sm89", "sm120"], [[0], [0, 1]], {}, {"a": 1}]


def _paths(doc, prefix=()):
    yield prefix
    if isinstance(doc, dict):
        for key, value in doc.items():
            yield from _paths(value, prefix + (key,))


def mutate(doc: dict, rng: random.Random) -> dict:
    doc = copy.deepcopy(doc)
    for _ in range(rng.randint(1, 3)):
        paths = [p for p in _paths(doc) if p]
        path = rng.choice(paths)
        parent = doc
        for key in path[:-1]:
            parent = parent[key]
        action = rng.random()
        if action < 0.6:
            parent[path[-1]] = rng.choice(VALUES)
        elif action < 0.8:
            del parent[path[-1]]
        elif isinstance(parent, dict):
            parent[rng.choice(["extra", "max_batch", "tensor", "mode"])] = rng.choice(VALUES)
    return doc


def _valid_spec() -> dict:
    spec = yaml.safe_load((REPO / "specs" / "tiny-code.yaml").read_text())
    spec["model"]["checkpoint"] = str(TINY_CODE)
    spec["parallel"] = {"tensor": 2}
    spec["quantization"] = {"mode": "int8_weight_only", "exclude": ["lm_head"]}
    return spec


@pytest.mark.parametrize("seed", range(8))
def test_mutated_specs_validate_or_fail_in_one_line(seed):
    rng = random.Random(seed)
    valid = _valid_spec()
    outcomes = {"valid": 0, "refused": 0}
    for _ in range(60):
        doc = mutate(valid, rng)
        try:
            spec_from_dict(doc, base_dir=REPO / "specs")
            outcomes["valid"] += 1
        except UserError as exc:
            assert "\n" not in str(exc) and str(exc), (doc, str(exc))
            outcomes["refused"] += 1
    assert outcomes["refused"] > 0


@pytest.mark.parametrize("seed", range(8))
def test_mutated_configs_give_an_architecture_or_one_line(tmp_path, seed):
    rng = random.Random(100 + seed)
    valid = json.loads((TINY_CODE / "config.json").read_text())
    gpu = find_gpu("H100-SXM")
    for index in range(60):
        doc = mutate(valid, rng)
        ckpt = tmp_path / f"c{index}"
        ckpt.mkdir()
        (ckpt / "config.json").write_text(json.dumps(doc))
        try:
            arch = arch_config(ckpt)
        except UserError as exc:
            assert "\n" not in str(exc) and str(exc), (doc, str(exc))
            continue
        plan = Plan(arch=arch, counts=param_counts(arch), gpu=gpu, gpus=1, tp=1, precision="fp16",
                    workload=workload_for(arch=arch), medusa=None)
        assert plan.as_dict()["parameters"] > 0  # every figure computes from a config we accepted


@pytest.mark.parametrize("fields, message", [
    ({"model_type": "qwen2"}, "model_type 'qwen2' disagrees with architectures ['LlamaForCausalLM']"),
    ({"hidden_size": 0}, "hidden_size must be a positive integer, got 0"),
    ({"vocab_size": -1}, "vocab_size must be a positive integer, got -1"),
    ({"num_attention_heads": 7}, "num_key_value_heads=2 does not divide num_attention_heads=7"),
    ({"num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": None},
     "num_attention_heads=6 does not divide hidden_size=256"),
    ({"intermediate_size": 76.8}, "intermediate_size must be a positive integer, got 76.8"),
    ({"num_hidden_layers": None}, "num_hidden_layers must be a positive integer, got None"),
    ({"tie_word_embeddings": "no"}, "tie_word_embeddings must be true or false, got 'no'"),
])
def test_config_nonsense_is_named(tmp_path, fields, message):
    config = {**json.loads((TINY_CODE / "config.json").read_text()), **fields}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError) as info:
        arch_config(tmp_path)
    assert message in str(info.value) and "\n" not in str(info.value), str(info.value)


@pytest.mark.parametrize("text, message", [
    ("model:\n  checkpoint: x\nmodel:\n  dtype: float32\n", "key 'model' appears twice at line 3"),
    ("model: {checkpoint: x}\nquantization: {calibration: {data: c.txt, bogus: 1}}\n",
     "quantization.calibration.bogus: unknown key; valid keys here: data, samples, seq_len"),
    ("build: {targets: 89}\nmodel: {checkpoint: x}\n", "build.targets: a list of compute capabilities like [sm89], got 89"),
])
def test_spec_documents_refused_with_the_key(tmp_path, text, message):
    from trtbuild.builder.spec.resolve import load_spec

    path = tmp_path / "spec.yaml"
    path.write_text(text)
    with pytest.raises(UserError) as info:
        load_spec(path)
    assert message in str(info.value), str(info.value)
    path.write_bytes(b"\xff\xfe model: 1")
    with pytest.raises(UserError, match="not UTF-8 text"):
        load_spec(path)

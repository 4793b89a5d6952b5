"""Spec validation: valid specs load; each bad input is one line naming the YAML path."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError
import yaml

from trtbuild.builder.errors import SpecError, UserError
from trtbuild.builder.spec.resolve import load_spec, spec_from_dict

from conftest import REPO, TINY_CODE

MEDUSA = TINY_CODE / "medusa"


def spec_dict(**overrides) -> dict:
    data = {"model": {"checkpoint": str(TINY_CODE), "dtype": "float32"},
            "build": {"max_input_len": 64, "max_seq_len": 512}}
    for section, values in overrides.items():
        if values is None:
            data.pop(section, None)
        elif isinstance(values, dict):
            data.setdefault(section, {}).update(values)
        else:
            data[section] = values
    return data


def error_of(data: dict, base_dir: Path = Path(".")) -> str:
    with pytest.raises(UserError) as info:
        spec_from_dict(data, base_dir=base_dir)
    return str(info.value)


def test_bundled_spec_loads_with_checkpoint_facts():
    spec = load_spec(REPO / "specs" / "tiny-code.yaml")
    assert spec.model.checkpoint == TINY_CODE.resolve()
    assert spec.arch.num_layers == 6 and spec.arch.num_heads == 8 and spec.arch.num_kv_heads == 2
    assert spec.cuda_graph_batch_sizes == (1, 2, 4, 8)


def test_spec_hash_is_of_what_the_spec_means(tmp_path):
    """The manifest's spec_sha256 names a deployment: the same spec written differently (key
    order, a relative checkpoint path, a default spelled out) hashes the same; any change of a
    value does not."""
    base = spec_from_dict(spec_dict())
    reordered = {"build": {"max_seq_len": 512, "max_input_len": 64},
                 "model": {"dtype": "float32", "checkpoint": os.path.relpath(TINY_CODE, tmp_path)}}
    assert spec_from_dict(reordered, base_dir=tmp_path).sha256() == base.sha256()
    assert spec_from_dict(spec_dict(build={"max_batch_size": 8})).sha256() == base.sha256()  # the default
    assert spec_from_dict(spec_dict(build={"max_batch_size": 4})).sha256() != base.sha256()
    assert spec_from_dict(spec_dict(model={"dtype": "float16"})).sha256() != base.sha256()


def test_spec_is_read_only_data():
    spec = spec_from_dict(spec_dict())
    with pytest.raises(ValidationError, match="frozen"):
        spec.build.max_batch_size = 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.arch = None
    # Resolution adds facts beside the document; the document itself stays the YAML's data.
    assert set(spec.model_dump()) == {"model", "build", "passes", "parallel", "quantization", "speculative", "runtime"}
    sections = [spec.document, *(getattr(spec.document, name) for name in type(spec.document).model_fields)]
    assert not any(getattr(section, "__pydantic_private__", None) for section in sections)  # nothing written on the side


def test_defaults_and_explicit_buckets():
    spec = spec_from_dict(spec_dict(build={"max_batch_size": 12, "cuda_graph_batch_sizes": [8, 1, 4]}))
    assert spec.cuda_graph_batch_sizes == (1, 4, 8)
    assert spec_from_dict(spec_dict(build={"max_batch_size": 12})).cuda_graph_batch_sizes == (1, 2, 4, 8, 12)


@pytest.mark.parametrize("overrides, expected", [
    ({"parallel": {"tensor": 3}}, "parallel.tensor: 3 does not divide num_attention_heads=8; valid: 1, 2, 4, 8"),
    ({"parallel": {"tensor": 16}}, "parallel.tensor: 16 does not divide num_attention_heads=8"),
    ({"build": {"max_input_len": 600}}, "build.max_input_len: 600 exceeds max_seq_len=512"),
    ({"build": {"max_seq_len": 4096, "max_input_len": 64}},
     "build.max_seq_len: 4096 exceeds the checkpoint's max_position_embeddings=1024"),
    ({"build": {"max_batch_size": 0}}, "build.max_batch_size: Input should be greater than or equal to 1"),
    ({"runtime": {"multi_step": 0}}, "runtime.multi_step: Input should be greater than or equal to 1"),
    ({"build": {"targets": ["sm42"]}}, "build.targets: 'sm42' is not a compute capability"),
    ({"build": {"targets": ["sm75"]}}, "build.targets: sm75 has no float32 GEMM"),
    ({"build": {"cuda_graph_batch_sizes": [16]}},
     "build.cuda_graph_batch_sizes: 16 is outside [1, max_batch_size=8]"),
    ({"model": {"dtype": "float8"}}, "model.dtype: 'float8' is not valid; valid: 'float32', 'float16' or 'bfloat16'"),
    ({"build": {"backend": "trt"}}, "build.backend: 'trt' is not valid"),
    ({"passes": {"disable": ["fuse_attn"]}},
     "passes.disable: unknown pass 'fuse_attn' (did you mean 'fuse_attention'?)"),
    ({"quantization": {"mode": "int2"}}, "quantization.mode: 'int2' is not valid; valid: 'none', 'int8_weight_only'"),
    ({"speculative": {"medusa": {"num_heads": 4}}}, "speculative.medusa.heads: required"),
    ({"speculative": {"medusa": {"heads": "/nonexistent", "num_heads": 4}}},
     "speculative.medusa.heads: /nonexistent: Medusa heads dir does not exist"),
    ({"speculative": {"medusa": {"heads": str(MEDUSA), "num_heads": 3}}},
     f"speculative.medusa.num_heads: 3, but {MEDUSA} has medusa_num_heads=4"),
    ({"speculative": {"medusa": {"heads": str(MEDUSA), "num_heads": 4, "tree": [[0], [0, 0, 0]]}}},
     "speculative.medusa.tree: [0, 0, 0] has no parent [0, 0] in the tree"),
    ({"speculative": {"medusa": {"heads": str(MEDUSA), "num_heads": 4, "tree": [[0, 0, 0, 0, 0]]}}},
     "speculative.medusa.tree: [0, 0, 0, 0, 0] is 5 deep but there are num_heads=4 heads"),
    ({"speculative": {"medusa": {"heads": str(MEDUSA), "num_heads": 4, "tree": "big"}}},
     "speculative.medusa.tree"),
    ({"parallel": {"pipeline": 7}}, "parallel.pipeline: 7 exceeds num_hidden_layers=6: every stage holds at least "
                                    "one decoder layer; valid: 1 to 6"),
    ({"parallel": {"pipeline": 0}}, "parallel.pipeline: Input should be greater than or equal to 1"),
    ({"parallel": {"pipeline": "2"}}, "parallel.pipeline: Input should be a valid integer"),
    ({"parallel": {"pipeline": 2, "layers_per_stage": [2, 2, 2]}},
     "parallel.layers_per_stage: 3 entries for pipeline=2; give one layer count per stage"),
    ({"parallel": {"pipeline": 2, "layers_per_stage": [6, 0]}},
     "parallel.layers_per_stage: entry 1 is 0; every stage holds at least one decoder layer"),
    ({"parallel": {"pipeline": 2, "layers_per_stage": [2, 3]}},
     "parallel.layers_per_stage: [2, 3] sums to 5; the checkpoint has num_hidden_layers=6"),
    ({"bulid": {"max_batch_size": 2}}, "bulid: unknown key (did you mean 'build'?)"),
    ({"build": {"max_batch": 2}}, "build.max_batch: unknown key (did you mean 'max_batch_size'?)"),
    ({"model": None}, "model: required"),
])
def test_bad_fields_name_their_path(overrides, expected):
    message = error_of(spec_dict(**overrides))
    assert message.startswith(expected), message
    assert "\n" not in message


def test_checkpoint_errors(tmp_path):
    assert "model.checkpoint" in error_of(spec_dict(model={"checkpoint": str(tmp_path / "nope")}))
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    message = error_of(spec_dict(model={"checkpoint": str(tmp_path)}))
    assert "architecture 'GPT2LMHeadModel' is not supported; supported: LlamaForCausalLM" in message


def test_relative_checkpoint_resolves_against_spec_file(tmp_path):
    nested = tmp_path / "specs"
    nested.mkdir()
    path = nested / "spec.yaml"
    path.write_text(yaml.safe_dump(spec_dict(model={"checkpoint": os.path.relpath(TINY_CODE, nested)})))
    assert load_spec(path).model.checkpoint == TINY_CODE.resolve()


def test_yaml_errors_are_one_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model: [unclosed\n")
    with pytest.raises(UserError, match=r"bad.yaml: not valid YAML at line"):
        load_spec(path)
    with pytest.raises(UserError, match="spec file does not exist"):
        load_spec(tmp_path / "missing.yaml")
    path.write_text("- a list\n")
    with pytest.raises(SpecError, match="a spec is a YAML mapping"):
        load_spec(path)


def test_cli_reports_spec_error_with_exit_code_2(tmp_path):
    path = tmp_path / "tp.yaml"
    path.write_text(yaml.safe_dump(spec_dict(parallel={"tensor": 3})))
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "trtbuild.cli", "build", str(path), "-o", str(out)],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: parallel.tensor: 3 does not divide num_attention_heads=8; valid: 1, 2, 4, 8"
    assert "Traceback" not in proc.stderr
    assert not out.exists() and list(tmp_path.iterdir()) == [path]


def test_medusa_section_resolves_the_tree(tmp_path):
    spec = spec_from_dict(spec_dict(speculative={"medusa": {"heads": str(MEDUSA), "num_heads": 4,
                                                           "tree_nodes": 10}}))
    assert len(spec.medusa.choices) == 10 and spec.medusa.choices[0] == (0,)
    assert spec.verify_tokens == 11 and spec.max_step_tokens == spec.build.max_input_len
    chosen = spec_from_dict(spec_dict(speculative={"medusa": {"heads": str(MEDUSA), "num_heads": 4,
                                                             "tree": [[1], [0, 0], [0]]}}))
    assert chosen.medusa.choices == ((0,), (0, 0), (1,))  # likeliest first, parents first


def test_prompt_lookup_and_suffix_sections_enable_with_the_contract_defaults():
    from trtbuild.contract.speculation import PromptLookupConfig, Source, SpeculationConfig, SuffixConfig

    assert spec_from_dict(spec_dict()).speculation is None and spec_from_dict(spec_dict()).verify_tokens == 1
    both = spec_from_dict(spec_dict(speculative={"suffix": {}, "prompt_lookup": {}}))
    # Sources in the spec's order (medusa, prompt_lookup, suffix), whatever order the YAML gives.
    assert both.speculation == SpeculationConfig((Source.prompt_lookup, Source.suffix), 17,
                                                 PromptLookupConfig(8, 1, 4), SuffixConfig(16, 16, 32, 0.1, 16))
    assert both.verify_tokens == 17 and both.max_step_tokens == 64
    lookup = spec_from_dict(spec_dict(speculative={"prompt_lookup": {"num_tokens": 5, "min_ngram": 2, "max_ngram": 3}}))
    assert lookup.speculation == SpeculationConfig((Source.prompt_lookup,), 6, PromptLookupConfig(5, 2, 3))
    suffix = spec_from_dict(spec_dict(speculative={"suffix": {"num_tokens": 40, "max_depth": 8, "max_match": 64,
                                                              "min_probability": 0, "cross_request": 0}}))
    assert suffix.speculation == SpeculationConfig((Source.suffix,), 41, suffix=SuffixConfig(40, 8, 64, 0.0, 0))
    # The manifest entry the runtime reads back is the same config.
    assert SpeculationConfig.from_manifest(both.speculation.to_manifest(), "m") == both.speculation


@pytest.mark.parametrize("sections, verify_tokens, sources", [
    ({"medusa": {"tree_nodes": 10}}, 11, ["medusa"]),
    ({"medusa": {"tree_nodes": 10}, "prompt_lookup": {}}, 11, ["medusa", "prompt_lookup"]),
    ({"suffix": {"num_tokens": 20}, "medusa": {"tree_nodes": 10}}, 21, ["medusa", "suffix"]),
    ({"medusa": {"tree_nodes": 3}, "prompt_lookup": {"num_tokens": 4}, "suffix": {"num_tokens": 2, "max_depth": 2}},
     5, ["medusa", "prompt_lookup", "suffix"]),
])
def test_verify_tokens_is_the_largest_sources_verification(sections, verify_tokens, sources):
    if "medusa" in sections:
        sections["medusa"].update(heads=str(MEDUSA), num_heads=4)
    spec = spec_from_dict(spec_dict(speculative=sections))
    assert spec.verify_tokens == verify_tokens == spec.speculation.verify_tokens
    assert [s.value for s in spec.speculation.sources] == sources


@pytest.mark.parametrize("sections, expected", [
    ({"prompt_lookup": {"num_tokens": 0}}, "speculative.prompt_lookup.num_tokens: 0: valid 1 to 64"),
    ({"prompt_lookup": {"num_tokens": 65}}, "speculative.prompt_lookup.num_tokens: 65: valid 1 to 64"),
    ({"prompt_lookup": {"min_ngram": 5}},
     "speculative.prompt_lookup.min_ngram: min_ngram 5, max_ngram 4: valid 1 ≤ min_ngram ≤ max_ngram ≤ 16"),
    ({"prompt_lookup": {"min_ngram": 0}},
     "speculative.prompt_lookup.min_ngram: min_ngram 0, max_ngram 4: valid 1 ≤ min_ngram ≤ max_ngram ≤ 16"),
    ({"prompt_lookup": {"max_ngram": 17}},
     "speculative.prompt_lookup.max_ngram: min_ngram 1, max_ngram 17: valid 1 ≤ min_ngram ≤ max_ngram ≤ 16"),
    ({"prompt_lookup": {"num_tokens": "8"}}, "speculative.prompt_lookup.num_tokens: Input should be a valid integer"),
    ({"prompt_lookup": {"ngram": 2}}, "speculative.prompt_lookup.ngram: unknown key (did you mean 'min_ngram'?); "
                                      "valid keys here: num_tokens, min_ngram, max_ngram"),
    ({"suffix": {"num_tokens": 0}}, "speculative.suffix.num_tokens: 0: valid 1 to 64"),
    ({"suffix": {"max_depth": 17}}, "speculative.suffix.max_depth: 17: valid 1 to num_tokens (16)"),
    ({"suffix": {"num_tokens": 4}}, "speculative.suffix.max_depth: 16: valid 1 to num_tokens (4)"),
    ({"suffix": {"max_match": 257}}, "speculative.suffix.max_match: 257: valid 1 to 256"),
    ({"suffix": {"min_probability": 1.0}}, "speculative.suffix.min_probability: 1.0: valid [0, 1)"),
    ({"suffix": {"min_probability": -0.5}}, "speculative.suffix.min_probability: -0.5: valid [0, 1)"),
    ({"suffix": {"cross_request": 1025}}, "speculative.suffix.cross_request: 1025: valid 0 (off) to 1024"),
    ({"suffix": {"cross_request": True}}, "speculative.suffix.cross_request: Input should be a valid integer"),
    ({"suffix": []}, "speculative.suffix: Input should be a valid dictionary"),
])
def test_bad_draft_source_settings_name_their_field(sections, expected):
    message = error_of(spec_dict(speculative=sections))
    assert message.startswith(expected), message
    assert "\n" not in message


@pytest.mark.parametrize("sections, field, tokens", [
    ({"prompt_lookup": {"num_tokens": 40}}, "speculative.prompt_lookup.num_tokens", 41),
    ({"prompt_lookup": {}, "suffix": {"num_tokens": 32}}, "speculative.suffix.num_tokens", 33),
    ({"medusa": {"tree_nodes": 40}, "prompt_lookup": {}}, "speculative.medusa.tree", 41),
])
def test_a_verification_longer_than_a_sequence_is_refused_naming_its_source(sections, field, tokens):
    if "medusa" in sections:
        sections["medusa"].update(heads=str(MEDUSA), num_heads=4)
    message = error_of(spec_dict(build={"max_input_len": 16, "max_seq_len": 32}, speculative=sections))
    assert message == f"{field}: {tokens} tokens per verification exceed build.max_seq_len=32"


def test_medusa_heads_for_another_model_are_refused(tmp_path):
    import numpy as np

    from trtbuild.builder.medusa.heads import MedusaHeads, save_heads

    rng = np.random.default_rng(0)
    heads = MedusaHeads.from_arrays(blocks=((((rng.standard_normal((256, 256))), rng.standard_normal(256)),),) * 2,
                        out=(rng.standard_normal((1000, 256)),) * 2)
    save_heads(heads, tmp_path / "other")
    message = error_of(spec_dict(speculative={"medusa": {"heads": str(tmp_path / "other"), "num_heads": 2}}))
    assert message.startswith("speculative.medusa.heads:") and "vocab_size=1000, the checkpoint 4096" in message
    (tmp_path / "pickled").mkdir()
    (tmp_path / "pickled" / "medusa_lm_head.pt").write_bytes(b"\x80\x04")
    message = error_of(spec_dict(speculative={"medusa": {"heads": str(tmp_path / "pickled"), "num_heads": 2}}))
    assert "is a pickle, which trtbuild never loads" in message

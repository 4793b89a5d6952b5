"""The real pretrained model end to end: SmolLM2-135M-Instruct built from llama.cpp's GGUF file
(specs/smollm2-135m.yaml) gives transformers' greedy tokens on the same file, through the Python
API, `trtbuild run`, the chat endpoint with the file's own template, and tensor parallelism 3; so
does its int4 build keeping the file's Q4_1 weights (specs/smollm2-135m-int4.yaml)."""
from __future__ import annotations

import json
import subprocess
import sys
import urllib.request

import pytest

from serving import served

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ",
           "<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n"]
# One worker builds the real model's engine dirs (pytest-xdist runs a group on one worker).
pytestmark = pytest.mark.xdist_group("smollm2")
NEW_TOKENS = 24
EOS = 2  # <|im_end|>, the file's tokenizer.ggml.eos_token_id


@pytest.fixture(scope="module")
def reference(smollm2_gguf):
    """transformers' own GGUF loader on the same file: its tokenizer and float32 model."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
    model = AutoModelForCausalLM.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name,
                                                 dtype=torch.float32).eval()

    def greedy(ids: list[int], new_tokens: int = NEW_TOKENS) -> list[int]:
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False,
                                 attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        return out[0, len(ids):].tolist()

    return tokenizer, greedy


def _expected(reference, prompt: str) -> list[int]:
    tokenizer, greedy = reference
    assert tokenizer.eos_token_id == EOS
    return _until_eos(greedy(tokenizer(prompt)["input_ids"]))


def _generate(engine, prompts: list[str]) -> list[list[int]]:
    from trtbuild.runtime.llm import LLM
    from trtbuild.runtime.core.sampling import SamplingParams

    with LLM(engine, backend="onnxruntime") as llm:
        outputs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0))
    return [_until_eos(list(o.token_ids)) for o in outputs]


def _until_eos(ids: list[int]) -> list[int]:
    """The tokens before the first end-of-sequence id (transformers stops there; so does the runtime)."""
    return ids[:ids.index(EOS)] if EOS in ids else ids


def test_llm_gives_transformers_greedy_tokens_in_one_batch(smollm2_engine, reference):
    assert _generate(smollm2_engine, PROMPTS) == [_expected(reference, p) for p in PROMPTS]


def test_the_engine_dir_carries_the_files_chat_template_and_eos(smollm2_engine, reference):
    from trtbuild.runtime.engine_dir import load

    tokenizer, _ = reference
    engine = load(smollm2_engine)
    assert engine.chat_template() == tokenizer.chat_template
    assert tokenizer.eos_token_id in engine.eos_token_ids()
    manifest = json.loads((smollm2_engine / "manifest.json").read_text())
    assert manifest["side_files"]["chat_template.jinja"] and "chat_template.jinja" in manifest["files"]


def test_trtbuild_run_prints_transformers_greedy_text(smollm2_engine, reference):
    tokenizer, _ = reference
    prompt = PROMPTS[0]
    proc = subprocess.run([sys.executable, "-m", "trtbuild.cli", "run", str(smollm2_engine), "--prompt", prompt,
                           "--max-tokens", str(NEW_TOKENS), "--temperature", "0", "--backend", "onnxruntime"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    expected = _expected(reference, prompt)
    assert proc.stdout.startswith(prompt + tokenizer.decode(expected))


def test_chat_endpoint_answers_with_the_files_template_as_transformers_does(smollm2_engine, reference, tmp_path):
    tokenizer, greedy = reference
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tokenizer(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))["input_ids"]
    expected = _until_eos(greedy(ids))
    with served(smollm2_engine, tmp_path / "serve.log", model="smollm2") as server:
        body = json.dumps({"model": "smollm2", "messages": messages, "max_tokens": NEW_TOKENS,
                           "temperature": 0}).encode()
        request = urllib.request.Request(f"{server.base}/v1/chat/completions", body,
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            answer = json.loads(response.read())
    assert answer["choices"][0]["message"]["content"] == tokenizer.decode(expected, skip_special_tokens=True)
    assert answer["usage"]["prompt_tokens"] == len(ids)


def test_tensor_parallel_3_gives_the_same_tokens(smollm2_tp3_engine, reference):
    manifest = json.loads((smollm2_tp3_engine / "manifest.json").read_text())
    assert [rank["num_kv_heads"] for rank in manifest["ranks"]] == [1, 1, 1]
    assert _generate(smollm2_tp3_engine, PROMPTS[:2]) == [_expected(reference, p) for p in PROMPTS[:2]]


def test_int4_keeping_the_files_q4_1_weights_gives_transformers_greedy_tokens(smollm2_int4_engine, reference):
    """Quantized in, quantized out: every linear keeps the file's codes and block offsets (210 =
    30 layers × 7; the tied LM head stays float), so int4 decodes as the float model of the file."""
    proc = subprocess.run([sys.executable, "-m", "trtbuild.cli", "inspect", str(smollm2_int4_engine)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "gguf codes   kept GGUF Q4_1 codes as int4 group 32 with block offsets: 210 layers (" in proc.stdout
    assert _generate(smollm2_int4_engine, PROMPTS) == [_expected(reference, p) for p in PROMPTS]

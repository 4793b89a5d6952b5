"""Medusa on the real model: heads trained by `trtbuild medusa train` straight from SmolLM2's GGUF
file (self-distilled, the LM head kept), built with specs/smollm2-135m-medusa.yaml, and greedy
tokens that equal plain decoding's on a 9-query / 3-KV-head model with a 49k vocabulary."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from trtbuild.builder.medusa.heads import load_heads
from trtbuild.checkpoint.source import open_weights
from trtbuild.runtime.llm import LLM
from trtbuild.runtime.core.sampling import SamplingParams

pytestmark = pytest.mark.xdist_group("smollm2")  # one worker builds the real model's engine dirs
PROMPTS = ["<|im_start|>user\nWrite a Python function that reverses a string.<|im_end|>\n<|im_start|>assistant\n",
           "def fibonacci(n):\n    ",
           "The three primary colours are"]


def test_frozen_out_heads_keep_the_files_lm_head(smollm2_gguf, smollm2_medusa_heads):
    heads = load_heads(smollm2_medusa_heads)
    assert (heads.num_heads, heads.hidden_size, heads.vocab_size) == (3, 576, 49152)
    config = json.loads((smollm2_medusa_heads / "config.json").read_text())
    assert config["trtbuild"]["train_out"] is False and config["trtbuild"]["self_distill"] is True
    lm_head = open_weights(smollm2_gguf).tensor("model.embed_tokens.weight", torch.float32).numpy()  # tied
    for k in range(3):
        np.testing.assert_array_equal(heads.out(k), lm_head)


def test_greedy_tokens_are_identical_with_medusa_at_batch_1_and_a_mixed_batch(smollm2_medusa_engine):
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    outputs = {}
    for size in (0, 16, None):  # plain, a pinned 16-guess tree, the adaptive choice
        with LLM(smollm2_medusa_engine, backend="onnxruntime", medusa_tree_size=size, threads=2) as llm:
            alone = [llm.generate([p], params)[0].token_ids for p in PROMPTS]
            mixed = [o.token_ids for o in llm.generate(PROMPTS, params)]  # three prompt lengths in one batch
            stats = llm.speculation.stats
        if size == 16:
            assert stats.verify_steps > 0 and stats.tree_sizes.keys() <= {17}
        if size == 0:
            assert stats.verify_steps == 0
        outputs[size] = (alone, mixed)
    assert outputs[0][0] == outputs[0][1]
    assert outputs[16] == outputs[0]
    assert outputs[None] == outputs[0]


def test_heads_that_keep_the_lm_head_share_its_weight(smollm2_medusa_engine):
    import onnx

    records = [json.loads(line) for line in (smollm2_medusa_engine / "passes.jsonl").read_text().splitlines()]
    attach = next(r for r in records if r["pass"] == "attach_medusa")
    assert attach["shares_lm_head"] is True and attach["numerics"]["ok"]
    graph = onnx.load(smollm2_medusa_engine / "rank0.onnx", load_external_data=False).graph
    projections = [i.name for i in graph.initializer if list(i.dims) in ([576, 49152], [49152, 576])]
    assert projections == ["lm_head.weight"]  # tied: the embedding's, no copy per head
    lm_head, heads = (next(n for n in graph.node if n.name == name) for name in ("/model/lm_head/MatMul", "/medusa/MatMul"))
    assert heads.input[1] == lm_head.input[1]  # the heads' one MatMul reads what the LM head reads

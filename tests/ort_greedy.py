"""Greedy decoding over a rank graph in ONNX Runtime, straight on the engine contract.

Test-side driver (the runtime proper is trtbuild.runtime): prompts of different lengths
are right-padded into one prefill step, then every sequence decodes one token per step.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from trtbuild.plugins.onnxruntime import session as ort_config
from trtbuild.contract.step import CacheShape, cache_names, step_arrays


def greedy(onnx_path: Path, prompts: list[list[int]], max_new_tokens: int, num_layers: int,
           num_kv_heads: int, head_dim: int, s_max: int, dtype=np.float32) -> list[list[int]]:
    session = ort_config.session(Path(onnx_path))
    shape = CacheShape(num_kv_heads, s_max, head_dim)
    caches = {f"past_{name}": shape.zeros(len(prompts), dtype) for name in cache_names(num_layers)}
    rows, starts = [list(p) for p in prompts], [0] * len(prompts)
    out = [[] for _ in prompts]
    for _ in range(max_new_tokens):
        arrays = step_arrays(rows, starts, s_max)
        results = ort_config.run(session, {**arrays.as_dict(), **caches})
        caches = {name: results[name.replace("past_", "present_")] for name in caches}
        next_ids = results["logits"][:, 0].argmax(-1)  # [B]
        starts = [start + len(row) for start, row in zip(starts, rows)]
        rows = [[int(token)] for token in next_ids]
        for b, token in enumerate(next_ids):
            out[b].append(int(token))
    return out


def transformers_greedy(checkpoint: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    out = []
    for prompt in prompts:
        with torch.no_grad():
            gen = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                                 do_sample=False, pad_token_id=0)
        out.append(gen[0, len(prompt):].tolist())
    return out

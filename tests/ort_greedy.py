"""Greedy decoding over a rank graph in ONNX Runtime, straight on the engine contract.

Test-side driver (the runtime proper is trtbuild.runtime): prompts of different lengths
are right-padded into one prefill step, then every sequence decodes one token per step.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort


def greedy(onnx_path: Path, prompts: list[list[int]], max_new_tokens: int, num_layers: int,
           num_kv_heads: int, head_dim: int, s_max: int, dtype=np.float32) -> list[list[int]]:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(str(onnx_path), options, providers=["CPUExecutionProvider"])
    batch = len(prompts)
    lengths = np.array([len(p) for p in prompts], np.int64)
    caches = {f"past_{kind}_{layer}": np.zeros((batch, num_kv_heads, s_max, head_dim), dtype)
              for layer in range(num_layers) for kind in ("key", "value")}
    seq = int(lengths.max())
    ids = np.zeros((batch, seq), np.int32)
    for b, prompt in enumerate(prompts):
        ids[b, : len(prompt)] = prompt
    write = np.zeros(batch, np.int64)
    out = [[] for _ in prompts]
    for step in range(max_new_tokens):
        positions = (write[:, None] + np.arange(ids.shape[1])[None, :]).astype(np.int32)  # [B, S]
        kv_length = lengths if step == 0 else write + 1
        feeds = {
            "input_ids": ids, "position_ids": positions, "write_index": write, "kv_length": kv_length,
            "attention_mask": np.arange(s_max)[None, None, None, :] <= positions[:, None, :, None],
            "logits_index": ((lengths - 1) if step == 0 else np.zeros(batch, np.int64))[:, None],
            **caches,
        }
        names = [o.name for o in session.get_outputs()]
        results = dict(zip(names, session.run(names, feeds)))
        for name in caches:
            caches[name] = results[name.replace("past_", "present_")]
        next_ids = results["logits"][:, 0].argmax(-1)  # [B]
        for b in range(batch):
            out[b].append(int(next_ids[b]))
        write = kv_length
        ids = next_ids.astype(np.int32)[:, None]
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

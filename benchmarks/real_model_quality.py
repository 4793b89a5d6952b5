"""Perplexity of the real model, per trtbuild build mode and from the peers, on the same token ids:
the engine's tokenizer (the GGUF file's, rebuilt into the engine dir) on the evaluation text, in
trtbuild eval's windows of EVAL_CONTEXT tokens (runtime/evaluate.py)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

EVAL_CONTEXT = 512

# RTN rows round the file's values afresh (keep_gguf_codes: false): at group 32 the default keeps Q4_1 codes,
# which the int4-q4_1-kept rows measure.
_INT4 = [(f"int4-{alg}-g{g}{'-a8' if a8 else ''}",
          {"mode": "int4_weight_only", "algorithm": alg, "group_size": g, **({"cpu_activations": "int8"} if a8 else {}),
           **({"keep_gguf_codes": False} if alg == "rtn" else {})})
         for a8 in (False, True) for g in (64, 32) for alg in ("rtn", "awq", "gptq")]
# (row name, model.dtype, quantization fields); 128 does not divide the model's 576 channels.
MODES: list[tuple[str, str, dict | None]] = [("float32", "float32", None), ("float16", "float16", None),
                                               ("int8", "float32", {"mode": "int8_weight_only"})]
MODES += [(name, "float32", fields) for name, fields in _INT4]
# onnxruntime-genai's int4 default, our way: RTN, group 32, int8 activations and the LM head in int4
# too (for a tied 49152 × 576 head, a fifth of the weights, which in float32 outweigh the int4 rest).
MODES += [("int4-rtn-g32-a8-all", "float32", {"mode": "int4_weight_only", "algorithm": "rtn", "group_size": 32,
                                               "cpu_activations": "int8", "exclude": [], "keep_gguf_codes": False})]
# Quantized in, quantized out: the file's own Q4_1 codes, scales and block offsets (builder/quant/gguf_codes.py).
MODES += [("int4-q4_1-kept", "float32", {"mode": "int4_weight_only", "group_size": 32}),
          ("int4-q4_1-kept-a8", "float32", {"mode": "int4_weight_only", "group_size": 32, "cpu_activations": "int8"})]
MODES += [("w8a8", "float32", {"mode": "w8a8"}), ("fp8", "float32", {"mode": "fp8"}),
          ("nvfp4", "float32", {"mode": "nvfp4"})]
CALIBRATED = {"awq", "gptq"}
STATIC_ACTIVATIONS = {"w8a8", "fp8"}  # modes whose activation scales come from calibration text


def token_ids(engine: Path, text: Path) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(engine / "tokenizer.json")).encode(text.read_text(encoding="utf-8")).ids


def _perplexity(nll: float, count: int) -> float:
    return float(np.exp(nll / count))


def _nll(logits: np.ndarray, targets: np.ndarray) -> float:
    """Summed negative log-likelihood of ``targets`` [C] under ``logits`` [C, V], in float64."""
    logits = logits.astype(np.float64)
    top = logits.max(axis=-1, keepdims=True)
    logz = top[:, 0] + np.log(np.exp(logits - top).sum(axis=-1))
    return float((logz - logits[np.arange(len(targets)), targets]).sum())


def engine_perplexity(engine: Path, text: Path, max_tokens: int, threads: int) -> float:
    from trtbuild.runtime.evaluate import evaluate

    return evaluate(engine, text, EVAL_CONTEXT, max_tokens, threads=threads).perplexity


def transformers_perplexity(gguf: Path, ids: list[int], max_tokens: int, threads: int) -> float:
    """transformers' own GGUF reader and Llama, float32, on the same windows."""
    import torch
    from transformers import AutoModelForCausalLM

    from trtbuild.runtime.evaluate import windows

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    nll, count = 0.0, 0
    with torch.no_grad():
        for window in windows(ids, EVAL_CONTEXT, max_tokens):
            logits = model(input_ids=torch.from_numpy(window[None, :-1])).logits[0].numpy()  # [C, V]
            nll += _nll(logits, window[1:])
            count += len(window) - 1
    return _perplexity(nll, count)


def llama_cpp_perplexity(path: Path, ids: list[int], max_tokens: int, threads: int) -> float:
    """llama.cpp (llama-cpp-python) on a GGUF file, every position's logits, the same windows."""
    from llama_cpp import Llama

    from trtbuild.runtime.evaluate import windows

    llm = Llama(str(path), n_ctx=EVAL_CONTEXT, n_batch=EVAL_CONTEXT, logits_all=True, n_threads=threads,
                n_threads_batch=threads, verbose=False)
    nll, count = 0.0, 0
    for window in windows(ids, EVAL_CONTEXT, max_tokens):
        llm.reset()
        llm.eval(window[:-1].tolist())
        nll += _nll(np.asarray(llm.scores[:len(window) - 1]), window[1:])  # [C, V]
        count += len(window) - 1
    return _perplexity(nll, count)

"""Held-out perplexity and greedy agreement of a checkpoint (transformers) or an engine dir
(its rank ONNX in ONNX Runtime), on the same tokens and windows, so the two compare."""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..contract import onnxruntime as ort_config
from ..contract.step import CACHE_DTYPES, CacheShape, cache_names, step_arrays
from ..plugins import fp4


@dataclass(frozen=True)
class Scores:
    nll: float               # summed negative log-likelihood of every predicted token
    count: int
    argmax: np.ndarray       # the model's top-1 prediction at every scored position

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll / self.count)


@dataclass(frozen=True)
class EvalResult:
    perplexity: float
    tokens: int
    context: int
    agreement: float | None = None   # share of positions whose top-1 matches the reference's

    def as_dict(self) -> dict:
        return {"perplexity": round(self.perplexity, 4), "tokens": self.tokens, "context": self.context,
                "greedy_agreement": None if self.agreement is None else round(self.agreement, 4)}


def windows(ids: list[int], context: int, max_tokens: int | None) -> np.ndarray:
    """Non-overlapping windows of ``context`` + 1 tokens (inputs and shifted targets), [N, C + 1]."""
    ids = np.asarray(ids[: max_tokens + 1] if max_tokens else ids, dtype=np.int64)
    count = (len(ids) - 1) // context
    if count == 0:
        raise ValueError(f"{len(ids)} tokens is fewer than one window of {context}")
    return np.stack([ids[i * context: (i + 1) * context + 1] for i in range(count)])


def _log_softmax_pick(logits: np.ndarray, targets: np.ndarray) -> tuple[float, np.ndarray]:
    logits = logits.astype(np.float64)                                # [N, V]
    top = logits.max(axis=-1, keepdims=True)
    logz = top[:, 0] + np.log(np.exp(logits - top).sum(axis=-1))
    return float((logz - logits[np.arange(len(targets)), targets]).sum()), logits.argmax(-1)


def score_checkpoint(checkpoint: Path, batches: np.ndarray, batch: int = 8) -> Scores:
    import os

    import torch
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    nll, argmax = 0.0, []
    with torch.no_grad():
        for i in range(0, len(batches), batch):
            chunk = torch.from_numpy(batches[i:i + batch])
            logits = model(input_ids=chunk[:, :-1]).logits.float().numpy()   # [b, C, V]
            part, top = _log_softmax_pick(logits.reshape(-1, logits.shape[-1]), chunk[:, 1:].numpy().reshape(-1))
            nll += part
            argmax.append(top)
    return Scores(nll, batches[:, 1:].size, np.concatenate(argmax))


def score_engine(engine_dir: Path, batches: np.ndarray, threads: int = 0) -> Scores:
    """Each window is fed in chunks of max_input_len tokens through the slot caches, with logits
    requested for every position (logits_index = all rows), exactly as the engine would run it."""
    from .engine_dir import load

    d = load(engine_dir)
    session = ort_config.session(fp4.ort_source(d.rank_file(0, "onnx")), threads)
    dtype = CACHE_DTYPES[d.dtype]
    shape = CacheShape(d.num_kv_heads, d.max_seq_len, d.head_dim)
    context = batches.shape[1] - 1
    if context > d.max_seq_len:
        raise ValueError(f"--context {context} exceeds the engine's max_seq_len {d.max_seq_len}")
    nll, argmax = 0.0, []
    for start in range(0, len(batches), d.max_batch_size):
        group = batches[start:start + d.max_batch_size]
        b = len(group)
        caches = {f"past_{name}": shape.zeros(b, dtype) for name in cache_names(d.num_layers)}
        rows = []
        for begin in range(0, context, d.max_input_len):
            end = min(begin + d.max_input_len, context)
            arrays = step_arrays(group[:, begin:end].tolist(), [begin] * b, d.max_seq_len, all_logits=True)
            out = ort_config.run(session, {**arrays.as_dict(), **caches})
            caches = {name: out[name.replace("past_", "present_")] for name in caches}
            rows.append(out["logits"])                                     # [b, s, V]
        logits = np.concatenate(rows, axis=1)                              # [b, C, V]
        part, top = _log_softmax_pick(logits.reshape(-1, logits.shape[-1]), group[:, 1:].reshape(-1))
        nll += part
        argmax.append(top)
    return Scores(nll, batches[:, 1:].size, np.concatenate(argmax))


def is_engine_dir(path: Path) -> bool:
    return (Path(path) / "manifest.json").is_file()


def score(target: Path, batches: np.ndarray, threads: int = 0) -> Scores:
    if is_engine_dir(target):
        return score_engine(target, batches, threads)
    if (Path(target) / "config.json").is_file():
        return score_checkpoint(target, batches)
    raise ValueError(f"{target}: neither an engine dir (manifest.json) nor a checkpoint dir (config.json)")


def evaluate(target: Path, data: Path, context: int = 512, max_tokens: int | None = None,
             reference: Path | None = None, threads: int = 0) -> EvalResult:
    from tokenizers import Tokenizer

    tokenizer_dir = Path(target)
    for path in (tokenizer_dir, *([Path(reference)] if reference else [])):
        if not (is_engine_dir(path) or (path / "config.json").is_file()):
            raise ValueError(f"{path}: neither an engine dir (manifest.json) nor a checkpoint dir (config.json)")
    ids = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).encode(Path(data).read_text(encoding="utf-8")).ids
    batches = windows(ids, context, max_tokens)
    scores = score(Path(target), batches, threads)
    agreement = None
    if reference is not None:
        agreement = float((score(Path(reference), batches, threads).argmax == scores.argmax).mean())
    return EvalResult(perplexity=scores.perplexity, tokens=scores.count, context=context, agreement=agreement)

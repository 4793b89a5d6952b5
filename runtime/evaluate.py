"""Held-out perplexity and greedy agreement of a checkpoint (transformers) or an engine dir
(its rank ONNX in ONNX Runtime), on the same tokens and windows, so the two compare."""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..checkpoint.errors import CheckpointError
from ..checkpoint.gguf_config import is_gguf
from ..checkpoint.tokenizer import checkpoint_tokenizer, tokenizer_from
from ..plugins.onnxruntime import session as ort_config
from ..contract.pipeline import HIDDEN_STATES, HIDDEN_STATES_OUT, stage_cache_names
from ..contract.step import CACHE_DTYPES, CacheShape, step_arrays
from ..plugins.onnxruntime import fp4


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
    cpu_activations: str | None = None  # an engine dir's (quantization.cpu_activations); None for checkpoints

    def as_dict(self) -> dict:
        return {"perplexity": round(self.perplexity, 4), "tokens": self.tokens, "context": self.context,
                "greedy_agreement": None if self.agreement is None else round(self.agreement, 4),
                "cpu_activations": self.cpu_activations}


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
    import torch

    from ..checkpoint.model import load_checkpoint_model

    model = load_checkpoint_model(checkpoint, torch.float32)
    nll, argmax = 0.0, []
    with torch.no_grad():
        for i in range(0, len(batches), batch):
            chunk = torch.from_numpy(batches[i:i + batch])
            logits = model(input_ids=chunk[:, :-1]).logits.float().numpy()   # [b, C, V]
            part, top = _log_softmax_pick(logits.reshape(-1, logits.shape[-1]), chunk[:, 1:].numpy().reshape(-1))
            nll += part
            argmax.append(top)
    return Scores(nll, batches[:, 1:].size, np.concatenate(argmax))


def score_engine(d, batches: np.ndarray, threads: int = 0) -> Scores:
    """Each window is fed in chunks of max_input_len tokens through the slot caches, with logits
    requested for every position (logits_index = all rows), exactly as the engine would run it."""
    run = _rank_runner(d, threads)
    dtype = CACHE_DTYPES[d.dtype]
    shape = CacheShape(d.num_kv_heads, d.max_seq_len, d.head_dim)  # each rank's KV heads
    context = batches.shape[1] - 1
    if context > d.max_seq_len:
        raise ValueError(f"--context {context} exceeds the engine's max_seq_len {d.max_seq_len}")
    nll, argmax = 0.0, []
    for start in range(0, len(batches), d.max_batch_size):
        group = batches[start:start + d.max_batch_size]
        b = len(group)
        caches = [{f"past_{name}": shape.zeros(b, dtype) for name in stage_cache_names(d.rank_layers(rank))}
                  for rank in range(d.world_size)]  # each rank holds its stage's layers
        rows = []
        for begin in range(0, context, d.max_input_len):
            end = min(begin + d.max_input_len, context)
            arrays = step_arrays(group[:, begin:end].tolist(), [begin] * b, d.max_seq_len, all_logits=True)
            outputs = run([{**arrays.as_dict(), **rank_caches} for rank_caches in caches])
            caches = [{name: out[name.replace("past_", "present_")] for name in rank_caches}
                      for out, rank_caches in zip(outputs, caches)]
            rows.append(outputs[-d.tensor_parallel]["logits"])             # [b, s, V], from the last stage
        logits = np.concatenate(rows, axis=1)                              # [b, C, V]
        part, top = _log_softmax_pick(logits.reshape(-1, logits.shape[-1]), group[:, 1:].reshape(-1))
        nll += part
        argmax.append(top)
    return Scores(nll, batches[:, 1:].size, np.concatenate(argmax))


def _rank_runner(d, threads: int):
    """feeds per rank → outputs per rank: one session, or for a tensor/pipeline-parallel dir all
    ranks' graphs in this process, stage after stage (each stage's hidden states into the next),
    its tensor ranks' collectives computed exactly (no process group)."""
    if d.world_size == 1:
        session = ort_config.session(fp4.ort_source(d.rank_file(0, "onnx")), threads, activations=d.cpu_activations)
        return lambda feeds: [ort_config.run(session, feeds[0])]
    from ..plugins.onnxruntime.segments import LocalRanks

    tensor = d.tensor_parallel
    stages = [LocalRanks([fp4.cpu_model(d.rank_file(rank, "onnx")) for rank in range(start, start + tensor)],
                         d.path, threads, d.cpu_activations) for start in range(0, d.world_size, tensor)]

    def run(feeds: list[dict]) -> list[dict]:
        outputs, hidden = [], None
        for index, stage in enumerate(stages):
            part = feeds[index * tensor:(index + 1) * tensor]
            outputs += stage.run(part if hidden is None else [{**f, HIDDEN_STATES: hidden} for f in part])
            hidden = outputs[-1].get(HIDDEN_STATES_OUT)
        return outputs

    return run


def is_engine_dir(path: Path) -> bool:
    return (Path(path) / "manifest.json").is_file()


def _loaded(target: Path):
    """An engine dir, checked before anything in it is read (contract.manifest), or a checkpoint path."""
    from .engine_dir import load

    if is_engine_dir(target):
        engine_dir = load(target)
        engine_dir.require_cpu_graphs(" (trtbuild eval runs its rank graphs)")
        return engine_dir
    if is_gguf(target) or (Path(target) / "config.json").is_file():
        return Path(target)
    raise ValueError(f"{target}: neither an engine dir (manifest.json), a checkpoint dir (config.json) nor a .gguf file")


def score(target, batches: np.ndarray, threads: int = 0) -> Scores:
    """``target``: a loaded EngineDir, or a checkpoint dir."""
    if isinstance(target, Path):
        return score_checkpoint(target, batches)
    return score_engine(target, batches, threads)


def _token_ids(loaded, data: Path) -> list[int]:
    """``data`` tokenized by the tokenizer of ``loaded`` (an EngineDir's side file, or a checkpoint's)."""
    path = None if isinstance(loaded, Path) else loaded.side_file("tokenizer.json")
    try:
        tokenizer = checkpoint_tokenizer(loaded) if path is None else tokenizer_from(path.read_bytes(), str(path))
    except CheckpointError as exc:
        raise ValueError(str(exc)) from None
    try:
        text = Path(data).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"--data {data}: not UTF-8 text") from None
    return tokenizer.encode(text).ids


def evaluate(target: Path, data: Path, context: int = 512, max_tokens: int | None = None,
             reference: Path | None = None, threads: int = 0) -> EvalResult:
    loaded = _loaded(Path(target))
    compared = _loaded(Path(reference)) if reference is not None else None
    batches = windows(_token_ids(loaded, data), context, max_tokens)
    scores = score(loaded, batches, threads)
    agreement = None
    if compared is not None:
        agreement = float((score(compared, batches, threads).argmax == scores.argmax).mean())
    return EvalResult(perplexity=scores.perplexity, tokens=scores.count, context=context, agreement=agreement,
                      cpu_activations=None if isinstance(loaded, Path) else loaded.cpu_activations.value)

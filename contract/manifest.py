"""manifest.json's schema version and file hashing: what builder writes and runtime checks."""
from __future__ import annotations

import hashlib
from pathlib import Path

from .json_file import read_json_object

# Bump on any incompatible change of manifest.json. 2: tensor parallelism; each entry of
# ``ranks`` carries its KV heads, I/O table and weight bytes (the top-level ``io`` is gone).
# 3: ``tensorrt`` records the compute capabilities the engines serve (contract/gpu_targets.py);
# the top-level ``targets`` (the spec's request, untrue for TensorRT builds) is gone.
# 4: pipeline parallelism; top-level ``tensor_parallel`` is T (ranks per stage, no longer the rank
# count) beside ``pipeline_parallel`` P, and each rank entry says its ``stage``, ``tensor_rank``
# and ``layers`` [start, stop) (the decoder layers, and so the KV-cache layers, it holds).
# 5: ``side_files`` says of every file in SIDE_FILES whether the build wrote it; the runtime reads
# only those listed (hashed) and refuses a dir holding one the build did not write.
# 6: ``medusa_logits`` is [B, 1, K, V], the heads at each row's greedy path end (was [B, R, K, V]).
# 7: ``speculation``: the draft sources and verify_tokens (contract/speculation.py); the
# verification path (profile rows, the CPU verify graph) is built for any source, not only Medusa.
# 8: ``kv_cache`` (layout slots | paged, block_size, each rank's pool [block_size, H_kv, D]); a paged
# engine's rank entry lists ``paged_onnx`` (the graph it was compiled from) and its I/O table is that
# graph's (pools, block_table, kv_slots; no write_index).
# Compatible additions (no bump: absent reads as none): ``draft_head`` (contract/draft_head.py
# DraftHeadEntry: draft.onnx, its taps, vocabulary, accuracy, num_tokens), and with it the step's
# ``draft_features`` output in every rank graph.
SCHEMA_VERSION = 8

# The files beside the ranks' that the runtime reads: the tokenizer, its config and chat template
# (transformers 5 keeps the template in chat_template.jinja), the end-of-sequence ids
# (generation_config.json, config.json). Each is copied from the checkpoint where it has one.
SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
              "config.json")
EOS_FILES = ("generation_config.json", "config.json")


def eos_token_ids(configs: dict[str, dict], vocab_size: int) -> tuple[int, ...]:
    """The end-of-sequence ids that ``configs`` (EOS_FILES' objects by name, those there are) give,
    each an id or a list; ValueError naming the file for one that is not a token id below
    ``vocab_size`` (the build refuses it; a runtime would stop on nothing)."""
    ids: list[int] = []
    for name in EOS_FILES:
        value = configs.get(name, {}).get("eos_token_id")
        values = value if isinstance(value, list) else [] if value is None else [value]
        if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab_size for i in values):
            raise ValueError(f"{name}: eos_token_id {value!r} must be token ids below vocab_size {vocab_size}")
        ids += values
    return tuple(dict.fromkeys(ids))

# spec.runtime.multi_step's default, and what the runtime takes for a manifest written before
# the field (greedy decode steps run back to back: runtime/llm.py).
DEFAULT_MULTI_STEP = 8

# New tokens a request generates unless it says: spec.runtime.max_tokens's default and
# SamplingParams' (one value for the CLI, the server's chat route, LLM.default_params and a
# bare SamplingParams(); before, SamplingParams() said 64 and the spec 128).
DEFAULT_MAX_TOKENS = 128


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


MANIFEST = "manifest.json"
REQUIRED_KEYS = ("schema_version", "files", "ranks", "model", "limits", "spec", "tensorrt", "tensor_parallel",
                 "pipeline_parallel", "side_files")


class ManifestError(ValueError):
    """The engine dir cannot be trusted or read; the message names the file or key."""


def read_manifest(engine_dir: Path) -> dict:
    """manifest.json as a mapping with the keys every engine dir has, of the schema we read."""
    path = Path(engine_dir) / MANIFEST
    if not path.is_file():
        raise ManifestError(f"{engine_dir}: not an engine dir (no {MANIFEST}); build one with "
                            f"`trtbuild build SPEC -o {engine_dir}`")
    try:
        manifest = read_json_object(path)
    except ValueError as exc:
        raise ManifestError(str(exc)) from None
    version = manifest.get("schema_version")
    if version != SCHEMA_VERSION:
        raise ManifestError(f"{path}: schema_version {version}, this runtime reads {SCHEMA_VERSION}; "
                            "rebuild the engine dir with this trtbuild")
    missing = [key for key in REQUIRED_KEYS if key not in manifest]
    if missing:
        raise ManifestError(f"{path}: missing keys {', '.join(missing)}")
    if not isinstance(manifest["files"], dict) or not isinstance(manifest["ranks"], list) or not manifest["ranks"]:
        raise ManifestError(f"{path}: 'files' must be an object and 'ranks' a non-empty list")
    check_rank_grid(path, manifest)
    return manifest


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def check_rank_grid(path: Path, manifest: dict) -> None:
    """The ranks form the whole T × P grid in order (rank = stage · T + tensor rank), and the
    stages' layers are contiguous runs covering the model's decoder layers, the same for every
    tensor rank of a stage."""
    tensor, pipeline, ranks = manifest["tensor_parallel"], manifest["pipeline_parallel"], manifest["ranks"]
    for key, value in (("tensor_parallel", tensor), ("pipeline_parallel", pipeline)):
        if not _count(value) or value < 1:
            raise ManifestError(f"{path}: {key} {value!r} is not an integer ≥ 1")
    if len(ranks) != tensor * pipeline:
        raise ManifestError(f"{path}: {len(ranks)} ranks, but tensor_parallel {tensor} × pipeline_parallel "
                            f"{pipeline} = {tensor * pipeline}")
    num_layers = manifest["model"].get("num_layers") if isinstance(manifest["model"], dict) else None
    start = 0
    for index, rank in enumerate(ranks):
        if not isinstance(rank, dict):
            raise ManifestError(f"{path}: ranks[{index}] is not an object")
        stage, tensor_rank = divmod(index, tensor)
        for key, want in (("rank", index), ("stage", stage), ("tensor_rank", tensor_rank)):
            if rank.get(key) != want or not _count(rank.get(key)):
                raise ManifestError(f"{path}: ranks[{index}].{key} is {rank.get(key)!r}; the grid says {want} "
                                    f"(rank = stage · {tensor} + tensor rank)")
        layers = rank.get("layers")
        if not (isinstance(layers, list) and len(layers) == 2 and all(map(_count, layers))
                and layers[0] < layers[1]):
            raise ManifestError(f"{path}: ranks[{index}].layers {layers!r} is not [start, stop) of decoder layers")
        if tensor_rank == 0:
            if layers[0] != start:
                raise ManifestError(f"{path}: ranks[{index}].layers {layers} does not start where stage "
                                    f"{stage - 1}'s end ({start})")
            start = layers[1]
        elif layers != ranks[index - tensor_rank]["layers"]:
            raise ManifestError(f"{path}: ranks[{index}].layers {layers} differs from its stage's tensor rank 0 "
                                f"{ranks[index - tensor_rank]['layers']}")
    if start != num_layers:
        raise ManifestError(f"{path}: the stages' layers end at {start}; model.num_layers is {num_layers!r}")


# Per rank: the files it must have, and those it may (a graph with no external weights has no
# data file; an engine dir built without a CPU stage, or before it existed, has no rankN.cpu.onnx;
# one with slot caches has no rankN.paged.onnx).
# A dir built with build.cpu_graphs: false ("cpu_graphs": false) has the engines alone.
RANK_FILES, OPTIONAL_RANK_FILES = ("onnx", "engine"), ("onnx_data", "paged_onnx", "cpu_onnx", "cpu_onnx_data")


def has_cpu_graphs(manifest: dict) -> bool:
    """Whether the dir holds the rank ONNX graphs (manifests before the field always did)."""
    return manifest.get("cpu_graphs", True) is not False


def rank_files(manifest: dict) -> list[str]:
    """The files the format says an engine dir needs: each rank's graph, its weights and its
    engine, its CPU step model if it has one, and the tokenizer. All must be listed (hashed) in
    ``files``."""
    names = ["tokenizer.json"]
    for index, rank in enumerate(manifest["ranks"]):
        if not isinstance(rank, dict):
            raise ManifestError(f"{MANIFEST}: ranks[{index}] is not an object")
        for key in (*RANK_FILES, *OPTIONAL_RANK_FILES):
            name = rank.get(key)
            if name is None and (key in OPTIONAL_RANK_FILES or (key == "onnx" and not has_cpu_graphs(manifest))):
                continue
            if not isinstance(name, str) or not _plain_name(name):
                raise ManifestError(f"{MANIFEST}: ranks[{index}].{key} {name!r} is not a file name inside the "
                                    "engine dir")
            names.append(name)
    return names


def _plain_name(name: str) -> bool:
    return bool(name) and "/" not in name and "\\" not in name and name not in (".", "..")

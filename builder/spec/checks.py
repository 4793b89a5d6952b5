"""Spec checks against the checkpoint: context lengths, tensor parallelism, quantization.

Each refusal is one line naming the YAML field and what would be valid.
"""
from __future__ import annotations

import math

from ...contract.kv_budget import block_size_problem, blocks_for_tokens
from ...contract.speculation import Source
from ..errors import SpecError
from ..frontend.checkpoint import ArchConfig
from .model import Spec, linear_names


def check_against_checkpoint(spec: Spec) -> None:
    """What the schema cannot know: the spec against the checkpoint's architecture."""
    arch = spec.arch
    _check_tensor_parallel(spec)
    _check_pipeline(spec)
    if spec.build.max_seq_len > arch.max_position_embeddings:
        raise SpecError("build.max_seq_len", f"{spec.build.max_seq_len} exceeds the checkpoint's "
                                             f"max_position_embeddings={arch.max_position_embeddings}")
    if arch.sliding_window and arch.sliding_window < spec.build.max_seq_len:
        raise SpecError("build.max_seq_len", f"{spec.build.max_seq_len} exceeds the checkpoint's "
                                             f"sliding_window={arch.sliding_window}, which trtbuild does "
                                             "not implement; use at most that")
    _check_quantization(spec)
    _check_verification(spec)
    _check_draft_head(spec)
    _check_kv_budget(spec)
    if spec.model.dtype.value == "float32" and "sm75" in spec.build.targets:
        raise SpecError("build.targets", "sm75 has no float32 GEMM in TensorRT-RTX; use model.dtype "
                                         "float16 or drop sm75")


# The spec field that sets each draft source's verification S.
VERIFY_FIELDS = {Source.medusa: "speculative.medusa.tree", Source.prompt_lookup: "speculative.prompt_lookup.num_tokens",
                 Source.suffix: "speculative.suffix.num_tokens", Source.draft_head: "speculative.draft_head.num_tokens"}


def _check_verification(spec: Spec) -> None:
    """Every source's verification step fits a sequence (its root plus guesses within max_seq_len)."""
    for source, tokens in spec.source_verify_tokens.items():
        if tokens > spec.build.max_seq_len:
            raise SpecError(VERIFY_FIELDS[source], f"{tokens} tokens per verification exceed "
                                                   f"build.max_seq_len={spec.build.max_seq_len}")


def _check_draft_head(spec: Spec) -> None:
    """The draft head is built for one rank: its features come from every layer of the whole
    model and its graph runs beside rank 0's (tensor or pipeline ranks would each need it placed)."""
    if spec.draft_head is not None and spec.world_size > 1:
        raise SpecError("speculative.draft_head", f"not built with parallel.tensor {spec.parallel.tensor} × "
                                                  f"parallel.pipeline {spec.parallel.pipeline} yet; a draft head "
                                                  "engine is single-rank (tensor: 1, pipeline: 1)")


def _check_kv_budget(spec: Spec) -> None:
    """A block size that tiles the cache, and a byte budget that holds one request of max_seq_len on
    each rank (a share of free memory is checked where it is known: at load)."""
    r, b = spec.runtime, spec.build
    problem = block_size_problem(r.kv_block_size, b.max_seq_len)
    if problem is not None:
        raise SpecError("runtime.kv_block_size", problem)
    if isinstance(r.kv_cache_memory, int):
        need = blocks_for_tokens(b.max_seq_len, r.kv_block_size) * r.kv_block_size * spec.kv_bytes_per_token
        if r.kv_cache_memory < need:
            raise SpecError("runtime.kv_cache_memory", f"{r.kv_cache_memory} bytes hold less than one request of "
                                                       f"build.max_seq_len={b.max_seq_len} tokens "
                                                       f"({spec.kv_bytes_per_token} bytes a token on a rank); "
                                                       f"give at least {need} bytes ({need / 2**20:.1f} MiB)")


def _check_tensor_parallel(spec: Spec) -> None:
    refusal = tensor_parallel_refusal(spec.arch, spec.parallel.tensor)
    if refusal is not None:
        raise SpecError("parallel.tensor", refusal)


def _check_pipeline(spec: Spec) -> None:
    layers, p = spec.arch.num_layers, spec.parallel
    if p.pipeline > layers:
        raise SpecError("parallel.pipeline", f"{p.pipeline} exceeds num_hidden_layers={layers}: every stage holds "
                                             f"at least one decoder layer; valid: 1 to {layers}")
    if p.layers_per_stage and sum(p.layers_per_stage) != layers:
        raise SpecError("parallel.layers_per_stage", f"{list(p.layers_per_stage)} sums to {sum(p.layers_per_stage)}; "
                                                     f"the checkpoint has num_hidden_layers={layers}")


def tensor_parallel_ok(arch: ArchConfig, tp: int) -> bool:
    return (arch.num_heads % tp == 0 and (arch.num_kv_heads % tp == 0 or tp % arch.num_kv_heads == 0)
            and arch.intermediate_size % tp == 0 and arch.vocab_size % tp == 0)


def tensor_parallel_refusal(arch: ArchConfig, tp: int) -> str | None:
    """Why ``tp`` ranks cannot shard this architecture (None: they can). Megatron-style
    sharding needs whole heads, whole MLP columns and whole vocab slices per rank; ``plan``
    asks the same question for its GPU counts."""
    if tensor_parallel_ok(arch, tp):
        return None
    if arch.num_heads % tp:
        return f"{tp} does not divide num_attention_heads={arch.num_heads}; valid: {_divisors(arch.num_heads)}"
    if arch.num_kv_heads % tp and tp % arch.num_kv_heads:
        return (f"{tp} neither divides nor is a multiple of num_key_value_heads={arch.num_kv_heads} "
                "(KV heads are split or replicated whole)")
    for field, size in (("intermediate_size", arch.intermediate_size), ("vocab_size", arch.vocab_size)):
        if size % tp:
            return (f"{tp} does not divide {field}={size} "
                    f"({'MLP columns' if field == 'intermediate_size' else 'the vocab-parallel LM head'} "
                    "split evenly across ranks)")
    return None


def _divisors(n: int, limit: int = 1024) -> str:
    """Divisors of ``n`` up to ``limit`` (a tensor parallelism beyond that is not a real choice)."""
    return ", ".join(str(d) for d in range(1, min(n, limit) + 1) if n % d == 0)


def _group_sizes(n: int) -> str:
    """The int4 group sizes a layer of every width dividing into ``n`` channels takes: the
    divisors of ``n`` from the spec's minimum group of 8 (``Quantization.group_size``)."""
    valid = [d for d in range(8, n + 1) if n % d == 0]
    return ", ".join(map(str, valid)) if valid else f"none (the widths' common divisor is {n}, under the minimum 8)"


def _check_quantization(spec: Spec) -> None:
    q, arch, targets = spec.quantization, spec.arch, spec.build.targets
    if q.mode == "fp8" and (not targets or any(int(t[2:]) < 89 for t in targets)):
        raise SpecError("quantization.mode", f"fp8 needs every build target to be sm89 or newer; build.targets is "
                                             f"{list(targets) or 'portable'}")
    if q.mode == "nvfp4" and (not targets or any(t not in ("sm120", "sm121") for t in targets)):
        raise SpecError("quantization.mode", f"nvfp4 needs sm120/sm121 targets only; build.targets is "
                                             f"{list(targets) or 'portable'}")
    if q.kv_cache in ("int8", "fp8"):
        raise SpecError("quantization.kv_cache", f"{q.kv_cache} caches do not build: TensorRT-RTX's KV-cache "
                                                 "update (ONNX TensorScatter) takes only float16/bfloat16/float32 "
                                                 "caches; use auto or fp16")
    if q.quantize_embeddings and q.mode not in ("int8_weight_only", "int4_weight_only", "w8a8"):
        raise SpecError("quantization.quantize_embeddings", f"applies to int8_weight_only, int4_weight_only and "
                                                            f"w8a8 (int8 rows); mode is {q.mode}")
    if q.cpu_activations == "int8" and q.mode not in ("int8_weight_only", "int4_weight_only"):
        raise SpecError("quantization.cpu_activations", f"int8 applies to int4_weight_only and int8_weight_only "
                                                        f"(ONNX Runtime's n-bit GEMM); mode is {q.mode}")
    if q.quantize_embeddings and arch.tie_word_embeddings:
        raise SpecError("quantization.quantize_embeddings", "the checkpoint ties its embeddings to lm_head "
                                                            "(tie_word_embeddings): quantize lm_head instead")
    if q.mode == "none":
        return
    if q.mode in ("int8_weight_only", "w8a8", "fp8", "nvfp4") and q.algorithm != "rtn":
        raise SpecError("quantization.algorithm", f"{q.algorithm} applies to int4_weight_only; {q.mode} "
                                                  "uses rtn (per output channel)")
    if q.mode in ("w8a8", "fp8") and q.calibration is None:
        raise SpecError("quantization.calibration", f"required for mode {q.mode} (static activation scales): "
                                                    "{data: TEXT_FILE, samples: N, seq_len: L}")
    if q.mode in ("int4_weight_only", "nvfp4"):
        group = 16 if q.mode == "nvfp4" else q.group_size  # NVFP4's block is fixed by the format
        tp = spec.parallel.tensor
        per_rank = "" if tp == 1 else f" / parallel.tensor {tp}"
        dims = (("hidden_size", arch.hidden_size), (f"intermediate_size{per_rank}", arch.intermediate_size // tp),
                (f"num_attention_heads × head_dim{per_rank}", arch.num_heads * arch.head_dim // tp))
        for field, dim in dims:
            if dim % group:
                if q.mode == "nvfp4":
                    raise SpecError("quantization.mode", f"{group} does not divide {field}={dim} "
                                                         "(NVFP4 blocks are 16 input channels)")
                raise SpecError("quantization.group_size", f"{group} does not divide {field}={dim}; valid: "
                                                           f"{_group_sizes(math.gcd(*(d for _, d in dims)))}")
    if q.algorithm in ("awq", "gptq") or q.calibration is not None:
        if q.calibration is None:
            raise SpecError("quantization.calibration", f"required for algorithm {q.algorithm}: "
                                                        "{data: TEXT_FILE, samples: N, seq_len: L}")
        for path in q.calibration.data:
            if not path.is_file():
                raise SpecError("quantization.calibration.data", f"{path} is not a file")
        if not q.calibration.data:
            raise SpecError("quantization.calibration.data", "no files given")
    names = linear_names(arch)
    for pattern in q.exclude:
        if not any(pattern in name for name in names):
            raise SpecError("quantization.exclude", f"{pattern!r} matches no linear layer "
                                                    f"(names look like {names[0]}, lm_head)")

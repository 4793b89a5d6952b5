"""The deployment spec: the YAML document validated (``SpecDocument``, plain data), and the
read-only ``Spec`` that flows down the build: the document with the facts resolution read
(the checkpoint's architecture, the Medusa heads and their tree). Resolution and the
cross-checks against the checkpoint live in builder/spec/resolve.py; nothing here reads a file.

Every field is documented in specs/README.md. Errors are one line naming the YAML path:
``parallel.tensor: 3 does not divide num_key_value_heads=2``.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import cached_property
from enum import Enum
from pathlib import Path
from typing import Literal

import numpy as np
# Strict ints and booleans: `max_batch_size: true` or `"8"` is a mistake to name, not a 1 or an 8.
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator, model_validator

from ...contract.manifest import DEFAULT_MAX_TOKENS, DEFAULT_MULTI_STEP
from ...onnxruntime_cpu.session import CpuActivations
from ...contract.pipeline import RankPosition, balanced_layers, rank_positions, stage_layers
from ...contract.dtypes import NUMPY_DTYPES
from ..sharding import kv_heads_per_rank
from ...contract.gpu_targets import RTX_TARGETS, TENSORRT_TARGETS  # noqa: F401  (RTX_TARGETS: API)
from .errors import FieldError
from ..frontend.checkpoint import ArchConfig



class DType(str, Enum):
    float32 = "float32"
    float16 = "float16"
    bfloat16 = "bfloat16"

    @property
    def torch(self):
        import torch
        return getattr(torch, self.value)  # torch names its dtypes as the spec does

    @property
    def numpy(self) -> np.dtype:
        return NUMPY_DTYPES[self.value]

    @property
    def onnx(self) -> int:
        """The ONNX TensorProto element type."""
        from onnx.helper import np_dtype_to_tensor_dtype
        return np_dtype_to_tensor_dtype(self.numpy)

    @property
    def short(self) -> str:
        """The precision's short name in plans and GPU tables (fp32, fp16, bf16)."""
        return {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}[self.value]


class Backend(str, Enum):
    auto = "auto"
    tensorrt = "tensorrt"
    tensorrt_rtx = "tensorrt-rtx"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_enum_values=False)


class ModelSection(_Section):
    checkpoint: Path = Field(description="HF checkpoint dir, or a .gguf file (llama.cpp; dequantized as read); relative paths are relative to the spec file")
    dtype: DType = DType.float16


class BuildSection(_Section):
    backend: Backend = Backend.auto
    targets: tuple[str, ...] = Field(default=(), description="compute capabilities; empty = portable")
    max_batch_size: StrictInt = Field(8, ge=1, le=4096)
    max_input_len: StrictInt = Field(512, ge=1)
    max_seq_len: StrictInt = Field(2048, ge=2)
    cuda_graph_batch_sizes: tuple[StrictInt, ...] | None = None
    builder_optimization_level: StrictInt = Field(3, ge=0, le=5)
    cpu_graphs: StrictBool = Field(True, description=(
        "keep each rank's ONNX graphs and their weights in the engine dir (the CPU runtime and "
        "trtbuild eval run them); false ships the TensorRT engines alone, about half the size"))

    @field_validator("targets", mode="before")
    @classmethod
    def _targets(cls, value):
        if isinstance(value, str):
            value = [value]
        if value is None:
            value = []
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"a list of compute capabilities like [sm89], got {value!r}")
        out = []
        for item in value:
            name = str(item).lower().replace(".", "")
            name = name if name.startswith("sm") else f"sm{name}"
            if name not in TENSORRT_TARGETS:
                raise ValueError(f"{item!r} is not a compute capability; valid: {', '.join(TENSORRT_TARGETS)}")
            out.append(name)
        return tuple(dict.fromkeys(out))

    @model_validator(mode="after")
    def _limits(self):
        if self.max_input_len > self.max_seq_len:
            raise FieldError("max_input_len", f"{self.max_input_len} exceeds max_seq_len={self.max_seq_len}")
        for size in self.cuda_graph_batch_sizes or ():
            if not 1 <= size <= self.max_batch_size:
                raise FieldError("cuda_graph_batch_sizes",
                                  f"{size} is outside [1, max_batch_size={self.max_batch_size}]")
        return self


class PassesSection(_Section):
    disable: tuple[str, ...] = ()
    numerics: StrictBool = Field(True, description="run each pass's graph in ONNX Runtime and compare")
    numerics_whole_max_mib: StrictInt = Field(128, ge=0, description=(
        "largest model (MiB of weights) whose built graph the numerics check runs; above it, the same "
        "passes run on a graph of its first layers with the real weights (plus structural checks)"))
    atol: float = Field(1e-3, gt=0)
    rtol: float = Field(1e-2, gt=0)
    # After quantization the reference is torch with the same fake quantization; activation
    # rounding can land on the other side of a step there, so outputs get a looser bound.
    quantized_rtol: float = Field(5e-2, gt=0)


class ParallelSection(_Section):
    tensor: StrictInt = Field(1, ge=1)
    pipeline: StrictInt = Field(1, ge=1, description="pipeline stages P: contiguous runs of decoder layers")
    layers_per_stage: tuple[StrictInt, ...] = Field((), description=(
        "decoder layers of each stage, first to last (one entry per stage, summing to the model's "
        "layers); empty: balanced by layer count"))

    @model_validator(mode="after")
    def _stages(self):
        if not self.layers_per_stage:
            return self
        if len(self.layers_per_stage) != self.pipeline:
            raise FieldError("layers_per_stage", f"{len(self.layers_per_stage)} entries for pipeline={self.pipeline}; "
                                                 "give one layer count per stage")
        for index, count in enumerate(self.layers_per_stage):
            if count < 1:
                raise FieldError("layers_per_stage", f"entry {index} is {count}; every stage holds at least one "
                                                     "decoder layer")
        return self


class CalibrationSection(_Section):
    data: tuple[Path, ...] = Field(description="text file(s) to calibrate on; relative to the spec file")

    @field_validator("data", mode="before")
    @classmethod
    def _one_or_more(cls, value):
        return [value] if isinstance(value, (str, Path)) else value
    samples: StrictInt = Field(32, ge=1)
    seq_len: StrictInt = Field(256, ge=8)


class QuantizationSection(_Section):
    mode: Literal["none", "int8_weight_only", "int4_weight_only", "w8a8", "fp8", "nvfp4"] = "none"
    algorithm: Literal["rtn", "awq", "gptq"] = "rtn"
    group_size: StrictInt = Field(128, ge=8)
    calibration: CalibrationSection | None = None
    kv_cache: Literal["auto", "fp16", "int8", "fp8"] = "auto"
    exclude: tuple[str, ...] = ("lm_head",)
    smoothquant_alpha: float = Field(0.5, ge=0.0, le=1.0, description="w8a8: migration strength")
    quantize_embeddings: StrictBool = Field(False, description="int8 per-row embedding table (DequantizeLinear → Gather)")
    keep_gguf_codes: StrictBool = Field(True, description="a .gguf checkpoint's Q4_0 (Q8_0) blocks that the mode "
                                        "represents keep their codes instead of being re-quantized")
    cpu_activations: Literal["float", "int8"] = Field(
        "float", description="ONNX Runtime (CPU) only: int8 quantizes the activations of int4/int8 weight-only "
                             "MatMuls on the fly (faster; the numerics check and eval measure the cost)")

    @property
    def activations(self) -> CpuActivations:
        return CpuActivations(self.cpu_activations)

    @property
    def bits(self) -> int | None:
        """Weight bits of the implemented modes (w8a8 weights are int8 too)."""
        return {"int8_weight_only": 8, "int4_weight_only": 4, "w8a8": 8, "fp8": 8, "nvfp4": 4}.get(self.mode)


class MedusaSection(_Section):
    heads: Path = Field(description="Medusa heads dir (public layout); relative to the spec file")
    num_heads: StrictInt = Field(ge=1, le=16, description="K: must equal the heads' medusa_num_heads")
    tree: Literal["default"] | tuple[tuple[StrictInt, ...], ...] = Field(
        "default", description="default: grown from the heads' measured accuracy; or paths of ranks")
    tree_nodes: StrictInt = Field(63, ge=1, le=255, description="nodes of the default tree (the root not counted)")


class SpeculativeSection(_Section):
    medusa: MedusaSection | None = None


class RuntimeSection(_Section):
    max_tokens: StrictInt = Field(DEFAULT_MAX_TOKENS, ge=1)
    temperature: float = Field(0.0, ge=0.0)
    top_k: StrictInt = Field(0, ge=0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    prefix_cache: StrictBool = True
    multi_step: StrictInt = Field(DEFAULT_MULTI_STEP, ge=1)


class SpecDocument(_Section):
    """The spec file's content, validated field by field (plain data: nothing read from disk)."""

    model: ModelSection
    build: BuildSection = BuildSection()
    passes: PassesSection = PassesSection()
    parallel: ParallelSection = ParallelSection()
    quantization: QuantizationSection = QuantizationSection()
    speculative: SpeculativeSection = SpeculativeSection()
    runtime: RuntimeSection = RuntimeSection()


@dataclass(frozen=True)
class ResolvedMedusa:
    """The spec's Medusa section with what its heads dir says (builder/medusa/resolve.py)."""

    heads: Path                                       # absolute
    num_heads: int
    num_layers: int                                   # residual blocks per head (medusa_num_layers)
    choices: tuple[tuple[int, ...], ...]              # the tree to build, likeliest path first
    topk_accuracy: tuple[tuple[float, ...], ...] | None  # the heads' held-out top-1..n accuracy, if recorded
    rank_accuracy: tuple[tuple[float, ...], ...]      # P(rank r of head k is right): trees grow by it

    @property
    def tree_size(self) -> int:
        """Tokens of one verification step: the root plus every choice."""
        return 1 + len(self.choices)


@dataclass(frozen=True)
class Spec:
    """One resolved deployment spec (builder/spec/resolve.py makes it): the document, paths made
    absolute, and the facts read from the checkpoint and the heads. Never mutated."""

    document: SpecDocument
    arch: ArchConfig
    medusa: ResolvedMedusa | None

    @property
    def model(self) -> ModelSection:
        return self.document.model

    @property
    def build(self) -> BuildSection:
        return self.document.build

    @property
    def passes(self) -> PassesSection:
        return self.document.passes

    @property
    def parallel(self) -> ParallelSection:
        return self.document.parallel

    @property
    def quantization(self) -> QuantizationSection:
        return self.document.quantization

    @property
    def runtime(self) -> RuntimeSection:
        return self.document.runtime

    @property
    def world_size(self) -> int:
        """Ranks: T tensor ranks in each of P pipeline stages."""
        return self.parallel.tensor * self.parallel.pipeline

    @cached_property
    def stages(self) -> tuple[range, ...]:
        """Each pipeline stage's decoder layers (spec_checks made sure they cover the model)."""
        p = self.parallel
        return stage_layers(p.layers_per_stage or balanced_layers(self.arch.num_layers, p.pipeline))

    @cached_property
    def ranks(self) -> tuple[RankPosition, ...]:
        """Every rank's stage, tensor rank and layers (rank = stage · T + tensor rank)."""
        return rank_positions(self.stages, self.parallel.tensor)

    @property
    def kv_heads_per_rank(self) -> int:
        """KV heads in each rank's caches (split, or one replicated head when TP exceeds them)."""
        return kv_heads_per_rank(self.parallel.tensor, self.arch.num_kv_heads)

    @property
    def max_step_tokens(self) -> int:
        """Largest S of one step: a prefill chunk or a Medusa tree."""
        return max(self.build.max_input_len, self.verify_tokens)

    @property
    def verify_tokens(self) -> int:
        """S of a Medusa verification step (1 without Medusa: plain decode)."""
        return self.medusa.tree_size if self.medusa else 1

    @property
    def cuda_graph_batch_sizes(self) -> tuple[int, ...]:
        if self.build.cuda_graph_batch_sizes:
            return tuple(sorted(set(self.build.cuda_graph_batch_sizes)))
        sizes, b = [], 1
        while b < self.build.max_batch_size:
            sizes.append(b)
            b *= 2
        return tuple(sizes + [self.build.max_batch_size])

    def model_dump(self, **kwargs) -> dict:
        """The document as data (what the manifest records)."""
        return self.document.model_dump(**kwargs)

    def canonical_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))

    def sha256(self) -> str:
        return hashlib.sha256(self.canonical_json().encode()).hexdigest()


def linear_names(arch: ArchConfig) -> list[str]:
    """Module paths of the linear layers the quantizer may touch, as transformers names them."""
    names = [f"layers.{i}.{part}" for i in range(arch.num_layers)
             for part in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                          "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
    return names + ["lm_head"]

"""The spec file's YAML document validated (``SpecDocument``, plain data: nothing read from
disk), section by section. Every field is documented in specs/README.md; errors are one line
naming the YAML path."""
from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Literal

# Strict ints and booleans: `max_batch_size: true` or `"8"` is a mistake to name, not a 1 or an 8.
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator, model_validator

from ...contract.gpu_targets import TENSORRT_TARGETS
from ...contract.kv_budget import DEFAULT_BLOCK_SIZE, parse_kv_cache_memory
from ...contract.manifest import DEFAULT_MAX_TOKENS, DEFAULT_MULTI_STEP
from ...contract.speculation import DraftHeadSourceConfig, PromptLookupConfig, SuffixConfig
from ...plugins.onnxruntime.session import CpuActivations
from .dtype import DType
from .errors import FieldError


class Backend(str, Enum):
    auto = "auto"
    tensorrt = "tensorrt"
    tensorrt_rtx = "tensorrt-rtx"


class KVCacheLayout(str, Enum):
    """The TensorRT engine's KV caches (contract/step.py): a slot of max_seq_len positions per row,
    or one pool of blocks per layer that every row draws from through a block table."""

    slots = "slots"
    paged = "paged"


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
    kv_cache_layout: KVCacheLayout | None = Field(None, description=(
        "the TensorRT engine's KV caches: paged (pools of runtime.kv_block_size blocks; every rank "
        "pools its own layers' and KV heads' caches) or slots; unset: paged"))
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


def _config_problem(config, field: str | None = None) -> FieldError | None:
    """A host-side draft source's settings checked by the contract's own rule (the one the runtime
    applies to a manifest); the error names ``field``, else the field its message starts with.
    A message about one field loses its leading name (the path says it); one about two keeps both."""
    problem = config.problem()
    if problem is None:
        return None
    named = problem.split(" ", 1)[0]
    single = "," not in problem.partition(":")[0]
    return FieldError(field or named, problem.removeprefix(f"{named} ") if single else problem)


# Fields and defaults are those of contract/speculation.py's configs (the manifest's entry); the
# ranges are checked there too, so a spec is refused exactly where a runtime would refuse its dir.
class PromptLookupSection(_Section):
    num_tokens: StrictInt = Field(PromptLookupConfig.num_tokens, description="longest chain proposed (1 to 64)")
    min_ngram: StrictInt = Field(PromptLookupConfig.min_ngram, description="shortest n-gram looked up")
    max_ngram: StrictInt = Field(PromptLookupConfig.max_ngram, description="longest n-gram looked up (≤ 16)")

    @model_validator(mode="after")
    def _valid(self):
        # min_ngram and max_ngram are checked together: blame max_ngram where it alone is out of range.
        if (error := _config_problem(self.config, "max_ngram" if self.max_ngram > 16 else None)) is not None:
            raise error
        return self

    @property
    def config(self) -> PromptLookupConfig:
        return PromptLookupConfig(**self.model_dump())


class SuffixSection(_Section):
    num_tokens: StrictInt = Field(SuffixConfig.num_tokens, description="most tree nodes proposed (1 to 64)")
    max_depth: StrictInt = Field(SuffixConfig.max_depth, description="longest path proposed (≤ num_tokens)")
    max_match: StrictInt = Field(SuffixConfig.max_match, description="longest suffix matched (1 to 256)")
    min_probability: float = Field(SuffixConfig.min_probability, description="a node's least path probability [0, 1)")
    cross_request: StrictInt = Field(SuffixConfig.cross_request, description="recent requests' outputs kept (0 to 1024)")

    @model_validator(mode="after")
    def _valid(self):
        if (error := _config_problem(self.config)) is not None:
            raise error
        return self

    @property
    def config(self) -> SuffixConfig:
        return SuffixConfig(**self.model_dump())


class DraftHeadSection(_Section):
    path: Path = Field(description="draft head dir (draft_head.json, draft_head.safetensors: `trtbuild draft "
                                   "train`); relative to the spec file")
    num_tokens: StrictInt = Field(DraftHeadSourceConfig.num_tokens, description="longest chain drafted (1 to 64)")

    @model_validator(mode="after")
    def _valid(self):
        if (error := _config_problem(self.config, "num_tokens")) is not None:
            raise error
        return self

    @property
    def config(self) -> DraftHeadSourceConfig:
        return DraftHeadSourceConfig(num_tokens=self.num_tokens)


class SpeculativeSection(_Section):
    medusa: MedusaSection | None = None
    prompt_lookup: PromptLookupSection | None = None
    suffix: SuffixSection | None = None
    draft_head: DraftHeadSection | None = None


class RuntimeSection(_Section):
    max_tokens: StrictInt = Field(DEFAULT_MAX_TOKENS, ge=1)
    temperature: float = Field(0.0, ge=0.0)
    top_k: StrictInt = Field(0, ge=0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    prefix_cache: StrictBool = True
    multi_step: StrictInt = Field(DEFAULT_MULTI_STEP, ge=1)
    kv_cache_memory: int | float | None = Field(None, description=(
        "KV-cache budget: bytes (an integer or \"1GiB\") or a share in (0, 1] of the memory free at load; "
        "unset: max_batch_size × max_seq_len tokens (every row's whole context)"))
    kv_block_size: StrictInt = Field(DEFAULT_BLOCK_SIZE, description="token positions per KV block (a power of two)")

    @field_validator("kv_cache_memory", mode="before")
    @classmethod
    def _budget(cls, value):
        return None if value is None else parse_kv_cache_memory(value)


class SpecDocument(_Section):
    """The spec file's content, validated field by field (plain data: nothing read from disk)."""

    model: ModelSection
    build: BuildSection = BuildSection()
    passes: PassesSection = PassesSection()
    parallel: ParallelSection = ParallelSection()
    quantization: QuantizationSection = QuantizationSection()
    speculative: SpeculativeSection = SpeculativeSection()
    runtime: RuntimeSection = RuntimeSection()

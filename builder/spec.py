"""The deployment spec: YAML validated once into a read-only ``Spec``.

Every field is documented in specs/README.md. Errors are one line naming the YAML path:
``parallel.tensor: 3 does not divide num_key_value_heads=2``.
"""
from __future__ import annotations

import hashlib
import json
from enum import Enum
from pathlib import Path
from typing import Callable, Literal

import yaml
# Strict ints and booleans: `max_batch_size: true` or `"8"` is a mistake to name, not a 1 or an 8.
from pydantic import (BaseModel, ConfigDict, Field, PrivateAttr, StrictBool, StrictInt, ValidationError, field_validator,
                      model_validator)

from ..contract.manifest import DEFAULT_MULTI_STEP
from ..contract.onnxruntime import CpuActivations
from ..contract.tensor_parallel import kv_heads_per_rank
from ..contract.gpu_targets import RTX_TARGETS, TENSORRT_TARGETS  # noqa: F401  (RTX_TARGETS: API)
from .errors import SpecError, UserError
from .spec_checks import check_against_checkpoint, linear_names  # noqa: F401  (linear_names: API)
from .spec_errors import FieldError, did_you_mean, spec_error
from .frontend.checkpoint import ArchConfig, arch_config



class DType(str, Enum):
    float32 = "float32"
    float16 = "float16"
    bfloat16 = "bfloat16"

    @property
    def torch(self):
        import torch
        return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[self.value]


class Backend(str, Enum):
    auto = "auto"
    tensorrt = "tensorrt"
    tensorrt_rtx = "tensorrt-rtx"


PASS_NAMES = ("canonicalize", "fuse_rmsnorm", "fuse_rotary", "fuse_attention", "quantize_weights",
              "shard_tensor_parallel", "attach_medusa", "plan_cuda_graphs")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_enum_values=False)


class ModelSection(_Section):
    checkpoint: Path = Field(description="HF checkpoint dir; relative paths are relative to the spec file")
    dtype: DType = DType.float16
    _arch: ArchConfig | None = PrivateAttr(default=None)

    @property
    def arch(self) -> ArchConfig:
        assert self._arch is not None, "Spec was not validated through load_spec/Spec.from_dict"
        return self._arch


class BuildSection(_Section):
    backend: Backend = Backend.auto
    targets: tuple[str, ...] = Field(default=(), description="compute capabilities; empty = portable")
    max_batch_size: StrictInt = Field(8, ge=1, le=4096)
    max_input_len: StrictInt = Field(512, ge=1)
    max_seq_len: StrictInt = Field(2048, ge=2)
    cuda_graph_batch_sizes: tuple[StrictInt, ...] | None = None
    builder_optimization_level: StrictInt = Field(3, ge=0, le=5)

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

    @field_validator("disable")
    @classmethod
    def _known(cls, value):
        for name in value:
            if name not in PASS_NAMES:
                raise ValueError(f"unknown pass {name!r}{did_you_mean(name, PASS_NAMES)}; "
                                 f"valid: {', '.join(PASS_NAMES)}")
        return value


class ParallelSection(_Section):
    tensor: StrictInt = Field(1, ge=1)
    pipeline: Literal[1] = Field(1, description="reserved: pipeline parallelism is not implemented")


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
    _choices: tuple[tuple[int, ...], ...] = PrivateAttr(default=())
    _accuracy: tuple[tuple[float, ...], ...] | None = PrivateAttr(default=None)
    _rank_accuracy: list[list[float]] = PrivateAttr(default_factory=list)
    _num_layers: int = PrivateAttr(default=1)

    @property
    def choices(self) -> tuple[tuple[int, ...], ...]:
        """The tree to build, likeliest path first (every prefix is a tree)."""
        assert self._choices, "Spec was not validated through load_spec/Spec.from_dict"
        return self._choices

    @property
    def topk_accuracy(self) -> tuple[tuple[float, ...], ...] | None:
        """The heads' held-out top-1..top-n accuracy, if their config records it."""
        return self._accuracy

    @property
    def rank_accuracy(self) -> list[list[float]]:
        """P(rank r of head k is right): what trees are grown and ordered by."""
        return self._rank_accuracy

    @property
    def num_layers(self) -> int:
        """Residual blocks per head (the heads' medusa_num_layers)."""
        return self._num_layers

    @property
    def tree_size(self) -> int:
        """Tokens of one verification step: the root plus every choice."""
        return 1 + len(self.choices)


class SpeculativeSection(_Section):
    medusa: MedusaSection | None = None


class RuntimeSection(_Section):
    max_tokens: StrictInt = Field(128, ge=1)
    temperature: float = Field(0.0, ge=0.0)
    top_k: StrictInt = Field(0, ge=0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    prefix_cache: StrictBool = True
    multi_step: StrictInt = Field(DEFAULT_MULTI_STEP, ge=1)


class Spec(_Section):
    """One validated deployment spec. Never mutated after validation."""

    model: ModelSection
    build: BuildSection = BuildSection()
    passes: PassesSection = PassesSection()
    parallel: ParallelSection = ParallelSection()
    quantization: QuantizationSection = QuantizationSection()
    speculative: SpeculativeSection = SpeculativeSection()
    runtime: RuntimeSection = RuntimeSection()

    @property
    def arch(self) -> ArchConfig:
        return self.model.arch

    @property
    def world_size(self) -> int:
        return self.parallel.tensor * self.parallel.pipeline

    @property
    def kv_heads_per_rank(self) -> int:
        """KV heads in each rank's caches (split, or one replicated head when TP exceeds them)."""
        return kv_heads_per_rank(self.world_size, self.arch.num_kv_heads)

    @property
    def max_step_tokens(self) -> int:
        """Largest S of one step: a prefill chunk or a Medusa tree."""
        return max(self.build.max_input_len, self.verify_tokens)

    @property
    def medusa(self) -> MedusaSection | None:
        return self.speculative.medusa

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

    def canonical_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))

    def sha256(self) -> str:
        return hashlib.sha256(self.canonical_json().encode()).hexdigest()

    @classmethod
    def from_dict(cls, data: dict, base_dir: Path = Path("."),
                  absent_checkpoint: Callable[[Path], ArchConfig | None] | None = None) -> "Spec":
        """``absent_checkpoint``: for readers that need only the architecture (``plan``), the
        facts to use when the checkpoint dir is not here (None: refuse, as a build must)."""
        if not isinstance(data, dict):
            raise SpecError("", f"a spec is a YAML mapping with sections {', '.join(cls.model_fields)}")
        try:
            spec = cls.model_validate(data)
        except ValidationError as exc:
            raise spec_error(cls, exc) from None
        except FieldError as exc:  # raised by a section validator outside pydantic's wrapping
            raise SpecError(exc.path, exc.message) from None
        checkpoint = spec.model.checkpoint
        if not checkpoint.is_absolute():
            checkpoint = (Path(base_dir) / checkpoint).resolve()
        stand_in = absent_checkpoint(checkpoint) if absent_checkpoint and not checkpoint.exists() else None
        try:
            arch = stand_in or arch_config(checkpoint)
        except UserError as exc:
            raise SpecError("model.checkpoint", str(exc)) from None
        model = spec.model.model_copy(update={"checkpoint": checkpoint})
        model._arch = arch
        spec = spec.model_copy(update={"model": model})
        calibration = spec.quantization.calibration
        if calibration is not None:
            calibration = calibration.model_copy(update={"data": tuple(
                path if path.is_absolute() else (Path(base_dir) / path).resolve() for path in calibration.data)})
            spec = spec.model_copy(update={"quantization": spec.quantization.model_copy(
                update={"calibration": calibration})})
        if spec.medusa is not None:
            from .medusa.resolve import resolve_medusa  # the heads' modules load only for Medusa specs

            spec = spec.model_copy(update={"speculative": SpeculativeSection(
                medusa=resolve_medusa(spec.medusa, spec.arch, Path(base_dir)))})
        check_against_checkpoint(spec)
        return spec


class _DuplicateKey(yaml.YAMLError):
    def __init__(self, key, line: int):
        super().__init__(f"duplicate key {key!r}")
        self.key, self.line = key, line


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's own rule, which PyYAML does not enforce: mapping keys are unique (else the last
    silently wins, and a spec means something other than it reads)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise _DuplicateKey(key, key_node.start_mark.line + 1)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_spec(path: Path, absent_checkpoint: Callable[[Path], ArchConfig | None] | None = None) -> Spec:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: spec file does not exist")
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)
    except UnicodeDecodeError:
        raise UserError(f"{path}: not UTF-8 text") from None
    except _DuplicateKey as exc:
        raise UserError(f"{path}: key {exc.key!r} appears twice at line {exc.line}; give each key once") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise UserError(f"{path}: not valid YAML{where}: {getattr(exc, 'problem', exc)}") from None
    return Spec.from_dict(data, base_dir=path.parent, absent_checkpoint=absent_checkpoint)



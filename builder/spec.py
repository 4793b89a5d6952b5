"""The deployment spec: YAML validated once into a read-only ``Spec``.

Every field is documented in specs/README.md. Errors are one line naming the YAML path:
``parallel.tensor: 3 does not divide num_key_value_heads=2``.
"""
from __future__ import annotations

import difflib
import hashlib
import json
from enum import Enum
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

from ..contract.tensor_parallel import kv_heads_per_rank
from .errors import SpecError, UserError
from .frontend.checkpoint import ArchConfig, arch_config

# Compute capabilities each TensorRT flavour can target ahead of time.
RTX_TARGETS = ("sm75", "sm80", "sm86", "sm89", "sm120", "sm121")
TENSORRT_TARGETS = ("sm75", "sm80", "sm86", "sm87", "sm89", "sm90", "sm100", "sm103", "sm110",
                    "sm120", "sm121")


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
    max_batch_size: int = Field(8, ge=1, le=4096)
    max_input_len: int = Field(512, ge=1)
    max_seq_len: int = Field(2048, ge=2)
    cuda_graph_batch_sizes: tuple[int, ...] | None = None
    builder_optimization_level: int = Field(3, ge=0, le=5)

    @field_validator("targets", mode="before")
    @classmethod
    def _targets(cls, value):
        if isinstance(value, str):
            value = [value]
        out = []
        for item in value or ():
            name = str(item).lower().replace(".", "")
            name = name if name.startswith("sm") else f"sm{name}"
            if name not in TENSORRT_TARGETS:
                raise ValueError(f"{item!r} is not a compute capability; valid: {', '.join(TENSORRT_TARGETS)}")
            out.append(name)
        return tuple(dict.fromkeys(out))

    @model_validator(mode="after")
    def _limits(self):
        if self.max_input_len > self.max_seq_len:
            raise _FieldError("max_input_len", f"{self.max_input_len} exceeds max_seq_len={self.max_seq_len}")
        for size in self.cuda_graph_batch_sizes or ():
            if not 1 <= size <= self.max_batch_size:
                raise _FieldError("cuda_graph_batch_sizes",
                                  f"{size} is outside [1, max_batch_size={self.max_batch_size}]")
        return self


class PassesSection(_Section):
    disable: tuple[str, ...] = ()
    numerics: bool = Field(True, description="run each pass's graph in ONNX Runtime and compare")
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
                raise ValueError(f"unknown pass {name!r}{_did_you_mean(name, PASS_NAMES)}; "
                                 f"valid: {', '.join(PASS_NAMES)}")
        return value


class ParallelSection(_Section):
    tensor: int = Field(1, ge=1)
    pipeline: Literal[1] = Field(1, description="reserved: pipeline parallelism is not implemented")


class CalibrationSection(_Section):
    data: tuple[Path, ...] = Field(description="text file(s) to calibrate on; relative to the spec file")

    @field_validator("data", mode="before")
    @classmethod
    def _one_or_more(cls, value):
        return [value] if isinstance(value, (str, Path)) else value
    samples: int = Field(32, ge=1)
    seq_len: int = Field(256, ge=8)


class QuantizationSection(_Section):
    mode: Literal["none", "int8_weight_only", "int4_weight_only", "w8a8", "fp8", "nvfp4"] = "none"
    algorithm: Literal["rtn", "awq", "gptq"] = "rtn"
    group_size: int = Field(128, ge=8)
    calibration: CalibrationSection | None = None
    kv_cache: Literal["auto", "fp16", "int8", "fp8"] = "auto"
    exclude: tuple[str, ...] = ("lm_head",)
    smoothquant_alpha: float = Field(0.5, ge=0.0, le=1.0, description="w8a8: migration strength")
    quantize_embeddings: bool = Field(False, description="int8 per-row embedding table (DequantizeLinear → Gather)")

    @property
    def bits(self) -> int | None:
        """Weight bits of the implemented modes (w8a8 weights are int8 too)."""
        return {"int8_weight_only": 8, "int4_weight_only": 4, "w8a8": 8, "fp8": 8, "nvfp4": 4}.get(self.mode)


class MedusaSection(_Section):
    heads: Path = Field(description="Medusa heads dir (public layout); relative to the spec file")
    num_heads: int = Field(ge=1, le=16, description="K: must equal the heads' medusa_num_heads")
    tree: Literal["default"] | tuple[tuple[int, ...], ...] = Field(
        "default", description="default: grown from the heads' measured accuracy; or paths of ranks")
    tree_nodes: int = Field(63, ge=1, le=255, description="nodes of the default tree (the root not counted)")
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
    max_tokens: int = Field(128, ge=1)
    temperature: float = Field(0.0, ge=0.0)
    top_k: int = Field(0, ge=0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    prefix_cache: bool = True


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
    def from_dict(cls, data: dict, base_dir: Path = Path(".")) -> "Spec":
        if not isinstance(data, dict):
            raise SpecError("", f"a spec is a YAML mapping with sections {', '.join(cls.model_fields)}")
        try:
            spec = cls.model_validate(data)
        except ValidationError as exc:
            raise _spec_error(exc) from None
        except _FieldError as exc:  # raised by a section validator outside pydantic's wrapping
            raise SpecError(exc.path, exc.message) from None
        checkpoint = spec.model.checkpoint
        if not checkpoint.is_absolute():
            checkpoint = (Path(base_dir) / checkpoint).resolve()
        try:
            arch = arch_config(checkpoint)
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
            spec = spec.model_copy(update={"speculative": SpeculativeSection(
                medusa=_resolve_medusa(spec.medusa, spec.arch, Path(base_dir)))})
        _check_against_checkpoint(spec)
        return spec


def load_spec(path: Path) -> Spec:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: spec file does not exist")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise UserError(f"{path}: not valid YAML{where}: {getattr(exc, 'problem', exc)}") from None
    return Spec.from_dict(data, base_dir=path.parent)


def _check_against_checkpoint(spec: Spec) -> None:
    arch = spec.arch
    _check_tensor_parallel(spec)
    if spec.build.max_seq_len > arch.max_position_embeddings:
        raise SpecError("build.max_seq_len", f"{spec.build.max_seq_len} exceeds the checkpoint's "
                                             f"max_position_embeddings={arch.max_position_embeddings}")
    if arch.sliding_window and arch.sliding_window < spec.build.max_seq_len:
        raise SpecError("build.max_seq_len", f"{spec.build.max_seq_len} exceeds the checkpoint's "
                                             f"sliding_window={arch.sliding_window}, which trtbuild does "
                                             "not implement; use at most that")
    _check_quantization(spec)
    if spec.medusa is not None and spec.verify_tokens > spec.build.max_seq_len:
        raise SpecError("speculative.medusa.tree", f"{spec.verify_tokens} tokens per verification exceed "
                                                   f"build.max_seq_len={spec.build.max_seq_len}")
    if spec.model.dtype == DType.float32 and "sm75" in spec.build.targets:
        raise SpecError("build.targets", "sm75 has no float32 GEMM in TensorRT-RTX; use model.dtype "
                                         "float16 or drop sm75")


def _check_tensor_parallel(spec: Spec) -> None:
    """Megatron-style sharding needs whole heads, whole MLP columns and whole vocab slices per rank."""
    arch, tp = spec.arch, spec.parallel.tensor
    if arch.num_heads % tp:
        raise SpecError("parallel.tensor", f"{tp} does not divide num_attention_heads={arch.num_heads}; "
                                           f"valid: {_divisors(arch.num_heads)}")
    if arch.num_kv_heads % tp and tp % arch.num_kv_heads:
        raise SpecError("parallel.tensor", f"{tp} neither divides nor is a multiple of num_key_value_heads="
                                           f"{arch.num_kv_heads} (KV heads are split or replicated whole)")
    for field, size in (("intermediate_size", arch.intermediate_size), ("vocab_size", arch.vocab_size)):
        if size % tp:
            raise SpecError("parallel.tensor", f"{tp} does not divide {field}={size} "
                                               f"({'MLP columns' if field == 'intermediate_size' else 'the vocab-parallel LM head'} "
                                               "split evenly across ranks)")


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def _resolve_medusa(section: MedusaSection, arch: ArchConfig, base_dir: Path) -> MedusaSection:
    """Checks the heads dir against the checkpoint and fixes the tree (computed once, here)."""
    from .medusa.heads import read_heads_config
    from .medusa.tree import check_tree, default_tree, ordered, rank_accuracy

    heads = section.heads if section.heads.is_absolute() else (base_dir / section.heads).resolve()
    try:
        config = read_heads_config(heads)
    except UserError as exc:
        raise SpecError("speculative.medusa.heads", str(exc)) from None
    if config.num_heads != section.num_heads:
        raise SpecError("speculative.medusa.num_heads", f"{section.num_heads}, but {heads} has "
                                                        f"medusa_num_heads={config.num_heads}")
    for name, got, want in (("hidden_size", config.hidden_size, arch.hidden_size),
                            ("vocab_size", config.vocab_size, arch.vocab_size)):
        if got != want:
            raise SpecError("speculative.medusa.heads", f"{heads} has {name}={got}, the checkpoint {want}: "
                                                        "these heads were trained for another model")
    accuracy = rank_accuracy(config.topk_accuracy, section.num_heads)
    if section.tree == "default":
        choices = default_tree(accuracy, section.tree_nodes)
    else:
        problem = check_tree(section.tree, section.num_heads)
        if problem:
            raise SpecError("speculative.medusa.tree", problem)
        if not section.tree:
            raise SpecError("speculative.medusa.tree", "empty; give at least [[0]] or use default")
        choices = ordered(section.tree, accuracy)
    resolved = section.model_copy(update={"heads": heads})
    resolved._choices, resolved._accuracy = choices, config.topk_accuracy
    resolved._rank_accuracy, resolved._num_layers = accuracy, config.num_layers
    return resolved


def linear_names(arch: ArchConfig) -> list[str]:
    """Module paths of the linear layers the quantizer may touch, as transformers names them."""
    names = [f"layers.{i}.{part}" for i in range(arch.num_layers)
             for part in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                          "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
    return names + ["lm_head"]


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
        for field, dim in (("hidden_size", arch.hidden_size), (f"intermediate_size{per_rank}", arch.intermediate_size // tp),
                           (f"num_attention_heads × head_dim{per_rank}", arch.num_heads * arch.head_dim // tp)):
            if dim % group:
                where = "quantization.mode" if q.mode == "nvfp4" else "quantization.group_size"
                raise SpecError(where, f"{group} does not divide {field}={dim}" +
                                (" (NVFP4 blocks are 16 input channels)" if q.mode == "nvfp4" else ""))
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


class _FieldError(ValueError):
    def __init__(self, path: str, message: str):
        self.path, self.message = path, message
        super().__init__(message)


def _did_you_mean(name: str, choices) -> str:
    close = difflib.get_close_matches(name, list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _model_at(loc: tuple) -> type[BaseModel] | None:
    model: type[BaseModel] | None = Spec
    for part in loc:
        field = model.model_fields.get(part) if model else None
        ann = field.annotation if field else None
        model = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
    return model


def _spec_error(exc: ValidationError) -> SpecError:
    err = exc.errors()[0]
    loc = tuple(str(p) for p in err["loc"])
    path = ".".join(loc)
    kind = err["type"]
    if kind == "extra_forbidden":
        parent = _model_at(loc[:-1])
        fields = list(parent.model_fields) if parent else []
        return SpecError(path, f"unknown key{_did_you_mean(loc[-1], fields)}; valid keys here: "
                               f"{', '.join(fields)}")
    if kind == "missing":
        return SpecError(path, "required")
    if kind in ("enum", "literal_error"):
        return SpecError(path, f"{err['input']!r} is not valid; valid: {err['ctx']['expected']}")
    ctx_err = err.get("ctx", {}).get("error")
    if isinstance(ctx_err, _FieldError):
        return SpecError(".".join(loc + (ctx_err.path,)), ctx_err.message)
    message = err["msg"].removeprefix("Value error, ")
    return SpecError(path, f"{message} (got {err['input']!r})" if kind != "value_error" else message)

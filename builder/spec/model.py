"""The read-only ``Spec`` that flows down the build: the validated YAML document
(builder/spec/document.py) with the facts resolution read (the checkpoint's architecture, the
Medusa heads and their tree). Resolution and the cross-checks against the checkpoint live in
builder/spec/resolve.py; nothing here reads a file.

Every field is documented in specs/README.md. Errors are one line naming the YAML path:
``parallel.tensor: 3 does not divide num_key_value_heads=2``.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from ...contract.draft_head import DraftHeadConfig
from ...contract.kv_budget import kv_bytes_per_token
from ...contract.pipeline import RankPosition, balanced_layers, rank_positions, stage_layers
from ...contract.speculation import Source, SpeculationConfig
from ..sharding import kv_heads_per_rank
from ..frontend.checkpoint import ArchConfig
from .document import (BuildSection, KVCacheLayout, ModelSection, ParallelSection, PassesSection, QuantizationSection,
                       RuntimeSection, SpecDocument)


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
class ResolvedDraftHead:
    """The spec's draft head section with its dir's config (checked to fit the target)."""

    path: Path                                        # absolute
    config: DraftHeadConfig
    num_tokens: int                                   # longest chain drafted (tokens after the root)


@dataclass(frozen=True)
class Spec:
    """One resolved deployment spec (builder/spec/resolve.py makes it): the document, paths made
    absolute, and the facts read from the checkpoint and the heads. Never mutated."""

    document: SpecDocument
    arch: ArchConfig
    medusa: ResolvedMedusa | None
    draft_head: ResolvedDraftHead | None = None

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
    def kv_cache_layout(self) -> KVCacheLayout:
        """The TensorRT engine's KV layout: build.kv_cache_layout, else paged (every rank, of any
        tensor/pipeline grid, pages the caches of its own layers and KV heads)."""
        return self.build.kv_cache_layout or KVCacheLayout.paged

    @property
    def kv_heads_per_rank(self) -> int:
        """KV heads in each rank's caches (split, or one replicated head when TP exceeds them)."""
        return kv_heads_per_rank(self.parallel.tensor, self.arch.num_kv_heads)

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes of one token position on the fullest rank: its stage's layers, its KV heads, the
        model's dtype (the caches' element type)."""
        layers = max(len(stage) for stage in self.stages)
        return kv_bytes_per_token(layers, self.kv_heads_per_rank, self.arch.head_dim,
                                  self.model.dtype.numpy.itemsize)

    @property
    def max_step_tokens(self) -> int:
        """Largest S of one step: a prefill chunk or a verification."""
        return max(self.build.max_input_len, self.verify_tokens)

    @cached_property
    def source_verify_tokens(self) -> dict[Source, int]:
        """Each draft source's largest verification S (root included), in the spec's order
        (medusa, prompt_lookup, suffix, draft_head; those present): Medusa's tree, a host source's
        num_tokens guesses after the root."""
        section = self.document.speculative
        sizes = {}
        if self.medusa is not None:
            sizes[Source.medusa] = self.medusa.tree_size
        if section.prompt_lookup is not None:
            sizes[Source.prompt_lookup] = 1 + section.prompt_lookup.num_tokens
        if section.suffix is not None:
            sizes[Source.suffix] = 1 + section.suffix.num_tokens
        if self.draft_head is not None:
            sizes[Source.draft_head] = 1 + self.draft_head.num_tokens
        return sizes

    @cached_property
    def speculation(self) -> SpeculationConfig | None:
        """The engine's draft sources (the manifest's ``speculation`` entry); None without any."""
        sizes = self.source_verify_tokens
        if not sizes:
            return None
        section = self.document.speculative
        return SpeculationConfig(
            sources=tuple(sizes), verify_tokens=max(sizes.values()),
            prompt_lookup=section.prompt_lookup.config if section.prompt_lookup is not None else None,
            suffix=section.suffix.config if section.suffix is not None else None,
            draft_head=section.draft_head.config if section.draft_head is not None else None)

    @property
    def verify_tokens(self) -> int:
        """S of the largest verification step any draft source asks (1 without one: plain decode)."""
        return self.speculation.verify_tokens if self.speculation is not None else 1

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

"""A model's size by precision, from its config alone: parameter counts, weight bytes and KV
bytes per token. Embeddings (and an untied lm_head) stay 16-bit in every mode, as the
quantization passes exclude them; int8 and w8a8 add an fp16 scale per output channel, int4 one
per group of 128, fp4 (NVFP4) an fp8 scale per block of 16."""
from __future__ import annotations

from dataclasses import dataclass

from ..frontend.checkpoint import ArchConfig

PRECISIONS = ("fp32", "fp16", "bf16", "fp8", "int8", "w8a8", "int4", "fp4")
# The spec's quantization modes as plan precisions.
QUANTIZATION_PRECISION = {"int8_weight_only": "int8", "w8a8": "w8a8", "int4_weight_only": "int4", "fp8": "fp8",
                          "nvfp4": "fp4"}
INT4_GROUP = 128
FP4_BLOCK = 16


@dataclass(frozen=True)
class ParamCounts:
    embedding: int   # input embedding table
    head: int        # lm_head (0 when tied to the embedding)
    linear: int      # q/k/v/o and MLP projections: what quantization shrinks
    other: int       # norms and biases
    linear_rows: int  # output channels over all linear layers (int8 scales)

    @property
    def total(self) -> int:
        return self.embedding + self.head + self.linear + self.other

    @property
    def matmul(self) -> int:
        """Parameters a token multiplies through (the lm_head included, the embedding gather not)."""
        return self.linear + (self.head or self.embedding)


def param_counts(arch: ArchConfig) -> ParamCounts:
    h, hd = arch.hidden_size, arch.head_dim
    q, kv = arch.num_heads * hd, arch.num_kv_heads * hd
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * arch.intermediate_size
    rows_per_layer = q + 2 * kv + h + 2 * arch.intermediate_size + h
    other = arch.num_layers * (2 * h + (2 * hd if arch.qk_norm else 0) + ((q + 2 * kv) if arch.attention_bias else 0)) + h
    embedding = arch.vocab_size * h
    return ParamCounts(embedding=embedding, head=0 if arch.tie_word_embeddings else embedding,
                       linear=arch.num_layers * per_layer, other=other, linear_rows=arch.num_layers * rows_per_layer)


def weight_bytes(counts: ParamCounts, precision: str) -> float:
    if precision == "fp32":
        return 4.0 * counts.total
    fixed = 2 * (counts.embedding + counts.head + counts.other)
    linear = {"fp16": 2.0 * counts.linear, "bf16": 2.0 * counts.linear, "fp8": 1.0 * counts.linear,
              "int8": counts.linear + 2.0 * counts.linear_rows,
              "w8a8": counts.linear + 2.0 * counts.linear_rows,
              "int4": 0.5 * counts.linear + 2.0 * counts.linear / INT4_GROUP,
              "fp4": 0.5 * counts.linear + 1.0 * counts.linear / FP4_BLOCK}[precision]
    return fixed + linear


def kv_bytes_per_token(arch: ArchConfig, element_bytes: int) -> int:
    return 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * element_bytes

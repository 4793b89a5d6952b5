"""Pipeline stages: which decoder layers each stage holds, and where a rank sits in the grid.

The decoder layers split into P contiguous stages (balanced by layer count, earlier stages
taking the remainder, or as the spec's ``parallel.layers_per_stage`` lists). The first stage
holds the embedding and reads the token ids; every later stage reads the hidden states the one
before it wrote. The last holds the final norm and the LM (and Medusa) heads. With T tensor
ranks per stage there are T·P ranks: rank = stage · T + tensor rank.

A stage hands the next one the residual stream after its last layer, all S rows of the step:
``hidden_states_out`` [B, S, D] (model dtype) out, ``hidden_states`` [B, S, D] in.
"""
from __future__ import annotations

from dataclasses import dataclass

HIDDEN_STATES = "hidden_states"          # input of every stage but the first
HIDDEN_STATES_OUT = "hidden_states_out"  # output of every stage but the last


def balanced_layers(num_layers: int, pipeline: int) -> tuple[int, ...]:
    """Layers per stage, as even as whole layers allow; the first stages take one more."""
    per, extra = divmod(num_layers, pipeline)
    return tuple(per + (1 if stage < extra else 0) for stage in range(pipeline))


def stage_layers(counts: tuple[int, ...]) -> tuple[range, ...]:
    """Each stage's global layer indices from the layer count of each."""
    out, start = [], 0
    for count in counts:
        out.append(range(start, start + count))
        start += count
    return tuple(out)


@dataclass(frozen=True)
class RankPosition:
    """Where a rank sits: its stage, its tensor rank inside the stage, and the stage's layers."""

    rank: int
    stage: int
    tensor_rank: int
    layers: range
    first: bool   # holds the embedding, reads input_ids
    last: bool    # holds the final norm and the heads, writes logits


def rank_positions(stages: tuple[range, ...], tensor: int) -> tuple[RankPosition, ...]:
    """Every rank of the T × P grid, rank = stage · T + tensor rank."""
    return tuple(RankPosition(rank=stage * tensor + t, stage=stage, tensor_rank=t, layers=layers,
                              first=stage == 0, last=stage == len(stages) - 1)
                 for stage, layers in enumerate(stages) for t in range(tensor))


def cache_layer(name: str) -> int | None:
    """The layer of a ``past_*``/``present_*`` cache name (``past_key_12`` → 12), else None."""
    if not name.startswith(("past_key_", "past_value_", "present_key_", "present_value_")):
        return None
    return int(name.rsplit("_", 1)[1])


def stage_cache_names(layers: range) -> list[str]:
    """``key_3, value_3, key_4, …``: a stage's caches under their global layer names."""
    return [f"{kind}_{layer}" for layer in layers for kind in ("key", "value")]

"""The spec's Medusa section against its heads dir: checked once at resolution, the tree fixed."""
from __future__ import annotations

from ...contract.medusa_acceptance import tree_problem
from ..errors import SpecError, UserError
from ..frontend.checkpoint import ArchConfig
from ..spec.document import MedusaSection
from ..spec.model import ResolvedMedusa
from .heads import read_heads_config
from .tree import default_tree, ordered, rank_accuracy


def resolve_medusa(section: MedusaSection, arch: ArchConfig) -> ResolvedMedusa:
    """Checks the heads dir (``section.heads``, absolute) against the checkpoint and fixes the
    tree (computed once, here)."""
    heads = section.heads
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
        problem = tree_problem(section.tree, section.num_heads)
        if problem:
            raise SpecError("speculative.medusa.tree", problem)
        if not section.tree:
            raise SpecError("speculative.medusa.tree", "empty; give at least [[0]] or use default")
        choices = ordered(section.tree, accuracy)
    return ResolvedMedusa(heads=heads, num_heads=section.num_heads, num_layers=config.num_layers, choices=choices,
                          topk_accuracy=config.topk_accuracy,
                          rank_accuracy=tuple(tuple(row) for row in accuracy))

"""What the engine core speculates with: the sources it serves (the default a request gets),
Medusa's trees where the engine has heads, host drafting (prompt lookup, suffix) where those
sources are on, and the one adaptive policy (adaptive.py) over them, with the step times and
counters it keeps."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from ...contract.speculation import PromptLookupConfig, Source, SuffixConfig
from .acceptance import AcceptanceModel, SpeculationStats
from .adaptive import AdaptivePolicy, SourceModel, SpeculationMode
from .chain import chain_tree
from .host import HostDrafting
from ..core.tree import Tree
from .sources import sources_for
from .step_times import EMPTY, Context, StepTimes, calibrate
from .trees import MedusaTrees

if TYPE_CHECKING:
    from .draft_head_source import DraftHeadSource
    from ..core.engine import Engine
    from ..engine_dir import EngineDir

HOST_SOURCES = (Source.prompt_lookup, Source.suffix)


@dataclass
class Speculation:
    sources: tuple[Source, ...]
    times: StepTimes
    stats: SpeculationStats
    policy: AdaptivePolicy
    medusa: MedusaTrees | None
    host: HostDrafting | None
    draft_head: "DraftHeadSource | None" = None

    def sources_of(self, requested: tuple[Source, ...] | None) -> tuple[Source, ...]:
        """A request's sources: the engine's for None, else those asked (the input processor has
        refused any the engine does not serve)."""
        return self.sources if requested is None else requested

    def verifies_medusa(self, batch: int, rids: list[str], context: Context = EMPTY) -> bool:
        """Whether the policy would verify a Medusa tree for ``rids`` (those of a decode batch of
        ``batch`` rows that speculate with Medusa): then the step computes the heads to draft it."""
        candidate = self.medusa.candidate() if self.medusa is not None and rids else None
        if candidate is None:
            return False
        return Source.medusa in self.policy.decide(batch, {rid: [candidate] for rid in rids}, context).sources()


def speculation_for(engine_dir: "EngineDir", engine: "Engine", sources: tuple[Source, ...] | None,
                    mode: SpeculationMode, medusa_tree_size: int | None, multi_step: int,
                    threads: int = 0, draft_tree_width: int | None = None) -> Speculation | None:
    """The engine's speculation: ``sources`` None takes the engine dir's (its spec's
    ``speculative`` section), () turns it off. Adaptive mode calibrates step times on ``engine``
    (plain decoding as ``multi_step`` runs); ``medusa_tree_size`` pins Medusa's tree prefix.
    ``threads``: the draft head's ONNX Runtime session's (0: ONNX Runtime chooses);
    ``draft_tree_width``: tokens its drafts offer at each depth (None: TREE_WIDTH; 1: chains)."""
    config = engine_dir.speculation
    if sources is None:
        sources = config.sources if config is not None else ()
    sources = tuple(dict.fromkeys(sources))
    where = engine_dir.path
    if draft_tree_width is not None and draft_tree_width < 1:
        raise ValueError(f"draft_tree_width {draft_tree_width}: valid 1 (chains) or more")
    if draft_tree_width is not None and Source.draft_head not in sources:
        raise ValueError(f"draft_tree_width {draft_tree_width}: " + (
            f"{where} was built without a draft head" if engine_dir.draft_head is None
            else "draft_head is not among the sources"))
    if medusa_tree_size and Source.medusa not in sources:
        raise ValueError(f"medusa_tree_size {medusa_tree_size}: " + (
            f"{where} was built without Medusa heads" if engine_dir.medusa is None else "medusa is not among the sources"))
    if not sources:
        return None
    if config is None:
        raise ValueError(f"speculation {', '.join(s.value for s in sources)}: {where} was built without a "
                         "verification path; rebuild with a speculative section (specs/README.md)")
    if Source.medusa in sources and engine_dir.medusa is None:
        raise ValueError(f"speculation medusa: {where} was built without Medusa heads")
    if Source.draft_head in sources and engine_dir.draft_head is None:
        raise ValueError(f"speculation draft_head: {where} was built without a draft head "
                         "(speculative.draft_head in its spec)")
    host_sources = tuple(s for s in sources if s in HOST_SOURCES)
    max_tokens = config.verify_tokens - 1
    tree = Tree(tuple(tuple(path) for path in engine_dir.medusa["tree"])) if Source.medusa in sources else None
    # Calibration times the largest verification any source may run (the shape, not the tokens, costs).
    widest = tree if tree is not None and tree.size >= config.verify_tokens else chain_tree(max_tokens)
    adaptive = mode == SpeculationMode.adaptive
    # A pinned Medusa tree alone decides nothing from step times: no calibration to wait for.
    decides = adaptive and (medusa_tree_size is None or bool(host_sources))
    times = (calibrate(engine, widest, engine_dir.max_batch_size, engine_dir.max_seq_len, multi_step) if decides
             else StepTimes())
    stats = SpeculationStats()
    models: dict[Source, SourceModel] = {}
    medusa = None
    if tree is not None:
        fixed = medusa_tree_size if medusa_tree_size is not None else None if adaptive else len(tree.choices)
        medusa = models[Source.medusa] = MedusaTrees(tree, AcceptanceModel(engine_dir.medusa["rank_accuracy"]),
                                                     stats, fixed)
    host = None
    if host_sources:
        settings = replace(config, sources=host_sources,
                           prompt_lookup=_capped(config.prompt_lookup or PromptLookupConfig(), max_tokens),
                           suffix=_capped(config.suffix or SuffixConfig(), max_tokens))
        host = HostDrafting(sources_for(settings), max_tokens, mode)
        models.update(dict.fromkeys(host_sources, host))
    draft_head = None
    if Source.draft_head in sources:
        draft_head = models[Source.draft_head] = _draft_head(engine_dir, max_tokens, mode, threads, draft_tree_width)
    return Speculation(sources, times, stats, AdaptivePolicy(times, models, stats, mode), medusa, host, draft_head)


def _draft_head(engine_dir: "EngineDir", max_tokens: int, mode: SpeculationMode, threads: int,
                width: int | None) -> "DraftHeadSource":
    """The engine dir's draft head: its graph in a session of its own, a draft slot per engine row."""
    from .draft_head import DraftHeadDrafter
    from .draft_head_source import DraftHeadSource, read_draft_map

    entry = engine_dir.draft_head
    drafter = DraftHeadDrafter(engine_dir.draft_head_graph, read_draft_map(engine_dir), engine_dir.max_seq_len,
                               capacity=engine_dir.max_batch_size, threads=threads,
                               max_step_tokens=engine_dir.max_input_len)
    if drafter.hidden_size != engine_dir.model["hidden_size"]:
        raise ValueError(f"{engine_dir.draft_head_graph}: features of width {drafter.hidden_size}; the model's "
                         f"hidden_size is {engine_dir.model['hidden_size']}: rebuild the engine dir")
    return DraftHeadSource(drafter, min(max_tokens, entry.num_tokens), mode, width=width, max_nodes=max_tokens)


def _capped(settings, max_tokens: int):
    """A host source's settings with its chain no longer than the engine verifies."""
    return replace(settings, num_tokens=min(settings.num_tokens, max_tokens))

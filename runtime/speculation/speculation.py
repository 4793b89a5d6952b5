"""What the engine core speculates with: the sources it serves (the default a request gets),
Medusa's tree policy where the engine has heads, host drafting (prompt lookup, suffix) where
those sources are on, and the step times and counters they share."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from ...contract.speculation import PromptLookupConfig, Source, SuffixConfig
from .acceptance import AcceptanceModel, SpeculationStats
from .chain import chain_tree
from .host import HostDrafting, SpeculationMode
from ..core.tree import Tree
from .policy import SpeculationPolicy
from .sources import sources_for
from .step_times import EMPTY, Context, StepTimes, calibrate

if TYPE_CHECKING:
    from ..core.engine import Engine
    from ..engine_dir import EngineDir

HOST_SOURCES = (Source.prompt_lookup, Source.suffix)


@dataclass
class Speculation:
    sources: tuple[Source, ...]
    times: StepTimes
    stats: SpeculationStats
    medusa: SpeculationPolicy | None
    host: HostDrafting | None

    def sources_of(self, requested: tuple[Source, ...] | None) -> tuple[Source, ...]:
        """A request's sources: the engine's for None, else those asked (the input processor has
        refused any the engine does not serve)."""
        return self.sources if requested is None else requested

    def count_step(self, batch: int, verifies: bool, seq_len: int) -> None:
        if self.medusa is not None:
            self.medusa.count_step(batch, verifies, seq_len)
        elif verifies:
            self.stats.verify_steps += 1
            self.stats.tree_sizes[seq_len] += 1
        else:
            self.stats.plain_steps += 1

    def stood_aside(self, batch: int, steps: int, context: Context = EMPTY) -> None:
        if self.medusa is not None:
            self.medusa.stood_aside(batch, steps, context)
        else:
            self.stats.plain_steps += steps

    def choose_medusa(self, batch: int, context: Context = EMPTY) -> int:
        """Medusa's tree prefix for a decode batch whose rows have ``context`` cached (0: none, or no heads)."""
        return self.medusa.choose(batch, context) if self.medusa is not None else 0


def speculation_for(engine_dir: "EngineDir", engine: "Engine", sources: tuple[Source, ...] | None,
                    mode: SpeculationMode, medusa_tree_size: int | None, multi_step: int) -> Speculation | None:
    """The engine's speculation: ``sources`` None takes the engine dir's (its spec's
    ``speculative`` section), () turns it off. Adaptive mode calibrates step times on ``engine``
    (plain decoding as ``multi_step`` runs); ``medusa_tree_size`` pins Medusa's tree prefix."""
    config = engine_dir.speculation
    if sources is None:
        sources = config.sources if config is not None else ()
    sources = tuple(dict.fromkeys(sources))
    where = engine_dir.path
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
    medusa = None
    if tree is not None:
        fixed = medusa_tree_size if medusa_tree_size is not None else None if adaptive else len(tree.choices)
        medusa = SpeculationPolicy(tree, AcceptanceModel(engine_dir.medusa["rank_accuracy"]), times, fixed)
    host = None
    if host_sources:
        settings = replace(config, sources=host_sources,
                           prompt_lookup=_capped(config.prompt_lookup or PromptLookupConfig(), max_tokens),
                           suffix=_capped(config.suffix or SuffixConfig(), max_tokens))
        host = HostDrafting(sources_for(settings), max_tokens, times, mode)
    stats = medusa.stats if medusa is not None else SpeculationStats()
    return Speculation(sources, times, stats, medusa, host)


def _capped(settings, max_tokens: int):
    """A host source's settings with its chain no longer than the engine verifies."""
    return replace(settings, num_tokens=min(settings.num_tokens, max_tokens))

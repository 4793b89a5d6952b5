"""Host draft sources: proposers that read only the request's tokens (no model), one per file,
and ``sources_for`` which builds the ones an engine's speculation config lists."""
from __future__ import annotations

from ....contract.speculation import Source, SpeculationConfig
from .base import EMPTY, HostDraftSource, Proposal
from .prompt_lookup import PromptLookupSource
from .suffix import SuffixSource

__all__ = ["EMPTY", "HostDraftSource", "PromptLookupSource", "Proposal", "SuffixSource", "sources_for"]


def sources_for(config: SpeculationConfig) -> dict[Source, HostDraftSource]:
    """A source object per host source in ``config.sources`` (Medusa runs on the device, not here)."""
    sources: dict[Source, HostDraftSource] = {}
    for source in config.sources:
        if source is Source.prompt_lookup:
            if config.prompt_lookup is None:
                raise ValueError("speculation.prompt_lookup: settings missing while sources lists prompt_lookup")
            sources[source] = PromptLookupSource(config.prompt_lookup)
        elif source is Source.suffix:
            if config.suffix is None:
                raise ValueError("speculation.suffix: settings missing while sources lists suffix")
            sources[source] = SuffixSource(config.suffix)
    return sources

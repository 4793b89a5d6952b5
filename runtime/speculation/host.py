"""Host draft sources in the step loop: which source drafts each request, and how long a chain a
decode batch verifies (none where it does not pay).

A host source (prompt lookup, suffix; runtime/speculation/sources/) proposes a chain after each
request's last token. Whether a chain is worth verifying depends on the request (a code edit
repeats its prompt for long runs, free chat hardly ever) and on what a verification costs at
this batch size. So acceptance is learned per (source, depth): P(the token at depth d is kept |
the ones before it were), from every verification across requests, and per request on top of
that (the global figure as its prior). The expected kept tokens of a chain of n are
Σ_k Π_{d ≤ k} p_d. The batch's chain length n maximises expected tokens per second,
Σ_rows (1 + E_row[n]) / t(B, S), against plain decoding (multi-step runs, ``plain_estimate``),
with the same MIN_GAIN margin as Medusa's trees; the step times are the Medusa policy's
(step_times.py: calibrated at load, refined by every step). A request whose drafts stood aside
EXPLORE_AFTER decisions in a row verifies one chain regardless, so a request whose text turns
repetitive late (or an estimate made in a slow spell) is found again.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Sequence

import numpy as np

from ...contract.speculation import Source
from ...medusa_math.acceptance import MIN_GAIN
from .sources.base import HostDraftSource
from .step_times import StepTimes

PRIOR = 0.5            # P(kept) per depth before any verification, where a source gives no estimate
PRIOR_WEIGHT = 8.0     # the prior counts as this many verifications (global estimate)
REQUEST_WEIGHT = 4.0   # the global estimate counts as this many of a request's own
EXPLORE_AFTER = 16     # decisions a request's drafts stand aside before one is verified anyway


class SpeculationMode(Enum):
    """``adaptive``: verify where expected tokens per second beat plain decoding (the default);
    ``always``: verify every draft a source has, at its full length (benchmarks, tests)."""
    adaptive = "adaptive"
    always = "always"


@dataclass
class DepthCounts:
    """Verifications of chains, by depth: tried (the tokens before were kept) and kept."""
    trials: np.ndarray
    hits: np.ndarray

    @classmethod
    def empty(cls, depth: int) -> "DepthCounts":
        return cls(np.zeros(depth), np.zeros(depth))

    def record(self, length: int, kept: int) -> None:
        self.trials[:min(kept + 1, length)] += 1
        self.hits[:kept] += 1

    def probabilities(self, prior: np.ndarray, weight: float) -> np.ndarray:
        return (self.hits + weight * prior) / (self.trials + weight)


@dataclass(frozen=True)
class HostDraft:
    source: Source
    tokens: tuple[int, ...]
    expected: np.ndarray    # [len(tokens) + 1]: expected kept tokens verifying the first n

    def expected_at(self, n: int) -> float:
        return float(self.expected[min(n, len(self.tokens))])


@dataclass
class _RequestState:
    counts: dict[Source, DepthCounts] = field(default_factory=dict)
    aside: int = 0          # decisions in a row its draft stood aside


class HostDrafting:
    """The engine's host sources, their acceptance estimates, and the batch decision."""

    def __init__(self, sources: dict[Source, HostDraftSource], max_tokens: int, times: StepTimes,
                 mode: SpeculationMode = SpeculationMode.adaptive):
        if max_tokens < 1:
            raise ValueError(f"host drafting needs a verification of ≥ 2 tokens (max_tokens {max_tokens})")
        self.sources, self.max_tokens, self.times, self.mode = sources, max_tokens, times, mode
        self.counts = {source: DepthCounts.empty(max_tokens) for source in sources}
        self._requests: dict[str, _RequestState] = {}

    def probabilities(self, source: Source, rid: str | None = None, prior: np.ndarray | None = None) -> np.ndarray:
        """[max_tokens]: P(the token at each depth is kept | the ones before were). ``prior``: the
        source's own estimate for this draft (a longer n-gram match is likelier kept), which the
        counts overrule as verifications come in; PRIOR where the source gives none."""
        base = np.full(self.max_tokens, PRIOR)
        if prior is not None:
            base[:len(prior)] = prior[:self.max_tokens]
        shared = self.counts[source].probabilities(base, PRIOR_WEIGHT)
        own = self._requests.get(rid).counts.get(source) if rid in self._requests else None
        return shared if own is None else own.probabilities(shared, REQUEST_WEIGHT)

    def draft(self, rid: str, context: Sequence[int], allowed: Sequence[Source], limit: int) -> HostDraft | None:
        """The allowed source's chain with the most expected kept tokens, at most ``limit`` long."""
        best = None
        for source in allowed:
            host = self.sources.get(source)
            if host is None:
                continue
            proposal = host.propose(rid, context, min(limit, self.max_tokens))
            tokens = proposal.tokens
            if not tokens:
                continue
            prior = np.asarray(proposal.probabilities, np.float64)
            kept = np.cumprod(self.probabilities(source, rid, prior)[:len(tokens)])
            draft = HostDraft(source, tuple(tokens), np.concatenate(([0.0], np.cumsum(kept))))
            if best is None or draft.expected[-1] > best.expected[-1]:
                best = draft
        return best

    def choose(self, batch: int, drafts: dict[str, HostDraft], fixed_tokens: float, fixed_seq: int) -> int:
        """The chain length the batch verifies (0: no host chains). ``fixed_tokens``, ``fixed_seq``:
        what the rest of the batch yields in a step and the S it needs (Medusa trees already
        chosen: their expected tokens and 1 + tree size; otherwise one token a row and 1)."""
        if not drafts:
            return 0
        longest = max(len(d.tokens) for d in drafts.values())
        if self.mode == SpeculationMode.always:
            return longest
        if not self.times.table:
            raise ValueError("adaptive host drafting needs measured step times")
        n = np.arange(longest + 1)  # [N + 1]
        seqs = np.maximum(fixed_seq, 1 + n)
        tokens = fixed_tokens + sum(1 + d.expected[np.minimum(n, len(d.tokens))] for d in drafts.values())
        rates = tokens / self.times.estimates(batch, seqs)
        if fixed_seq == 1:  # nothing else verifies: n = 0 is plain decoding, at its own (run) cost
            rates[0] = batch / self.times.plain_estimate(batch)
        best = int(np.argmax(rates))
        if best and rates[best] < MIN_GAIN * rates[0]:
            best = 0
        if best == 0:
            best = self._explore(drafts)
        for rid in drafts:
            state = self._requests.setdefault(rid, _RequestState())
            state.aside = 0 if best else state.aside + 1
        return best

    def _explore(self, drafts: dict[str, HostDraft]) -> int:
        """A chain length to verify although it does not pay on the estimates: the longest draft
        of a request whose drafts stood aside EXPLORE_AFTER times (0 if none has)."""
        due = [len(d.tokens) for rid, d in drafts.items()
               if self._requests.get(rid, _RequestState()).aside >= EXPLORE_AFTER]
        return max(due, default=0)

    def record(self, rid: str, source: Source, length: int, kept: int) -> None:
        """One verified chain of ``length`` tokens of which the first ``kept`` were kept."""
        self.counts[source].record(length, kept)
        state = self._requests.setdefault(rid, _RequestState())
        state.counts.setdefault(source, DepthCounts.empty(self.max_tokens)).record(length, kept)

    def close(self, rid: str, context: Sequence[int]) -> None:
        """The request ended: its sources forget it (a suffix source keeps its output for others)."""
        self._requests.pop(rid, None)
        for host in self.sources.values():
            host.close(rid, context)

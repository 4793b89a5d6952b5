"""Host draft sources in the step loop: which source drafts each request, and how long a chain a
decode batch verifies (none where it does not pay).

A host source (prompt lookup, suffix; runtime/speculation/sources/) proposes a chain after each
request's last token. Whether a chain is worth verifying depends on the request (a code edit
repeats its prompt for long runs, free chat hardly ever) and on what a verification costs at
this batch size. So acceptance is learned per (source, depth): P(the token at depth d is kept |
the ones before it were), from every verification across requests, and per request on top of
that (the global figure as its prior). A depth's prior is the source's stated probability for the
token, calibrated: how often tokens the source stated that likely were kept, at any depth
(``HostDrafting.calibration``). Taking the source at its word fails where it matters: a suffix chain seen once
states 1.0 for every token, and a chain's deep tokens are seldom tried, so their estimates stayed
at 1.0 and free chat verified 16-token chains that kept 0.3 tokens (measured on SmolLM2: 27
verifications, 8 tokens kept, in 256). The expected kept tokens of a chain of n are
Σ_k Π_{d ≤ k} p_d. The batch's chain length n maximises expected tokens per second,
Σ_rows (1 + E_row[n]) / t(B, S), against plain decoding (multi-step runs, ``plain_estimate``),
with the same MIN_GAIN margin as Medusa's trees; the step times are the Medusa policy's
(step_times.py: calibrated at load, refined by every step). A request whose drafts stood aside
EXPLORE_AFTER decisions in a row verifies EXPLORE_TOKENS of its chain regardless (its first
tokens are what the estimate lacks; a kept run lifts it and longer chains follow), so a request
whose text turns repetitive late (or an estimate made in a slow spell) is found again.

A source's chains are verified only RAMP times as deep as its longest kept run so far (at least
EXPLORE_TOKENS): a depth never reached has no count, only its prior, and at batch 8 a bet on the
prior is dear (SmolLM2 float32, code_edit: three verifications of 8 rows × 17 tokens at 316 ms
each, against a 38 ms plain step, kept 3.6 tokens a row). The reach doubles with each run kept
in full, so a source that copies long spans verifies long chains after a few steps.

Drafting has a price of its own: the sources' proposals, the estimates and the decision take
~1 ms a call on 2 CPU cores, which on the bundled model is a quarter of an 8-step greedy run
(0.46 ms a step), and lost it 0.56–0.89× of plain decoding at batch 1 while nothing was verified.
So a verification's cost counts the drafting that follows it (the recent median, per row), and
where a decision verified nothing, drafting backs off: the next call waits until the engine has
stepped for 1 / DRAFT_SHARE times what that call cost (a request not yet drafted for is due at
once). On SmolLM2 a run takes ~160 ms and drafting never waits; on the bundled model it drafts
about every tenth run while nothing pays.
"""
from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Sequence

import numpy as np

from ...contract.speculation import Source
from ...contract.medusa_acceptance import MIN_GAIN
from .sources.base import HostDraftSource
from .step_times import EMPTY, Context, StepTimes

PRIOR = 0.5            # P(kept) per depth before any verification, where a source gives no estimate
STATED_TRUST = 0.5     # before calibration, a stated probability q counts as PRIOR + STATED_TRUST·(q − PRIOR)
BUCKETS = 10           # stated probabilities are calibrated per tenth
PRIOR_WEIGHT = 8.0     # a prior counts as this many verified tokens (calibration, global per-depth estimate)
REQUEST_WEIGHT = 4.0   # the global estimate counts as this many of a request's own
EXPLORE_AFTER = 16     # decisions a request's drafts stand aside before one is verified anyway
EXPLORE_TOKENS = 2     # how much of its chain such a verification checks
RAMP = 2               # a source's chains reach RAMP × its longest kept run so far (≥ EXPLORE_TOKENS)
DRAFT_SHARE = 0.03     # where nothing is verified, drafting takes at most this share of the engine's time
RECENT_DRAFTS = 15     # drafting calls whose per-row seconds are kept (their median prices a verification)


class SpeculationMode(Enum):
    """``adaptive``: verify where expected tokens per second beat plain decoding (the default);
    ``always``: verify every draft a source has, at its full length (benchmarks, tests)."""
    adaptive = "adaptive"
    always = "always"


@dataclass
class KeptCounts:
    """Tokens of verified chains, per cell (a depth, or a tenth of the probability the source
    stated for the token: its calibration): tried (the tokens before were kept) and kept."""
    trials: np.ndarray
    hits: np.ndarray

    @classmethod
    def empty(cls, cells: int) -> "KeptCounts":
        return cls(np.zeros(cells), np.zeros(cells))

    def record(self, cells: np.ndarray, kept: int) -> None:
        """A verified chain whose i-th token falls in ``cells[i]``; its first ``kept`` were kept."""
        np.add.at(self.trials, cells[:kept + 1], 1)
        np.add.at(self.hits, cells[:kept], 1)

    def probabilities(self, cells: np.ndarray, prior: np.ndarray, weight: float) -> np.ndarray:
        """P(kept) in each of ``cells``, ``prior`` counting as ``weight`` tokens."""
        return (self.hits[cells] + weight * prior) / (self.trials[cells] + weight)

    def longest_kept(self) -> int:
        """By depth: the longest run any chain had kept (kept tokens are always a prefix)."""
        return int(np.count_nonzero(self.hits))


def _tenths(stated: np.ndarray) -> np.ndarray:
    """The calibration cell of each stated probability."""
    return np.minimum((stated * BUCKETS).astype(np.int64), BUCKETS - 1)


@dataclass(frozen=True)
class HostDraft:
    source: Source
    tokens: tuple[int, ...]
    stated: tuple[float, ...]  # the source's probability for each token
    expected: np.ndarray    # [len(tokens) + 1]: expected kept tokens verifying the first n

    def expected_at(self, n: int) -> float:
        return float(self.expected[min(n, len(self.tokens))])


@dataclass
class _RequestState:
    counts: dict[Source, KeptCounts] = field(default_factory=dict)  # by depth
    aside: int = 0          # decisions in a row its draft stood aside


class HostDrafting:
    """The engine's host sources, their acceptance estimates, and the batch decision."""

    def __init__(self, sources: dict[Source, HostDraftSource], max_tokens: int, times: StepTimes,
                 mode: SpeculationMode = SpeculationMode.adaptive):
        if max_tokens < 1:
            raise ValueError(f"host drafting needs a verification of ≥ 2 tokens (max_tokens {max_tokens})")
        self.sources, self.max_tokens, self.times, self.mode = sources, max_tokens, times, mode
        self.counts = {source: KeptCounts.empty(max_tokens) for source in sources}         # by depth
        self.calibration = {source: KeptCounts.empty(BUCKETS) for source in sources}      # by stated tenth
        self._depths = np.arange(max_tokens)
        self._requests: dict[str, _RequestState] = {}
        self._draft_seconds: deque = deque([0.0], maxlen=RECENT_DRAFTS)  # per row
        self._owed = 0.0            # engine seconds to pass before drafting again (backing off)
        self._drafted: set[str] = set()  # requests drafted for at least once

    def due(self, rids: Sequence[str]) -> bool:
        """Whether the decoding requests ``rids`` are drafted for after this step: unless the last
        decision verified nothing and the engine has not yet stepped for long enough since
        (``stepped``), or any of them was never drafted for."""
        return (self._owed <= 0.0 or self.mode == SpeculationMode.always
                or not self._drafted.issuperset(rids))

    def drafted(self, rids: Sequence[str], seconds: float, verifies: bool) -> None:
        """A drafting call for ``rids`` took ``seconds`` (proposals, estimates, decision) and its
        decision verifies a chain or not (then drafting backs off)."""
        if rids:
            self._draft_seconds.append(seconds / len(rids))
        self._drafted.update(rids)
        self._owed = 0.0 if verifies else seconds / DRAFT_SHARE

    def stepped(self, seconds: float) -> None:
        """The engine stepped (or ran) for ``seconds`` since the last drafting call."""
        self._owed -= seconds

    def drafting_estimate(self, rows: int) -> float:
        """Seconds a drafting call for ``rows`` requests takes (the recent median)."""
        return rows * statistics.median(self._draft_seconds)

    def probabilities(self, source: Source, rid: str | None = None, stated: Sequence[float] = ()) -> np.ndarray:
        """[max_tokens]: P(the token at each depth is kept | the ones before were). ``stated``: the
        source's own estimate for this draft's tokens (a longer n-gram match is likelier kept),
        PRIOR past them, calibrated; the depth's counts overrule it as verifications come in."""
        claimed = np.full(self.max_tokens, PRIOR)
        claimed[:min(len(stated), self.max_tokens)] = stated[:self.max_tokens]
        base = self.calibration[source].probabilities(_tenths(claimed), PRIOR + STATED_TRUST * (claimed - PRIOR),
                                                      PRIOR_WEIGHT)
        shared = self.counts[source].probabilities(self._depths, base, PRIOR_WEIGHT)
        own = self._requests.get(rid).counts.get(source) if rid in self._requests else None
        return shared if own is None else own.probabilities(self._depths, shared, REQUEST_WEIGHT)

    def reach(self, source: Source) -> int:
        """How deep ``source``'s chains are verified now: RAMP × its longest kept run (adaptive)."""
        if self.mode == SpeculationMode.always:
            return self.max_tokens
        return min(self.max_tokens, max(EXPLORE_TOKENS, RAMP * self.counts[source].longest_kept()))

    def draft(self, rid: str, context: Sequence[int], allowed: Sequence[Source], limit: int) -> HostDraft | None:
        """The allowed source's chain with the most expected kept tokens, at most ``limit`` long."""
        best = None
        for source in allowed:
            host = self.sources.get(source)
            if host is None:
                continue
            proposal = host.propose(rid, context, min(limit, self.reach(source)))
            tokens = proposal.tokens
            if not tokens:
                continue
            stated = tuple(proposal.probabilities)
            kept = np.cumprod(self.probabilities(source, rid, stated)[:len(tokens)])
            draft = HostDraft(source, tuple(tokens), stated, np.concatenate(([0.0], np.cumsum(kept))))
            if best is None or draft.expected[-1] > best.expected[-1]:
                best = draft
        return best

    def choose(self, batch: int, drafts: dict[str, HostDraft], fixed_tokens: float, fixed_seq: int,
               context: Context = EMPTY) -> int:
        """The chain length the batch verifies (0: no host chains). ``fixed_tokens``, ``fixed_seq``:
        what the rest of the batch yields in a step and the S it needs (Medusa trees already
        chosen: their expected tokens and 1 + tree size; otherwise one token a row and 1);
        ``context``: what the batch's rows have cached."""
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
        # A verification is followed by drafting for its rows; plain decoding mostly is not (backing off).
        rates = tokens / (self.times.estimates(batch, seqs, context) + self.drafting_estimate(len(drafts)))
        if fixed_seq == 1:  # nothing else verifies: n = 0 is plain decoding, at its own (run) cost
            rates[0] = batch / self.times.plain_estimate(batch, context)
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
        """A chain length to verify although it does not pay on the estimates: up to
        EXPLORE_TOKENS of the draft of a request whose drafts stood aside EXPLORE_AFTER times (0
        if none has)."""
        due = [min(len(d.tokens), EXPLORE_TOKENS) for rid, d in drafts.items()
               if self._requests.get(rid, _RequestState()).aside >= EXPLORE_AFTER]
        return max(due, default=0)

    def record(self, rid: str, source: Source, stated: Sequence[float], kept: int) -> None:
        """One verified chain whose tokens ``source`` stated with probabilities ``stated`` (its
        length), of which the first ``kept`` were kept."""
        depths = self._depths[:len(stated)]
        self.calibration[source].record(_tenths(np.asarray(stated, np.float64)), kept)
        self.counts[source].record(depths, kept)
        state = self._requests.setdefault(rid, _RequestState())
        state.counts.setdefault(source, KeptCounts.empty(self.max_tokens)).record(depths, kept)

    def close(self, rid: str, context: Sequence[int]) -> None:
        """The request ended: its sources forget it (a suffix source keeps its output for others)."""
        self._requests.pop(rid, None)
        self._drafted.discard(rid)
        for host in self.sources.values():
            host.close(rid, context)

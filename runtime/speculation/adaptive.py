"""Whether and how much to speculate, for every draft source: one policy over Medusa trees and
host chains (prompt lookup, suffix; any chain source), priced by measured step times and each
source's learned acceptance.

Speculating only pays when verifying S tokens a row costs little more than decoding one. On a
bandwidth-bound device (a GPU at small batch) a step's time hardly grows with its tokens; on a
compute-bound one (a CPU, or a GPU at large batch) it grows with B × S. Plain decoding is what the
runtime really does when it steps aside: multi-step greedy runs (runtime/engine_core.py), whose
cost per token is calibrated and observed separately from a single plain step's (on the CPU a
run's step skips the Medusa heads and costs a third of even a one-guess verification: on the
bundled model no tree pays at any batch there, docs/benchmarks.md; on a GPU at small batch a
verification costs about one step, and trees pay). The step times are step_times.py's
(calibrated at load, refined by every step: calibration runs B in powers of four up to max_batch
× a few tree sizes, and greedy runs per B, ~2 s for the bundled model on 2 CPU cores); what a draft is worth is its source's acceptance
model's: Medusa's per (head, rank) (acceptance.py, trees.py), a chain source's per depth with
its stated probabilities calibrated, the draft head's per token by its calibration alone (host.py).

Each decode row offers candidates, one per source that drafted for it, each as ``expected[n]``:
the kept tokens expected verifying its first n drafted tokens (a tree prefix of n choices, or a
chain of n: a step of S = 1 + n tokens a row). The batch's S and each row's source maximise
expected tokens per second, Σ_rows (1 + E_row[n]) / (t(B, S) + drafting), against plain decoding
(``StepTimes.plain_estimate``), and S = 1 (plain) unless that beats plain decoding by MIN_GAIN
(contract/medusa_acceptance.py: `trtbuild plan` applies the same margin). Drafting is priced in
two parts: the drafting call that follows a verification (proposals, estimates, this decision:
the recent median per row; ~1 ms a call on 2 CPU cores, a quarter of an 8-step greedy run of the
bundled model (0.46 ms a step), which lost it 0.56–0.89× of plain decoding at batch 1 while
nothing was verified),
and, for a source whose drafting computes (a draft model), its measured seconds per drafted token
per row (``measured``), which a row pays for each token it verifies from that source.

Exploration, one rule for every source: standing aside, a (batch size, source) verifies the
source's likeliest-to-pay draft once plain decoding since that source last verified at that batch
size took EXPLORE_AFTER times the verification's estimated cost. So a step time measured in a slow
spell (calibration, one noisy step), or a request whose text turns repetitive late, cannot keep a
source off for good, and exploring costs at most 1 / EXPLORE_AFTER of plain decoding's time where
the source does not pay.

Drafting backs off, one rule (``Backoff``, the policy's for every drafting call and the draft
head's for its own): where a drafting call's decision verified nothing it drafted, the next call
waits until the engine has stepped for 2^m / DRAFT_SHARE times what that call cost, m the calls
before it in a row that verified nothing (at most MAX_DOUBLINGS; a call with no row to draft for,
prompts prefilling, is not one); a verification resets m (a request not yet drafted for is due at
once). So drafting that keeps not paying costs DRAFT_SHARE of the engine's time at first, and from
the fifth such call on DRAFT_SHARE / 16. On SmolLM2 a run
takes ~160 ms and the host sources' drafting (~1 ms a call) hardly waits; the draft head's at
batch 8 (~20 ms a call, its reading of the rows' positions included) did take DRAFT_SHARE, 3 % of
free chat's time, where it never paid; on the bundled model drafting waits about ten runs at first.

``always`` mode verifies every draft at its full length (benchmarks, tests); a candidate ``pinned``
(a fixed Medusa tree size) is verified at its full length in either mode.

Adding a source: its acceptance model implements ``SourceModel`` and is registered under its
``Source`` in the policy's ``models``; the engine core offers its drafts as candidates and reports
its drafting time with ``measured``.
"""
from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Protocol, Sequence

import numpy as np

from ...contract.medusa_acceptance import MIN_GAIN
from ...contract.speculation import Source
from ..core.tree import Accepted
from .acceptance import SpeculationStats
from .step_times import EMPTY, Context, StepTimes

if TYPE_CHECKING:
    from ..core.scheduler import Draft

# Standing aside, a (batch size, source) verifies the source's likeliest-to-pay draft once the plain
# decoding it did since that source last verified took EXPLORE_AFTER times the verification's
# estimated cost: exploring costs at most 1 / EXPLORE_AFTER of plain decoding's time.
EXPLORE_AFTER = 100
DRAFT_SHARE = 0.03     # where nothing is verified, drafting takes at most this share of the engine's time
MAX_DOUBLINGS = 4      # ... halved for each drafting call in a row that verified nothing, down to 1/16 of it
RECENT_DRAFTS = 15     # drafting measurements kept (their median prices a verification)


class SpeculationMode(Enum):
    """``adaptive``: verify where expected tokens per second beat plain decoding (the default);
    ``always``: verify every draft a source has, at its full length (benchmarks, tests)."""
    adaptive = "adaptive"
    always = "always"


class SourceModel(Protocol):
    """A source's acceptance model: learns from each verification of its drafts."""

    def verified(self, rid: str, draft: "Draft", path: Accepted) -> None: ...

    def close(self, rid: str, context: Sequence[int]) -> None: ...


@dataclass(frozen=True)
class Candidate:
    """One row's draft from one source as the policy weighs it. ``expected``: [N + 1], the kept
    tokens expected verifying its first n drafted tokens (S = 1 + n); ``pinned``: verified at its
    full length whatever it costs (a fixed Medusa tree size); ``drafted``: [N + 1], the tokens
    the source drafts for its first n (None: n; a draft model's tree: the chain's depth they
    reach, siblings costing no run), which a row pays ``drafting_cost`` for."""
    source: Source
    expected: np.ndarray
    pinned: bool = False
    drafted: np.ndarray | None = None

    @property
    def length(self) -> int:
        return len(self.expected) - 1

    def drafted_at(self, n: np.ndarray) -> np.ndarray:
        n = np.minimum(n, self.length)
        return n if self.drafted is None else self.drafted[n]


@dataclass(frozen=True)
class Decision:
    """The batch's step: ``seq`` tokens a row (1: plain), and by rid the rows that verify a draft:
    (its source, how many of its drafted tokens: a tree prefix's choices or a chain's tokens)."""
    seq: int = 1
    picks: dict[str, tuple[Source, int]] = field(default_factory=dict)

    def sources(self) -> set[Source]:
        return {source for source, _ in self.picks.values()}


PLAIN = Decision()


class Backoff:
    """Drafting's back-off (see above): ``due`` unless the last drafting call verified nothing and
    the engine has not yet stepped 2^m / DRAFT_SHARE times that call's seconds."""

    def __init__(self):
        self.owed = 0.0   # engine seconds to pass before drafting again
        self.misses = 0   # drafting calls in a row that verified nothing

    def due(self) -> bool:
        return self.owed <= 0.0

    def drafted(self, seconds: float, verified: bool) -> None:
        if verified:
            self.owed, self.misses = 0.0, 0
        else:
            self.owed = seconds / DRAFT_SHARE * 2 ** min(self.misses, MAX_DOUBLINGS)
            self.misses += 1

    def stepped(self, seconds: float) -> None:
        self.owed -= seconds


class AdaptivePolicy:
    """The decision for every decode batch, exploration, drafting back-off, and the verifications
    every source's acceptance model learns from (``models``, by source)."""

    def __init__(self, times: StepTimes, models: dict[Source, SourceModel], stats: SpeculationStats,
                 mode: SpeculationMode = SpeculationMode.adaptive):
        self.times, self.models, self.stats, self.mode = times, models, stats, mode
        self._aside: dict[tuple[int, Source], float] = {}  # (batch, source) → plain seconds since it verified
        self._call_seconds: deque = deque([0.0], maxlen=RECENT_DRAFTS)  # drafting calls, per row
        self._per_token: dict[Source, deque] = {}   # source → drafting seconds per drafted token per row
        self._backoff = Backoff()
        self._drafted: set[str] = set()  # requests drafted for at least once

    # -- the decision -------------------------------------------------------------------------

    def choose(self, batch: int, rows: dict[str, list[Candidate]], context: Context = EMPTY) -> Decision:
        """The step for a decode batch of ``batch`` rows that have ``context`` cached, ``rows``:
        the candidates of the rows that have drafts. The sources it verifies count as explored."""
        decision = self.decide(batch, rows, context)
        for source in decision.sources():
            self._aside[batch, source] = 0.0
        return decision

    def decide(self, batch: int, rows: dict[str, list[Candidate]], context: Context = EMPTY) -> Decision:
        """``choose`` without counting anything: what the batch would verify."""
        rows = {rid: cands for rid, cands in rows.items() if cands}
        if not rows:
            return PLAIN
        always = self.mode == SpeculationMode.always
        pinned = {rid: max((c for c in cands if c.pinned or always), key=lambda c: c.expected[-1])
                  for rid, cands in rows.items() if always or any(c.pinned for c in cands)}
        base = {rid: (c.source, c.length) for rid, c in pinned.items() if c.length}
        base_seq = 1 + max((n for _, n in base.values()), default=0)
        free = {rid: cands for rid, cands in rows.items() if rid not in pinned}
        if not free:
            return Decision(base_seq, base)
        if not self.times.table:
            raise ValueError("adaptive speculation needs measured step times")
        plain = self.times.plain_estimate(batch, context)
        longest = max(c.length for cands in free.values() for c in cands)
        n = np.arange(longest + 1)  # [N + 1] drafted tokens a free row verifies at most
        tokens = batch + sum(float(c.expected[-1]) for c in pinned.values()) + np.zeros(len(n))  # [N + 1]
        spent = np.full(len(n), float(sum(self.drafting_cost(c.source) * c.drafted_at(c.length)
                                          for c in pinned.values())))
        chosen: dict[str, np.ndarray] = {}  # rid → [N + 1] index of its candidate at each n
        for rid, cands in free.items():
            kept, seconds = self._values(cands, n)  # [C, N + 1] each
            # A drafted token is worth its drafting where what it keeps beats what plain decoding
            # makes of the row in that time.
            best = np.argmax(kept - seconds / plain, axis=0)  # [N + 1]
            tokens += kept[best, n]
            spent += seconds[best, n]
            chosen[rid] = best
        seqs = np.maximum(base_seq, 1 + n)
        rates = tokens / (self.times.estimates(batch, seqs, context) + spent + self.drafting_estimate(len(rows)))
        if base_seq == 1:  # nothing else verifies: n = 0 is plain decoding, at its own (run) cost
            rates[0] = batch / plain
        best_n = int(np.argmax(rates))
        if best_n and rates[best_n] < MIN_GAIN * rates[0]:
            best_n = 0
        if best_n == 0:
            explored = self._due(batch, free, plain, context)
            if explored is not None:
                source, k = explored
                picks = {rid: (source, min(k, c.length)) for rid, cands in free.items()
                         for c in cands if c.source == source and c.length}
                return Decision(max(base_seq, 1 + k), {**base, **picks})
        picks = dict(base)
        for rid, cands in free.items():
            candidate = cands[int(chosen[rid][best_n])]
            if min(best_n, candidate.length):
                picks[rid] = (candidate.source, min(best_n, candidate.length))
        return Decision(int(seqs[best_n]), picks)

    def _values(self, cands: list[Candidate], n: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """[C, N + 1] each: a row's expected kept tokens, and drafting seconds, per candidate and n."""
        kept = np.stack([c.expected[np.minimum(n, c.length)] for c in cands])
        seconds = np.stack([self.drafting_cost(c.source) * c.drafted_at(n) for c in cands])
        return kept, seconds

    def _due(self, batch: int, free: dict[str, list[Candidate]], plain: float,
             context: Context) -> tuple[Source, int] | None:
        """(a source, drafted tokens) to verify although nothing pays on the estimates: the source
        with the most plain decoding since it last verified at this batch size, where that reached
        EXPLORE_AFTER times its likeliest-to-pay verification's cost (None if none has)."""
        by_source: dict[Source, list[Candidate]] = {}
        for cands in free.values():
            for c in cands:
                if c.length:
                    by_source.setdefault(c.source, []).append(c)
        best, best_ratio = None, 1.0
        for source, cands in by_source.items():
            aside = self._aside.get((batch, source), 0.0)
            if aside <= 0.0:
                continue
            n = np.arange(1, max(c.length for c in cands) + 1)  # [N]
            kept = sum(c.expected[np.minimum(n, c.length)] for c in cands)  # [N]
            seconds = self.times.estimates(batch, 1 + n, context)  # [N]
            likeliest = 1 + int(np.argmax((batch + kept) / seconds))
            # The verification, and a single step in place of a run's (it computes what drafting reads).
            cost = (float(seconds[likeliest - 1]) + max(0.0, self.times.estimate(batch, 1, context) - plain)
                    + self.drafting_cost(source) * sum(float(c.drafted_at(likeliest)) for c in cands))
            ratio = aside / (EXPLORE_AFTER * cost)
            if ratio >= best_ratio:
                best, best_ratio = (source, likeliest), ratio
        return best

    # -- what happened --------------------------------------------------------------------------

    def count_step(self, batch: int, verifies: bool, seq_len: int) -> None:
        """One decode step of ``batch`` rows: a verification of ``seq_len`` tokens per row, or plain."""
        if verifies:
            self.stats.verify_steps += 1
            self.stats.tree_sizes[seq_len] += 1
        else:
            self.stood_aside(batch, 1)

    def stood_aside(self, batch: int, steps: int, context: Context = EMPTY) -> None:
        """``steps`` plain decode steps of ``batch`` rows (one, or a multi-step run's) from ``context``:
        every source's exploration budget at this batch size grows by their estimated seconds."""
        self.stats.plain_steps += steps
        if self.mode == SpeculationMode.adaptive and self.times.table:
            seconds = steps * self.times.plain_estimate(batch, context)
            for source in self.models:
                self._aside[batch, source] = self._aside.get((batch, source), 0.0) + seconds

    def record(self, rid: str, draft: "Draft", path: Accepted) -> None:
        """One row's verification of ``draft``, of which ``path`` was kept: its source's model learns."""
        self.stats.count_row(draft.source.value, len(path.nodes))
        self.models[draft.source].verified(rid, draft, path)

    def close(self, rid: str, context: Sequence[int]) -> None:
        """The request ended: the sources' models forget it (a suffix source keeps its output)."""
        self._drafted.discard(rid)
        for model in {id(m): m for m in self.models.values()}.values():
            model.close(rid, context)

    # -- drafting's cost and back-off -------------------------------------------------------------

    def measured(self, source: Source, tokens: int, seconds: float) -> None:
        """``source`` drafted ``tokens`` tokens (all rows together) in ``seconds`` of compute of its own."""
        if tokens > 0:
            self._per_token.setdefault(source, deque(maxlen=RECENT_DRAFTS)).append(seconds / tokens)

    def drafting_cost(self, source: Source) -> float:
        """Seconds a row pays per token ``source`` drafts (the recent median; 0 where never measured)."""
        recent = self._per_token.get(source)
        return statistics.median(recent) if recent else 0.0

    def due(self, rids: Sequence[str]) -> bool:
        """Whether the decoding requests ``rids`` are drafted for after this step: unless the last
        decision verified nothing and the engine has not yet stepped for long enough since
        (``stepped``), or any of them was never drafted for."""
        return (self._backoff.due() or self.mode == SpeculationMode.always
                or not self._drafted.issuperset(rids))

    def drafted(self, rids: Sequence[str], seconds: float, verifies: bool, priced: float = 0.0) -> None:
        """A drafting call for ``rids`` took ``seconds`` (proposals, estimates, decision) and its
        decision verifies what it drafted or not (then drafting backs off). ``priced``: the part of
        ``seconds`` a source already reported per drafted token (``measured``), which the back-off
        counts but a call's estimate leaves out (it is priced per token)."""
        if not rids:  # no request decoding (prompts prefilling): nothing drafted, nothing to back off from
            return
        self._call_seconds.append(max(0.0, seconds - priced) / len(rids))
        self._drafted.update(rids)
        self._backoff.drafted(seconds, verifies)

    def stepped(self, seconds: float) -> None:
        """The engine stepped (or ran) for ``seconds`` since the last drafting call."""
        self._backoff.stepped(seconds)

    def drafting_estimate(self, rows: int) -> float:
        """Seconds a drafting call for ``rows`` requests takes (the recent median)."""
        return rows * statistics.median(self._call_seconds)

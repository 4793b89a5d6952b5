"""Host draft sources (prompt lookup, suffix; runtime/speculation/sources/) as draft sources for
the adaptive policy (adaptive.py): each request's chain from the source expected to keep most of
it, and what the chain is worth, learned from every verification.

A host source proposes a chain after each request's last token. Whether a chain is worth verifying
depends on the request (a code edit repeats its prompt for long runs, free chat hardly ever) and
on what a verification costs at this batch size (the policy's). So acceptance is learned per
(source, depth): P(the token at depth d is kept | the ones before it were), from every
verification across requests, and per request on top of that (the global figure as its prior). A
depth's prior is the source's stated probability for the token, calibrated: how often tokens the
source stated that likely were kept, at any depth (``HostDrafting.calibration``). Taking the source
at its word fails where it matters: a suffix chain seen once states 1.0 for every token, and a
chain's deep tokens are seldom tried, so their estimates stayed at 1.0 and free chat verified
16-token chains that kept 0.3 tokens (measured on SmolLM2: 27 verifications, 8 tokens kept, in
256). The expected kept tokens of a chain of n are Σ_k Π_{d ≤ k} p_d: the series the policy weighs.

A draft model's stated probability is its own distribution's mass on the token, which varies token
by token far more than the depth does: SmolLM2's draft head on free chat kept 0.93 of the tokens
it gave ≥ 0.9 and 0.13 of those it gave 0.1–0.2, where depths 1 and 2 kept 0.44 and 0.41 over all
of them (benchmarks/draft_calibration.py). Averaged by depth, every chain is worth
the same and the policy verifies all of them or none. So for a source built ``per_token`` (the
draft head) the estimate is the calibration alone: P(kept | the tenth the model stated), learned
from every verification, and a chain is cut where its tokens turn unlikely.

A source's chains are verified only RAMP times as deep as its longest kept run so far (at least
FIRST_REACH): a depth never reached has no count, only its prior, and at batch 8 a bet on the
prior is dear (SmolLM2 float32, code_edit: three verifications of 8 rows × 17 tokens at 316 ms
each, against a 38 ms plain step, kept 3.6 tokens a row). The reach doubles with each run kept
in full, so a source that copies long spans verifies long chains after a few steps.

A draft model that also states its runners-up at each depth (the draft head's ``Proposal.
alternatives``) offers a tree: the chain and, beside each of its tokens, the next likeliest
tokens from the same distribution (siblings: no more draft runs). Each node is worth P(its path is
kept): the chain's product up to its parent times its own calibrated estimate, siblings and chain
tokens alike by the tenth they were stated in; the nodes go likeliest first, parents before
children, so the policy's n is a tree of the n likeliest nodes. Every node whose parent was kept
counts for the calibration, kept or not. SmolLM2's run-6 draft on free chat (teacher-forced, depth
1): its top-1 is the target's token at 0.469 of positions, its top-2 at 0.591, top-3 0.646.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import numpy as np

from ...contract.speculation import Source
from ..core.tree import Accepted, Tree
from .adaptive import SpeculationMode
from .chain import chain_tree, tree_of
from .sources.base import HostDraftSource

if TYPE_CHECKING:
    from ..core.scheduler import Draft

PRIOR = 0.5            # P(kept) per depth before any verification, where a source gives no estimate
STATED_TRUST = 0.5     # before calibration, a stated probability q counts as PRIOR + STATED_TRUST·(q − PRIOR)
BUCKETS = 10           # stated probabilities are calibrated per tenth
PRIOR_WEIGHT = 8.0     # a prior counts as this many verified tokens (calibration, global per-depth estimate)
REQUEST_WEIGHT = 4.0   # the global estimate counts as this many of a request's own
FIRST_REACH = 2        # how deep a source's chains are verified before any of its tokens was kept
RAMP = 2               # a source's chains reach RAMP × its longest kept run so far (≥ FIRST_REACH)


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

    def record_tried(self, cells: np.ndarray, kept: np.ndarray) -> None:
        """Tokens tried (their parents were kept) in ``cells``, ``kept`` bool: which were kept."""
        np.add.at(self.trials, cells, 1)
        np.add.at(self.hits, cells[kept], 1)

    def probabilities(self, cells: np.ndarray, prior: np.ndarray, weight: float) -> np.ndarray:
        """P(kept) in each of ``cells``, ``prior`` counting as ``weight`` tokens."""
        return (self.hits[cells] + weight * prior) / (self.trials[cells] + weight)

    def longest_kept(self) -> int:
        """By depth: the longest run any chain had kept (kept tokens are always a prefix)."""
        return int(np.count_nonzero(self.hits))


def tried_nodes(tree: Tree, path: Accepted) -> list[tuple[int, bool]]:
    """The nodes a verification of ``tree`` tried (their parents were kept; for a chain, its kept
    tokens and the one after), each with whether it was kept."""
    reached = {0, *path.nodes}
    return [(node, node in reached) for node in range(1, tree.size) if tree.parents[node] in reached]


def _tenths(stated: np.ndarray) -> np.ndarray:
    """The calibration cell of each stated probability."""
    return np.minimum((stated * BUCKETS).astype(np.int64), BUCKETS - 1)


@dataclass(frozen=True)
class HostDraft:
    """A chain, or a tree over one (``choices``): node i + 1 is ``tokens[i]``, stated ``stated[i]``."""
    source: Source
    tokens: tuple[int, ...]
    stated: tuple[float, ...]  # the source's probability for each token
    expected: np.ndarray    # [len(tokens) + 1]: expected kept tokens verifying the first n
    choices: tuple[tuple[int, ...], ...] | None = None  # a tree's nodes, parents first (None: a chain)
    drafted: np.ndarray | None = None  # [len(tokens) + 1]: chain tokens the first n nodes need (None: n)

    def expected_at(self, n: int) -> float:
        return float(self.expected[min(n, len(self.tokens))])

    def tree(self, n: int) -> Tree:
        """The first n nodes as the tree a verification scores."""
        return chain_tree(n) if self.choices is None else tree_of(self.choices[:n])


@dataclass
class _RequestState:
    counts: dict[Source, KeptCounts] = field(default_factory=dict)  # by depth


class HostDrafting:
    """The engine's host sources and their acceptance estimates."""

    def __init__(self, sources: dict[Source, HostDraftSource], max_tokens: int,
                 mode: SpeculationMode = SpeculationMode.adaptive, per_token: bool = False,
                 max_nodes: int | None = None):
        """``per_token``: the sources' stated probabilities are a draft model's own (its
        distribution's mass on each token), estimated through their calibration alone.
        ``max_tokens``: a chain's longest; ``max_nodes``: a tree's most nodes (None: max_tokens)."""
        if max_tokens < 1:
            raise ValueError(f"host drafting needs a verification of ≥ 2 tokens (max_tokens {max_tokens})")
        if max_nodes is not None and max_nodes < max_tokens:
            raise ValueError(f"max_nodes {max_nodes}: valid max_tokens ({max_tokens}) or more")
        self.sources, self.max_tokens, self.mode, self.per_token = sources, max_tokens, mode, per_token
        self.max_nodes = max_nodes or max_tokens
        self.counts = {source: KeptCounts.empty(max_tokens) for source in sources}         # by depth
        self.calibration = {source: KeptCounts.empty(BUCKETS) for source in sources}      # by stated tenth
        self._depths = np.arange(max_tokens)
        self._requests: dict[str, _RequestState] = {}

    def probabilities(self, source: Source, rid: str | None = None, stated: Sequence[float] = ()) -> np.ndarray:
        """[max_tokens]: P(the token at each depth is kept | the ones before were). ``stated``: the
        source's own estimate for this draft's tokens (a longer n-gram match is likelier kept),
        PRIOR past them, calibrated; the depth's counts overrule it as verifications come in,
        except for a ``per_token`` source (a draft model), where the calibration is the estimate."""
        claimed = np.full(self.max_tokens, PRIOR)
        claimed[:min(len(stated), self.max_tokens)] = stated[:self.max_tokens]
        base = self.calibrated(source, claimed)
        if self.per_token:
            return base
        shared = self.counts[source].probabilities(self._depths, base, PRIOR_WEIGHT)
        own = self._requests.get(rid).counts.get(source) if rid in self._requests else None
        return shared if own is None else own.probabilities(self._depths, shared, REQUEST_WEIGHT)

    def calibrated(self, source: Source, stated: np.ndarray) -> np.ndarray:
        """P(kept) of tokens ``source`` stated at these probabilities: their tenths' calibration."""
        return self.calibration[source].probabilities(_tenths(stated), PRIOR + STATED_TRUST * (stated - PRIOR),
                                                      PRIOR_WEIGHT)

    def reach(self, source: Source) -> int:
        """How deep ``source``'s chains are verified now: RAMP × its longest kept run (adaptive)."""
        if self.mode == SpeculationMode.always:
            return self.max_tokens
        return min(self.max_tokens, max(FIRST_REACH, RAMP * self.counts[source].longest_kept()))

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
            draft = (self._tree(source, tuple(tokens), stated, kept, proposal.alternatives) if proposal.alternatives
                     else HostDraft(source, tuple(tokens), stated, np.concatenate(([0.0], np.cumsum(kept)))))
            if best is None or draft.expected[-1] > best.expected[-1]:
                best = draft
        return best

    def _tree(self, source: Source, tokens: tuple[int, ...], stated: tuple[float, ...], kept: np.ndarray,
              alternatives) -> HostDraft:
        """The chain ``tokens`` (``kept``: P(kept up to each depth)) and its runners-up as a tree of
        at most ``max_nodes`` nodes, likeliest first (see above)."""
        # (P(the path is kept), the path, its token, the stated probability), chain nodes first
        nodes = [(float(kept[d]), (0,) * (d + 1), tokens[d], stated[d]) for d in range(len(tokens))]
        for depth, others in enumerate(alternatives[:len(tokens)]):
            if not others:
                continue
            parent = float(kept[depth - 1]) if depth else 1.0
            own = self.calibrated(source, np.array([q for _, q in others], np.float64))
            nodes += [(parent * float(p), (0,) * depth + (rank,), token, q)
                      for rank, ((token, q), p) in enumerate(zip(others, own), start=1)]
        # A node is never likelier than its parent, and ties go shallowest first: parents come first.
        nodes = sorted(nodes, key=lambda node: (-node[0], len(node[1]), node[1]))[:self.max_nodes]
        depths = [len(path) for _, path, _, _ in nodes]
        return HostDraft(source, tuple(token for _, _, token, _ in nodes), tuple(q for *_, q in nodes),
                         np.concatenate(([0.0], np.cumsum([p for p, *_ in nodes]))),
                         tuple(path for _, path, _, _ in nodes), np.concatenate(([0], np.maximum.accumulate(depths))))

    def record(self, rid: str, source: Source, stated: Sequence[float], kept: int) -> None:
        """One verified chain whose tokens ``source`` stated with probabilities ``stated`` (its
        length), of which the first ``kept`` were kept."""
        tried = np.asarray(stated, np.float64)[:kept + 1]
        self._record(rid, source, tried, np.arange(len(tried)) < kept, len(stated), kept)

    def verified(self, rid: str, draft: "Draft", path: Accepted) -> None:
        tried = tried_nodes(draft.tree, path)
        stated = np.array([draft.probabilities[node - 1] for node, _ in tried], np.float64)
        self._record(rid, draft.source, stated, np.array([kept for _, kept in tried], bool), draft.tree.depth,
                     len(path.nodes))

    def _record(self, rid: str, source: Source, stated: np.ndarray, kept: np.ndarray, depth: int,
                path: int) -> None:
        """Tokens tried, stated at ``stated``, ``kept`` or not, for the calibration; a chain ``depth``
        deep of which the first ``path`` were kept, for the per-depth counts."""
        self.calibration[source].record_tried(_tenths(stated), kept)
        depths = self._depths[:depth]
        self.counts[source].record(depths, path)
        state = self._requests.setdefault(rid, _RequestState())
        state.counts.setdefault(source, KeptCounts.empty(self.max_tokens)).record(depths, path)

    def close(self, rid: str, context: Sequence[int]) -> None:
        """The request ended: its sources forget it (a suffix source keeps its output for others)."""
        self._requests.pop(rid, None)
        for host in self.sources.values():
            host.close(rid, context)

"""The draft head as a draft source in the step loop: it holds the target's features after every
step, reads them just before drafting a chain for the rows that speculate with it, and learns
its chains' acceptance from every verification as the host sources do (host.py), token by token.

Acceptance is estimated per token from the probability the draft gave it (host.py's
``per_token``: the calibration by stated tenth alone, not the depth counts), and a chain stops
drafting where its next token cannot pay for its run (``_worth_more``).

What the engine core tells it (runtime/engine_core.py):
- after a step, each row's committed positions (a prefill chunk's or a plain step's tokens; a
  verification's root and accepted nodes; a greedy run's steps) with their DRAFT_FEATURES and the
  tokens that follow them (``observe_*``). They are held, not read: the newest READ_WINDOW of
  each request's unread positions;
- before a decode step, ``draft``: the drafter first reads the rows' held positions (one batched
  observe: it writes its K/V there, over whatever it drafted there before, the rollback), then
  drafts one batched chain per row in sync (its last read position is the one before the row's
  root), offered to the policy as a Candidate;
- a request's end (``close``).
A row the drafter is not in sync with (its sources left out draft_head, or a step whose features
were not observed) gets no chain until its next observed step.

Reading only when drafting, and only the newest READ_WINDOW positions: where the policy backs off
(the draft does not pay at this batch size, or another source's drafts are verified), the draft
costs nothing between its drafting calls, where it used to read every step's positions (at batch 8
on SmolLM2, free chat, that reading was half the draft's cost: 0.15–0.18 s of 4.9 s). The
positions a request skipped stay masked out of the draft's attention, as an unseen cached prefix's
are. Measured with `python benchmarks/draft_accuracy.py --windows 0,64,32,16,8` on SmolLM2's run-5
draft: top-1 with the draft attending to only its last 32 positions is 0.466 on free chat against
0.451 attending to all (0.423 at 16), 0.322 against 0.331 on held-out chat instructions; it
trained on windows of 160. A prompt's catch-up is bounded the same way.

Trees: a greedy or seeded row's chain comes with the draft's runners-up at each depth (``width``
tokens a depth in all, TREE_WIDTH by default), and HostDrafting (host.py) offers the likeliest
nodes of that tree, at most ``max_nodes`` (the engine's verify_tokens − 1); the chain's depth
(``max_tokens``) and its cut (``_worth_more``) stay the chain's.

Sampling: a greedy or seeded request verifies the draft's argmax chain or tree by the point-mass
rule (runtime/speculation/medusa.py accept_sampled: a seed gives plain sampling's tokens whatever
was drafted); an unseeded sampled request drafts its chain from q (the request's own draft uniforms)
and verifies it by the full-distribution rule (full_sampling.py: min(1, p/q), a residual draw at
the first rejection), which keeps more of a draft whose q is spread, at the same distribution.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from ...contract.draft_head import DRAFT_MAP_FILE, MAP_TENSOR
from ...contract.speculation import Source
from ..core.tree import Accepted
from .draft_head import DraftHeadDrafter, Observation
from .adaptive import Backoff, SpeculationMode
from .full_sampling import draft_uniforms
from .host import HostDraft, HostDrafting
from .sources.base import EMPTY, Proposal

# The newest unread positions of a request the drafter reads before drafting for it (see above).
READ_WINDOW = 32
# Tokens a greedy or seeded row's draft offers at each depth: the chain's and the next likeliest
# (a tree over the chain, host.py; measured in docs/benchmarks.md "Trees over the chain").
TREE_WIDTH = 3


@dataclass(frozen=True)
class Chain:
    """A row's chain as the engine core attaches it: the host-style draft (tokens, stated
    probabilities, expected kept tokens), and for the full-distribution rule the draft's q over
    its K ids at each depth (None: verified by the point-mass rule)."""
    draft: HostDraft
    distributions: np.ndarray | None = None  # [k, K]


@dataclass(frozen=True)
class _Unread:
    """A request's committed positions the drafter has not read: the newest ones, contiguous."""
    start: int
    features: np.ndarray  # [n, H]
    tokens: tuple[int, ...]

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


class _Proposals:
    """The HostDraftSource HostDrafting asks: the chains this step's batched ``propose`` made."""

    source = Source.draft_head

    def __init__(self):
        self.chains: dict[str, Proposal] = {}

    def propose(self, rid: str, context: Sequence[int], max_tokens: int) -> Proposal:
        chain = self.chains.get(rid, EMPTY)
        return Proposal(chain.tokens[:max_tokens], chain.probabilities[:max_tokens], chain.alternatives[:max_tokens])

    def close(self, rid: str, context: Sequence[int]) -> None:
        self.chains.pop(rid, None)


def read_draft_map(engine_dir) -> np.ndarray:
    """int64 [K]: the engine dir's draft-to-target ids (a listed file; shape, dtype, range checked)."""
    from ...checkpoint.errors import CheckpointError
    from ...checkpoint.weight_map import WeightMap

    path, entry = Path(engine_dir.path) / DRAFT_MAP_FILE, engine_dir.draft_head
    if DRAFT_MAP_FILE not in engine_dir.manifest["files"] or not path.is_file():
        raise ValueError(f"{path}: missing from the engine dir (built before the draft map was written?); rebuild")
    try:
        weights = WeightMap.from_files(Path(engine_dir.path), [path])
        found = weights.entry(MAP_TENSOR) if MAP_TENSOR in weights else None
        if found is None or found.dtype != "I64" or tuple(found.shape) != (entry.draft_vocab_size,):
            raise ValueError(f"{path}: {MAP_TENSOR} must be int64 [{entry.draft_vocab_size}]")
        ids = weights.tensor(MAP_TENSOR).numpy().astype(np.int64)
    except CheckpointError as exc:
        raise ValueError(str(exc)) from None
    if ids.min(initial=0) < 0 or ids.max(initial=0) >= engine_dir.vocab_size:
        raise ValueError(f"{path}: {MAP_TENSOR} holds ids outside the vocabulary [0, {engine_dir.vocab_size})")
    if len(np.unique(ids)) != len(ids):  # two draft ids for one token would split its probability
        raise ValueError(f"{path}: {MAP_TENSOR} maps two draft ids to one target id")
    return ids


class DraftHeadSource:
    """The drafter of one engine, and its chains' acceptance model (the policy's SourceModel)."""

    source = Source.draft_head

    def __init__(self, drafter: DraftHeadDrafter, max_tokens: int, mode, window: int = READ_WINDOW,
                 width: int | None = None, max_nodes: int | None = None):
        """``max_tokens``: a chain's longest; ``width``: tokens offered at each depth of a greedy
        or seeded row's chain (None: TREE_WIDTH; 1: chains only); ``max_nodes``: a tree's most
        (None: max_tokens)."""
        width = TREE_WIDTH if width is None else width
        if window < 1:
            raise ValueError(f"window {window}: valid 1 or more (positions read before drafting)")
        if width < 1:
            raise ValueError(f"width {width}: valid 1 (chains) or more (trees over the chain)")
        self.drafter = drafter
        self.proposals = _Proposals()
        self.model = HostDrafting({Source.draft_head: self.proposals}, max_tokens, mode, per_token=True,
                                  max_nodes=max_nodes)
        self.mode = mode
        self.window = window
        self.width = width
        self._unread: dict[str, _Unread] = {}
        self._backoff = Backoff()  # its own: its chains may go unverified where another source's are

    # -- its own back-off: drafting costs model runs, so chains nobody verifies are not drafted each step

    def due(self) -> bool:
        """Whether to draft after this step: unless its last chains went unverified (another
        source's were, or none) and the engine has not stepped long enough since (adaptive.py's
        ``Backoff``, for this source alone)."""
        return self._backoff.due() or self.mode == SpeculationMode.always

    def stepped(self, seconds: float) -> None:
        self._backoff.stepped(seconds)

    def decided(self, seconds: float, verified: bool) -> None:
        """Its drafting took ``seconds`` and the batch verifies its chains or not."""
        self._backoff.drafted(seconds, verified)

    # -- feeding it ------------------------------------------------------------------------------

    def hold(self, row: Observation) -> None:
        """Keeps a request's newly committed positions for the drafter's next read, after any it
        holds already (from ``row.start`` on: a row that restarts earlier replaces what it held
        past there; one that starts past a gap drops what it held), the newest ``window`` only."""
        unread = self._unread.get(row.rid)
        start, features, tokens = row.start, np.asarray(row.features), tuple(int(t) for t in row.tokens)
        if unread is not None and unread.start <= row.start <= unread.end:
            kept = row.start - unread.start
            start, features, tokens = unread.start, np.concatenate([unread.features[:kept], features]), \
                unread.tokens[:kept] + tokens
        cut = max(0, len(tokens) - self.window)
        # A cut window is copied: its view would keep a whole prefill chunk's features alive.
        self._unread[row.rid] = _Unread(start + cut, features[cut:].copy() if cut else features, tokens[cut:])

    def read(self, rids: Sequence[str]) -> None:
        """The drafter reads what it holds of ``rids``, in one batched observe; requests it has no
        slot left for are skipped (they draft nothing, and keep what is held for a later read)."""
        free, rows = len(self.drafter.free), []
        for rid in rids:
            unread = self._unread.get(rid)
            if unread is None:
                continue
            known = rid in self.drafter.requests
            if known or free:
                del self._unread[rid]
                rows.append(Observation(rid, unread.start, unread.features, unread.tokens))
                free -= not known
        if rows:
            self.drafter.observe(rows)

    def observe_step(self, rids: Sequence[str], starts: Sequence[int], rows_nodes: Sequence[Sequence[int]],
                     features: np.ndarray, contexts: Sequence[Sequence[int]]) -> None:
        """After a step: row b of ``rids`` computed positions starts[b] + i for its committed nodes
        ``rows_nodes[b]`` (indices into the step's S: 0..n-1 for a prefill chunk or plain step; the
        root 0 and the accepted nodes of a verification) with ``features`` [B, S, H]; ``contexts``
        the requests' tokens after the commit (the token after each position). Held (``hold``)."""
        for rid, start, nodes, row_features, context in zip(rids, starts, rows_nodes, features, contexts):
            n = len(nodes)
            if n == 0 or len(context) < start + n + 1:  # the row ended before the token after its last position
                continue
            self.hold(Observation(rid, start, row_features[list(nodes)], context[start + 1:start + n + 1]))

    def in_sync(self, rid: str, root_position: int) -> bool:
        """Whether the drafter has read, or holds, every position up to the one before a row's root
        (it can draft for it)."""
        unread = self._unread.get(rid)
        if unread is not None:
            return unread.end == root_position
        request = self.drafter.requests.get(rid)
        return request is not None and request.logits is not None and request.last == root_position - 1

    # -- drafting ----------------------------------------------------------------------------------

    def draft(self, rows: list[tuple[str, int, int, object | None]],
              row_seconds: float | None = None) -> tuple[dict[str, Chain], float, int]:
        """Chains for ``rows`` (rid, output position of the root's successor, the most tokens it may
        take, the sampler where the row samples without a seed, else None). ``row_seconds``: what
        plain decoding spends on a row's token now (None: chains are drafted to full length).
        Returns the chains, the drafter's seconds (reading the rows' held positions, then drafting)
        and the tokens it drafted."""
        if not rows:
            return {}, 0.0, 0
        began = time.perf_counter()
        self.read([rid for rid, *_ in rows])
        rows = [row for row in rows if row[0] in self.drafter.requests]  # those it had a slot for
        if not rows:
            return {}, time.perf_counter() - began, 0
        reach = self.model.reach(Source.draft_head)
        worth_more = self._worth_more(row_seconds)
        k = min(reach, max(limit for _, _, limit, _ in rows))
        greedy = [(rid, limit) for rid, _, limit, sampler in rows if sampler is None]
        sampled = [(rid, position, limit, sampler) for rid, position, limit, sampler in rows if sampler is not None]
        chains: dict[str, Chain] = {}
        drafted = 0
        if greedy and k:
            proposed = self.drafter.propose([rid for rid, _ in greedy], k, worth_more=worth_more,
                                            width=min(self.width, self.drafter.draft_vocab))
            for rid, limit in greedy:
                chains[rid] = self._chain(rid, proposed[rid].proposal, limit, None)
                drafted += len(proposed[rid].tokens)
        if sampled and k:
            uniforms = np.stack([draft_uniforms(sampler, position, k) for _, position, _, sampler in sampled])
            temperatures = [sampler.params.temperature for *_, sampler in sampled]
            proposed = self.drafter.propose([rid for rid, *_ in sampled], k, with_distributions=True,
                                            uniforms=uniforms, temperatures=temperatures, worth_more=worth_more)
            for rid, _, limit, _ in sampled:
                chain = proposed[rid]
                chains[rid] = self._chain(rid, chain.proposal, limit, chain.distributions)
                drafted += len(chain.tokens)
        chains = {rid: chain for rid, chain in chains.items() if chain is not None}
        return chains, time.perf_counter() - began, drafted

    def _worth_more(self, row_seconds: float | None):
        """The drafter's test of a chain so far: drafting its next token costs a row one draft run's
        share (the drafter's seconds per run per row), and that token is kept only if all before
        it are (the calibrated probabilities' product), when it saves a row ``row_seconds`` of
        plain decoding. Where that bound is below the cost, no later token of the chain can pay
        either. None (draft on) in always mode, before a chain run was timed, or without
        ``row_seconds``."""
        cost = self.drafter.seconds_per_row_run
        if self.mode == SpeculationMode.always or cost is None or not row_seconds:
            return None
        floor = cost / row_seconds

        def worth_more(stated: Sequence[float]) -> bool:
            kept = self.model.probabilities(Source.draft_head, None, stated)[:len(stated)]
            return float(np.prod(kept)) >= floor
        return worth_more

    def _chain(self, rid: str, proposal: Proposal, limit: int, distributions: np.ndarray | None) -> Chain | None:
        self.proposals.chains[rid] = proposal
        draft = self.model.draft(rid, (), (Source.draft_head,), limit)
        if draft is None:
            return None
        return Chain(draft, distributions[:len(draft.tokens)] if distributions is not None else None)

    # -- the policy's SourceModel ------------------------------------------------------------------

    def verified(self, rid: str, draft, path: Accepted) -> None:
        self.model.verified(rid, draft, path)

    def close(self, rid: str, context: Sequence[int]) -> None:
        self.model.close(rid, context)
        self._unread.pop(rid, None)
        self.drafter.close(rid)

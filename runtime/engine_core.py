"""The engine core: schedule, run the engine it is given, sample, commit.

It knows requests only as the scheduler's ``Request`` plus their sampling state; text is the
output processor's (runtime/output_processor.py), which sees every committed token through
the ``on_token`` callback of ``step`` and may end a request there (a stop string). The thread,
inbox and readers are the engine loop's (runtime/engine_loop.py), its only caller."""
from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np

from ..contract.speculation import Source
from .core.engine import Engine, StepOutput
from .core.sampling import Sampler
from .core.scheduler import Draft, Phase, Request, Scheduler, TokenSink
from .core.step import CopySlot, Discard, KeepPath, KeepPathInBlocks, LoadBlock, Plan, SaveBlock, Step, StepKind
from .core.tree import Accepted
from .speculation.adaptive import Candidate
from .speculation.host import HostDraft
from .speculation.full_sampling import accept_sampled_full
from .speculation.medusa import accept_greedy, accept_sampled, candidates
from .speculation.speculation import Speculation
from .speculation.step_times import Context
from .structured import CompiledConstraint, GrammarMatcher, TreeWalk

log = logging.getLogger(__name__)


@dataclass
class RuntimeStats:
    steps: int = 0
    engine_s: float = 0.0       # inside Engine.step
    loop_s: float = 0.0         # whole core steps, engine and detokenization included
    prefill_steps: int = 0
    prefill_s: float = 0.0      # inside Engine.step for prefill chunks
    decode_steps: int = 0
    greedy_runs: int = 0        # multi-step runs (their steps count in decode_steps)


@dataclass
class Sampling:
    """A request's sampler and what sampling recorded: logprobs (cut to the request's tokens
    when it completes) and the step counts a completion reports."""
    sampler: Sampler
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[tuple[tuple[int, float], ...]] = field(default_factory=list)
    decode_steps: int = 0        # engine steps that produced tokens after the first
    accepted_tokens: int = 0     # draft tokens accepted (any source)
    matcher: GrammarMatcher | None = None  # a constrained request's grammar state
    sources: tuple[Source, ...] = ()       # the draft sources it speculates with (none: plain)


class EngineCore:
    """One step at a time: cache operations, one engine step (or a greedy run of ``multi_step``
    steps), sampling (Medusa acceptance and drafting included), commit."""

    def __init__(self, engine: Engine, scheduler: Scheduler, speculation: Speculation | None, multi_step: int):
        self.engine, self.scheduler, self.speculation = engine, scheduler, speculation
        self.multi_step = multi_step
        self.stats = RuntimeStats()
        self.sampling: dict[str, Sampling] = {}
        self.constrained: set[str] = set()  # rids with a matcher: none, and no step does mask work
        self._distributions: dict[str, np.ndarray] = {}  # rid → its draft-head chain's q [k, K], this drafting only

    def add(self, request: Request, constraint: CompiledConstraint | None = None) -> None:
        """``constraint``: the request's ``params.constraint`` compiled (runtime/structured/)."""
        if (constraint is None) != (request.params.constraint is None):
            raise ValueError(f"request {request.rid}: its constraint must come compiled, and only with params.constraint")
        sources = self.speculation.sources_of(request.params.speculation) if self.speculation is not None else ()
        self.scheduler.add(request)
        self.sampling[request.rid] = Sampling(Sampler(request.params), sources=sources,
                                              matcher=constraint.matcher() if constraint is not None else None)
        if constraint is not None:
            self.constrained.add(request.rid)

    def abort(self, rid: str) -> None:
        """Ends a request at the next step, which reports it finished ("abort"); unknown ids are ignored."""
        if rid in self.sampling:
            self.scheduler.finish(rid, "abort")

    def drop(self, rids: set[str]) -> None:
        """Ends these requests now and forgets them, wherever they are (waiting, running, finished
        in a step that then failed): a failure ended them, and no step will report them. Their
        slots free at the next schedule; unknown ids are ignored."""
        for rid in rids:
            request = self.scheduler.requests.get(rid)
            if request is not None:
                self.scheduler.finish(rid, "abort")
                del self.scheduler.requests[rid]
            if self.sampling.pop(rid, None) is not None and self.speculation is not None:
                self.speculation.policy.close(rid, request.tokens if request is not None else [])
            self.constrained.discard(rid)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self, on_token: TokenSink, interrupted: Callable[[], bool]) -> list[tuple[Request, Sampling]]:
        """One scheduler step; every committed token goes to ``on_token`` in order. Returns the
        requests that finished (and their sampling state), removed from the core.
        ``interrupted()``: whether a greedy run should end after its current step (a request
        is waiting for a free slot, or an abort)."""
        start = time.perf_counter()
        if self.constrained:
            on_token = self._grammar_sink(on_token)
        plan = self.scheduler.schedule()
        self._apply(plan)
        step, run, heads_at = plan.step, 0, {}
        if step is not None:
            limit, heads = self._decode_plan(step)
            run = self.scheduler.run_length(step, limit)
            if run > 1 and step.block_tables:  # the run's positions took blocks: the rows' tables now
                step = replace(step, block_tables=self.scheduler.tables(step.rids))
            if self.speculation is not None and step.kind == StepKind.decode and not heads:
                step = replace(step, draft_heads=False)  # nobody drafts from this step's heads
        if run > 1:
            done = self._greedy_run(step, run, on_token, interrupted)
            if self.speculation is not None:  # stepped aside: plain steps, in a run
                context = Context.of(step.starts)
                self.speculation.times.observe_run(len(step.rids), done, time.perf_counter() - start, context)
                self.speculation.policy.stood_aside(len(step.rids), done, context)
        elif step is not None:
            engine_start = time.perf_counter()
            out = self.engine.step(step)
            seconds = time.perf_counter() - engine_start
            self._count(step.kind, 1, seconds)
            heads_at, accepted = self._sample_and_commit(step, out, on_token)
            if self.speculation is not None and self.speculation.draft_head is not None:
                self._observe_step(step, out, accepted)
            if self.speculation is not None and step.kind == StepKind.decode:
                self.speculation.times.observe(len(step.rids), step.seq_len, seconds, time.perf_counter() - start,
                                               Context.of(step.starts))
        if self.speculation is not None:
            self.speculation.policy.stepped(time.perf_counter() - start)
            if self.speculation.draft_head is not None:
                self.speculation.draft_head.stepped(time.perf_counter() - start)
            self._draft(heads_at)
        finished = [(r, self.sampling.pop(r.rid)) for r in self.scheduler.pop_finished()]
        if self.speculation is not None:
            for request, _ in finished:
                self.speculation.policy.close(request.rid, request.tokens)
        if self.constrained:
            self.constrained.difference_update(r.rid for r, _ in finished)
        if not self.scheduler.has_work():
            self._apply(Plan(self.scheduler.flush(), None))
        self.stats.loop_s += time.perf_counter() - start
        return finished

    def _grammar_sink(self, on_token: TokenSink) -> TokenSink:
        """``on_token`` after advancing the request's grammar: a token that ends the grammar
        finishes the request ("stop") before the output processor sees it. A grammar that fails
        (llguidance's limits, met by a grammar that cannot end: its matcher refuses what comes
        next) ends it as "length", the text cut short, logged with llguidance's error: never as
        a successful stop, nor as "abort", which is a client's."""
        def sink(request: Request, token: int) -> bool:
            matcher = self.sampling[request.rid].matcher
            if matcher is not None:
                ended = matcher.advance(token)
                reason = "length" if matcher.failed else "stop" if ended else None
                if matcher.failed:
                    log.warning("request %s: its constraint failed after %d tokens, ended as length: %s",
                                request.rid, len(request.output), matcher.error)
                if reason is not None:
                    self.scheduler.end_at_token(request.rid, reason)
            return on_token(request, token)
        return sink

    def _decode_plan(self, step: Step) -> tuple[int, bool]:
        """(greedy runs up to how many steps, whether the step's Medusa heads are wanted): a
        single step whose heads draft the next tree where Medusa would verify one for this
        batch, else runs of ``multi_step``, whose steps (and a single one, where rows cannot run
        on) nobody drafts from."""
        if (self.speculation is not None and step.kind == StepKind.decode
                and self.speculation.verifies_medusa(
                    len(step.rids), [rid for rid in step.rids if Source.medusa in self.sampling[rid].sources],
                    Context.of(step.starts))):
            return 1, True
        return self.multi_step, False

    def _count(self, kind: StepKind, steps: int, seconds: float) -> None:
        self.stats.engine_s += seconds
        self.stats.steps += steps
        if kind == StepKind.prefill:
            self.stats.prefill_steps += steps
            self.stats.prefill_s += seconds
        else:
            self.stats.decode_steps += steps

    def _sample_and_commit(self, step: Step, out: StepOutput, on_token: TokenSink) -> tuple[dict, dict]:
        """Accepts each verifying row's path, samples every row's next token and commits. Returns
        the Medusa heads' logits [K, V] at each row's newest token, by rid, for drafting, and the
        verifying rows' accepted paths."""
        sampled: dict[str, int] = {}
        accepted: dict[str, Accepted] = {}
        heads_at: dict[str, object] = {}  # rid → medusa logits [K, V] at its newest token
        spec = self.speculation
        if spec is not None and step.kind == StepKind.decode:
            spec.policy.count_step(len(step.rids), step.verifies, step.seq_len)
        # Plain rows read logits row 0: those that take its argmax share one over the batch.
        plain, argmax = not step.trees and out.logits.shape[1] == 1, None
        for row, (rid, samples, tree) in enumerate(zip(step.rids, step.samples, step.row_trees)):
            if not samples:
                continue
            state = self.sampling[rid]
            sampler, params = state.sampler, state.sampler.params
            node, walk, residual = 0, None, None
            position = len(self.scheduler.requests[rid].output)  # of the first token this row decides
            if tree is not None:
                draft = self.scheduler.requests[rid].draft
                tokens, logits = list(step.tokens[row]), out.logits[row, :tree.size]
                # A constrained row walks masked rows; the grammar follows its path (then rolls back).
                walk = TreeWalk(state.matcher, tree, tokens, logits) if state.matcher is not None else logits
                if params.greedy:
                    path = accept_greedy(tree, tokens, walk)
                elif draft.distributions is not None:  # a chain drawn from the draft head's q: the full rule
                    full = accept_sampled_full(tokens[1:], draft.distributions, logits, sampler, position,
                                               q_ids=spec.draft_head.drafter.draft_to_target)
                    path = Accepted(tuple(range(1, len(full.tokens) + 1)), full.tokens)
                    residual = full.next_token  # drawn at the chain's end, or from the residual at a rejection
                else:  # any source: exact speculative sampling, from the seeded per-position draws
                    path = accept_sampled(tree, tokens, walk, sampler, position)
                # A draft may run past the grammar's end (or into a token it refuses): cut there.
                keep = walk.kept(path.nodes) if state.matcher is not None else len(path.nodes)
                if keep < len(path.nodes):
                    path = Accepted(path.nodes[:keep], path.tokens[:keep])
                accepted[rid], node = path, path.last_node
                position += len(path.nodes)  # the sampled token follows the accepted ones
                spec.policy.record(rid, draft, path)
                if params.logprobs:
                    state.logprobs += [sampler.logprob(logits[tree.parents[n]], tokens[n]) for n in path.nodes]
                if params.logprobs and params.top_logprobs:
                    state.top_logprobs += [sampler.alternatives(logits[tree.parents[n]], params.top_logprobs)
                                           for n in path.nodes]
            if step.kind == StepKind.decode:
                state.decode_steps += 1
            if plain and sampler.takes_argmax:
                if argmax is None:
                    argmax = out.logits[:, 0].argmax(-1).tolist()  # [B]
                token, logprob = argmax[row], None
            elif residual is not None:
                token = residual
                logprob = sampler.logprob(out.logits[row, node], token) if params.logprobs else None
            elif state.matcher is not None:  # the masked row; logprobs stay the model's
                masked = walk.finish(path.nodes) if tree is not None else state.matcher.masked(out.logits[row, node])
                token = sampler.sample(masked, position)[0]
                logprob = sampler.logprob(out.logits[row, node], token) if params.logprobs else None
            else:
                token, logprob = sampler.sample(out.logits[row, node], position)
            if logprob is not None:
                state.logprobs.append(logprob)
                if params.top_logprobs:
                    state.top_logprobs.append(sampler.alternatives(out.logits[row, node], params.top_logprobs))
            sampled[rid] = token
            if out.medusa is not None:
                # The heads ran at the unmasked greedy path's end only: a sampled row whose acceptance
                # ended elsewhere, or a constrained row whose masked path did, drafts nothing from
                # them this step. A row without a tree ends at node 0.
                unmasked_greedy = tree is None or (params.greedy and state.matcher is None)
                if tree is None or node == (node if unmasked_greedy else accept_greedy(tree, tokens, logits).last_node):
                    heads_at[rid] = out.medusa[row, 0]
        emitted = self.scheduler.commit(step, sampled, accepted, on_token)
        if accepted:  # only the guesses committed: a row that ended on a path's token (eos, a stop string) took no more
            per_row = Counter(request.rid for request, _ in emitted)
            for rid, path in accepted.items():
                self.sampling[rid].accepted_tokens += min(len(path.nodes), per_row[rid])
        return heads_at, accepted

    def _draft_head_rows(self, rids) -> list[int]:
        """Rows of ``rids`` whose requests speculate with the draft head (it must see their steps)."""
        return [row for row, rid in enumerate(rids)
                if rid in self.sampling and Source.draft_head in self.sampling[rid].sources]

    def _observe_step(self, step: Step, out: StepOutput, accepted: dict[str, Accepted]) -> None:
        """The draft head sees the positions this step committed: each row's tokens, or a
        verification's root and accepted nodes, with their features."""
        rows = self._draft_head_rows(step.rids)
        if not rows or out.draft_features is None:
            return

        def committed(b: int) -> tuple[int, ...]:  # the step's token indices now in the row's cache
            if step.row_trees[b] is None:
                return tuple(range(len(step.tokens[b])))
            path = accepted.get(step.rids[b])
            return (0, *(path.nodes if path is not None else ()))

        self._observe(step, rows, [committed(b) for b in rows], out.draft_features[rows])

    def _observe(self, step: Step, rows: list[int], nodes: list[tuple[int, ...]], features: np.ndarray) -> None:
        """Hands the draft head ``step``'s ``rows``: the token indices ``nodes`` each committed and
        their ``features`` [B', S, H], with the requests' tokens after the commit."""
        requests = self.scheduler.requests
        rids = [step.rids[b] for b in rows]
        self.speculation.draft_head.observe_step(rids, [step.starts[b] for b in rows], nodes, features,
                                                 [requests[rid].context if rid in requests else () for rid in rids])

    def _greedy_run(self, step: Step, steps: int, on_token: TokenSink, interrupted: Callable[[], bool]) -> int:
        """Up to ``steps`` decode steps back to back (scheduler.run_length), each row fed its own
        argmax; ends early after a step where a row may have stopped (a stop or eos id), or when
        ``interrupted()``. Then commits the tokens, one at a time through ``on_token``. Returns
        the steps run."""
        engine_start = time.perf_counter()
        run = self.engine.greedy_run(step)
        stops = self.scheduler.stop_ids(step)
        produced: list[list[int]] = []  # [n][B]
        rows = (self._draft_head_rows(step.rids)
                if self.speculation is not None and self.speculation.draft_head is not None else [])
        features: list[np.ndarray] = []  # [n] of [B', 1, H]: each step's, the draft head's rows
        for _ in range(steps):
            tokens = run.advance()
            produced.append(tokens)
            if rows and run.features is not None:
                features.append(run.features[rows])  # a copy: the run reuses its buffer
            if (stops and not stops.isdisjoint(tokens)) or interrupted():
                break
        self._count(StepKind.decode, len(produced), time.perf_counter() - engine_start)
        self.stats.greedy_runs += 1
        taken = {rid: len(self.scheduler.requests[rid].output) for rid in step.rids}
        self.scheduler.commit_run(step, produced, on_token)
        for rid in step.rids:  # a row that ended took fewer of the run's tokens
            self.sampling[rid].decode_steps += len(self.scheduler.requests[rid].output) - taken[rid]
        if features and len(features) == len(produced):
            ran = [len(self.scheduler.requests[step.rids[b]].output) - taken[step.rids[b]] for b in rows]
            self._observe(step, rows, [tuple(range(n)) for n in ran], np.concatenate(features, axis=1))  # [B', n, H]
        return len(produced)

    def _draft(self, heads_at: dict) -> None:
        """Next step's drafts for the decoding requests that have none pending: each source's
        candidate per row (Medusa's tree, from the heads at the row's newest token; the host
        sources' chain), then the policy's decision (runtime/speculation/adaptive.py): which rows
        verify which source's draft and how much of it, none where speculating would not beat
        plain decoding."""
        spec = self.speculation
        policy, host = spec.policy, spec.host
        if not heads_at and host is None and spec.draft_head is None:  # Medusa alone drafts only from heads just computed
            return
        decoding = [self.scheduler.requests[rid] for rid in self.scheduler.slots.decoding()]
        rids = [r.rid for r in decoding if r.phase == Phase.decoding]
        host_due = policy.due(rids)  # False: drafting is backing off (nothing it drafted paid of late)
        if host is not None and not host_due:
            host = None
        if not heads_at and host is None and not (spec.draft_head is not None and host_due):
            return
        medusa = spec.medusa.candidate() if heads_at and spec.medusa is not None else None
        offers: dict[str, list[Candidate]] = {}   # rid → its candidates, one per source
        chains: dict[tuple[str, Source], HostDraft] = {}   # (rid, source) → its chain
        host_start = time.perf_counter()
        for request in decoding:
            if request.phase != Phase.decoding or request.draft is not None:
                continue
            sources, rid = self.sampling[request.rid].sources, request.rid
            row = offers.setdefault(rid, [])
            if medusa is not None and rid in heads_at and Source.medusa in sources:
                row.append(medusa)
            if host is not None:
                left = request.params.max_tokens - len(request.output) - 1  # the step samples one more
                chain = host.draft(rid, request.context, sources, left) if left > 0 else None
                if chain is not None:
                    chains[rid, chain.source] = chain
                    row.append(Candidate(chain.source, chain.expected))
        head_due = spec.draft_head is not None and host_due and spec.draft_head.due()
        context = Context.of([r.computed for r in decoding])
        head_seconds, head_rows = self._draft_head_offers(decoding, context, offers, chains) if head_due else (0.0, 0)
        decision = policy.choose(len(decoding), offers, context)
        if host is not None or head_rows:  # something drafted (a call that drafted nothing is no miss)
            # (Medusa's share of the loop above is small: its trees come from heads already computed.)
            policy.drafted(rids, time.perf_counter() - host_start,
                           verifies=any(source != Source.medusa for source in decision.sources()), priced=head_seconds)
        if head_rows:  # a call with no row to draft for (none in sync, a prompt prefilling) drafted nothing
            spec.draft_head.decided(head_seconds, Source.draft_head in decision.sources())
        for rid, (source, k) in decision.picks.items():
            request = self.scheduler.requests[rid]
            if source == Source.medusa:
                tree = spec.medusa.prefix(k)
                request.draft = Draft(tree, tuple(candidates(tree, request.last_token, heads_at[rid])[1:]), source)
            else:
                chain = chains[rid, source]
                q = self._distributions.get(rid) if source == Source.draft_head else None
                request.draft = Draft(chain.tree(k), chain.tokens[:k], chain.source, chain.stated[:k],
                                      q[:k] if q is not None else None)
        self._distributions = {}

    def _draft_head_offers(self, decoding: list[Request], context: Context, offers: dict,
                           chains: dict) -> tuple[float, int]:
        """The draft head's chain for each decoding row that speculates with it and that it has seen
        up to the row's root, as one more candidate of the row; its drafting measured for the policy.
        Returns the drafter's seconds and the rows it drafted for."""
        spec, rows = self.speculation, []
        for request in decoding:
            state = self.sampling[request.rid]
            if (request.phase != Phase.decoding or request.draft is not None or Source.draft_head not in state.sources
                    or not spec.draft_head.in_sync(request.rid, request.computed)):
                continue
            left = request.params.max_tokens - len(request.output) - 1  # the step samples one more
            if left <= 0:
                continue
            params = state.sampler.params
            # Unseeded, unconstrained sampling verifies by the full-distribution rule: drafted from q.
            full = not params.greedy and params.seed is None and state.matcher is None
            rows.append((request.rid, len(request.output), left, state.sampler if full else None))
        row_seconds = (spec.policy.times.plain_estimate(len(decoding), context) / len(decoding)
                       if decoding and spec.policy.times.table else None)
        drafted, seconds, tokens = spec.draft_head.draft(rows, row_seconds)
        spec.policy.measured(Source.draft_head, tokens, seconds)
        for rid, chain in drafted.items():
            chains[rid, Source.draft_head] = chain.draft
            offers.setdefault(rid, []).append(Candidate(Source.draft_head, chain.draft.expected,
                                                        drafted=chain.draft.drafted))
            if chain.distributions is not None:
                self._distributions[rid] = chain.distributions
        return seconds, len(rows)

    def _apply(self, plan: Plan) -> None:
        for op in plan.ops:
            if isinstance(op, CopySlot):
                if op.length:
                    self.engine.copy_slot(op.src, op.dst, op.length)
            elif isinstance(op, SaveBlock):
                self.engine.save_block(op.slot, op.index, op.block)
            elif isinstance(op, LoadBlock):
                self.engine.load_block(op.block, op.slot, op.index)
            elif isinstance(op, KeepPath):
                self.engine.keep_path(op.slot, op.start, op.nodes)
            elif isinstance(op, Discard):
                self.engine.discard(op.slots, op.blocks)
            elif isinstance(op, KeepPathInBlocks):  # a paged engine's (the scheduler is paged only for one)
                self.engine.keep_path_in_blocks(op.blocks, op.start, op.nodes)


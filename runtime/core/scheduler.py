"""In-flight batching scheduler: plain Python, no engine, testable with exact asserts.

Every call to ``schedule()`` returns one engine ``Step`` (a prefill chunk or a decode of
every decoding request) plus the cache operations to apply first (slot moves, prefix-block
saves and loads, memory to return). ``commit()`` takes the step's sampled tokens and advances
requests. Prefill and decode steps alternate while both have work, so new prompts start soon
and running ones keep flowing.

Memory is a budget of KV blocks (runtime/core/kv_manager.py): a waiting request is admitted
FCFS when a slot is free and blocks for its first chunk are; rows take blocks as they grow
(every position a step writes, padding and draft nodes included). When a decode or prefill step
finds the budget exhausted, the most recently arrived running request is preempted: its slot
and blocks are freed and it goes back to the front of the queue; resumed, it recomputes its
prompt and output so far (a prefill of tokens[:-1] that samples nothing) and decodes on from its
last token, so its greedy tokens are those of an uninterrupted run. Priority is arrival order,
kept across preemptions: a request is only preempted for older ones, which finish, so none is
preempted forever; and one request alone always fits (``add`` refuses those that cannot).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable, Sequence

from ...contract.kv_budget import DEFAULT_BLOCK_SIZE
from ...contract.speculation import Source
from .tree import Accepted, Tree
from .kv_manager import KVManager, blocks_for
from .sampling import SamplingParams
from .slots import Move, SlotTable
from .step import CacheOp, CopySlot, Discard, KeepPath, KeepPathInBlocks, LoadBlock, Plan, SaveBlock, Step, StepKind

NOTHING_ACCEPTED = Accepted((), ())  # a plain row's "path": no guesses

# Sees each token right after it is appended; True: a stop string completed (the request ends).
TokenSink = Callable[["Request", int], bool]


class Phase(Enum):
    waiting = "waiting"
    prefilling = "prefilling"
    decoding = "decoding"
    finished = "finished"


class Batching(Enum):
    inflight = "inflight"
    static = "static"   # a new wave starts only when the whole previous wave has finished


@dataclass
class Request:
    rid: str
    prompt: list[int]
    params: SamplingParams
    output: list[int] = field(default_factory=list)
    computed: int = 0                 # tokens whose K/V are in the slot
    written: int = 0                  # slot positions [0, written) hold K/V, rejected tree nodes included
    phase: Phase = Phase.waiting
    finish_reason: str | None = None
    cached_tokens: int = 0            # prompt tokens loaded from the prefix cache
    draft: "Draft | None" = None      # guesses to verify at the next decode step
    arrival: int = -1                 # the scheduler's admission priority: lower runs first
    preemptions: int = 0

    @property
    def prefill_len(self) -> int:
        """Tokens to compute before decoding: the prompt, or (resumed after a preemption) the
        prompt and output but the last token, which the first decode step feeds."""
        return len(self.prompt) + max(len(self.output) - 1, 0)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def context(self) -> "TokenView":
        """``tokens`` without copying them: what a host draft source reads after every step (its
        length and the new tail), where ``tokens`` would copy a long prompt for every row each time."""
        return TokenView(self.prompt, self.output)

    @property
    def last_token(self) -> int:
        """``tokens[-1]`` without building ``tokens`` (a decode step needs only this, every step)."""
        return self.output[-1] if self.output else self.prompt[-1]


class TokenView(Sequence[int]):
    """prompt + output, read in place (int or step-1 slice indices)."""
    __slots__ = ("prompt", "output")

    def __init__(self, prompt: list[int], output: list[int]):
        self.prompt, self.output = prompt, output

    def __len__(self) -> int:
        return len(self.prompt) + len(self.output)

    def __getitem__(self, index):
        n = len(self.prompt)
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                return [self[i] for i in range(start, stop, step)]
            return self.prompt[start:min(stop, n)] + self.output[max(start - n, 0):max(stop - n, 0)]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(index)
        return self.prompt[index] if index < n else self.output[index - n]


@dataclass(frozen=True)
class Draft:
    """A tree of guessed tokens following the request's last token (``tokens[i]`` is node i + 1),
    and the draft source that guessed them (a Medusa tree, or a host source's chain)."""
    tree: Tree
    tokens: tuple[int, ...]
    source: Source = Source.medusa
    probabilities: tuple[float, ...] = ()  # a host draft's (chain or tree): its source's stated P(kept) per token
    # A draft-head chain drawn from its distributions q [k, K] (the draft's ids): verified by the
    # full-distribution rule (runtime/speculation/full_sampling.py); None: the point-mass rule.
    distributions: object = None


class Scheduler:
    def __init__(self, capacity: int, max_seq_len: int, max_chunk: int, token_budget: int | None = None,
                 kv: KVManager | None = None, eos_token_ids: tuple[int, ...] = (),
                 batching: Batching = Batching.inflight, paged: bool = False):
        """``kv``: the block budget (None: enough for every slot to reach max_seq_len, in blocks
        of the default size, without a prefix cache). ``paged``: the engine keeps K/V in a pool of
        the budget's blocks (the paged TensorRT engine; ``kv`` must share blocks by reference):
        steps carry each row's block ids, prefix hits and saves move nothing (the blocks are
        shared), and neither do rows moving between slots (a row's K/V stays in its blocks)."""
        self.slots = SlotTable(capacity)
        self.max_seq_len, self.max_chunk = max_seq_len, max_chunk
        self.token_budget = token_budget or max_chunk
        self.kv = kv if kv is not None else KVManager(capacity * blocks_for(max_seq_len, DEFAULT_BLOCK_SIZE),
                                                    DEFAULT_BLOCK_SIZE, prefix_caching=False)
        self.eos_token_ids = tuple(eos_token_ids)
        self.batching = batching
        if paged and not self.kv.shared:
            raise ValueError("a paged engine's scheduler needs a KV manager that shares blocks (shared=True)")
        self.paged = paged
        self.waiting: deque[Request] = deque()
        self.requests: dict[str, Request] = {}
        self._pending: list[CacheOp | Move] = []  # Moves become CopySlots when handed out
        self._last_kind: StepKind | None = None
        self._arrivals = 0
        self._touched = 0              # slots [0, _touched) may hold K/V since the last Discard
        self._scratch_touched = False

    # -- requests ---------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        """Queues a request; refuses one that can never run, touching nothing else."""
        if request.rid in self.requests:
            raise ValueError(f"request id {request.rid!r} is already in use")
        if not request.prompt:
            raise ValueError(f"request {request.rid}: empty prompt")
        need = len(request.prompt) + request.params.max_tokens
        if need > self.max_seq_len:
            raise ValueError(f"request {request.rid}: prompt of {len(request.prompt)} tokens + max_tokens "
                             f"{request.params.max_tokens} = {need} exceeds the engine's max_seq_len "
                             f"{self.max_seq_len}")
        blocks = blocks_for(need, self.kv.block_size)
        if blocks > self.kv.num_blocks and not self.kv.rows_reserved:
            raise ValueError(f"request {request.rid}: prompt of {len(request.prompt)} tokens + max_tokens "
                             f"{request.params.max_tokens} = {need} needs {blocks} KV blocks of "
                             f"{self.kv.block_size} tokens; the KV budget (kv_cache_memory) holds "
                             f"{self.kv.num_blocks}")
        request.arrival, self._arrivals = self._arrivals, self._arrivals + 1
        self.requests[request.rid] = request
        self.waiting.append(request)

    def finish(self, rid: str, reason: str) -> None:
        """Ends a request now (stop string, abort); frees its slot at the next schedule."""
        request = self.requests[rid]
        if request.phase == Phase.finished:
            return
        if request.phase == Phase.waiting:
            self.waiting.remove(request)
        else:
            self._moved(self.slots.release(rid))
            self.kv.release(rid)
        request.phase, request.finish_reason = Phase.finished, reason

    def has_work(self) -> bool:
        return bool(self.waiting) or self.slots.num_active > 0

    def pop_finished(self) -> list[Request]:
        done = [r for r in self.requests.values() if r.phase == Phase.finished]
        for r in done:
            del self.requests[r.rid]
        return done

    # -- scheduling ---------------------------------------------------------------------------
    def schedule(self) -> Plan:
        self._discard()       # slots freed since: before admissions load blocks into them
        self._admit()
        step = self._next_step()
        self._discard()       # slots of requests preempted for this step
        return Plan(ops=self._take_pending(), step=step)

    def flush(self) -> list[CacheOp]:
        """With nothing left to run: the pending cache operations (the last requests' slots to
        discard), so an idle engine holds no row's pages."""
        self._discard()
        return self._take_pending()

    def _moved(self, moves: list[Move]) -> None:
        """Rows moved between slots: their K/V moves too, unless it lives in blocks (paged)."""
        if not self.paged:
            self._pending += moves

    def tables(self, rids) -> tuple[tuple[int, ...], ...]:
        """Each row's block ids now, for a paged engine's step (empty otherwise)."""
        return tuple(tuple(self.kv.row(rid)) for rid in rids) if self.paged else ()

    def _take_pending(self) -> list[CacheOp]:
        ops, self._pending = [self._copy(op) if isinstance(op, Move) else op for op in self._pending], []
        return ops

    def _next_step(self) -> Step | None:
        decode_first = self.slots.num_decoding and (not self.slots.prefilling()
                                                     or self._last_kind == StepKind.prefill)  # alternate
        order = (self._decode_step, self._prefill_step) if decode_first else (self._prefill_step, self._decode_step)
        step = order[0]() or order[1]()
        self._last_kind = step.kind if step else None
        return step

    def _copy(self, move: Move) -> CopySlot:
        """Resolved when handed out, after every commit: the owner's filled length then (0 if it
        has finished or been preempted since, when its K/V is no longer needed)."""
        owner = self.requests.get(move.owner)
        # A verification wrote the whole tree; a pending KeepPath still reads nodes past `computed`.
        length = max(owner.computed, owner.written) if owner is not None and owner.phase != Phase.finished else 0
        return CopySlot(move.src, move.dst, length)

    def _discard(self) -> None:
        """Tells the engine which slots and store blocks hold nothing now (freed slots past the
        active ones, the scratch slot after a swap, evicted cached blocks), so the host pools
        return their pages. A paged engine's pool is the budget: nothing to return."""
        if self.paged:
            self.kv.take_dropped()
            return
        slots = tuple(range(self.slots.num_active, self._touched))
        if self._scratch_touched:
            slots += (self.slots.scratch,)
        blocks = tuple(self.kv.take_dropped())
        if slots or blocks:
            self._pending.append(Discard(slots, blocks))
        self._touched, self._scratch_touched = self.slots.num_active, False

    def _admit(self) -> None:
        if self.batching == Batching.static and self.slots.num_active:
            return
        while self.waiting and self.slots.free:
            request = self.waiting[0]
            hit = self.kv.match(request.prompt)
            computed = len(hit) * self.kv.block_size
            first_chunk = min(request.prefill_len - computed, self.max_chunk, self.token_budget)
            if not self.kv.fits(request.rid, hit, computed + first_chunk):
                break  # FCFS: nobody overtakes the request at the front
            self.waiting.popleft()
            slot = self.slots.admit(request.rid)
            self._touched = max(self._touched, self.slots.num_active)
            request.phase = Phase.prefilling
            self.kv.hit(request.rid, request.prompt, hit)
            if not self.paged:
                self._pending += [LoadBlock(block, slot, index) for index, block in enumerate(hit)]
            # Free and unused blocks sufficed before the hit took its own; the row may evict those
            # (loaded already: the eviction's Discard comes after the LoadBlocks). Shared, the hit's
            # blocks are the row's own first ones.
            self.kv.grow(request.rid, computed + first_chunk)
            request.computed = computed
            if not request.preemptions:
                request.cached_tokens = computed

    def _running_newest_first(self) -> list[Request]:
        return sorted((self.requests[rid] for rid in self.slots.decoding() + self.slots.prefilling()),
                      key=lambda r: r.arrival, reverse=True)

    def _preempt(self, request: Request) -> None:
        """Frees ``request``'s slot and blocks and queues it first; it recomputes when resumed."""
        self._moved(self.slots.release(request.rid))
        self.kv.release(request.rid)
        request.phase, request.computed, request.written, request.draft = Phase.waiting, 0, 0, None
        request.preemptions += 1
        self.kv.stats.preemptions += 1
        self.waiting.appendleft(request)

    def _chunk(self, request: Request) -> int:
        return min(request.prefill_len - request.computed, self.max_chunk)

    def _prefill_step(self) -> Step | None:
        prefilling = self.slots.prefilling()
        if not prefilling:
            return None
        first = self.requests[prefilling[0]]
        want = min(self._chunk(first), self.token_budget, self.max_seq_len - first.computed)
        if not self.kv.grow(first.rid, first.computed + want):
            # Short of blocks: preempt newer requests, newest first, or take what fits.
            newer = [r for r in self._running_newest_first() if r.arrival > first.arrival]
            room = self.kv.reclaimable(evict_used=True) + sum(self.kv.freed_by_release(r.rid) for r in newer)
            want = min(want, (len(self.kv.row(first.rid)) + room) * self.kv.block_size - first.computed)
            if want <= 0:
                return None
            for victim in newer:
                if self.kv.grow(first.rid, first.computed + want):
                    break
                self._preempt(victim)
            if not self.kv.grow(first.rid, first.computed + want):
                return None
        prefilling = self.slots.prefilling()  # preemptions may have moved rows
        rows, seq, budget = [(first, want)], want, self.token_budget - want
        for rid in prefilling[prefilling.index(first.rid) + 1:]:
            request = self.requests[rid]
            take = min(self._chunk(request), budget)
            # Rows are padded to the step's longest chunk: every padded write stays in the cache,
            # in blocks the row holds (taken without evicting cached prompts others use).
            padded = max(seq, take)
            candidates = rows + [(request, take)]
            if take <= 0 or any(r.computed + padded > self.max_seq_len for r, _ in candidates):
                break
            if sum(self.kv.missing(r.rid, r.computed + padded) for r, _ in candidates) > self.kv.reclaimable(False):
                break
            for r, _ in candidates:
                self.kv.grow(r.rid, r.computed + padded, evict_used=False)
            rows.append((request, take))
            seq, budget = padded, budget - take
        return Step(kind=StepKind.prefill, first_slot=self.slots.slot_of(first.rid),
                    rids=tuple(r.rid for r, _ in rows),
                    tokens=tuple(tuple(r.context[r.computed:r.computed + take]) for r, take in rows),
                    starts=tuple(r.computed for r, _ in rows),
                    samples=tuple(r.computed + take == r.prefill_len and not r.output for r, take in rows),
                    block_tables=self.tables(r.rid for r, _ in rows))

    def _decode_step(self) -> Step | None:
        # One position a row, oldest first; short of blocks, the newest running request is
        # preempted (the row itself, when it is the newest).
        for request in sorted((self.requests[rid] for rid in self.slots.decoding()), key=lambda r: r.arrival):
            while request.phase == Phase.decoding and not self.kv.grow(request.rid, request.computed + 1):
                self._preempt(self._running_newest_first()[0])
        rids = self.slots.decoding()
        if not rids:
            return None
        requests = [self.requests[rid] for rid in rids]
        drafts = [r.draft for r in requests]
        seq = 1 + max((len(d.tokens) for d in drafts if d is not None), default=0)
        # Every row writes S positions (padding included): near max_seq_len, or where the blocks
        # for them are not free, plain steps (a guess never preempts anyone).
        if seq > 1 and (any(r.computed + seq > self.max_seq_len for r in requests)
                        or sum(self.kv.missing(r.rid, r.computed + seq) for r in requests) > self.kv.reclaimable(False)):
            drafts = [None] * len(requests)
        elif seq > 1:
            for r in requests:
                self.kv.grow(r.rid, r.computed + seq, evict_used=False)
        trees = tuple(d.tree if d is not None else None for d in drafts)
        return Step(kind=StepKind.decode, first_slot=0, rids=tuple(rids),
                    tokens=tuple((r.last_token, *(d.tokens if d is not None else ())) for r, d in zip(requests, drafts)),
                    starts=tuple(r.computed for r in requests), samples=(True,) * len(rids),
                    trees=trees if any(t is not None for t in trees) else (), block_tables=self.tables(rids))

    # -- results ------------------------------------------------------------------------------
    def commit(self, step: Step, sampled: dict[str, int], accepted: dict[str, Accepted] | None = None,
               on_token: TokenSink | None = None) -> list[tuple[Request, int]]:
        """Advances the step's requests; ``sampled`` maps request id → new token for rows that sample,
        ``accepted`` a verifying row's accepted guesses (which come before its sampled token).
        Each token is appended and handed to ``on_token`` (see ``append``) before the next: a
        row that ends at a path's token (eos, a stop id or string, max_tokens) takes no more.

        Returns (request, token) for every new token, in row order.
        """
        emitted = []
        for row, (rid, tokens, does_sample, tree) in enumerate(zip(step.rids, step.tokens, step.samples,
                                                                   step.row_trees)):
            request = self.requests[rid]
            request.draft = None
            request.written = max(request.written, step.starts[row] + len(tokens))
            path = (accepted.get(rid) if accepted and tree is not None else None) or NOTHING_ACCEPTED
            # The root and the accepted nodes are now cached; rejected nodes are garbage past kv_length.
            request.computed += len(tokens) if tree is None else 1 + len(path.nodes)
            if step.kind == StepKind.prefill and request.computed == request.prefill_len:
                moves = self.slots.promote(rid)
                self._moved(moves)
                self._scratch_touched |= bool(moves) and not self.paged
                request.phase = Phase.decoding
                self._save_prompt_blocks(request)
            if not does_sample:
                continue
            for token in (*path.tokens, sampled[rid]):
                emitted.append((request, token))
                if self.append(request, token, on_token):
                    break
            else:
                if path.nodes and path.nodes != tuple(range(1, len(path.nodes) + 1)):
                    if self.paged:
                        self._pending.append(KeepPathInBlocks(tuple(self.kv.row(rid)), step.starts[row], path.nodes))
                    else:  # slot_of, not the step's row: a release earlier in this loop may have moved it.
                        self._pending.append(KeepPath(self.slots.slot_of(rid), step.starts[row], path.nodes))
        return emitted

    def run_length(self, step: Step, limit: int) -> int:
        """How many plain decode steps ``step`` may run back to back, each row fed the argmax of
        its previous step (multi-step decoding): up to ``limit`` and no row past max_tokens; 1
        where a row samples, wants logprobs or verifies a tree, or a prompt is prefilling (its
        chunks alternate with decode steps), and no row past the KV blocks it can hold."""
        if limit <= 1 or step.kind != StepKind.decode or step.trees or self.slots.prefilling():
            return 1
        steps = limit
        for rid in step.rids:
            request = self.requests[rid]
            if not request.params.takes_argmax:
                return 1
            steps = min(steps, request.params.max_tokens - len(request.output))
        # Each step of the run writes one more position a row: as many as free blocks allow
        # (the first one's the step holds already).
        for rid, start in zip(step.rids, step.starts):
            if steps > 1 and not self.kv.grow(rid, start + steps, evict_used=False):
                steps = min(steps, self.kv.held_positions(rid) - start)
        return max(steps, 1)

    def commit_run(self, step: Step, tokens: list[list[int]], on_token: TokenSink | None = None) -> None:
        """Advances ``step``'s requests by a run of n = len(tokens) plain decode steps:
        ``tokens[i][row]`` is what step i produced for the row and fed step i + 1, so the row's
        last token and n - 1 new ones are now cached. Tokens are appended one at a time (see
        ``append``); a row that ends takes no token after that, and what later steps wrote past
        its end is garbage past its length."""
        steps = len(tokens)
        for row, rid in enumerate(step.rids):
            request = self.requests[rid]
            request.computed += steps
            request.written = max(request.written, step.starts[row] + steps)
            for produced in tokens:
                if self.append(request, produced[row], on_token):
                    break

    def append(self, request: Request, token: int, on_token: TokenSink | None) -> bool:
        """Appends one new token; True if the request ended with it. Token-level endings (eos, a
        stop id, max_tokens) are decided first, then ``on_token(request, token)`` sees the token
        (the output processor detokenizes it) and returns True when a stop string completed,
        which ends the request there with reason "stop"."""
        request.output.append(token)
        reason = self._finish_reason(request, token)
        if reason:
            self.finish(request.rid, reason)
        if on_token is not None and on_token(request, token):
            self.end_at_token(request.rid, "stop")  # a stop string at the last allowed token is still a stop
        return request.phase == Phase.finished

    def end_at_token(self, rid: str, reason: str) -> None:
        """Ends a request at the token just appended with ``reason``, which overrides a token-level
        ending of that same token ("length" at max_tokens): what the text or grammar saw decides."""
        self.finish(rid, reason)
        self.requests[rid].finish_reason = reason

    def _save_prompt_blocks(self, request: Request) -> None:
        saved = self.kv.save(request.rid, request.prompt)
        if self.paged:
            return  # shared: cached where they are, nothing to copy or discard
        dropped = self.kv.take_dropped()  # evicted for these saves: discarded before they are written
        if dropped:
            self._pending.append(Discard((), tuple(dropped)))
        slot = self.slots.slot_of(request.rid)
        self._pending += [SaveBlock(slot, index, block) for index, block in saved]

    def stop_ids(self, step: Step) -> set[int]:
        """The ids that end any of the step's rows (``_finish_reason``'s "stop"): eos unless
        ignored, stop ids."""
        ids: set[int] = set()
        for rid in step.rids:
            params = self.requests[rid].params
            ids.update(params.stop_token_ids)
            if not params.ignore_eos:
                ids.update(self.eos_token_ids)
        return ids

    def _finish_reason(self, request: Request, token: int) -> str | None:
        params = request.params
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
            return "stop"
        if len(request.output) >= params.max_tokens:
            return "length"
        return None

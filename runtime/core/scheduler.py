"""In-flight batching scheduler: plain Python, no engine, testable with exact asserts.

Every call to ``schedule()`` returns one engine ``Step`` (a prefill chunk or a decode of
every decoding request) plus the cache operations to apply first (slot moves, prefix-block
saves and loads). ``commit()`` takes the step's sampled tokens and advances requests.
Waiting requests are admitted FCFS whenever a slot is free; prefill and decode steps
alternate while both have work, so new prompts start soon and running ones keep flowing.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable, Sequence

from ...contract.speculation import Source
from ..speculation.medusa import Accepted, Tree
from .prefix_cache import PrefixCache
from .sampling import SamplingParams
from .slots import Move, SlotTable
from .step import CacheOp, CopySlot, KeepPath, LoadBlock, Plan, SaveBlock, Step, StepKind

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
    probabilities: tuple[float, ...] = ()  # a host chain's: its source's stated P(kept) per token


class Scheduler:
    def __init__(self, capacity: int, max_seq_len: int, max_chunk: int, token_budget: int | None = None,
                 prefix_cache: PrefixCache | None = None, eos_token_ids: tuple[int, ...] = (),
                 batching: Batching = Batching.inflight):
        self.slots = SlotTable(capacity)
        self.max_seq_len, self.max_chunk = max_seq_len, max_chunk
        self.token_budget = token_budget or max_chunk
        self.prefix_cache = prefix_cache
        self.eos_token_ids = tuple(eos_token_ids)
        self.batching = batching
        self.waiting: deque[Request] = deque()
        self.requests: dict[str, Request] = {}
        self._pending: list[CacheOp | Move] = []  # Moves become CopySlots when handed out
        self._last_kind: StepKind | None = None

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
            self._pending += self.slots.release(rid)
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
        self._admit()
        ops, self._pending = [self._copy(op) if isinstance(op, Move) else op for op in self._pending], []
        prefill = self._prefill_step()
        decode = self._decode_step()
        step = prefill or decode
        if prefill and decode and self._last_kind == StepKind.prefill:
            step = decode  # alternate while both have work
        self._last_kind = step.kind if step else None
        return Plan(ops=ops, step=step)

    def _copy(self, move: Move) -> CopySlot:
        """Resolved when handed out, after every commit: the owner's filled length then (0 if it
        has finished since, when its K/V is no longer needed)."""
        owner = self.requests.get(move.owner)
        # A verification wrote the whole tree; a pending KeepPath still reads nodes past `computed`.
        length = max(owner.computed, owner.written) if owner is not None and owner.phase != Phase.finished else 0
        return CopySlot(move.src, move.dst, length)

    def _admit(self) -> None:
        if self.batching == Batching.static and self.slots.num_active:
            return
        while self.waiting and self.slots.free:
            request = self.waiting.popleft()
            slot = self.slots.admit(request.rid)
            request.phase = Phase.prefilling
            if self.prefix_cache is not None:
                blocks = self.prefix_cache.match(request.prompt)
                self._pending += [LoadBlock(block, slot, index) for index, block in enumerate(blocks)]
                request.computed = request.cached_tokens = len(blocks) * self.prefix_cache.block_size

    def _prefill_step(self) -> Step | None:
        rows, seq, budget = [], 0, self.token_budget
        for rid in self.slots.prefilling():
            request = self.requests[rid]
            take = min(len(request.prompt) - request.computed, self.max_chunk, budget)
            # Rows are padded to the step's longest chunk; every padded write must stay in the cache.
            if take <= 0 or any(r.computed + max(seq, take) > self.max_seq_len for r, _ in rows + [(request, take)]):
                break
            rows.append((request, take))
            seq, budget = max(seq, take), budget - take
        if not rows:
            return None
        return Step(kind=StepKind.prefill, first_slot=self.slots.num_decoding,
                    rids=tuple(r.rid for r, _ in rows),
                    tokens=tuple(tuple(r.prompt[r.computed:r.computed + take]) for r, take in rows),
                    starts=tuple(r.computed for r, _ in rows),
                    samples=tuple(r.computed + take == len(r.prompt) for r, take in rows))

    def _decode_step(self) -> Step | None:
        rids = self.slots.decoding()
        if not rids:
            return None
        requests = [self.requests[rid] for rid in rids]
        drafts = [r.draft for r in requests]
        seq = 1 + max((len(d.tokens) for d in drafts if d is not None), default=0)
        # Every row writes S positions (padding included): near max_seq_len, plain steps.
        if seq > 1 and any(r.computed + seq > self.max_seq_len for r in requests):
            drafts = [None] * len(requests)
        trees = tuple(d.tree if d is not None else None for d in drafts)
        return Step(kind=StepKind.decode, first_slot=0, rids=tuple(rids),
                    tokens=tuple((r.last_token, *(d.tokens if d is not None else ())) for r, d in zip(requests, drafts)),
                    starts=tuple(r.computed for r in requests), samples=(True,) * len(rids),
                    trees=trees if any(t is not None for t in trees) else ())

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
            if step.kind == StepKind.prefill and does_sample:
                self._pending += self.slots.promote(rid)
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
                    # slot_of, not the step's row: a release earlier in this loop may have moved it.
                    self._pending.append(KeepPath(self.slots.slot_of(rid), step.starts[row], path.nodes))
        return emitted

    def run_length(self, step: Step, limit: int) -> int:
        """How many plain decode steps ``step`` may run back to back, each row fed the argmax of
        its previous step (multi-step decoding): up to ``limit`` and no row past max_tokens; 1
        where a row samples, wants logprobs or verifies a tree, or a prompt is prefilling (its
        chunks alternate with decode steps)."""
        if limit <= 1 or step.kind != StepKind.decode or step.trees or self.slots.prefilling():
            return 1
        steps = limit
        for rid in step.rids:
            request = self.requests[rid]
            if not request.params.takes_argmax:
                return 1
            steps = min(steps, request.params.max_tokens - len(request.output))
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
        if self.prefix_cache is None:
            return
        slot = self.slots.slot_of(request.rid)
        for index, block in self.prefix_cache.insert(request.prompt):
            self._pending.append(SaveBlock(slot, index, block))

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

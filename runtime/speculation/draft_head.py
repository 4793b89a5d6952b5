"""The draft head at run time: its own one-layer KV per request, fed the target's features of
committed positions (``observe``: the draft head source reads a request's held positions just
before drafting for it), and chains drafted from it between steps (``propose``).

Positions (contract/draft_head.py): at position p the draft reads the embedding of token p + 1
and a feature of position p, and its logits there predict token p + 2. ``observe`` gets, per
request, the target-computed positions p0 .. p0 + n − 1 with their DRAFT_FEATURES and the tokens
p0 + 1 .. p0 + n (the last one the token just sampled or accepted); it writes the draft's K/V at
those positions (over whatever a chain drafted there: the rollback after a rejection) and keeps
the logits and hidden state of the last one. ``propose`` then drafts: token 1 is the kept
logits' choice, token i + 1 comes from one draft step at position p_last + i that reads token i
and the draft's own hidden state of the position before. A chain of k costs k − 1 session runs,
each one S = 1 run over every proposing request.

Which cache positions a request's draft attends to is tracked per request (``known``): those
``observe`` wrote, and those the current chain drafted; everything past the last observed
position is forgotten at the next ``observe``. A request admitted with a cached prompt prefix
that the target did not recompute has no features for it, so the draft never saw those
positions: they are masked out of its attention (not read as zero keys, which would still take
softmax weight); so are positions an ``observe`` skips over (past the last observed position,
before the first new one: the draft head source reads only a window of a request's newest).

The drafter runs either form of the draft's graph: ``draft.cpu.onnx`` (builder/draft_head/
cpu_graph.py: GroupQueryAttention over the filled length, the slot pool bound in place as past
and present, no copy of the cache per run: what the runtime opens) or ``draft.onnx`` (attention
over the whole cache, the caches fed as arrays and the new positions copied back).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from ...contract.draft_head import DRAFT_HIDDEN, DRAFT_LOGITS, FEATURES, NUM_KV_HEADS
from ...contract.step import VERIFY_ROWS, StepArrays, fill_step_arrays
from ...plugins.onnxruntime.session import Spinning, run, session
from ..backends.onnxruntime.one_write_start import move_back, write_from_one_start
from ..core.sampling import inverse_cdf, softmax
from .sources.base import Proposal

ORT_FLOATS = {"tensor(float)": np.float32, "tensor(float16)": np.float16}
DRAFT_SPINNING = Spinning.never  # measured: benchmarks/draft_step.py
# Weight of the newest measurement in the drafting-cost averages.
COST_SMOOTHING = 0.2


@dataclass(frozen=True)
class Observation:
    """One request's new target-computed positions after a target step."""
    rid: str
    start: int              # p0: the first new position the target computed
    features: np.ndarray    # [n, H] the target's DRAFT_FEATURES at p0 .. p0 + n − 1
    tokens: Sequence[int]   # [n] the tokens at positions p0 + 1 .. p0 + n


@dataclass(frozen=True)
class DraftChain:
    """One request's drafted chain: target ids, the draft's probability of each, (when asked)
    the draft's full distribution over its K ids at each depth, in the draft's id order, and
    (a greedy chain drafted ``width`` > 1) the runners-up at each depth: (target id, probability)
    pairs, likeliest first, from the distribution the chain's token there came from."""
    tokens: tuple[int, ...]
    probabilities: tuple[float, ...]
    distributions: np.ndarray | None = None  # [k, K] float64, rows sum to 1
    alternatives: tuple[tuple[tuple[int, float], ...], ...] = ()  # [k][width − 1]

    @property
    def proposal(self) -> Proposal:
        return Proposal(self.tokens, self.probabilities, self.alternatives)


@dataclass
class _Request:
    slot: int
    known: np.ndarray          # bool [S_max]: positions whose draft K/V may be attended to
    last: int = -1             # the last observed position
    logits: np.ndarray | None = None  # [K] the draft's logits there (predicting token last + 2)
    hidden: np.ndarray | None = None  # [H] its hidden state there (the next step's feature)


class DraftHeadDrafter:
    """Drafts chains for up to ``capacity`` live requests from ``draft.cpu.onnx`` or ``draft.onnx``
    (builder/draft_head/); ``draft_to_target`` int [K] maps each draft id to its target id (the
    engine dir's map). ``threads``: the session's (0: ONNX Runtime chooses); ``spinning``: its
    workers' (DRAFT_SPINNING)."""

    def __init__(self, graph: Path, draft_to_target: np.ndarray, max_seq_len: int, capacity: int,
                 threads: int = 0, max_step_tokens: int = 512, spinning: Spinning = DRAFT_SPINNING):
        self.session = session(Path(graph), threads, spinning=spinning, huge_pages=True)
        inputs = {i.name: i for i in self.session.get_inputs()}
        outputs = {o.name: o for o in self.session.get_outputs()}
        missing = [n for n in ("past_key_0", "past_value_0", FEATURES) if n not in inputs] + \
                  [n for n in (DRAFT_LOGITS, DRAFT_HIDDEN) if n not in outputs]
        if missing:
            raise ValueError(f"{graph}: not a draft head step graph (no {', '.join(missing)}); rebuild the engine dir")
        if not all(isinstance(d, int) for d in (*inputs["past_key_0"].shape[2:], inputs[FEATURES].shape[2],
                                                 outputs[DRAFT_LOGITS].shape[2])):
            raise ValueError(f"{graph}: its cache, feature and vocabulary sizes must be fixed numbers; rebuild the engine dir")
        past, features = inputs["past_key_0"], inputs[FEATURES]
        if features.type not in ORT_FLOATS:
            raise ValueError(f"{graph}: {FEATURES} is {features.type}; float or float16 expected")
        metadata = self.session.get_modelmeta().custom_metadata_map
        # The CPU form (builder/draft_head/cpu_graph.py) takes up to ``fold_rows`` rows a run, the
        # caches bound in place with the rows folded into heads; draft.onnx (0) any rows, copied.
        self.fold_rows = int(metadata.get(VERIFY_ROWS, 0))
        if self.fold_rows:
            if NUM_KV_HEADS not in metadata:
                raise ValueError(f"{graph}: no {NUM_KV_HEADS} metadata; make it with draft_cpu_graph")
            num_kv_heads, (_, _, graph_seq_len, head_dim) = int(metadata[NUM_KV_HEADS]), past.shape
        else:
            _, num_kv_heads, graph_seq_len, head_dim = past.shape
        self.hidden_size = features.shape[2]
        if graph_seq_len != max_seq_len:
            raise ValueError(f"{graph}: its cache holds {graph_seq_len} positions; max_seq_len {max_seq_len} given")
        outputs = {o.name: o for o in self.session.get_outputs()}
        self.draft_vocab = draft_vocab = outputs[DRAFT_LOGITS].shape[2]
        self.draft_to_target = np.asarray(draft_to_target, np.int64)
        if self.draft_to_target.shape != (draft_vocab,):
            raise ValueError(f"draft_to_target has shape {list(self.draft_to_target.shape)}; "
                             f"[{draft_vocab}] expected (one target id per draft id of {graph})")
        if capacity < 1:
            raise ValueError(f"capacity {capacity}: valid 1 or more")
        if max_step_tokens < 1:
            raise ValueError(f"max_step_tokens {max_step_tokens}: valid 1 or more")
        self.max_step_tokens = max_step_tokens  # the most positions of one row in one observe run
        self.max_seq_len, self.capacity = max_seq_len, capacity
        self.dtype = ORT_FLOATS[features.type]
        # Slot 0 is never assigned (a scratch slot, as the target's pools keep one).
        self.keys = np.zeros((capacity + 1, num_kv_heads, max_seq_len, head_dim), self.dtype)  # [N, H_kv, S_max, D]
        self.values = np.zeros_like(self.keys)
        self.requests: dict[str, _Request] = {}
        self.free = list(range(capacity, 0, -1))
        self.seconds_per_token: float | None = None   # drafting runs' wall time per drafted token
        self.seconds_per_row_run: float | None = None  # a chain run's wall time per row it drafts for
        self.observe_seconds: float | None = None     # one observe call's wall time

    # --- requests -------------------------------------------------------------------------------

    def _request(self, rid: str) -> _Request:
        request = self.requests.get(rid)
        if request is None:
            if not self.free:
                raise ValueError(f"request {rid!r}: all {self.capacity} draft slots are taken; close a request first")
            request = _Request(slot=self.free.pop(), known=np.zeros(self.max_seq_len, np.bool_))
            self.requests[rid] = request
        return request

    def close(self, rid: str) -> None:
        """The request ended: its slot is free for the next one (its stale K/V is never attended to:
        a new request starts with nothing known)."""
        request = self.requests.pop(rid, None)
        if request is not None:
            self.free.append(request.slot)

    def cache(self, rid: str) -> tuple[np.ndarray, np.ndarray]:
        """Views of the request's draft keys and values [H_kv, S_max, D] (positions not ``known`` hold stale data)."""
        slot = self.requests[rid].slot
        return self.keys[slot], self.values[slot]

    # --- one session run ------------------------------------------------------------------------

    def _run(self, requests: list[_Request], tokens: list[list[int]], starts: list[int],
             features: np.ndarray, last: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """One draft step over rows of new ``tokens`` [B][n_b] written from ``starts``, ``features``
        [B, S, H] (padded). Returns the logits [B, K] and hidden [B, H] at each row's index ``last``."""
        if not self.fold_rows:
            return self._run_copied(requests, tokens, starts, features, last)
        logits, hidden = [None] * len(requests), [None] * len(requests)
        for rows in self._slot_runs(requests):
            pick = lambda values: [values[i] for i in rows]  # noqa: E731
            seq = max(len(tokens[i]) for i in rows)  # a run's own padding
            out_logits, out_hidden = self._run_in_place(pick(requests), pick(tokens), pick(starts),
                                                        features[rows, :seq], pick(last))
            for i, row in enumerate(rows):
                logits[row], hidden[row] = out_logits[i], out_hidden[i]
        return np.stack(logits), np.stack(hidden)

    def _slot_runs(self, requests: list[_Request]) -> list[list[int]]:
        """The rows (indices into ``requests``) in runs of consecutive slots, each run at most
        ``fold_rows`` long: each run's caches are one view of the pool."""
        order = sorted(range(len(requests)), key=lambda row: requests[row].slot)
        runs: list[list[int]] = []
        for row in order:
            run = runs[-1] if runs else None
            if run and len(run) < self.fold_rows and requests[run[-1]].slot + 1 == requests[row].slot:
                run.append(row)
            else:
                runs.append([row])
        return runs

    def _arrays(self, requests: list[_Request], tokens: list[list[int]], starts: list[int],
                last: list[int]) -> StepArrays:
        batch, seq = len(tokens), max(len(t) for t in tokens)
        arrays = fill_step_arrays(StepArrays.empty(batch, seq, 1, self.max_seq_len), tokens, starts,
                                  self.max_seq_len)
        arrays.logits_index[:, 0] = last
        for row, request in enumerate(requests):
            # Causal over the positions this draft wrote: never an unseen prefix position.
            arrays.attention_mask[row, 0] &= request.known[None, :]
        return arrays

    def _run_in_place(self, requests: list[_Request], tokens: list[list[int]], starts: list[int],
                      features: np.ndarray, last: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """A run of the CPU form over rows of consecutive slots: the pool's rows bound as past and
        present ([1, B·H_kv, S_max, D] views), every row written from the largest start and moved
        back after (one_write_start.py). Padding's writes land past a row's last position, which
        the next ``observe`` forgets."""
        import onnxruntime as ort

        arrays = self._arrays(requests, tokens, starts, last)
        shifted = write_from_one_start(arrays)
        first, batch = requests[0].slot, len(requests)
        binding = self.session.io_binding()
        logits = np.empty((batch, 1, self.draft_vocab), np.float32)  # [B, 1, K]
        hidden = np.empty((batch, 1, self.hidden_size), self.dtype)  # [B, 1, H]
        binding.bind_ortvalue_output(DRAFT_LOGITS, ort.OrtValue.ortvalue_from_numpy(logits))
        binding.bind_ortvalue_output(DRAFT_HIDDEN, ort.OrtValue.ortvalue_from_numpy(hidden))
        for name, value in (*arrays.as_dict().items(), (FEATURES, np.ascontiguousarray(features, self.dtype))):
            binding.bind_cpu_input(name, value)
        for name, pool in (("key_0", self.keys), ("value_0", self.values)):
            rows = pool[first:first + batch]
            view = ort.OrtValue.ortvalue_from_numpy(rows.reshape(1, -1, *rows.shape[2:]))  # shares the pool's memory
            binding.bind_ortvalue_input(f"past_{name}", view)
            binding.bind_ortvalue_output(f"present_{name}", view)
        self.session.run_with_iobinding(binding)
        move_back({"key": self.keys, "value": self.values}, first, shifted, arrays.input_ids.shape[1])
        return logits[:, 0], hidden[:, 0]

    def _run_copied(self, requests: list[_Request], tokens: list[list[int]], starts: list[int],
                    features: np.ndarray, last: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """A run of ``draft.onnx``: the rows' caches fed as arrays, their new positions copied back."""
        arrays = self._arrays(requests, tokens, starts, last)
        slots = np.array([r.slot for r in requests])
        contiguous = bool(np.all(np.diff(slots) == 1))
        if contiguous:  # a view of the pool, no gather
            keys, values = self.keys[slots[0]:slots[-1] + 1], self.values[slots[0]:slots[-1] + 1]
        else:
            keys, values = self.keys[slots], self.values[slots]  # [B, H_kv, S_max, D]
        feeds = {**arrays.as_dict(), FEATURES: features, "past_key_0": keys, "past_value_0": values}
        out = run(self.session, feeds)
        present_k, present_v = out["present_key_0"], out["present_value_0"]
        for row, (request, start) in enumerate(zip(requests, starts)):
            end = start + len(tokens[row])  # only the row's real positions: padding's writes are dropped
            self.keys[request.slot, :, start:end] = present_k[row, :, start:end]
            self.values[request.slot, :, start:end] = present_v[row, :, start:end]
        return out[DRAFT_LOGITS][:, 0], out[DRAFT_HIDDEN][:, 0]

    # --- after a target step --------------------------------------------------------------------

    def observe(self, rows: Sequence[Observation]) -> None:
        """Writes each row's positions into its draft cache and keeps its last position's logits and
        hidden state. Rows of different lengths share one session run, padded (measured with a
        SmolLM2-shaped draft at B = 4 and 8, rows of 1..4 new positions: no slower than one run
        per distinct length, up to 1.2× faster, since a run's cost is mostly per-row work over the
        whole cache), except rows whose padding would run past the cache's end, which run on
        their own. Rows longer than ``max_step_tokens`` (a prompt's catch-up) run in chunks."""
        began = time.perf_counter()
        rows = [row for row in rows if self._check(row)]
        rids = [row.rid for row in rows]
        if len(set(rids)) != len(rids):
            raise ValueError(f"observe: request ids {rids} repeat; one row per request per call expected")
        requests = [self._request(rid) for rid in rids]
        chunk = self.max_step_tokens
        longest = max((len(row.tokens) for row in rows), default=0)
        for offset in range(0, longest, chunk):
            piece = [(request, Observation(row.rid, row.start + offset, np.asarray(row.features)[offset:offset + chunk],
                                           list(row.tokens)[offset:offset + chunk]))
                     for request, row in zip(requests, rows) if len(row.tokens) > offset]
            seq = max(len(row.tokens) for _, row in piece)
            fits = [row.start + seq <= self.max_seq_len for _, row in piece]
            together = [c for c, fit in zip(piece, fits) if fit]
            for group in ([together] if together else []) + [[c] for c, fit in zip(piece, fits) if not fit]:
                self._observe_group(group)
        if rows:
            self.observe_seconds = _smoothed(self.observe_seconds, time.perf_counter() - began)

    def _check(self, row: Observation) -> bool:
        """Whether the row has positions; a one-line ValueError where it is malformed."""
        features = np.asarray(row.features)
        n = len(row.tokens)
        if features.ndim != 2 or features.shape[1] != self.hidden_size:
            raise ValueError(f"observe: request {row.rid!r}: features have shape {list(features.shape)}; "
                             f"[n, {self.hidden_size}] expected (the target's draft features)")
        if features.shape[0] != n:
            raise ValueError(f"observe: request {row.rid!r}: {features.shape[0]} feature rows for {n} tokens; "
                             "one per position expected")
        if row.start < 0 or row.start + n > self.max_seq_len:
            raise ValueError(f"observe: request {row.rid!r}: positions {row.start}..{row.start + n - 1} "
                             f"outside the cache [0, {self.max_seq_len})")
        return n > 0

    def _observe_group(self, group: list[tuple[_Request, Observation]]) -> None:
        seq = max(len(row.tokens) for _, row in group)
        features = np.zeros((len(group), seq, self.hidden_size), self.dtype)  # [B, S, H]
        for b, (request, row) in enumerate(group):
            n = len(row.tokens)
            features[b, :n] = row.features
            # Everything past the new last position is a stale draft: forget it (rollback). So is
            # what lies between the last observed position and these (positions never read).
            request.known[request.last + 1:row.start] = False
            request.known[row.start + n:] = False
            request.known[row.start:row.start + n] = True
        logits, hidden = self._run([r for r, _ in group], [[int(t) for t in row.tokens] for _, row in group],
                                   [row.start for _, row in group], features,
                                   [len(row.tokens) - 1 for _, row in group])
        for b, (request, row) in enumerate(group):
            request.last = row.start + len(row.tokens) - 1
            request.logits, request.hidden = logits[b].astype(np.float32), hidden[b].copy()

    # --- drafting -------------------------------------------------------------------------------

    def propose(self, rids: Sequence[str], max_tokens: int, with_distributions: bool = False,
                uniforms: np.ndarray | None = None, temperatures: Sequence[float] | None = None,
                worth_more: Callable[[Sequence[float]], bool] | None = None,
                width: int = 1) -> dict[str, DraftChain]:
        """A chain of up to ``max_tokens`` per observed request (fewer where the cache ends).

        Greedy by default: each token the argmax of the draft's distribution q. With ``uniforms``
        [len(rids), max_tokens] in [0, 1) the chain is drawn from q instead (q at each row's
        ``temperature``, 1 by default), token i by the inverse CDF at ``uniforms[row, i]``: the
        draft the full-distribution acceptance rule needs (``accept_sampled_full``), which then
        also needs ``with_distributions``. ``worth_more``: given a row's chain so far (its tokens'
        probabilities), whether another token is worth drafting; a row it refuses stops there. The
        drafted K/V is scratch past the last observed position, overwritten by the next ``observe``.
        ``width`` > 1 (greedy only): each depth's next ``width`` − 1 likeliest tokens too, the
        siblings of a tree over the chain (they cost no draft run: the same distribution)."""
        began = time.perf_counter()
        if max_tokens < 0:
            raise ValueError(f"max_tokens {max_tokens}: valid 0 or more")
        if not 1 <= width <= self.draft_vocab:
            raise ValueError(f"width {width}: valid 1 to the draft's vocabulary of {self.draft_vocab}")
        if len(set(rids)) != len(rids):
            raise ValueError(f"propose: request ids {list(rids)} repeat; one chain per request per call")
        requests = []
        for rid in rids:
            request = self.requests.get(rid)
            if request is None or request.logits is None:
                raise ValueError(f"propose: request {rid!r} has not been observed; observe its positions first")
            requests.append(request)
        sampled = uniforms is not None
        if sampled and np.shape(uniforms) != (len(rids), max_tokens):
            raise ValueError(f"uniforms have shape {list(np.shape(uniforms))}; [{len(rids)}, {max_tokens}] expected")
        temps = np.ones(len(rids)) if temperatures is None else np.asarray(temperatures, np.float64)
        if sampled and not np.all(temps > 0):
            raise ValueError(f"temperatures {list(temps)}: each > 0 expected for a sampled draft")
        if sampled and width > 1:
            raise ValueError(f"width {width}: a chain drawn from q has no runners-up; width 1 expected")
        chosen = [[] for _ in rids]     # draft ids
        probs = [[] for _ in rids]
        dists = [[] for _ in rids]
        others = [[] for _ in rids]     # per depth: the runners-up, (draft id, probability)
        logits = np.stack([r.logits for r in requests])  # [B, K]
        hidden = np.stack([r.hidden for r in requests])  # [B, H]
        live = list(range(len(rids)))  # rows still drafting; logits/hidden hold their rows in order
        for depth in range(max_tokens):
            q = softmax(logits.astype(np.float64) / (temps[live, None] if sampled else 1.0))  # [B_live, K]
            for i, row in enumerate(live):
                token = int(inverse_cdf(q[i], uniforms[row, depth])) if sampled else int(np.argmax(q[i]))
                chosen[row].append(token)
                probs[row].append(float(q[i, token]))
                if with_distributions:
                    dists[row].append(q[i])
            if width > 1:
                top = np.argpartition(-q, width - 1, axis=1)[:, :width]  # [B_live, width], unordered
                for i, row in enumerate(live):
                    ranked = [int(t) for t in top[i][np.argsort(-q[i, top[i]], kind="stable")] if t != chosen[row][-1]]
                    others[row].append(tuple((t, float(q[i, t])) for t in ranked[:width - 1]))
            # The next token needs a draft step at the position after the deepest one so far: it
            # reads the token just chosen and the hidden state of the position before.
            position = {row: requests[row].last + 1 + depth for row in live}
            keep = [i for i, row in enumerate(live) if depth + 1 < max_tokens and position[row] < self.max_seq_len
                    and (worth_more is None or worth_more(probs[row]))]
            if not keep:
                break
            live, step_features = [live[i] for i in keep], hidden[keep]  # [B_live, H]
            batch = [requests[row] for row in live]
            for request, row in zip(batch, live):
                request.known[position[row]] = True
            run_began = time.perf_counter()
            logits, hidden = self._run(batch, [[int(self.draft_to_target[chosen[row][-1]])] for row in live],
                                       [position[row] for row in live],
                                       step_features[:, None, :].astype(self.dtype), [0] * len(live))
            # What one more token deeper costs a row (the first token of a chain needs no run: it
            # comes from the observed position's logits).
            self.seconds_per_row_run = _smoothed(self.seconds_per_row_run,
                                                 (time.perf_counter() - run_began) / len(live))
        vocab = len(self.draft_to_target)
        target = lambda ids: tuple(int(self.draft_to_target[t]) for t in ids)  # noqa: E731
        chains = {rid: DraftChain(target(chosen[row]), tuple(probs[row]),
                                  np.array(dists[row]).reshape(-1, vocab) if with_distributions else None,
                                  tuple(tuple((int(self.draft_to_target[t]), p) for t, p in depth)
                                        for depth in others[row]))
                  for row, rid in enumerate(rids)}
        drafted = sum(len(c) for c in chosen)
        if drafted:
            self.seconds_per_token = _smoothed(self.seconds_per_token, (time.perf_counter() - began) / drafted)
        return chains


def _smoothed(average: float | None, sample: float) -> float:
    return sample if average is None else (1 - COST_SMOOTHING) * average + COST_SMOOTHING * sample


"""Sampling parameters and the per-request sampler (numpy, on host logits)."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ...contract.manifest import DEFAULT_MAX_TOKENS
from ...contract.speculation import Source
from ..structured.constraint import CONSTRAINT_TYPES, Constraint


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling. The defaults are the spec's runtime section's (an engine dir's
    own runtime values come from ``LLM.default_params()``)."""
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 0.0       # 0: greedy
    top_k: int = 0                 # 0: off
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()     # stop strings; the output is cut before them
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0          # with logprobs: also the N likeliest tokens at each position
    # Draft sources this request may speculate with: None, the engine's (LLM's) own; (): none.
    speculation: tuple[Source, ...] | None = None
    constraint: Constraint | None = None  # structured output: the text must match it (runtime/structured/)

    def __post_init__(self):
        problems = []
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            problems.append(f"max_tokens must be an integer ≥ 1 (got {self.max_tokens!r})")
        if not self.temperature >= 0:
            problems.append(f"temperature must be ≥ 0 (got {self.temperature!r})")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            problems.append(f"seed must be None or an integer ≥ 0 (got {self.seed!r})")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            problems.append(f"top_k must be an integer ≥ 0 (got {self.top_k!r})")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p must be in (0, 1] (got {self.top_p!r})")
        if not isinstance(self.top_logprobs, int) or not 0 <= self.top_logprobs <= 20:
            problems.append(f"top_logprobs must be an integer in [0, 20] (got {self.top_logprobs!r})")
        if any(not s for s in self.stop):
            problems.append("stop strings must be non-empty")
        if self.constraint is not None and not isinstance(self.constraint, CONSTRAINT_TYPES):
            problems.append(f"constraint must be one of {', '.join(t.__name__ for t in CONSTRAINT_TYPES)} "
                            f"(got {type(self.constraint).__name__})")
        if self.speculation is not None and (not isinstance(self.speculation, (tuple, list))
                                             or not all(isinstance(s, Source) for s in self.speculation)):
            problems.append(f"speculation must be None or a tuple of Source members "
                            f"({', '.join(s.name for s in Source)}) (got {self.speculation!r})")
        if problems:
            raise ValueError("; ".join(problems))
        if self.speculation is not None:
            object.__setattr__(self, "speculation", tuple(dict.fromkeys(self.speculation)))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "stop", tuple(self.stop))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def takes_argmax(self) -> bool:
        """Greedy without logprobs or a constraint: the token is the logits' argmax, which a
        batch takes at once (and a multi-step run feeds back without the host seeing the
        logits; a constrained row needs its mask every token)."""
        return self.greedy and not self.logprobs and self.constraint is None


# Independent uniforms per output position (Sampler.uniform's stream): the token draw, then the
# acceptance test and the draft's own draw of the full-distribution speculative rule
# (runtime/speculation/full_sampling.py).
PLAIN_STREAM, ACCEPT_STREAM, DRAFT_STREAM = 0, 1, 2


@dataclass
class Sampler:
    """Draws one token from a row of logits. The randomness of output position t (the index of
    the output token being decided, 0 first) is one uniform keyed by (seed, t) alone, so a seeded
    request's token at t depends on nothing but the seed, t and the row's distribution: not on
    how many drafts were tried before, how many steps ran, nor the batch around it. Speculative
    acceptance draws from the same key (runtime/speculation/medusa.py ``accept_sampled``), so a
    drafted position gets the token plain sampling would. An unseeded request draws its key once
    from the OS: random, by the same rule."""

    params: SamplingParams
    key: int = field(init=False)

    def __post_init__(self):
        self.key = self.params.seed if self.params.seed is not None else int(np.random.SeedSequence().entropy)
        self.takes_argmax = self.params.takes_argmax  # read every token: an attribute, not a property

    def sample(self, logits: np.ndarray, position: int) -> tuple[int, float | None]:
        """(token at output ``position``, its log-probability under the model's distribution if asked)."""
        p = self.params
        if self.takes_argmax:  # the argmax needs no float64 copy of the row
            return int(logits.argmax()), None
        logits = logits.astype(np.float64)  # [V]
        token = int(np.argmax(logits)) if p.greedy else self.draw(self.distribution(logits), position)
        logprob = float(np.log(softmax(logits)[token])) if p.logprobs else None
        return token, logprob

    def draw(self, probs: np.ndarray, position: int) -> int:
        """The token at output ``position`` from ``probs`` [V]: the inverse CDF at its uniform."""
        return inverse_cdf(probs, self.uniform(position))

    def uniform(self, position: int, stream: int = 0) -> float:
        """U[0, 1) for output ``position``: 53 bits of a hash of (key, position), or of (key,
        position, stream) for another independent uniform of the same position (``ACCEPT_STREAM``,
        ``DRAFT_STREAM``: the full-distribution speculative rule's test and draft draws)."""
        entropy = (self.key, position) if stream == PLAIN_STREAM else (self.key, position, stream)
        bits = np.random.SeedSequence(entropy).generate_state(1, np.uint64)[0]
        return float(bits >> np.uint64(11)) * 2.0 ** -53

    def distribution(self, logits: np.ndarray) -> np.ndarray:
        """[V] float64: what a sampled row draws from (temperature, then top-k, then top-p)."""
        p = self.params
        scaled = logits.astype(np.float64) / p.temperature
        if p.top_k and p.top_k < len(scaled):  # top_k ≥ V keeps every token
            kth = np.partition(scaled, -p.top_k)[-p.top_k]
            scaled = np.where(scaled < kth, -np.inf, scaled)
        probs = softmax(scaled)
        if p.top_p < 1.0:
            order = np.argsort(-probs, kind="stable")
            cumulative = np.cumsum(probs[order])
            keep = order[: int(np.searchsorted(cumulative, p.top_p) + 1)]
            mask = np.zeros_like(probs, dtype=bool)
            mask[keep] = True
            probs = np.where(mask, probs, 0.0)
            probs /= probs.sum()
        return probs


    @staticmethod
    def logprob(logits: np.ndarray, token: int) -> float:
        """log p(token) under the model's (untempered) distribution."""
        return float(np.log(softmax(logits.astype(np.float64))[token]))

    @staticmethod
    def alternatives(logits: np.ndarray, count: int) -> tuple[tuple[int, float], ...]:
        """The ``count`` likeliest tokens and their log-probabilities (untempered), likeliest first."""
        log_probs = np.log(softmax(logits.astype(np.float64)))  # [V]
        best = np.argpartition(-log_probs, count - 1)[:count]
        best = best[np.argsort(-log_probs[best], kind="stable")]
        return tuple((int(t), float(log_probs[t])) for t in best)


def inverse_cdf(probs: np.ndarray, u: float | np.ndarray) -> int | np.ndarray:
    """The first token whose cumulative probability exceeds ``u`` × the total (``u`` in [0, 1),
    a scalar or an array of them): token i for u in [P(< i), P(≤ i)), so never a token of
    probability 0; the last such token where rounding leaves ``u`` past the total."""
    cumulative = np.cumsum(probs)  # [V]
    token = np.searchsorted(cumulative, np.asarray(u) * cumulative[-1], side="right")
    last = int(np.flatnonzero(probs)[-1])
    return np.minimum(token, last) if np.ndim(token) else int(min(token, last))


def softmax(x: np.ndarray) -> np.ndarray:
    """Over the last axis (a row of logits, or rows of them)."""
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)

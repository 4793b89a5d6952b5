"""Speculative sampling with a full draft distribution (Leviathan et al. 2023; Chen et al. 2023):
a chain x_1..x_k drawn from the draft's q_1..q_k, kept or cut by the target's p_1..p_{k+1}.

Two exact rules are available; both emit tokens distributed exactly as plain sampling from p.

- ``accept_sampled`` (runtime/speculation/medusa.py), the point-mass rule over any draft (for the
  draft head: its argmax chain). A seeded request's tokens are plain sampling's, token for token,
  whatever was drafted. Its acceptance is Σ p·δ = p(x) per position.
- ``accept_sampled_full`` (here), over a chain drawn from q. Same distribution, higher acceptance
  (Σ min(p, q) per position), but not the same tokens as plain sampling for a seed: which token
  comes out depends on the draft. Reproducible: every uniform is the request's own seeded one
  for its output position (Sampler.uniform's streams), so a seed and the same drafts give the
  same output.

So seeded requests keep the point-mass rule over the argmax chain; unseeded ones can take this.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..core.sampling import ACCEPT_STREAM, DRAFT_STREAM, Sampler


@dataclass(frozen=True)
class FullAccepted:
    tokens: tuple[int, ...]  # the accepted prefix of the chain
    next_token: int          # the token after it: the residual's draw at a rejection, else p_{k+1}'s


def draft_uniforms(sampler: Sampler, position: int, count: int) -> np.ndarray:
    """[count] the uniforms a chain drafted from output ``position`` on draws its tokens with
    (DraftHeadDrafter.propose's ``uniforms`` row): the request's own, one per position."""
    return np.array([sampler.uniform(position + i, DRAFT_STREAM) for i in range(count)])


def accept_sampled_full(tokens: Sequence[int], q: np.ndarray, logits: np.ndarray, sampler: Sampler,
                        position: int, q_ids: np.ndarray | None = None) -> FullAccepted:
    """The chain ``tokens`` (target ids, drafted for output positions ``position`` onward) drawn
    from ``q`` [k, V] (or [k, K] over the target ids ``q_ids`` [K]: the draft head's reduced
    vocabulary); ``logits`` [k + 1, V]: the target's logits at each drafted position and after
    the last (masked rows for a constrained request), turned into p by ``sampler.distribution``.

    x_i is kept with probability min(1, p_i(x_i) / q_i(x_i)) (the uniform of ``ACCEPT_STREAM``
    at its position); at the first rejection the next token is drawn from norm(max(0, p_i − q_i))
    and the chain ends; if all are kept, the next token is drawn from p_{k+1}. Draws use the
    position's plain uniform, so a next token drawn from p_{k+1} is plain sampling's."""
    k = len(tokens)
    if len(q) != k or len(logits) != k + 1:
        raise ValueError(f"accept_sampled_full: {k} tokens need {k} draft rows (got {len(q)}) and {k + 1} "
                         f"logits rows (got {len(logits)})")
    kept = []
    for i, token in enumerate(tokens):
        p = sampler.distribution(np.asarray(logits[i]))  # [V] float64
        qi = _dense(np.asarray(q[i], np.float64), q_ids, len(p))  # [V]
        if not qi[token] > 0:
            raise ValueError(f"accept_sampled_full: draft token {token} at depth {i} has draft probability "
                             f"{qi[token]}; a chain drawn from q has q(x) > 0")
        # u < p/q, written without the division: min(1, ·) is implied by u < 1.
        if sampler.uniform(position + i, ACCEPT_STREAM) * qi[token] < p[token]:
            kept.append(int(token))
            continue
        residual = np.maximum(p - qi, 0.0)
        if not residual.sum() > 0:  # p ≤ q everywhere yet x rejected: only by rounding (p == q)
            residual = p
        return FullAccepted(tuple(kept), sampler.draw(residual, position + i))
    p = sampler.distribution(np.asarray(logits[k]))
    return FullAccepted(tuple(kept), sampler.draw(p, position + k))


def _dense(q: np.ndarray, ids: np.ndarray | None, vocab: int) -> np.ndarray:
    if ids is None:
        if q.shape != (vocab,):
            raise ValueError(f"accept_sampled_full: a draft row of {q.shape[0]} probabilities for a vocabulary "
                             f"of {vocab}; pass q_ids for a reduced draft vocabulary")
        return q
    dense = np.zeros(vocab)
    dense[ids] = q
    return dense

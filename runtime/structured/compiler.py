"""Constraints compiled once for one tokenizer: llguidance's token-level matcher, cached.

Compiling builds llguidance's tokenizer view (~0.6 s for a 49k vocabulary, once, at the first
constraint: a runtime that never sees one never pays it) and a pristine matcher per constraint,
kept in a bounded LRU; each request's matcher is a copy of it (runtime/structured/matcher.py).
llguidance enforces its own parser limits (grammar size, lexer states, per-token fuel), so a
pathological grammar becomes an error rather than unbounded work; callers that must not wait
at all (an event loop: the server, AsyncLLM) compile through a ``CompilePool``
(runtime/structured/compile_pool.py): bounded threads, a deadline from when a compile starts."""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from ...contract.errors import first_line
from .constraint import Constraint, ConstraintError
from .matcher import GrammarMatcher

CACHE_SIZE = 64  # compiled constraints kept (one matcher each: the grammar plus its lexer cache)


@dataclass(frozen=True)
class CompiledConstraint:
    """A constraint's pristine matcher (never advanced; requests advance copies) and its width."""
    constraint: Constraint
    template: object          # llguidance.LLMatcher
    vocab_size: int

    def matcher(self) -> GrammarMatcher:
        """A new request's grammar state (what the engine core asks every compiled constraint for)."""
        return GrammarMatcher(self.template, self.vocab_size)


class ConstraintCompiler:
    """Compiles constraints for one tokenizer (a ``tokenizers.Tokenizer``) whose logits rows are
    ``vocab_size`` wide (the engine's; ids past the tokenizer's are never allowed). Thread-safe."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...], cache_size: int = CACHE_SIZE,
                 max_tokens: int | None = None):
        """``max_tokens``: the longest text a request can hold (the engine's max_seq_len); a
        constraint that forces more tokens than that before it can end is refused."""
        self.tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, tuple(eos_token_ids)
        self.max_tokens = max_tokens
        self.cache_size = cache_size
        self._llg_tokenizer = None
        self._cache: OrderedDict[Constraint, CompiledConstraint] = OrderedDict()
        self._lock = threading.Lock()
        self.compiled = 0  # compilations done (cache misses), for tests and benchmarks

    def cached(self, constraint: Constraint) -> CompiledConstraint | None:
        """The constraint's compiled form if the cache has it (cheap: callers on an event loop
        ask this before handing a compile to a thread), else None."""
        with self._lock:
            hit = self._cache.get(constraint)
            if hit is not None:
                self._cache.move_to_end(constraint)
            return hit

    def compile(self, constraint: Constraint) -> CompiledConstraint:
        """The constraint's compiled form, from the cache when it is there; raises
        ``ConstraintError`` (text starting with the constraint's kind) if it cannot be compiled."""
        hit = self.cached(constraint)
        if hit is not None:
            return hit
        compiled = self._compile(constraint)  # outside the lock: others hit the cache meanwhile
        with self._lock:
            self._cache[constraint] = compiled
            self._cache.move_to_end(constraint)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            self.compiled += 1
        return compiled

    def _compile(self, constraint: Constraint) -> CompiledConstraint:
        from llguidance import LLMatcher

        try:
            grammar = constraint.grammar()
        except ValueError as exc:
            raise ConstraintError(f"{constraint.kind}: {first_line(exc)}") from None
        matcher = LLMatcher(self._tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise ConstraintError(f"{constraint.kind}: {first_line(ConstraintError(matcher.get_error()))}")
        self._check_finite(constraint, matcher)
        return CompiledConstraint(constraint, matcher, self.vocab_size)

    def _check_finite(self, constraint: Constraint, matcher) -> None:
        """Refuses a constraint no answer can complete. llguidance compiles a grammar with no
        finite text (a required property whose schema is its own, a $ref cycle, ``start: "a"
        start``) without complaint, then fails mid-answer; such a grammar forces its text on and
        on from the start, so the tokens it forces there (llguidance stops counting at its own
        limit, over 10000) are checked against the longest answer this engine can hold. One that
        branches forever without forcing anything runs to max_tokens ("length")."""
        if self.max_tokens is None:
            return
        probe = matcher.deep_copy()
        forced = len(probe.compute_ff_tokens())
        if probe.is_error():
            raise ConstraintError(f"{constraint.kind}: {first_line(ConstraintError(probe.get_error()))}")
        if forced >= self.max_tokens:
            raise ConstraintError(f"{constraint.kind}: no text of under {self.max_tokens} tokens (the engine's "
                                  f"max_seq_len) matches it: it forces at least {forced} tokens "
                                  "before it can end (a required property, item or rule that contains "
                                  "itself has no finite text)")

    def _tokenizer(self):
        with self._lock:
            if self._llg_tokenizer is None:
                from llguidance import LLTokenizer

                eos = list(self.eos_token_ids) or None
                self._llg_tokenizer = LLTokenizer(self.tokenizer.to_str(), n_vocab=self.vocab_size, eos_token=eos)
            return self._llg_tokenizer


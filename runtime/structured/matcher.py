"""One request's grammar state: the mask it puts on a logits row, advanced token by token.

A copy of the compiled constraint's pristine matcher (runtime/structured/compiler.py). The
engine core masks the row it samples from (``masked``), advances with every committed token
(``advance``: True once the grammar has ended), and lets the acceptance of a draft (a Medusa
tree or a host source's chain) walk it with the grammar's state following the path
(``TreeWalk``), rolled back afterwards."""
from __future__ import annotations

import numpy as np


class GrammarMatcher:
    def __init__(self, template, vocab_size: int):
        """``template``: a compiled constraint's pristine llguidance.LLMatcher, copied here."""
        self.matcher = template.deep_copy()
        self.vocab_size = vocab_size
        self.bitmask = np.zeros((self.vocab_size + 31) // 32, np.int32)  # [ceil(V / 32)], bit i: token i allowed

    def allowed(self) -> np.ndarray:
        """[V] bool: the tokens the grammar allows next."""
        self.matcher.unsafe_compute_mask_ptr(self.bitmask.ctypes.data, self.bitmask.nbytes)
        return np.unpackbits(self.bitmask.view(np.uint8), bitorder="little")[:self.vocab_size].view(bool)

    def masked(self, logits: np.ndarray) -> np.ndarray:
        """A copy of the row [V] with the tokens the grammar refuses at -inf."""
        return np.where(self.allowed(), logits, -np.inf).astype(logits.dtype, copy=False)

    def advance(self, token: int) -> bool:
        """Takes a committed token; True when the grammar has ended (no token but eos may follow).
        A token the grammar refused (sampled from a row it left empty, e.g. once llguidance's
        limits stopped it) ends nothing: it puts the matcher in error (``failed``)."""
        self.matcher.consume_token(token)
        return self.matcher.is_stopped() and not self.matcher.is_error()

    @property
    def failed(self) -> bool:
        """The grammar refused a committed token or hit its limits: the output no longer follows it."""
        return self.matcher.is_error()

    @property
    def error(self) -> str:
        """Why it failed: llguidance's error, first line (empty while it has not)."""
        return (self.matcher.get_error() or "").split("\n", 1)[0]

    def take(self, token: int) -> bool:
        """Advances by a draft token if the grammar allows it next; False, the state unchanged,
        for a token it refuses, and for any token once it has ended (llguidance takes an eos
        there without counting it, so a later rollback would undo one token too many)."""
        return self.matcher.try_consume_tokens([token]) == 1

    def rollback(self, tokens: int) -> None:
        if tokens:
            self.matcher.rollback(tokens)


class TreeWalk:
    """A Medusa tree's logits [T, V] as an acceptance walk reads them (runtime/speculation/medusa.py's
    ``accept_greedy`` / ``accept_sampled``: root first, then one child at a time along the path
    it takes): node n's row comes masked by the grammar's state after the path to n, so the
    walk takes the masked argmax (or a typical token) and stops at the first token the grammar
    refuses. A draft can run past the grammar's end (prompt lookup copies a JSON object and the
    end-of-turn token after it): the matcher takes a path's nodes only while the grammar allows
    them, and ``kept`` says where the accepted path is cut, after the node that ended the grammar or
    before one it refused. ``finish`` gives the masked row at the kept path's end and rolls the
    matcher back to the root: the commit advances it through what was kept."""

    def __init__(self, matcher: GrammarMatcher, tree, tokens: list[int], logits: np.ndarray):
        self.matcher, self.tree, self.tokens, self.logits = matcher, tree, tokens, logits
        self.path: list[int] = []   # nodes the walk has reached, root excluded
        self.taken = 0              # of them, the first ``taken`` are in the matcher; the rest it refused

    def __getitem__(self, node: int) -> np.ndarray:
        self._reach(node)
        return self.matcher.masked(self.logits[node])

    def _reach(self, node: int) -> None:
        if node != (self.path[-1] if self.path else 0):
            if self.tree.parents[node] != (self.path[-1] if self.path else 0):
                raise ValueError(f"tree walk: node {node} does not continue the path {self.path}")
            if self.taken == len(self.path) and self.matcher.take(self.tokens[node]):
                self.taken += 1
            self.path.append(node)

    def kept(self, nodes: tuple[int, ...]) -> int:
        """How many of an acceptance's path ``nodes`` (root excluded) the grammar takes."""
        for node in nodes[len(self.path):]:
            self._reach(node)
        return min(self.taken, len(nodes))

    def finish(self, nodes: tuple[int, ...]) -> np.ndarray:
        """The masked row [V] after ``nodes`` (a kept path); the matcher is back at the root."""
        for node in nodes[len(self.path):]:
            self._reach(node)
        if len(nodes) > self.taken:
            raise ValueError(f"tree walk: the grammar refused node {self.path[self.taken]}; finish a kept path")
        self.matcher.rollback(self.taken - len(nodes))
        row = self.matcher.masked(self.logits[nodes[-1] if nodes else 0])
        self.matcher.rollback(len(nodes))
        self.path, self.taken = [], 0
        return row

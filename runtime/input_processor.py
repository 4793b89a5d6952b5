"""The input processor: one validation for every caller (``LLM.generate``/``submit``/``stream``,
``AsyncLLM``, the server, the CLI), so each rule lives here once.

Refusals are ``ValueError`` with one line naming the field (or prompt) and what is valid."""
from __future__ import annotations

import numpy as np

from .engine_dir import EngineDir
from .sampling import SamplingParams


def checked_multi_step(value: int) -> int:
    """``multi_step`` as the runtime takes it: an integer ≥ 1 (1: every step goes through the
    scheduler, detokenizer and stop strings)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"multi_step must be an integer ≥ 1 (got {value!r})")
    return value


class InputProcessor:
    """Turns a prompt into checked token ids and checks a request fits the engine dir."""

    def __init__(self, tokenizer, engine_dir: EngineDir):
        self.tokenizer, self.engine_dir = tokenizer, engine_dir

    def default_params(self, **overrides) -> SamplingParams:
        """SamplingParams with the engine dir's runtime defaults (the spec's runtime section;
        fields it leaves out keep SamplingParams' own, which are the spec's defaults too)."""
        defaults = self.engine_dir.runtime_defaults
        values = {k: defaults[k] for k in ("max_tokens", "temperature", "top_k", "top_p") if k in defaults}
        return SamplingParams(**{**values, **overrides})

    def tokens(self, prompt: str | list[int]) -> list[int]:
        """The prompt's token ids; refuses text that is not UTF-8 and ids outside the vocabulary."""
        if isinstance(prompt, str):
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError("prompt: not valid UTF-8 text") from None
            return self.tokenizer.encode(prompt).ids
        tokens = list(prompt)
        vocab = self.engine_dir.vocab_size
        # numpy integers are ids too; bools and floats are mistakes to name, not ids.
        wrong = next((t for t in tokens if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer))), None)
        if wrong is not None:
            raise ValueError(f"prompt: token ids are integers, got {wrong!r} ({type(wrong).__name__})")
        tokens = [int(t) for t in tokens]
        bad = next((t for t in tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt: token id {bad} is outside the vocabulary [0, {vocab})")
        return tokens

    def check(self, tokens: list[int], params: SamplingParams, where: str = "prompt") -> None:
        """A request that can run: a non-empty prompt whose tokens plus max_tokens fit max_seq_len."""
        limit = self.engine_dir.max_seq_len
        if not tokens:
            raise ValueError(f"{where}: empty")
        if len(tokens) + params.max_tokens > limit:
            raise ValueError(f"{where}: {len(tokens)} tokens + max_tokens {params.max_tokens} exceeds "
                             f"max_seq_len {limit}")

    def process(self, prompt: str | list[int], params: SamplingParams, where: str = "prompt") -> list[int]:
        """The checked token ids of one request."""
        tokens = self.tokens(prompt)
        self.check(tokens, params, where)
        return tokens

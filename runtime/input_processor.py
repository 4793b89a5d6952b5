"""The input processor: one validation for every caller (``LLM.generate``/``submit``/``stream``,
``AsyncLLM``, the server, the CLI), so each rule lives here once.

Refusals are ``InputRefused`` (a ``ValueError``) with one line naming the field (or prompt) and
what is valid; the server turns them into its OpenAI-shaped 400s. What passes comes out as a
``ValidRequest``, the only kind of request the engine loop (runtime/engine_loop.py) takes, so a
request is checked once, wherever it was checked (the server does it in a worker thread)."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .engine_dir import EngineDir
from ..contract.speculation import Source
from .core.sampling import SamplingParams
from .structured import CompiledConstraint, ConstraintCompiler


class InputRefused(ValueError):
    """A request the engine cannot take. ``param`` is the request field at fault ("prompt" or
    "max_tokens"); ``code`` the OpenAI error code (``context_length_exceeded``), None if none fits."""

    def __init__(self, message: str, param: str, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


def checked_multi_step(value: int) -> int:
    """``multi_step`` as the runtime takes it: an integer ≥ 1 (1: every step goes through the
    scheduler, detokenizer and stop strings)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"multi_step must be an integer ≥ 1 (got {value!r})")
    return value


@dataclass(frozen=True)
class CheckedPrompt:
    """A prompt's token ids as ``InputProcessor.prompt`` checked them: each in the vocabulary, and
    room left to generate."""
    tokens: list[int]
    checked_by: "InputProcessor" = field(repr=False, compare=False)


@dataclass(frozen=True)
class ValidRequest:
    """A request ``InputProcessor.request`` checked against its engine dir. The engine loop takes
    only these, made by its own LLM's processor, and checks nothing of them again."""
    tokens: list[int]
    params: SamplingParams
    checked_by: "InputProcessor" = field(repr=False, compare=False)
    constraint: CompiledConstraint | None = field(default=None, repr=False, compare=False)  # params.constraint's


class InputProcessor:
    """Turns a prompt into checked token ids and checks a request fits the engine dir."""

    def __init__(self, tokenizer, engine_dir: EngineDir, constraints: ConstraintCompiler | None = None,
                 speculation_sources: tuple[Source, ...] = ()):
        """``constraints``: compiles a request's ``params.constraint`` (cached) when it is checked;
        without one, constrained requests are refused. ``speculation_sources``: the draft sources
        the engine serves, of which a request's ``params.speculation`` may name any."""
        self.tokenizer, self.engine_dir, self.constraints = tokenizer, engine_dir, constraints
        self.speculation_sources = speculation_sources

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
                raise InputRefused("prompt: not valid UTF-8 text", "prompt") from None
            # encode_batch, not encode: it lets go of the GIL while it works (encode holds it, so a
            # long prompt tokenized in one thread would stall every other, the server's event loop too).
            return self.tokenizer.encode_batch([prompt])[0].ids
        tokens = list(prompt)
        vocab = self.engine_dir.vocab_size
        # numpy integers are ids too; bools and floats are mistakes to name, not ids.
        wrong = next((t for t in tokens if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer))), None)
        if wrong is not None:
            raise InputRefused(f"prompt: token ids are integers, got {wrong!r} ({type(wrong).__name__})", "prompt")
        tokens = [int(t) for t in tokens]
        bad = next((t for t in tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise InputRefused(f"prompt: token id {bad} is outside the vocabulary [0, {vocab})", "prompt")
        return tokens

    def prompt(self, prompt: str | list[int], where: str = "prompt") -> CheckedPrompt:
        """The prompt's checked token ids: a token-id list's length is checked before its ids
        (cheap first: a huge list is refused without a loop over it)."""
        if isinstance(prompt, str):
            tokens = self.tokens(prompt)
            self._check_length(tokens, where)
        else:
            self._check_length(prompt := list(prompt), where)
            tokens = self.tokens(prompt)
        return CheckedPrompt(tokens, self)

    def request(self, prompt: CheckedPrompt, params: SamplingParams, where: str = "prompt",
                compiled: CompiledConstraint | None = None) -> ValidRequest:
        """A request that can run: the prompt's tokens plus max_tokens fit max_seq_len, and its
        ``params.constraint`` compiled (``compiled``: already compiled by the caller, e.g. the
        server under its deadline; else compiled here, cached)."""
        self.check_room(prompt, params, where)
        if (compiled is not None) and (compiled.constraint != params.constraint):
            raise TypeError("the compiled constraint given is not the request's params.constraint")
        if params.constraint is not None and compiled is None:
            if self.constraints is None:
                raise InputRefused("constraint: this input processor compiles no constraints", "constraint")
            compiled = self.constraints.compile(params.constraint)  # ConstraintError (a ValueError) if it cannot
        return ValidRequest(prompt.tokens, params, self, compiled)

    def check_room(self, prompt: CheckedPrompt, params: SamplingParams, where: str = "prompt") -> None:
        """The prompt's tokens plus max_tokens fit max_seq_len, and the draft sources it asks for are
        served (all of ``request``'s checks but the
        constraint's compile, for callers that compile it elsewhere: AsyncLLM)."""
        if prompt.checked_by is not self:
            raise TypeError("a CheckedPrompt from another input processor (another engine dir's rules)")
        limit = self.engine_dir.max_seq_len
        if len(prompt.tokens) + params.max_tokens > limit:
            raise InputRefused(f"{where}: {len(prompt.tokens)} tokens + max_tokens {params.max_tokens} exceeds "
                               f"max_seq_len {limit}", "max_tokens", "context_length_exceeded")
        if params.speculation and (missing := [s.value for s in params.speculation
                                               if s not in self.speculation_sources]):
            served = ", ".join(s.value for s in self.speculation_sources) or "none"
            raise InputRefused(f"speculation: {', '.join(missing)} is not served by this engine (sources: {served})",
                               "speculation")

    def process(self, prompt: str | list[int], params: SamplingParams, where: str = "prompt") -> ValidRequest:
        """One request, checked whole."""
        return self.request(self.prompt(prompt, where), params, where)

    def _check_length(self, tokens: list, where: str) -> None:
        """A prompt that leaves room to generate: non-empty and shorter than max_seq_len."""
        limit = self.engine_dir.max_seq_len
        if not tokens:
            raise InputRefused(f"{where}: empty", "prompt")
        if len(tokens) >= limit:
            raise InputRefused(f"{where}: {len(tokens)} tokens leave no room to generate within max_seq_len {limit}",
                               "prompt", "context_length_exceeded")

"""What an engine dir says about speculative decoding: the manifest's ``speculation`` entry.

The builder writes it from the spec's ``speculative:`` section; the runtime reads it back from an
untrusted engine dir, so ``SpeculationConfig.from_manifest`` checks every field and refuses in one
line naming it. Medusa's own facts (heads, tree, rank accuracy) stay in the manifest's ``medusa``
entry; this entry says which draft sources the engine serves, how many tokens one verification
step may carry, and each host-side source's settings.

Draft sources (runtime/speculation/sources/):
- ``medusa``: the heads' top-k guesses as a tree (needs heads built into the engine);
- ``prompt_lookup``: the last n tokens (max_ngram down to min_ngram) found earlier in the prompt and
  output; the tokens that followed them there, as a chain;
- ``suffix``: a suffix trie over the request's prompt and output (and over recent requests'
  outputs, ``cross_request``), the continuation of the longest matched suffix grown by frequency,
  as a chain (the greedy path of the tree SuffixDecoding would grow).
- ``draft_head``: a trained draft head (contract/draft_head.py) run on the target's features, its
  chain drafted autoregressively (needs the head built into the engine).
Each source's proposal is verified by the same step (a tree mask over S tokens a row; a chain is
the tree whose every node has one child).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import Enum


class Source(str, Enum):
    medusa = "medusa"
    prompt_lookup = "prompt_lookup"
    suffix = "suffix"
    draft_head = "draft_head"


@dataclass(frozen=True)
class PromptLookupConfig:
    num_tokens: int = 8      # longest chain proposed (tokens after the root)
    min_ngram: int = 1
    max_ngram: int = 4

    def problem(self) -> str | None:
        if not 1 <= self.num_tokens <= 64:
            return f"num_tokens {self.num_tokens}: valid 1 to 64"
        if not 1 <= self.min_ngram <= self.max_ngram <= 16:
            return f"min_ngram {self.min_ngram}, max_ngram {self.max_ngram}: valid 1 ≤ min_ngram ≤ max_ngram ≤ 16"
        return None


@dataclass(frozen=True)
class SuffixConfig:
    num_tokens: int = 16        # most tree nodes proposed (the root not counted)
    max_depth: int = 16         # longest path in a proposal
    max_match: int = 32         # longest suffix of the sequence matched in the tree
    min_probability: float = 0.1  # a node is proposed only if its path's estimated probability reaches this
    cross_request: int = 16     # recent requests whose outputs are kept (0: each request's own text only)

    def problem(self) -> str | None:
        if not 1 <= self.num_tokens <= 64:
            return f"num_tokens {self.num_tokens}: valid 1 to 64"
        if not 1 <= self.max_depth <= self.num_tokens:
            return f"max_depth {self.max_depth}: valid 1 to num_tokens ({self.num_tokens})"
        if not 1 <= self.max_match <= 256:
            return f"max_match {self.max_match}: valid 1 to 256"
        if not 0.0 <= self.min_probability < 1.0:
            return f"min_probability {self.min_probability}: valid [0, 1)"
        if not 0 <= self.cross_request <= 1024:
            return f"cross_request {self.cross_request}: valid 0 (off) to 1024"
        return None


@dataclass(frozen=True)
class DraftHeadSourceConfig:
    num_tokens: int = 6      # longest chain the draft head proposes (tokens after the root)

    def problem(self) -> str | None:
        if not 1 <= self.num_tokens <= 64:
            return f"num_tokens {self.num_tokens}: valid 1 to 64"
        return None


@dataclass(frozen=True)
class SpeculationConfig:
    """The engine's draft sources, in the spec's order (the default a request gets), and the
    largest S of a verification step (root included) the engine was built for."""

    sources: tuple[Source, ...]
    verify_tokens: int
    prompt_lookup: PromptLookupConfig | None = None
    suffix: SuffixConfig | None = None
    draft_head: DraftHeadSourceConfig | None = None

    def to_manifest(self) -> dict:
        return {"sources": [s.value for s in self.sources], "verify_tokens": self.verify_tokens,
                "prompt_lookup": asdict(self.prompt_lookup) if self.prompt_lookup else None,
                "suffix": asdict(self.suffix) if self.suffix else None,
                "draft_head": asdict(self.draft_head) if self.draft_head else None}

    @classmethod
    def from_manifest(cls, entry: object, where: str) -> "SpeculationConfig":
        """Checks an engine dir's ``speculation`` entry (untrusted); ValueError naming
        ``where`` (the manifest's path) and the field."""
        def bad(field: str, why: str) -> ValueError:
            return ValueError(f"{where}: speculation.{field} {why}")

        if not isinstance(entry, dict):
            raise bad("", f"must be an object, got {type(entry).__name__}")
        unknown = set(entry) - {"sources", "verify_tokens", "prompt_lookup", "suffix", "draft_head"}
        if unknown:
            raise bad(sorted(unknown)[0], "is not a known field")
        sources_raw = entry.get("sources")
        if not isinstance(sources_raw, list) or not sources_raw:
            raise bad("sources", f"must be a non-empty list of {', '.join(s.value for s in Source)}")
        try:
            sources = tuple(Source(s) for s in sources_raw)
        except ValueError:
            raise bad("sources", f"{sources_raw!r}: valid {', '.join(s.value for s in Source)}") from None
        if len(set(sources)) != len(sources):
            raise bad("sources", f"{sources_raw!r} names a source twice")
        verify = entry.get("verify_tokens")
        if not isinstance(verify, int) or isinstance(verify, bool) or not 2 <= verify <= 4096:
            raise bad("verify_tokens", f"{verify!r}: must be an integer in [2, 4096]")
        configs = {}
        for name, kind in (("prompt_lookup", PromptLookupConfig), ("suffix", SuffixConfig),
                           ("draft_head", DraftHeadSourceConfig)):
            raw = entry.get(name)
            if name == "draft_head" and raw is None and Source.draft_head not in sources:
                configs[name] = None  # manifests before the draft head have no such key
                continue
            if (raw is None) == (Source(name) in sources):
                raise bad(name, "must be given exactly when sources lists it")
            if raw is None:
                configs[name] = None
                continue
            if not isinstance(raw, dict) or set(raw) != set(kind.__dataclass_fields__):
                raise bad(name, f"must be an object with {', '.join(kind.__dataclass_fields__)}")
            for key, value in raw.items():
                want = float if key == "min_probability" else int
                if isinstance(value, bool) or not isinstance(value, (int, float) if want is float else int):
                    raise bad(f"{name}.{key}", f"{value!r} is not {'a number' if want is float else 'an integer'}")
            config = kind(**raw)
            if (problem := config.problem()) is not None:
                raise bad(name, problem)
            if config.num_tokens + 1 > verify:
                raise bad(name, f"num_tokens {config.num_tokens} + 1 exceeds verify_tokens {verify}")
            configs[name] = config
        return cls(sources, verify, **configs)

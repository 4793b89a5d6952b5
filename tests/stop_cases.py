"""Stop strings picked from a greedy run's own text, so each ends at a known token: inside one
token, across two tokens, and (for Medusa) at a token inside an accepted guess path. Shared by
the decoding paths' tests (tests/test_stop_strings.py, tests/test_tensor_parallel.py)."""
from __future__ import annotations

from dataclasses import dataclass

from trtbuild.runtime.core.sampling import SamplingParams

PROMPT = "class Stack:\n    def __init__(self):\n        self."
MAX_TOKENS = 40


@dataclass(frozen=True)
class StopCase:
    name: str
    stop: str
    token_ids: list[int]   # what the completion must hold: up to the token completing the stop
    text: str              # the text before the stop


def greedy_steps(llm, prompt: str = PROMPT, max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    """The request's tokens, grouped by the LLM step that committed them (a Medusa step commits
    its accepted path and the sampled token together)."""
    rid = llm.submit(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    groups = []
    while llm.has_work():
        deltas, _ = llm.step()
        tokens = [d.token_id for d in deltas if d.rid == rid and d.token_id >= 0]
        if tokens:
            groups.append(tokens)
    return groups


def stop_cases(tokenizer, groups: list[list[int]], in_path: bool = False) -> list[StopCase]:
    """One stop inside a token and one spanning two, each first found in the text where it ends
    at its token; ``in_path``: that token is an accepted guess (not the last of its step)."""
    tokens = [t for g in groups for t in g]
    last_of_step = set()
    count = 0
    for g in groups:
        count += len(g)
        last_of_step.add(count - 1)
    ends = [len(tokenizer.decode(tokens[:i + 1])) for i in range(len(tokens))]
    full = tokenizer.decode(tokens)
    cases = {}
    for i in range(2, len(tokens) - 2):
        if in_path and i in last_of_step:
            continue
        start, end = ends[i - 1], ends[i]
        piece = full[start:end]
        if full[:end] != tokenizer.decode(tokens[:i + 1]) or not piece.isascii():
            continue
        candidates = {"inside one token": piece[1:] if len(piece.strip()) >= 3 else None,
                      "across two tokens": full[start - 2:end] if start >= 2 and end - start >= 1 else None}
        for name, stop in candidates.items():
            if name in cases or not stop or not stop.strip():
                continue
            at = full.find(stop)
            if at + len(stop) == end and at + len(stop) > start:  # first seen here, completed by token i
                cases[name] = StopCase(name, stop, tokens[:i + 1], full[:at])
    assert set(cases) == {"inside one token", "across two tokens"}, (full, groups)
    return list(cases.values())


def check_stop(llm, case: StopCase, streamed: bool, logprobs: bool = False, prompt: str = PROMPT) -> None:
    """The completion ends at the stop (token ids, text, logprobs) and, streamed, the pieces
    join to exactly the completion's text."""
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, stop=(case.stop,), logprobs=logprobs)
    if streamed:
        deltas = list(llm.stream(prompt, params))
        completion = deltas[-1].completion
        assert "".join(d.text for d in deltas) == completion.text, case
        assert [d.token_id for d in deltas] == case.token_ids, case
    else:
        (completion,) = llm.generate([prompt], params)
    assert (completion.text, completion.token_ids, completion.finish_reason) == (case.text, case.token_ids, "stop"), case
    if logprobs:
        assert len(completion.logprobs) == len(case.token_ids)

#!/usr/bin/env python3
"""How often a built draft head guesses the target's next greedy token on text it never trained on.

For each prompt set (the speculation benchmark's free_chat questions, the held-out side of
benchmarks/chat_instructions.py, raw stdlib docstring starts as code), the engine answers
greedily; the target's features of prompt and answer come from one prefill of the whole text,
and the draft reads them teacher-forced (draft.onnx, every position at once): its depth-1 top-1
over the answer's positions is the share of first chain tokens greedy verification would keep.
This is the figure to hold against `trtbuild draft train`'s own held-out one (text of its training
files) and the one that predicts the speculation benchmark's free_chat rows.

    python benchmarks/draft_accuracy.py build/bench-speculation/smollm2-float32-draft [--questions FILE]
        [--windows 0,64,32,16,8]   (top-1 with the draft attending to only its last W positions)
        [--top 4]                  (also how often the token is among the draft's top 2 .. 4: what a
                                    tree of the draft's runners-up can keep, draft_head_source.py)
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))


def prompt_sets(template, questions: Path | None = None) -> dict[str, list[str]]:
    """The prompt sets, rendered with the engine's chat template; ``questions``: a file of one user
    question a line, a set of its own (your traffic, or questions of the draft's training text)."""
    from chat_instructions import instructions
    from speculation_workloads import prompts

    user = lambda q: template.render([{"role": "user", "content": q}])  # noqa: E731
    sets = {"free_chat": [template.render(m) for m in prompts("free_chat", True)],
            "chat_instructions_heldout": [user(q) for q in instructions("heldout")[:8]]}
    if questions is not None:
        if not questions.is_file():
            raise SystemExit(f"--questions {questions}: not a file")
        lines = [line.strip() for line in questions.read_text(encoding="utf-8").splitlines() if line.strip()]
        if not lines:
            raise SystemExit(f"--questions {questions}: no questions (one a line expected)")
        if questions.stem in sets:
            raise SystemExit(f"--questions {questions}: the name {questions.stem!r} is a built-in set's; rename the file")
        sets[questions.stem] = [user(q) for q in lines]
    return sets


def teacher_forced_ranks(d, engine, session, draft_to_target: np.ndarray, history: list[int], first: int,
                         windows: Sequence[int] = (0,), top: int = 1) -> dict[int, list[int]]:
    """Per window W (0: the whole history) and answer position p ≥ first: the rank of token p + 2
    among the draft's ``top`` likeliest at p (0: its argmax; ``top``: not among them), the draft
    attending to its own positions p − W + 1 .. p only."""
    from trtbuild.contract.step import step_arrays
    from trtbuild.runtime.core.step import Step, StepKind

    n = len(history) - 1
    out = engine.step(Step(kind=StepKind.prefill, first_slot=0, rids=("x",), tokens=(tuple(history[:n]),),
                           starts=(0,), samples=(True,)))
    hits = {}
    for window in windows:
        feeds = step_arrays(((*history[1:n + 1],),), (0,), d.max_seq_len).as_dict()
        if window:  # [1, 1, n, S_max]: a band of the causal mask
            query, key = np.arange(n)[:, None], np.arange(d.max_seq_len)[None]
            feeds["attention_mask"] = feeds["attention_mask"] & (query - key < window)[None, None]
        feeds["logits_index"] = np.arange(n, dtype=np.int64)[None]
        feeds["features"] = out.draft_features[:, :n].astype(np.float32)
        heads = session.get_inputs()[-1].shape  # [B, H_kv, S_max, D]
        cache = np.zeros((1, heads[1], d.max_seq_len, heads[3]), np.float32)
        feeds["past_key_0"], feeds["past_value_0"] = cache, cache.copy()
        logits = session.run(["draft_logits"], {i.name: feeds[i.name] for i in session.get_inputs()})[0][0]  # [n, K]
        ranked = draft_to_target[np.argsort(-logits, axis=-1, kind="stable")[:, :top]]  # [n, top]
        hits[window] = [int(np.flatnonzero(np.append(ranked[p] == history[p + 2], True))[0])
                        for p in range(first, n - 1)]
    return hits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("engine_dir", type=Path)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--questions", type=Path, help="a file of user questions, one a line: one more prompt set")
    parser.add_argument("--windows", default="0",
                        help="comma-separated attention windows of the draft over its own positions, a top-1 "
                             "column each (0: all of them; the runtime reads the newest 32, draft_head_source.py)")
    parser.add_argument("--top", type=int, default=1,
                        help="also the share of positions whose token is among the draft's top 2 .. N (whole history)")
    args = parser.parse_args()
    if args.top < 1:
        raise SystemExit(f"--top {args.top}: 1 or more expected")
    try:
        windows = [int(w) for w in args.windows.split(",")]
    except ValueError:
        windows = [-1]
    if not windows or min(windows) < 0:
        raise SystemExit(f"--windows {args.windows}: comma-separated whole numbers ≥ 0 expected (0: no window)")

    import onnxruntime as ort

    from trtbuild.runtime.backends.onnxruntime.engine import OnnxRuntimeEngine
    from trtbuild.runtime.core.sampling import SamplingParams
    from trtbuild.runtime.engine_dir import load
    from trtbuild.runtime.llm import LLM
    from trtbuild.runtime.server.chat import chat_template
    from trtbuild.runtime.speculation.draft_head_source import read_draft_map

    d = load(args.engine_dir)
    if d.draft_head is None:
        raise SystemExit(f"{args.engine_dir}: built without a draft head")
    sets = prompt_sets(chat_template(d), args.questions)
    with LLM(args.engine_dir, backend="onnxruntime", threads=args.threads, speculation=()) as llm:
        answers = {name: llm.generate(texts, SamplingParams(max_tokens=args.max_tokens)) for name, texts in sets.items()}
    engine = OnnxRuntimeEngine(d, threads=args.threads)
    session = ort.InferenceSession(str(d.path / d.draft_head.graph), providers=["CPUExecutionProvider"])
    draft_to_target = read_draft_map(d)
    print(f"draft head trained: held-out top-1 {d.draft_head.accuracy.get('top1')} (its training files' text)")
    heads = [f"top-1 W={w}" if w else "top-1" for w in windows] + [f"top-{k}" for k in range(2, args.top + 1)]
    needed = sorted(set(windows) | ({0} if args.top > 1 else set()))  # the top-k columns read the whole history
    print(f"{'prompt set':28} {'prompts':>7} {'positions':>9} " + " ".join(f"{h:>11}" for h in heads)
          + f"  per prompt ({heads[0]})")
    for name, done in answers.items():
        ranks = [teacher_forced_ranks(d, engine, session, draft_to_target,
                                      list(c.prompt_token_ids) + list(c.token_ids), len(c.prompt_token_ids) - 1,
                                      needed, args.top) for c in done]
        flat = {w: np.array([r for row in ranks for r in row[w]]) for w in needed}
        shares = [np.mean(flat[w] == 0) for w in windows] + [np.mean(flat[0] < k) for k in range(2, args.top + 1)]
        print(f"{name:28} {len(done):7d} {len(flat[windows[0]]):9d} " + " ".join(f"{x:11.3f}" for x in shares)
              + "  " + " ".join(f"{np.mean(np.array(row[windows[0]]) == 0):.2f}" for row in ranks if row[windows[0]]))


if __name__ == "__main__":
    main()

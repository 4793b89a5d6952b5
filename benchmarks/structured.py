#!/usr/bin/env python3
"""Structured outputs on the real model (SmolLM2-135M-Instruct): what a constraint costs and
what it buys, for llguidance (the runtime's engine) and xgrammar (the one not chosen).

    python benchmarks/structured.py [--engine-dir build/smollm2-engine] [--tokens 48] [--prompts 50] [--json]

The engine dir is specs/smollm2-135m.yaml built (`trtbuild build specs/smollm2-135m.yaml -o DIR`).
xgrammar is optional (`pip install --no-deps xgrammar apache-tvm-ffi`: its own requirements pull
triton); without it its rows are left out.

1. Compile: the tokenizer view (once per runtime), then a JSON Schema with nested objects and
   enums and a regex, first and cached, through the same compiler interface the runtime uses.
2. Decoding: ms per token of each sequence from its first token to its last (median of the batch)
   at batch 1 and 8, greedy, unconstrained against
   each constraint, each engine plugged into the same runtime (multi_step 1 for all, so the
   only difference is the mask: a constrained row never takes a multi-step run).
3. Validity: --prompts chat prompts asking for JSON, greedy, unconstrained, with ``json_object``
   and with the schema: how often does the text parse as a JSON object?
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
from trtbuild.builder.progress import table as format_table  # noqa: E402
from trtbuild.runtime.llm import LLM  # noqa: E402
from trtbuild.runtime.core.sampling import SamplingParams  # noqa: E402
from trtbuild.runtime.server.chat import chat_template  # noqa: E402
from trtbuild.runtime.structured import ConstraintCompiler, JsonObject, JsonSchema, Regex  # noqa: E402

SCHEMA = JsonSchema({
    "type": "object", "additionalProperties": False, "required": ["name", "age", "role", "address"],
    "properties": {
        "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {"type": "object", "additionalProperties": False, "required": ["city", "country"],
                    "properties": {"city": {"type": "string", "maxLength": 20},
                                   "country": {"enum": ["FR", "DE", "US", "JP"]}}}}})
REGEX = Regex(r"\+[0-9]{2} [0-9]{3} [0-9]{3} [0-9]{4}|[a-z]{3,12}@[a-z]{3,10}\.(com|org|net)")
THINGS = ["a user account", "a book", "a city", "a car", "a movie", "a laptop", "a recipe", "a planet", "a song",
          "a company", "a restaurant", "a flight", "a hotel room", "a bank transfer", "a weather report",
          "a pet dog", "a football match", "a museum", "a programming language", "a smartphone",
          "a university course", "a train ticket", "a painting", "a mountain", "a coffee order"]
ASKS = ["Give me a JSON object describing {}. Reply with JSON only.",
        "Return {} as a JSON object with a few fields. Output only the JSON."]


class XGrammarCompiler:
    """xgrammar behind the runtime's compiler interface (``compile(constraint)`` → an object
    whose ``matcher()`` gives ``allowed``/``masked``/``advance``/``rollback``)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]):
        import xgrammar
        from transformers import PreTrainedTokenizerFast

        self.xgr, self.vocab_size = xgrammar, vocab_size
        info = xgrammar.TokenizerInfo.from_huggingface(PreTrainedTokenizerFast(tokenizer_object=tokenizer),
                                                       vocab_size=vocab_size, stop_token_ids=list(eos_token_ids))
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1)  # caches compiled grammars itself

    def compile(self, constraint):
        if isinstance(constraint, JsonSchema):
            grammar = self.compiler.compile_json_schema(constraint.schema)
        elif isinstance(constraint, Regex):
            grammar = self.compiler.compile_regex(constraint.pattern)
        else:
            grammar = self.compiler.compile_builtin_json_grammar()
        return _XGrammarCompiled(self, grammar, constraint)


class _XGrammarCompiled:
    """As runtime/structured's CompiledConstraint: the constraint it compiled, and matchers."""

    def __init__(self, owner: XGrammarCompiler, grammar, constraint):
        self.owner, self.grammar, self.constraint = owner, grammar, constraint

    def matcher(self):
        return _XGrammarMatcher(self.owner, self.grammar)


class _XGrammarMatcher:
    def __init__(self, owner: XGrammarCompiler, grammar):
        self.matcher = owner.xgr.GrammarMatcher(grammar)
        self.vocab_size = owner.vocab_size
        self.failed = False   # a refused token (the runtime ends the request as "abort")
        self.bitmask = np.zeros((1, (owner.vocab_size + 31) // 32), np.int32)  # [1, ceil(V / 32)]
        import torch

        self.bitmask_torch = torch.from_numpy(self.bitmask)  # shares the numpy buffer

    def allowed(self) -> np.ndarray:
        self.matcher.fill_next_token_bitmask(self.bitmask_torch)
        return np.unpackbits(self.bitmask.view(np.uint8), bitorder="little")[:self.vocab_size].view(bool)

    def masked(self, logits: np.ndarray) -> np.ndarray:
        return np.where(self.allowed(), logits, -np.inf).astype(logits.dtype, copy=False)

    def advance(self, token: int) -> bool:
        self.failed = self.failed or not self.matcher.accept_token(token)
        return not self.failed and self.matcher.is_terminated()

    def rollback(self, tokens: int) -> None:
        if tokens:
            self.matcher.rollback(tokens)


def engines(llm: LLM) -> dict:
    d = llm.engine_dir
    made = {"llguidance": lambda: ConstraintCompiler(llm.tokenizer, d.vocab_size, d.eos_token_ids())}
    try:
        import xgrammar  # noqa: F401

        made["xgrammar"] = lambda: XGrammarCompiler(llm.tokenizer, d.vocab_size, d.eos_token_ids())
    except ImportError:
        print("xgrammar is not installed: its rows are left out", file=sys.stderr)
    return made


def compile_times(make) -> dict:
    start = time.perf_counter()
    compiler = make()
    compiler.compile(Regex("a"))  # llguidance builds its tokenizer view at the first compile
    out = {"tokenizer_ms": (time.perf_counter() - start) * 1e3}
    for name, constraint in (("schema", SCHEMA), ("regex", REGEX)):
        for when in ("first", "cached"):
            start = time.perf_counter()
            compiler.compile(constraint)
            out[f"{name}_{when}_ms"] = (time.perf_counter() - start) * 1e3
    return out


def decode_speed(llm: LLM, constraint, batch: int, tokens: int, prompts: list[str]) -> tuple[float, int]:
    """(decode ms per token of a sequence, from its first token to its last, the batch's median;
    tokens made) for one greedy batch, after a warm-up run of the same batch."""
    params = SamplingParams(max_tokens=tokens, ignore_eos=constraint is None, constraint=constraint)
    llm.generate(prompts[:batch], params)  # warm: compiles, and the engine's first steps
    outs = llm.generate(prompts[:batch], params)
    per_token = [(o.finish_s - o.first_token_s) * 1e3 / (len(o.token_ids) - 1) for o in outs if len(o.token_ids) > 1]
    return float(np.median(per_token)), sum(len(o.token_ids) for o in outs)


def valid_rate(llm: LLM, prompts: list[str], constraint, tokens: int) -> tuple[int, int]:
    outs = llm.generate(prompts, SamplingParams(max_tokens=tokens, constraint=constraint))
    ok = 0
    for out in outs:
        try:
            ok += isinstance(json.loads(out.text), dict)
        except json.JSONDecodeError:
            pass
    return ok, len(outs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine-dir", type=Path, default=REPO / "build" / "smollm2-engine")
    parser.add_argument("--tokens", type=int, default=48, help="max new tokens in the speed runs")
    parser.add_argument("--prompts", type=int, default=50, help="JSON-asking prompts in the validity run")
    parser.add_argument("--valid-tokens", type=int, default=160)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    llm = LLM(args.engine_dir, backend="onnxruntime", multi_step=1, speculation=())
    template = chat_template(llm.engine_dir)
    chats = [template.render([{"role": "user", "content": ASKS[i % 2].format(THINGS[i % len(THINGS)])}])
             for i in range(max(args.prompts, 8))]
    results: dict = {"compile": {}, "decode": {}, "valid": {}}
    for name, make in engines(llm).items():
        results["compile"][name] = compile_times(make)
        # The input processor compiles a request's constraint: it must hold this engine's compiler
        # (setting llm.constraints alone left it with llguidance's).
        llm.constraints = llm.inputs.constraints = make()
        for batch in (1, 8):
            for label, constraint in (("none", None), ("schema", SCHEMA), ("regex", REGEX)):
                if label == "none" and name != "llguidance":
                    continue  # unconstrained decoding does not involve the engine
                ms, made = decode_speed(llm, constraint, batch, args.tokens, chats)
                results["decode"][f"{label if label == 'none' else name + ' ' + label} b{batch}"] = {
                    "ms_per_token": ms, "tokens": made}
    llm.constraints = llm.inputs.constraints = engines(llm)["llguidance"]()
    for label, constraint in (("unconstrained", None), ("json_object", JsonObject()), ("schema", SCHEMA)):
        ok, total = valid_rate(llm, chats[:args.prompts], constraint, args.valid_tokens)
        results["valid"][label] = {"parsed": ok, "prompts": total}
    if args.json:
        print(json.dumps(results, indent=1))
        return
    rows = [[name, f"{c['tokenizer_ms']:.0f}", f"{c['schema_first_ms']:.1f}", f"{c['schema_cached_ms']:.3f}",
             f"{c['regex_first_ms']:.1f}", f"{c['regex_cached_ms']:.3f}"] for name, c in results["compile"].items()]
    print(format_table(rows, ["engine", "tokenizer ms", "schema ms", "cached", "regex ms", "cached"]))
    base = {b: results["decode"][f"none b{b}"]["ms_per_token"] for b in (1, 8)}
    rows = [[label, str(r["tokens"]), f"{r['ms_per_token']:.2f}", f"{r['ms_per_token'] / base[int(label[-1])] - 1:+.1%}"]
            for label, r in results["decode"].items()]
    print(format_table(rows, ["decode (greedy)", "tokens", "decode ms/token", "vs none"]))
    rows = [[label, f"{r['parsed']}/{r['prompts']}"] for label, r in results["valid"].items()]
    print(format_table(rows, [f"{args.prompts} JSON prompts", "parse as an object"]))


if __name__ == "__main__":
    main()

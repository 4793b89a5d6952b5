"""Structured outputs (runtime/structured/): constraint values, the compiler's cache, the
matcher's mask and Medusa walk, and constrained generation on every decoding path (bundled
model; the real model's JSON at the end)."""
from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
from tokenizers import Tokenizer

from trtbuild.runtime.core.tree import Accepted, Tree
from trtbuild.runtime.speculation.medusa import accept_greedy
from trtbuild.runtime.core.sampling import SamplingParams
from trtbuild.runtime.structured import (Choice, ConstraintCompiler, ConstraintError, Grammar,
                                         JsonObject, JsonSchema, Regex, TreeWalk)

from conftest import TINY_CODE

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "kind", "size"],
          "properties": {"name": {"type": "string", "maxLength": 6}, "kind": {"enum": ["cat", "dog"]},
                         "size": {"type": "object", "additionalProperties": False, "required": ["cm"],
                                  "properties": {"cm": {"type": "integer", "minimum": 0, "maximum": 999}}}}}
REGEX = r"[0-9]{3}-[a-z]{2,4}"
LONG_PROMPT = ("import os\nimport sys\n\ndef main(argv):\n    for name in argv:\n        print(name, os.path.exists(name))"
               "\n\nif __name__ == '__main__':\n    main(sys.argv)\n# the parser\ndef parse(text):")  # > max_input_len 32


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_file(str(TINY_CODE / "tokenizer.json"))


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return ConstraintCompiler(tokenizer, 4096, (0,))


# -- values and the compiler ------------------------------------------------------------------------
def test_constraint_values_are_checked_and_canonical():
    assert JsonSchema({"type": "object", "b": 1}) == JsonSchema('{"type": "object",  "b": 1}')
    assert JsonSchema({"type": "object", "b": 1}).schema == '{"type":"object","b":1}'   # order kept: it is the output's
    for make, message in [(lambda: JsonSchema("{nope"), "json schema: not JSON (Expecting property name enclosed "
                                                          "in double quotes at character 1)"),
                          (lambda: JsonSchema([1]), "json schema: must be a JSON object, got list"),
                          (lambda: Regex(""), "regex: must be a non-empty string"),
                          (lambda: Choice(()), "choice: must be a non-empty list of non-empty strings"),
                          (lambda: Grammar(" "), "grammar: must be a non-empty string")]:
        with pytest.raises(ConstraintError) as caught:
            make()
        assert str(caught.value) == message
    with pytest.raises(ValueError, match=r"^constraint must be one of JsonSchema, JsonObject, Regex, Grammar, "
                                         r"Choice \(got str\)$"):
        SamplingParams(constraint='{"type": "object"}')
    # A constrained request needs a mask every token: no batch argmax, no multi-step run.
    assert SamplingParams().takes_argmax and not SamplingParams(constraint=JsonObject()).takes_argmax


def test_compiler_caches_within_its_bound(tokenizer):
    compiler = ConstraintCompiler(tokenizer, 4096, (0,), cache_size=2)
    a, b, c = Regex("a+"), Regex("b+"), Choice(("x", "y"))
    first = compiler.compile(a)
    assert compiler.compile(Regex("a+")) is first and compiler.compiled == 1
    compiler.compile(b), compiler.compile(c)          # a is now the least recently used: evicted
    assert compiler.compiled == 3
    assert compiler.compile(c) is compiler.compile(c) and compiler.compiled == 3
    assert compiler.compile(a) is not first and compiler.compiled == 4


@pytest.mark.parametrize("constraint, message", [
    (Regex("(("), "regex: "), (Grammar("root ::= missing"), "grammar: "),
    (JsonSchema({"type": "nonsense"}), "json schema: ")])
def test_compiler_refuses_bad_constraints_naming_the_kind(compiler, constraint, message):
    with pytest.raises(ConstraintError) as caught:
        compiler.compile(constraint)
    assert str(caught.value).startswith(message) and len(str(caught.value)) > len(message)


def test_matcher_masks_and_ends(compiler, tokenizer):
    matcher = compiler.compile(Choice(("ab", "cd"))).matcher()
    allowed = matcher.allowed()
    assert allowed.shape == (4096,) and not allowed[0]          # eos: not before a choice is complete
    assert {tokenizer.id_to_token(i) for i in np.flatnonzero(allowed)} >= {"a", "c"}
    logits = np.zeros(4096, np.float32)
    masked = matcher.masked(logits)
    assert masked.dtype == np.float32 and np.isneginf(masked).sum() == 4096 - allowed.sum()
    assert not matcher.advance(tokenizer.token_to_id("c"))
    assert matcher.advance(tokenizer.token_to_id("d"))          # the grammar has ended


def test_a_refused_token_fails_the_matcher_and_never_ends_it(compiler, tokenizer):
    """llguidance reports an errored matcher as stopped too; that must not read as a grammar
    that ended (the engine core would finish the request as a successful "stop")."""
    matcher = compiler.compile(Choice(("ab", "cd"))).matcher()
    assert not matcher.failed
    assert not matcher.advance(tokenizer.token_to_id("x"))     # refused: not an end
    assert matcher.failed


@pytest.mark.parametrize("constraint", [
    JsonSchema({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}),
    JsonSchema({"$defs": {"a": {"type": "object", "properties": {"b": {"$ref": "#/$defs/b"}}, "required": ["b"]},
                          "b": {"type": "array", "items": {"$ref": "#/$defs/a"}, "minItems": 1}}, "$ref": "#/$defs/a"}),
    Grammar('start: ("a" start)'), Grammar('start: "x" rest\nrest: "ab" rest')],
    ids=["self-recursive", "ref-cycle", "lark", "lark-rule"])
def test_constraints_with_no_finite_text_are_refused(tokenizer, constraint):
    """llguidance compiles these and fails mid-answer; the compiler refuses them, saying why."""
    compiler = ConstraintCompiler(tokenizer, 4096, (0,), max_tokens=1024)
    with pytest.raises(ConstraintError) as caught:
        compiler.compile(constraint)
    assert str(caught.value).startswith(f"{constraint.kind}: no text of under 1024 tokens (the engine's max_seq_len) "
                                        "matches it: it forces at least ")
    # Recursion that may end compiles: an optional property, a grammar with a way out.
    for fine in (JsonSchema({"type": "object", "properties": {"a": {"$ref": "#"}}}), Grammar('start: "a" | "a" start')):
        assert compiler.compile(fine).matcher().allowed().any()


def test_a_grammar_that_fails_mid_answer_ends_as_length(llm, caplog):
    """One that cannot be told in advance (no text forced at its start, then forced without end)
    ends as "length", the text so far kept, llguidance's error logged: never as "abort"."""
    grammar = Grammar('start: "qqqzzz" | "d" rest\nrest: "a" rest')
    with caplog.at_level("WARNING", logger="trtbuild.runtime.engine_core"):
        [out] = llm.generate(["def f(x):"], SamplingParams(max_tokens=20, constraint=grammar))
    assert (out.text, out.finish_reason) == ("da", "length")
    assert "its constraint failed after 2 tokens, ended as length: parser error: Too many items" in caplog.text


@pytest.mark.parametrize("text", ['root ::= "yes" | "no"', 'start: "yes" | "no"'], ids=["gbnf", "lark"])
def test_grammars_in_either_syntax(compiler, tokenizer, text):
    matcher = compiler.compile(Grammar(text)).matcher()
    assert not matcher.advance(tokenizer.token_to_id("n"))
    assert not matcher.allowed()[tokenizer.token_to_id("y")]
    assert matcher.advance(tokenizer.token_to_id("o"))


def test_tree_walk_accepts_the_masked_argmax_and_rolls_back(compiler, tokenizer):
    """Greedy acceptance through the walk stops at the first token the grammar refuses: the raw
    argmax at the root is a letter, the digits-only grammar takes the best digit instead."""
    letter, seven, five = (tokenizer.token_to_id(t) for t in ("a", "7", "5"))
    tree = Tree(((0,), (1,), (0, 0)))                   # nodes: 1 = (0,), 2 = (1,), 3 = (0, 0)
    tokens = [seven, letter, seven, five]               # root, then node 1..3
    logits = np.zeros((4, 4096), np.float32)            # [T, V]
    logits[0, letter], logits[0, seven] = 5.0, 3.0     # root: raw argmax "a", masked "7" (node 2)
    logits[2, five] = 4.0                               # after "7": "5", but node 2 has no children
    assert accept_greedy(tree, tokens, logits) == Accepted((1,), (letter,))
    matcher = compiler.compile(Regex("[0-9]+")).matcher()
    walk = TreeWalk(matcher, tree, tokens, logits)
    path = accept_greedy(tree, tokens, walk)
    assert path == Accepted((2,), (seven,))
    row = walk.finish(path.nodes)                       # the row after "7", masked: "5" or eos may follow
    assert int(np.argmax(row)) == five and np.isfinite(row[0]) and np.isneginf(row[letter])
    assert not matcher.allowed()[0]                     # rolled back to the root: eos not yet allowed


@pytest.mark.parametrize("rule", ["greedy", "sampled"])
def test_a_draft_past_the_grammars_end_is_cut_there(compiler, tokenizer, rule):
    """A chain drafting "c", "d", eos, "c" where the grammar (a choice of "cd") ends after "d",
    the model agreeing all along: every acceptance rule (greedy, and the seeded exact sampling every
    source's sampled rows use) takes the eos the ended grammar allows, and the walk keeps "c", "d"
    only. llguidance takes an eos after the end without counting it: taken into the matcher,
    the rollback would undo one token too many and the commit would find the grammar broken."""
    from trtbuild.runtime.core.sampling import Sampler
    from trtbuild.runtime.speculation.chain import chain_tree
    from trtbuild.runtime.speculation.medusa import accept_sampled

    c, d = tokenizer.token_to_id("c"), tokenizer.token_to_id("d")
    tree, tokens = chain_tree(4), [d, c, d, 0, c]       # root, then nodes 1..4
    logits = np.zeros((5, 4096), np.float32)            # [T, V]
    for node, token in enumerate(tokens[1:]):
        logits[node, token] = 30.0                      # each node's row: its child's token, by far
    matcher = compiler.compile(Choice(("cd", "ab"))).matcher()
    walk = TreeWalk(matcher, tree, tokens, logits)
    if rule == "greedy":
        path = accept_greedy(tree, tokens, walk)
    else:
        path = accept_sampled(tree, tokens, walk, Sampler(SamplingParams(temperature=1.0, seed=0)), position=0)
    assert path.nodes == (1, 2, 3)                      # the eos too: the masked row after "cd" allows only it
    assert walk.kept(path.nodes) == 2
    row = walk.finish(path.nodes[:2])
    assert np.flatnonzero(np.isfinite(row)).tolist() == [0]     # after "cd": the grammar has ended
    assert not matcher.advance(c) and matcher.advance(d)        # back at the root, in step with the commit


# -- generation on the bundled model ----------------------------------------------------------------
def _valid(constraint, text: str) -> bool:
    if isinstance(constraint, JsonSchema):
        jsonschema.validate(json.loads(text), json.loads(constraint.schema))
        return True
    if isinstance(constraint, JsonObject):
        return isinstance(json.loads(text), dict)
    if isinstance(constraint, Regex):
        return re.fullmatch(constraint.pattern, text) is not None
    return text in constraint.options


@pytest.fixture(scope="module")
def llm(tiny_engine):
    from trtbuild.runtime.llm import LLM

    return LLM(tiny_engine, backend="onnxruntime", multi_step=1)


@pytest.mark.parametrize("constraint", [JsonSchema(SCHEMA), Regex(REGEX), Choice(("alpha", "beta", "gamma"))],
                         ids=["schema", "regex", "choice"])
def test_sampled_outputs_match_their_constraint(llm, constraint):
    seeds = range(24)
    params = [SamplingParams(max_tokens=96, temperature=1.0, seed=seed, constraint=constraint) for seed in seeds]
    outs = llm.generate(["def f(x):"] * 12 + [LONG_PROMPT] * 12, params)
    assert [o.finish_reason for o in outs] == ["stop"] * len(outs)
    assert all(_valid(constraint, o.text) for o in outs)
    assert all(0 not in o.token_ids for o in outs)      # the grammar's end finished them, not an eos
    assert len({o.text for o in outs}) > 1              # sampling did sample


def test_greedy_constrained_output_is_the_same_on_every_path(tiny_engine, llm):
    """Plain steps, multi-step runs, chunked prefill and batches mixing constrained and free
    rows give the same constrained tokens; a free row gives exactly its unconstrained tokens."""
    from trtbuild.runtime.llm import LLM

    constrained = [SamplingParams(max_tokens=60, constraint=c) for c in (JsonSchema(SCHEMA), Regex(REGEX))]
    free = SamplingParams(max_tokens=90, ignore_eos=True)   # outlives the constrained rows: runs follow them
    prompts = [LONG_PROMPT, "def f(x):"]
    alone = [llm.generate([p], c)[0] for p, c in zip(prompts, constrained)]
    free_alone = llm.generate(["class A:"], free)[0].token_ids
    assert [o.finish_reason for o in alone] == ["stop", "stop"] and all(_valid(c.constraint, o.text)
                                                                          for c, o in zip(constrained, alone))
    assert list(json.loads(alone[0].text)) == ["name", "kind", "size"]   # the schema's order
    for multi_step in (1, 4):
        runner = llm if multi_step == 1 else LLM(tiny_engine, backend="onnxruntime", multi_step=4)
        runs = runner.stats.greedy_runs
        mixed = runner.generate([prompts[0], "class A:", prompts[1]], [constrained[0], free, constrained[1]])
        assert [m.token_ids for m in (mixed[0], mixed[2])] == [o.token_ids for o in alone]
        assert mixed[1].token_ids == free_alone
        # The same generate ran multi-step runs (the free row, once the constrained ones ended) ...
        assert (runner.stats.greedy_runs > runs) == (multi_step > 1)
    # ... and never with a constrained row in flight: runs take the raw argmax, which no mask touches.
    runs = runner.stats.greedy_runs
    assert [o.token_ids for o in runner.generate(prompts, constrained)] == [o.token_ids for o in alone]
    assert runner.stats.greedy_runs == runs


def test_medusa_acceptance_follows_the_grammar(medusa_engine):
    """Greedy constrained tokens with Medusa verifying equal those without; sampled ones match."""
    from trtbuild.runtime.llm import LLM

    plain = LLM(medusa_engine, backend="onnxruntime", medusa_tree_size=0, multi_step=1)
    medusa = LLM(medusa_engine, backend="onnxruntime", medusa_tree_size=8, multi_step=1)
    params = [SamplingParams(max_tokens=60, constraint=c) for c in (JsonSchema(SCHEMA), Regex(REGEX), JsonObject())]
    prompts = ["def f(x):", LONG_PROMPT, "class A:"]
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    got = medusa.generate(prompts, params)
    assert [o.token_ids for o in got] == expected
    assert sum(o.accepted_tokens for o in got) > 0      # the trees were verified, and some guesses taken
    sampled = [SamplingParams(max_tokens=96, temperature=0.7, seed=s, constraint=JsonSchema(SCHEMA)) for s in range(8)]
    assert all(_valid(JsonSchema(SCHEMA), o.text) for o in medusa.generate(["def f(x):"] * 8, sampled))


def test_stops_and_limits_keep_their_meaning(llm):
    schema = JsonSchema(SCHEMA)
    [cut] = llm.generate(["def f(x):"], SamplingParams(max_tokens=3, constraint=schema))
    assert cut.finish_reason == "length" and len(cut.token_ids) == 3
    [full] = llm.generate(["def f(x):"], SamplingParams(max_tokens=60, constraint=schema))
    [exact] = llm.generate(["def f(x):"], SamplingParams(max_tokens=len(full.token_ids), constraint=schema))
    assert exact.token_ids == full.token_ids and exact.finish_reason == "stop"   # complete at its last token
    [stopped] = llm.generate(["def f(x):"], SamplingParams(max_tokens=60, constraint=schema, stop=('"kind"',)))
    assert stopped.finish_reason == "stop" and full.text.startswith(stopped.text) and '"kind"' not in stopped.text


def test_real_model_json_matches_its_schema(smollm2_engine):
    """SmolLM2-135M-Instruct asked for JSON through its chat template: every sampled answer
    parses and validates, and greedy ones are the same with the batch's other rows free."""
    from trtbuild.runtime.llm import LLM
    from trtbuild.runtime.server.chat import chat_template

    person = {"type": "object", "additionalProperties": False, "required": ["name", "age", "role", "address"],
              "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0,
                                                                                  "maximum": 150},
                             "role": {"enum": ["admin", "user", "guest"]},
                             "address": {"type": "object", "additionalProperties": False, "required": ["city"],
                                         "properties": {"city": {"type": "string", "maxLength": 20}}}}}
    llm = LLM(smollm2_engine, backend="onnxruntime")
    prompt = chat_template(llm.engine_dir).render([{"role": "user", "content": "Describe a user of a web shop as JSON."}])
    sampled = [SamplingParams(max_tokens=80, temperature=0.8, seed=seed, constraint=JsonSchema(person)) for seed in range(8)]
    outs = llm.generate([prompt] * 8, sampled)
    assert [o.finish_reason for o in outs] == ["stop"] * 8 and all(_valid(JsonSchema(person), o.text) for o in outs)
    greedy = SamplingParams(max_tokens=80, constraint=JsonSchema(person))
    [alone] = llm.generate([prompt], greedy)
    mixed = llm.generate([prompt, prompt], [greedy, SamplingParams(max_tokens=16, ignore_eos=True)])
    assert mixed[0].token_ids == alone.token_ids and _valid(JsonSchema(person), alone.text)
    assert mixed[1].token_ids == llm.generate([prompt], SamplingParams(max_tokens=16, ignore_eos=True))[0].token_ids


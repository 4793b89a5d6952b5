#!/usr/bin/env python3
"""Everyday chat questions answered by the model itself: training text for `trtbuild draft train`.

A draft head learns what its target says; trained only on prose and "write a function" prompts,
SmolLM2's draft kept 0.08–0.19 of its guesses on free-chat answers (benchmarks/speculation.py's
free_chat), against 0.66 held out. So this asks the model everyday questions (templates × topics
written here, none of them benchmarks/speculation_texts.py's QUESTIONS or their topics), renders
each with the engine's chat template, lets a built engine answer greedily, and writes prompt and
answer, one conversation per paragraph. Teacher-forced training on that text (`--no-self-distill`)
is self-distillation at prefill cost: the answers are the model's own greedy text.

Questions a template writes vary only in their topic. ``--self-questions N`` also asks N questions
the model writes itself: its chat template up to the user's turn, sampled at
``--question-temperature`` until the turn ends (the Magpie recipe: an instruction-tuned model,
given only the user turn's header, writes the kind of request it was tuned on). Questions cut off
at ``--question-tokens``, shorter than 12 characters, repeated, or among the benchmark's are
dropped and more are drawn (``--skip`` and ``--limit`` apply to the listed questions; the
self-written ones come on top). ``--questions-out`` writes every question asked, one a line.

    python tools/chat_answers.py build/smollm2-engine -o build/draft-data/answers.txt
    python tools/chat_answers.py build/smollm2-engine -o build/draft-data/words.txt --words 900 --skip 290
    python tools/chat_answers.py build/smollm2-engine -o build/draft-data/more.txt --words 4000 --word-seed 1 \
        --word-templates all --skip 290
    python tools/chat_answers.py build/smollm2-engine -o build/draft-data/self.txt --self-questions 2000 --skip 290 \
        --questions-out build/draft-data/self_questions.txt
"""
from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

ACTIVITIES = ("cooking pasta", "saving money", "learning a new language", "running a first marathon",
              "growing tomatoes on a balcony", "writing a resume", "public speaking", "sleeping better",
              "baking bread", "painting with watercolors", "camping in the mountains", "moving to a new city",
              "preparing for a job interview", "keeping a journal", "learning to swim", "drawing portraits",
              "starting a vegetable garden", "studying for exams", "making new friends", "planning a road trip",
              "cycling to work", "learning to cook for a family", "organizing a small kitchen", "reading more books",
              "taking better photos", "keeping houseplants alive", "learning chess", "training for a 5k run",
              "saving energy at home", "writing a thank-you letter")
CONCEPTS = ("photosynthesis", "how volcanoes form", "the phases of the moon", "how rainbows appear", "earthquakes",
            "recycling", "how electric cars work", "how the internet works", "black holes", "why honeybees matter",
            "how airplanes stay in the air", "ocean tides", "why we have seasons", "how memory works",
            "how habits form", "inflation", "how a compass works", "the water cycle", "why leaves change color",
            "how batteries store energy", "the immune system's fever response", "how bread rises",
            "why the ocean is salty", "how glaciers move", "how solar panels work", "what causes thunder",
            "how a refrigerator keeps food cold", "why cats purr", "how bridges carry weight", "how maps are made")
THINGS = ("a lighthouse at night", "a train journey through the hills", "autumn leaves", "a quiet library",
          "a rainy afternoon", "the ocean at dawn", "an old oak tree", "a busy market", "a snowy village",
          "a kite on a windy day", "a cup of hot tea", "a mountain lake", "a street musician", "a garden in spring",
          "the first day of school", "a lost umbrella", "a bakery before sunrise", "fireflies in summer",
          "a harbor full of boats", "a desert at noon")
EVENTS = ("a family picnic", "a retirement party", "a rainy weekend at home", "a school science fair",
          "a small wedding", "a team-building day at work", "a picnic in the park", "a holiday dinner",
          "a charity bake sale", "a housewarming party")

TEMPLATES = (
    (ACTIVITIES, ("What are some tips for {}?", "How can I get better at {}?",
                  "What should I know before I start {}?", "Suggest a one-month plan for {}.")),
    (CONCEPTS, ("Explain {} in simple terms.", "Can you tell me about {}?", "Describe {} to a ten-year-old.")),
    (THINGS, ("Write a short poem about {}.", "Write a short story about {}.", "Describe {} in a few sentences.")),
    (EVENTS, ("Give me ideas for {}.", "How do I plan {}?")),
)


WORD_TEMPLATES = ("Write a short paragraph about {}.", "What does the word \"{}\" mean? Use it in a sentence.",
                  "Tell me something interesting about {}.")
# More ways to ask about a word (--word-templates all): instructions, advice, stories and
# explanations, as people chat, so the answers' forms vary as much as their topics.
MORE_WORD_TEMPLATES = ("Give me three tips related to {}.", "Explain {} to a beginner.",
                       "Write a short poem about {}.", "Why does {} matter in everyday life?",
                       "Write a short story that uses the word \"{}\".", "What are the pros and cons of {}?",
                       "How would you describe {} to a friend?", "List a few facts about {}.",
                       "What questions should I ask to learn about {}?")
WORD_TEMPLATE_SETS = {"three": WORD_TEMPLATES, "all": WORD_TEMPLATES + MORE_WORD_TEMPLATES}


def vocabulary_words(tokenizer, count: int, seed: int = 0) -> list[str]:
    """``count`` English-looking words from the model's own vocabulary (whole-word tokens of 5 to
    10 lower-case letters), drawn with ``seed``: topics nobody here picked, as varied as the
    vocabulary."""
    import numpy as np

    words = sorted({t for t in (tokenizer.decode([i]) for i in range(tokenizer.get_vocab_size()))
                    if t.startswith(" ") and t[1:].isalpha() and t[1:].islower() and 5 <= len(t) - 1 <= 10})
    chosen = np.random.default_rng(seed).choice(len(words), size=min(count, len(words)), replace=False)
    return [words[i].strip() for i in sorted(chosen)]


def benchmark_questions() -> tuple[str, ...]:
    """The speculation benchmark's free-chat questions: never training text."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from speculation_texts import QUESTIONS

    return QUESTIONS


def questions(words: list[str] = (), word_templates: tuple[str, ...] = WORD_TEMPLATES) -> list[str]:
    """Every question, in a fixed order (the templated topics, then one per word of ``words``,
    ``word_templates`` taking turns); none is a benchmark prompt."""
    out = [template.format(topic) for topics, templates in TEMPLATES for template, topic in
           itertools.product(templates, topics)]
    out += [word_templates[i % len(word_templates)].format(word) for i, word in enumerate(words)]
    overlap = set(out) & set(benchmark_questions())
    if overlap:
        raise SystemExit(f"benchmark questions among the training ones: {sorted(overlap)}")
    return out


QUESTION_MARK = "\x00question\x00"   # stands for the user's text when the template is split
MIN_QUESTION_CHARS = 12
SELF_QUESTION_CHUNK = 256          # questions sampled per generate call (progress between)


def user_turn(template) -> tuple[str, str]:
    """The chat template split at the user's text: what comes before it (system turn and the user
    turn's header) and the marker that ends the user's turn (the first line of what follows it)."""
    rendered = template.render([{"role": "user", "content": QUESTION_MARK}])
    before, _, after = rendered.partition(QUESTION_MARK)
    end = after.strip().split("\n", 1)[0].strip()   # "<|im_end|>", or the next role's "<|assistant|>"
    if not before or not end:
        raise SystemExit("the chat template has no user turn with an end marker to split at")
    return before, end


def _key(question: str) -> str:
    """What two questions share when they differ only in case, spacing or punctuation."""
    return "".join(ch for ch in question.casefold() if ch.isalnum())


def self_questions(llm, template, count: int, seed: int, temperature: float, max_tokens: int,
                   excluded: set[str], stop_ids: tuple[int, ...] = ()) -> list[str]:
    """``count`` distinct questions the model writes after its template's user-turn header, each
    sampled with its own seed (``seed`` picks the series); cut-off, short, repeated or ``excluded``
    ones (case, spacing and punctuation aside) are dropped and more drawn, up to 4 × ``count``
    samples. ``stop_ids``: the end marker's token id where it is one token (a special token's
    text never reaches the stop strings)."""
    from trtbuild.runtime.core.sampling import SamplingParams

    header, end = user_turn(template)
    kept: list[str] = []
    seen = {_key(q) for q in excluded}
    drawn, started = 0, time.perf_counter()
    while len(kept) < count and drawn < 4 * count:
        # About twice what is still missing (a third to a half of samples are dropped), in chunks.
        n = min(SELF_QUESTION_CHUNK, 4 * count - drawn, max(16, 2 * (count - len(kept))))
        params = [SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=(seed << 32) + drawn + i,
                                 stop=(end,), stop_token_ids=stop_ids) for i in range(n)]
        finished = 0
        for done in llm.generate([header] * n, params):
            text = " ".join(done.text.split())
            finished += done.finish_reason == "stop"
            if done.finish_reason == "stop" and len(text) >= MIN_QUESTION_CHARS and _key(text) not in seen:
                seen.add(_key(text))
                kept.append(text)
        if not drawn and not finished:
            raise SystemExit(f"none of {n} sampled questions ended with the template's end marker {end!r} "
                             f"within {max_tokens} tokens: raise --question-tokens, or the model does not "
                             "write user turns")
        drawn += n
        print(f"self-written questions: {min(len(kept), count)}/{count} kept of {drawn} drawn "
              f"({time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)
    if len(kept) < count:
        print(f"only {len(kept)} usable questions in {drawn} samples", file=sys.stderr)
    return kept[:count]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("engine", type=Path, help="a built engine dir of the model (with a chat template)")
    parser.add_argument("-o", "--out", type=Path, required=True)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--limit", type=int, default=0,
                        help="ask only the first N listed questions (0: all; self-written ones come on top)")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--words", type=int, default=0,
                        help="also ask about this many words of the model's vocabulary (more varied text)")
    parser.add_argument("--skip", type=int, default=0,
                        help="leave out the first N listed questions (asked before; 290 leaves out the templated ones)")
    parser.add_argument("--word-seed", type=int, default=0,
                        help="which words --words draws (another seed: other words, for more text)")
    parser.add_argument("--word-templates", choices=tuple(WORD_TEMPLATE_SETS), default="three",
                        help="how a word is asked about: the first three templates, or all twelve")
    parser.add_argument("--self-questions", type=int, default=0,
                        help="also ask this many questions the model writes itself (after the listed ones)")
    parser.add_argument("--question-seed", type=int, default=0, help="which self-written questions (another seed: others)")
    parser.add_argument("--question-temperature", type=float, default=1.0,
                        help="sampling temperature of the self-written questions")
    parser.add_argument("--question-tokens", type=int, default=64,
                        help="longest self-written question, in tokens (longer ones are dropped)")
    parser.add_argument("--questions-out", type=Path, help="also write the questions asked, one a line")
    args = parser.parse_args()
    if args.self_questions < 0 or args.question_seed < 0 or args.question_tokens < 1:
        parser.error("--self-questions and --question-seed must be ≥ 0, --question-tokens ≥ 1")
    if not args.question_temperature > 0:
        parser.error(f"--question-temperature {args.question_temperature}: must be > 0")

    from trtbuild.runtime.core.sampling import SamplingParams
    from trtbuild.runtime.engine_dir import load
    from trtbuild.runtime.llm import LLM
    from trtbuild.runtime.server.chat import chat_template

    try:
        engine_dir = load(args.engine)
    except ValueError as exc:  # EngineDirError: not an engine dir, a file that fails its hash
        parser.error(str(exc))
    words = vocabulary_words(llm_tokenizer(engine_dir), args.words, args.word_seed) if args.words else []
    templates = WORD_TEMPLATE_SETS[args.word_templates]
    listed = questions(words, templates)
    template = chat_template(engine_dir)
    end_ids = llm_tokenizer(engine_dir).encode(user_turn(template)[1], add_special_tokens=False).ids
    start = time.perf_counter()
    with LLM(args.engine, backend="onnxruntime", threads=args.threads, speculation=()) as llm:
        written = (self_questions(llm, template, args.self_questions, args.question_seed, args.question_temperature,
                                  args.question_tokens, set(listed) | set(benchmark_questions()),
                                  tuple(end_ids) if len(end_ids) == 1 else ())
                   if args.self_questions else [])
        asked = listed[args.skip:][:args.limit or None] + written
        prompts = [template.render([{"role": "user", "content": q}]) for q in asked]
        done = []
        for at in range(0, len(prompts), SELF_QUESTION_CHUNK):
            done += llm.generate(prompts[at:at + SELF_QUESTION_CHUNK], SamplingParams(max_tokens=args.max_tokens))
            print(f"answered {len(done)}/{len(prompts)} ({time.perf_counter() - start:.0f} s)",
                  file=sys.stderr, flush=True)
    tokens = sum(len(c.token_ids) for c in done)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n\n".join(p + c.text for p, c in zip(prompts, done)) + "\n", encoding="utf-8")
    if args.questions_out is not None:
        args.questions_out.parent.mkdir(parents=True, exist_ok=True)
        args.questions_out.write_text("".join(q + "\n" for q in asked), encoding="utf-8")
    seconds = time.perf_counter() - start
    print(f"{len(asked)} questions, {tokens} answer tokens in {seconds:.0f} s ({tokens / seconds:.0f} tok/s) "
          f"→ {args.out}", file=sys.stderr)


def llm_tokenizer(engine_dir):
    from trtbuild.checkpoint.tokenizer import tokenizer_from

    path = engine_dir.side_file("tokenizer.json")
    return tokenizer_from(path.read_bytes(), str(path))


if __name__ == "__main__":
    main()

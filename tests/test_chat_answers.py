"""tools/chat_answers.py's self-written questions: the template split at the user's turn, and what
is kept of the model's samples (an engine stand-in that answers by seed, so every rule is exact)."""
from __future__ import annotations

import importlib.util
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from trtbuild.runtime.server.chat import DEFAULT_TEMPLATE, ChatTemplate

TOOL = Path(__file__).resolve().parents[1] / "tools" / "chat_answers.py"
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("chat_answers", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules["chat_answers"] = module
    spec.loader.exec_module(module)
    return module


@dataclass
class _Done:
    text: str
    finish_reason: str


class _Model:
    """Answers sample ``seed`` with SAMPLES[seed % len]; records every prompt and parameter set."""

    def __init__(self, samples):
        self.samples, self.prompts, self.params = samples, [], []

    def generate(self, prompts, params):
        self.prompts += prompts
        self.params += params
        return [_Done(*self.samples[p.seed % len(self.samples)]) for p in params]


def test_the_template_splits_at_the_users_turn(tool):
    assert tool.user_turn(ChatTemplate(CHATML)) == ("<|im_start|>user\n", "<|im_end|>")
    header, end = tool.user_turn(ChatTemplate("<|im_start|>system\nBe brief.<|im_end|>\n" + CHATML))
    assert header == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n" and end == "<|im_end|>"
    assert tool.user_turn(ChatTemplate(DEFAULT_TEMPLATE)) == ("<|user|>\n", "<|assistant|>")


def test_a_template_without_a_user_turn_is_refused(tool):
    with pytest.raises(SystemExit, match="no user turn"):
        tool.user_turn(ChatTemplate("{{ messages[0].content }}"))


def test_cut_short_repeated_and_benchmark_questions_are_dropped_and_more_drawn(tool):
    samples = [("How do I  brew\\n green tea?".replace("\\n", "\n"), "stop"),
               ("Too short", "stop"),                                  # < 12 characters
               ("How do I brew green tea?", "stop"),                   # the first, whitespace aside
               ("Write a long story about a dragon who", "length"),    # cut off at the token limit
               ("what is the capital of France", "stop"),              # excluded, case and "?" aside
               ("Plan a week of vegetarian dinners.", "stop"),
               ("Explain how a bicycle stays upright.", "stop")]
    model = _Model(samples)
    template = ChatTemplate(DEFAULT_TEMPLATE)
    kept = tool.self_questions(model, template, 3, seed=2, temperature=0.9, max_tokens=32,
                               excluded={"What is the capital of France?"})
    assert kept == ["How do I brew green tea?", "Plan a week of vegetarian dinners.",
                    "Explain how a bicycle stays upright."]
    assert set(model.prompts) == {"<|user|>\n"}
    assert {(p.temperature, p.max_tokens, p.stop, p.stop_token_ids) for p in model.params} == \
        {(0.9, 32, ("<|assistant|>",), ())}
    seeds = [p.seed for p in model.params]
    assert len(set(seeds)) == len(seeds) and min(seeds) >= 2 << 32   # another --question-seed: other samples


def test_it_stops_drawing_at_four_samples_a_question(tool, capsys):
    model = _Model([("Too short", "stop")])
    assert tool.self_questions(model, ChatTemplate(DEFAULT_TEMPLATE), 5, 0, 1.0, 16, set()) == []
    assert len(model.params) == 20
    assert "only 0 usable questions in 20 samples" in capsys.readouterr().err


def test_a_model_that_never_ends_the_turn_is_refused_after_one_chunk(tool):
    model = _Model([("and so on and so on", "length")])
    with pytest.raises(SystemExit, match=re.escape("none of 16 sampled questions ended with the template's "
                                                   "end marker '<|assistant|>' within 16 tokens")):
        tool.self_questions(model, ChatTemplate(DEFAULT_TEMPLATE), 5, 0, 1.0, 16, set())
    assert len(model.params) == 16


def test_a_one_token_end_marker_stops_by_its_id(tool):
    model = _Model([("How do I brew green tea?", "stop")])
    tool.self_questions(model, ChatTemplate(CHATML), 1, 0, 1.0, 16, set(), stop_ids=(2,))
    assert {p.stop_token_ids for p in model.params} == {(2,)}


def test_a_missing_engine_dir_is_one_line_and_exit_2(tmp_path):
    import subprocess

    out = tmp_path / "answers.txt"
    done = subprocess.run([sys.executable, str(TOOL), str(tmp_path / "nowhere"), "-o", str(out), "--self-questions", "2"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and not out.exists()
    assert done.stderr.strip().splitlines()[-1] == (f"chat_answers.py: error: {tmp_path / 'nowhere'}: not an engine dir "
                                                    f"(no manifest.json); build one with `trtbuild build SPEC -o "
                                                    f"{tmp_path / 'nowhere'}`")
    assert "Traceback" not in done.stderr

"""Stop strings on every single-process decoding path (plain, multi-step runs, Medusa
verification) × streamed and not: token ids, text and logprobs end at the stop, and streamed
text equals the completion's (tensor parallel: tests/test_tensor_parallel.py)."""
from __future__ import annotations

import pytest

from trtbuild.runtime.llm import LLM

from stop_cases import check_stop, greedy_steps, stop_cases

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def plain(tiny_engine):
    return LLM(tiny_engine, backend="onnxruntime", threads=2, multi_step=1)


@pytest.fixture(scope="module")
def multi_step(tiny_engine):
    return LLM(tiny_engine, backend="onnxruntime", threads=2, multi_step=8)


@pytest.fixture(scope="module")
def medusa(medusa_engine):
    return LLM(medusa_engine, backend="onnxruntime", threads=2, medusa_tree_size=63)


@pytest.mark.parametrize("streamed", [False, True])
def test_plain_decoding_ends_at_the_stop(plain, streamed):
    for case in stop_cases(plain.tokenizer, greedy_steps(plain)):
        check_stop(plain, case, streamed, logprobs=not streamed)


@pytest.mark.parametrize("streamed", [False, True])
def test_multi_step_runs_end_at_the_stop(multi_step, streamed):
    groups = greedy_steps(multi_step)
    assert max(map(len, groups)) > 1  # the tokens came in runs
    for case in stop_cases(multi_step.tokenizer, groups):
        check_stop(multi_step, case, streamed)


@pytest.mark.parametrize("streamed", [False, True])
def test_medusa_ends_at_a_stop_inside_an_accepted_path(medusa, streamed):
    for case in stop_cases(medusa.tokenizer, greedy_steps(medusa), in_path=True):
        check_stop(medusa, case, streamed, logprobs=not streamed)

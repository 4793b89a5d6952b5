"""One validation for every caller: the same bad prompt is refused with the same message, field
and code through the input processor, ``LLM.submit`` and the server's request handling (its
OpenAI-shaped 400), without starting a server. (Text that is not UTF-8 cannot reach the server's
check: its JSON parser refuses lone surrogates first; tests/test_trust_boundary.py covers LLM's.)"""
from __future__ import annotations

import json

import pytest

from conftest import TINY_CODE
from trtbuild.runtime.input_processor import InputProcessor, InputRefused
from trtbuild.runtime.core.sampling import SamplingParams
from trtbuild.runtime.server.chat import DEFAULT_TEMPLATE, ChatTemplate
from trtbuild.runtime.server.inputs import Inputs, Limits
from trtbuild.runtime.server.protocol import ApiError

VOCAB, MAX_SEQ_LEN = 4096, 1024  # the bundled model, specs/tiny-code.yaml
BAD = [  # prompt, max_tokens, the field at fault, code, message
    ([5, -1], 2, "prompt", None, "prompt: token id -1 is outside the vocabulary [0, 4096)"),
    ([4096], 2, "prompt", None, "prompt: token id 4096 is outside the vocabulary [0, 4096)"),
    ("", 2, "prompt", None, "prompt: empty"),
    ([5] * MAX_SEQ_LEN, 2, "prompt", "context_length_exceeded",
     f"prompt: {MAX_SEQ_LEN} tokens leave no room to generate within max_seq_len {MAX_SEQ_LEN}"),
    ([5, 17, 300], 5000, "max_tokens", "context_length_exceeded",
     f"prompt: 3 tokens + max_tokens 5000 exceeds max_seq_len {MAX_SEQ_LEN}"),
]
IDS = [case[-1][:40] for case in BAD]


def _server_inputs(processor: InputProcessor) -> Inputs:
    return Inputs(processor, "tiny", Limits(max_body_bytes=1 << 20, max_prompt_chars=100_000, max_queue=8,
                                            body_timeout=5.0),
                  ChatTemplate(DEFAULT_TEMPLATE))


def _served(inputs: Inputs, prompt, max_tokens: int) -> tuple:
    with pytest.raises(ApiError) as refused:
        inputs.completion(json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": max_tokens}).encode())
    return refused.value.status, refused.value.message, refused.value.param, refused.value.code


@pytest.fixture(scope="module")
def processor() -> InputProcessor:
    """The bundled tokenizer under the two limits the rules read from an engine dir's manifest."""
    from tokenizers import Tokenizer

    from trtbuild.runtime.engine_dir import EngineDir

    manifest = {"model": {"vocab_size": VOCAB}, "limits": {"max_seq_len": MAX_SEQ_LEN}, "spec": {}}
    return InputProcessor(Tokenizer.from_file(str(TINY_CODE / "tokenizer.json")), EngineDir(TINY_CODE, manifest))


@pytest.mark.parametrize("prompt, max_tokens, param, code, message", BAD, ids=IDS)
def test_the_server_refuses_with_the_input_processors_message(processor, prompt, max_tokens, param, code, message):
    with pytest.raises(InputRefused) as direct:
        processor.process(prompt, SamplingParams(max_tokens=max_tokens))
    assert (str(direct.value), direct.value.param, direct.value.code) == (message, param, code)
    assert _served(_server_inputs(processor), prompt, max_tokens) == (400, message, param, code)


def test_the_server_and_the_processor_give_the_same_tokens(processor):
    prepared = _server_inputs(processor).completion(json.dumps({"model": "tiny", "prompt": "def f(x):",
                                                                "max_tokens": 4}).encode())
    (job,) = prepared.jobs
    tokens, params = job.tokens, job.params
    assert tokens == processor.tokens("def f(x):") == processor.tokenizer.encode("def f(x):").ids  # encode_batch: same ids
    assert params.max_tokens == 4


@pytest.mark.slow
def test_llm_refuses_with_the_servers_message(tiny_engine):
    from trtbuild.runtime.llm import LLM

    llm = LLM(tiny_engine, backend="onnxruntime")
    for prompt, max_tokens, param, code, message in BAD:
        with pytest.raises(ValueError) as direct:  # LLM's callers catch ValueError
            llm.submit(prompt, SamplingParams(max_tokens=max_tokens))
        assert (str(direct.value), direct.value.param, direct.value.code) == (message, param, code)
        assert _served(_server_inputs(llm.inputs), prompt, max_tokens) == (400, message, param, code)
    assert not llm.has_work()  # nothing half-queued

"""The TensorRT backend on a GPU: same greedy tokens as transformers. Skipped without a GPU."""
from __future__ import annotations

import pytest

from trtbuild.runtime.tensorrt_runtime import tensorrt_available

# Decided before the engine fixtures build anything: no GPU or no TensorRT, nothing to run.
_UNAVAILABLE = tensorrt_available(None)
pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(_UNAVAILABLE is not None, reason=f"needs an NVIDIA GPU with TensorRT: {_UNAVAILABLE}")]


def test_tensorrt_backend_matches_transformers(tiny_engine):
    from trtbuild.runtime.llm import LLM
    from trtbuild.runtime.sampling import SamplingParams

    from conftest import TINY_CODE
    from ort_greedy import transformers_greedy

    llm = LLM(tiny_engine, backend="tensorrt")
    prompts = ["def fibonacci(n):\n", "import os\n", "class Stack:\n"]
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))
    ids = [o.prompt_token_ids for o in outs]
    assert [o.token_ids for o in outs] == transformers_greedy(TINY_CODE, ids, 16)


def test_tensorrt_medusa_matches_plain_decoding(medusa_engine):
    from trtbuild.runtime.llm import LLM
    from trtbuild.runtime.sampling import SamplingParams

    prompts = ["def fibonacci(n):", "import os\n\n\ndef list_files(path):", "class Stack:"]
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    plain = LLM(medusa_engine, backend="tensorrt", medusa_tree_size=0).generate(prompts, params)
    llm = LLM(medusa_engine, backend="tensorrt")
    spec = llm.generate(prompts, params)
    assert [c.token_ids for c in spec] == [c.token_ids for c in plain]
    print("medusa on tensorrt:", llm.speculation.stats.as_dict())


def test_tensorrt_tensor_parallel_matches_one_rank(tmp_path, tiny_engine):
    """TP=2 on two GPUs (TensorRT, NCCL through set_communicator) gives the CPU runtime's tokens."""
    import subprocess
    import sys

    import yaml
    from cuda.bindings import runtime as cudart

    from conftest import REPO, TINY_CODE
    from trtbuild.runtime.llm import LLM
    from trtbuild.runtime.sampling import SamplingParams

    if cudart.cudaGetDeviceCount()[1] < 2:
        pytest.skip("needs two GPUs for two tensor-parallel ranks")
    spec = yaml.safe_load((REPO / "specs" / "tiny-code-tp2.yaml").read_text())
    spec["model"]["checkpoint"] = str(TINY_CODE)
    spec["build"].update(backend="tensorrt", targets=[])
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    subprocess.run([sys.executable, "-m", "trtbuild.builder.cli", "build", str(tmp_path / "spec.yaml"), "-o",
                    str(tmp_path / "tp2")], check=True)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    prompts = ["def fibonacci(n):", "import os", "class Stack:"]
    with LLM(tmp_path / "tp2", backend="tensorrt") as llm:
        gpu = [c.token_ids for c in llm.generate(prompts, params)]
    cpu = [c.token_ids for c in LLM(tiny_engine, backend="onnxruntime").generate(prompts, params)]
    assert gpu == cpu

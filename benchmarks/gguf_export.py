"""The bundled Llama checkpoint as a GGUF file, for the llama.cpp row of benchmarks/cpu_decode.py.

    python benchmarks/gguf_export.py [--checkpoint models/tiny-code] [--type f16|f32|q8_0|q4_0|q4_1] OUT.gguf

q8_0/q4_0/q4_1 write every matrix (embedding, linears, lm_head) in that llama.cpp block type,
quantized by the `gguf` package (bit-exact with ggml-quants.c), as a "pure" llama-quantize would.

Why not llama.cpp's convert_hf_to_gguf.py: it recognizes a byte-level BPE tokenizer by the hash
of its tokenization of a test string, and refuses ours (trained for the bundled model) although
its pre-tokenizer is GPT-2's regex split (tokenizer.json: ByteLevel, use_regex). This writes the
same layout with the `gguf` package (llama.cpp's own writer): Llama hyperparameters, the
tokenizer as "gpt2" BPE with the "gpt-2" pre-tokenizer, and the weights under GGUF's names, q/k
projections permuted from Hugging Face's half-split rotary to llama.cpp's interleaved one.
Checked by greedy tokens: llama.cpp on the f32 export gives transformers' tokens (see main()).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]

NAMES = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
         "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
         "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


BLOCK_TYPES = ("q8_0", "q4_0", "q4_1")


def _file_types() -> dict[str, object]:
    import gguf

    return {"f16": gguf.LlamaFileType.MOSTLY_F16, "f32": gguf.LlamaFileType.ALL_F32, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
            "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0, "q4_1": gguf.LlamaFileType.MOSTLY_Q4_1}


def _interleave_rotary(weight: np.ndarray, heads: int) -> np.ndarray:
    """[heads·D, K] rows of each head reordered from (first halves, second halves) to pairs."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _gguf_name(name: str) -> str:
    if name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if name == "model.norm.weight":
        return "output_norm.weight"
    if name == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = name.split(".", 3)  # model.layers.{i}.{module}.weight
    return f"blk.{layer}.{NAMES[rest.removesuffix('.weight')]}.weight"


def export(checkpoint: Path, out: Path, weight_type: str = "f16", encode=None) -> Path:
    """``encode``: (GGUF name, values [rows, cols] float32) → (raw blocks uint8, GGML type name)
    for each 2-D tensor, a per-tensor mix as llama.cpp's Q4_K_M writes (tests encode K-quants,
    which the `gguf` package cannot); None: every matrix in ``weight_type``."""
    import gguf
    from safetensors.numpy import load_file

    from trtbuild.builder.frontend.checkpoint import arch_config, read_config

    arch, config = arch_config(checkpoint), read_config(checkpoint)  # the builder's reading of config.json
    if arch.architecture != "LlamaForCausalLM" or arch.tie_word_embeddings:
        raise SystemExit(f"{checkpoint}: this exporter writes untied LlamaForCausalLM checkpoints only")
    heads, kv_heads = arch.num_heads, arch.num_kv_heads
    rope = config.get("rope_parameters") or {"rope_theta": config.get("rope_theta", 10000.0)}
    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_name(checkpoint.name)
    writer.add_context_length(arch.max_position_embeddings)
    writer.add_embedding_length(arch.hidden_size)
    writer.add_block_count(arch.num_layers)
    writer.add_feed_forward_length(arch.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(arch.head_dim)
    writer.add_value_length(arch.head_dim)
    writer.add_rope_dimension_count(arch.head_dim)
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    writer.add_layer_norm_rms_eps(arch.rms_norm_eps)
    writer.add_file_type(_file_types()[weight_type])

    tokenizer = json.loads((checkpoint / "tokenizer.json").read_text())
    model, pre = tokenizer["model"], tokenizer.get("pre_tokenizer") or {}
    if model["type"] != "BPE" or pre.get("type") != "ByteLevel" or not pre.get("use_regex", True):
        raise SystemExit(f"{checkpoint}/tokenizer.json: not a GPT-2 style byte-level BPE tokenizer")
    vocab = {**model["vocab"], **{t["content"]: t["id"] for t in tokenizer.get("added_tokens", [])}}
    tokens = [""] * (max(vocab.values()) + 1)
    for token, token_id in vocab.items():
        tokens[token_id] = token
    special = {t["id"] for t in tokenizer.get("added_tokens", []) if t.get("special")}
    types = [gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL for i in range(len(tokens))]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in model["merges"]])
    generation = json.loads((checkpoint / "generation_config.json").read_text()) \
        if (checkpoint / "generation_config.json").is_file() else config
    writer.add_bos_token_id(generation["bos_token_id"])
    writer.add_eos_token_id(generation["eos_token_id"] if isinstance(generation["eos_token_id"], int)
                            else generation["eos_token_id"][0])
    writer.add_add_bos_token(False)  # our prompts are token ids as given, like the other engines'

    weights = load_file(str(checkpoint / "model.safetensors"))
    for name, value in weights.items():
        value = value.astype(np.float32)
        if name.endswith("self_attn.q_proj.weight"):
            value = _interleave_rotary(value, heads)
        elif name.endswith("self_attn.k_proj.weight"):
            value = _interleave_rotary(value, kv_heads)
        # Norm vectors stay f32 (llama.cpp keeps 1-D tensors in f32).
        if encode is not None and value.ndim == 2:
            raw, type_name = encode(_gguf_name(name), value)
            writer.add_tensor(_gguf_name(name), raw, raw_dtype=gguf.GGMLQuantizationType[type_name])
        elif weight_type in BLOCK_TYPES and value.ndim == 2:
            kind = gguf.GGMLQuantizationType[weight_type.upper()]
            writer.add_tensor(_gguf_name(name), gguf.quants.quantize(value, kind), raw_dtype=kind)
        else:
            writer.add_tensor(_gguf_name(name), value.astype(np.float16) if weight_type == "f16" and value.ndim == 2 else value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--checkpoint", type=Path, default=REPO / "models" / "tiny-code")
    ap.add_argument("--type", choices=["f16", "f32", *BLOCK_TYPES], default="f16")
    ap.add_argument("--check", action="store_true",
                    help="compare llama.cpp's greedy tokens on the export with transformers' (llama-cpp-python)")
    args = ap.parse_args()
    export(args.checkpoint, args.out, args.type)
    print(f"wrote {args.out} ({args.out.stat().st_size / 2**20:.1f} MiB)")
    if args.check:
        import torch
        from llama_cpp import Llama
        from transformers import AutoModelForCausalLM

        prompt = list(range(100, 164))
        llm = Llama(str(args.out), n_ctx=256, n_threads=2, verbose=False)
        ours = []
        for token in llm.generate(prompt, temp=0.0, top_k=1):
            ours.append(token)
            if len(ours) == 32:
                break
        model = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32)
        reference = model.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False)[0, len(prompt):].tolist()
        same = next((i for i, (a, b) in enumerate(zip(ours, reference)) if a != b), len(ours))
        print(f"llama.cpp greedy tokens equal transformers' for the first {same} of 32")
        sys.exit(0 if same == 32 or args.type != "f32" else 1)  # only f32 must match exactly


if __name__ == "__main__":
    main()

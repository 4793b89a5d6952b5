#!/usr/bin/env python3
"""Train models/tiny-code: a small Llama-architecture decoder on the Python stdlib sources.

Runs on 2 CPU cores in about half an hour, seeded. Writes a standard Hugging Face
checkpoint directory (safetensors only) with its tokenizer, a held-out evaluation text,
a loss curve and a model card.

    python tools/train_tiny_model.py -o models/tiny-code --steps 1500
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from eval_perplexity import perplexity  # noqa: E402

EOS = "<|endoftext|>"
# Directories of the stdlib that are tests, bundled third-party code or generated files.
EXCLUDED_DIRS = {"test", "tests", "idlelib", "lib2to3", "site-packages", "ensurepip",
                 "turtledemo", "__pycache__", "tkinter", "pydoc_data", "encodings"}
HELD_OUT_BYTES = 600_000

# Prompts end before a newline: the BPE merges a newline with the next line's indentation
# ("\n    " is one token), so a prompt ending in "\n" cuts a token in half.
PROMPTS = [
    "def fibonacci(n):",
    "import os\n\n\ndef list_files(path):",
    "class Stack:\n    def __init__(self):",
    "    for i in range(len(",
    "def __repr__(self):",
]


def corpus_files(root: Path) -> list[Path]:
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(part in EXCLUDED_DIRS or part.startswith("config-") for part in rel.parts[:-1]):
            continue
        files.append(path)
    return files


def split_files(files: list[Path], root: Path) -> tuple[list[Path], list[Path]]:
    """Held-out files are chosen by a hash of their path, so the split is stable."""
    ranked = sorted(files, key=lambda p: hashlib.sha256(str(p.relative_to(root)).encode()).hexdigest())
    held, size = [], 0
    for path in ranked:
        if size + path.stat().st_size > HELD_OUT_BYTES:
            continue
        held.append(path)
        size += path.stat().st_size
        if size > HELD_OUT_BYTES * 0.95:
            break
    held_set = set(held)
    return [p for p in files if p not in held_set], sorted(held)


def read_text(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS,
                                   unk_token=None, pad_token=EOS, model_max_length=1024)


def encode_corpus(tokenizer, texts: list[str]) -> np.ndarray:
    eos = tokenizer.convert_tokens_to_ids(EOS)
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        ids.append(eos)
    return np.asarray(ids, dtype=np.int64)


def make_model(vocab_size: int, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=256, intermediate_size=768,
        num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=2,
        max_position_embeddings=1024, rope_theta=10000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0,
        hidden_act="silu", attention_bias=False, mlp_bias=False,
    )
    return LlamaForCausalLM(config)


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def batch_at(data: np.ndarray, rng: np.random.Generator, batch: int, seq: int) -> torch.Tensor:
    starts = rng.integers(0, len(data) - seq - 1, size=batch)
    return torch.from_numpy(np.stack([data[s:s + seq + 1] for s in starts]))


def train(model, data: np.ndarray, args) -> list[tuple[int, float]]:
    rng = np.random.default_rng(args.seed)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    long_from = int(args.steps * (1 - args.long_fraction))
    curve, t0, tokens = [], time.time(), 0
    model.train()
    for step in range(args.steps):
        # The last steps use the full 1024-token context so every position is trained.
        batch, seq = (args.batch // 4, 1024) if step >= long_from else (args.batch, args.seq)
        ids = batch_at(data, rng, batch, seq)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        loss = _loss(model, ids)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        tokens += batch * seq
        curve.append((step, loss.item()))
        if step % 20 == 0 or step == args.steps - 1:
            elapsed = time.time() - t0
            eta = elapsed / (step + 1) * (args.steps - step - 1)
            print(f"step {step:5d}/{args.steps}  loss {loss.item():.3f}  "
                  f"{tokens / elapsed:7.0f} tok/s  elapsed {elapsed / 60:5.1f} min  "
                  f"eta {eta / 60:5.1f} min", flush=True)
    return curve


def _loss(model, ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids[:, :-1]).logits  # [B, S, V]
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())


def plot_curve(curve, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, losses = zip(*curve)
    window = max(1, min(25, len(losses) // 4))
    smooth = np.convolve(losses, np.ones(window) / window, mode="valid")
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    ax.plot(steps, losses, alpha=0.3, label="loss")
    ax.plot(steps[window - 1:], smooth, label=f"mean of {window}")
    ax.set_xlabel("step")
    ax.set_ylabel("train cross-entropy (nats/token)")
    ax.set_title("tiny-code training loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def greedy_samples(model, tokenizer) -> list[tuple[str, str]]:
    model.eval()
    out = []
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=48, do_sample=False,
                                 pad_token_id=tokenizer.eos_token_id)
        out.append((prompt, tokenizer.decode(gen[0, ids.shape[1]:])))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-o", "--out", type=Path, default=Path("models/tiny-code"))
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--long-fraction", type=float, default=0.1)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--card-only", action="store_true",
                    help="rewrite the model card of an already trained --out (samples and perplexity recomputed)")
    args = ap.parse_args()

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)

    root = Path(sysconfig.get_paths()["stdlib"])
    files = corpus_files(root)
    train_files, held_files = split_files(files, root)
    train_texts = [read_text(p) for p in train_files]
    held_texts = [read_text(p) for p in held_files]
    print(f"corpus: {len(train_files)} train files ({sum(map(len, train_texts)) / 1e6:.1f} MB), "
          f"{len(held_files)} held-out files ({sum(map(len, held_texts)) / 1e6:.2f} MB) from {root}",
          flush=True)

    if args.card_only:
        rewrite_card(args, train_files, held_files, root)
        return

    t_start = time.time()
    tokenizer = train_tokenizer(train_texts, args.vocab)
    data = encode_corpus(tokenizer, train_texts)
    print(f"tokenizer: {len(tokenizer)} tokens; train set {len(data) / 1e6:.2f} M tokens", flush=True)

    model = make_model(len(tokenizer), args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f} M parameters", flush=True)
    curve = train(model, data, args)
    train_minutes = (time.time() - t_start) / 60

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    model.eval()
    model.generation_config.do_sample = False
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    held_path = out / "heldout.txt"
    held_path.write_text(EOS.join(held_texts), encoding="utf-8")
    plot_curve(curve, out / "loss.png")

    full = perplexity(out, held_path)
    quick = perplexity(out, held_path, max_tokens=16384)
    samples = greedy_samples(model, tokenizer)
    results = {
        "heldout_perplexity": full.perplexity, "heldout_tokens": full.tokens,
        "heldout_perplexity_16k": quick.perplexity, "context": full.context,
        "parameters": n_params, "train_minutes": round(train_minutes, 1),
        "train_tokens": int(data.size), "steps": args.steps, "final_loss": curve[-1][1],
    }
    (out / "eval_results.json").write_text(json.dumps(results, indent=2) + "\n")
    write_card(out, args, results, train_files, held_files, root, samples)
    print(json.dumps(results, indent=2))


def rewrite_card(args, train_files, held_files, root) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out: Path = args.out
    results = json.loads((out / "eval_results.json").read_text())
    full = perplexity(out, out / "heldout.txt")
    quick = perplexity(out, out / "heldout.txt", max_tokens=16384)
    results.update(heldout_perplexity=full.perplexity, heldout_perplexity_16k=quick.perplexity)
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    samples = greedy_samples(model, AutoTokenizer.from_pretrained(out))
    (out / "eval_results.json").write_text(json.dumps(results, indent=2) + "\n")
    write_card(out, args, results, train_files, held_files, root, samples)
    print(json.dumps(results, indent=2))


def write_card(out: Path, args, results, train_files, held_files, root, samples) -> None:
    rel = lambda ps: ", ".join(str(p.relative_to(root)) for p in ps)  # noqa: E731
    sample_md = "\n".join(f"**Prompt** `{p!r}`\n\n```python\n{p}{c}\n```\n" for p, c in samples)
    card = f"""---
license: psf-2.0
language: [code]
library_name: transformers
---
# tiny-code

A {results['parameters'] / 1e6:.2f} M-parameter Llama-architecture decoder trained from scratch on
the Python standard-library sources, so that trtbuild's examples, tests and benchmarks have a real
model whose outputs mean something. It writes Python-looking code; it is not useful for anything else.

## Architecture
`LlamaForCausalLM`: 6 layers, hidden 256, 8 query heads and 2 key/value heads (grouped-query
attention, head dim 32), SwiGLU MLP of width 768, RMSNorm (eps 1e-5), RoPE (theta 10000),
untied input/output embeddings, context 1024 tokens, vocabulary {args.vocab}
(byte-level BPE trained on the same corpus with `tokenizers`; `<|endoftext|>` is BOS/EOS/pad).

## Recipe (`tools/train_tiny_model.py`, seed {args.seed})
- {args.steps} AdamW steps (betas 0.9/0.95, weight decay 0.1, peak lr {args.lr}, {args.warmup}
  warm-up steps, cosine decay to 10 %), gradient clipping 1.0;
  batch {args.batch} × {args.seq} tokens, and for the last {int(args.long_fraction * 100)} % of steps
  batch {args.batch // 4} × 1024 tokens so every position of the context is trained.
- {results['train_tokens'] / 1e6:.2f} M training tokens; {results['train_minutes']} minutes wall on
  {args.threads} CPU cores (tokenizer training included). Final training loss {results['final_loss']:.3f}.

![loss curve](loss.png)

## Corpus and licence
The `.py` files of the CPython {sys.version.split()[0]} standard library (`{root}`), excluding
the directories {', '.join(sorted(EXCLUDED_DIRS))} and `config-*`. These sources are under the
Python Software Foundation License Version 2 (PSF-2.0); this model and its held-out text inherit it.
Train and held-out files are split by file, the held-out files chosen by the SHA-256 of their
relative path (about {HELD_OUT_BYTES // 1000} kB). Train files: {len(train_files)}.
Held-out files ({len(held_files)}), committed as `heldout.txt` joined by `<|endoftext|>`:
{rel(held_files)}.

## Evaluation (`python tools/eval_perplexity.py models/tiny-code`)
| held-out text | tokens | perplexity |
|---|---|---|
| all of `heldout.txt` (windows of {results['context']} tokens) | {results['heldout_tokens']} | {results['heldout_perplexity']:.3f} |
| first 16384 tokens (`--max-tokens 16384`, checked by the test suite) | 16384 | {results['heldout_perplexity_16k']:.3f} |

Figures are also in `eval_results.json`.

## Greedy continuations (48 new tokens)
Prompts end before a newline: the tokenizer merges a newline with the next line's indentation
(`"\\n    "` is one token), so a prompt ending in `"\\n"` splits a token and reads as odd text.

{sample_md}
"""
    (out / "README.md").write_text(card)


if __name__ == "__main__":
    main()

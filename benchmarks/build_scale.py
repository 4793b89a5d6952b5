"""How a build scales: random-weight checkpoints shaped like Llama-3.2-1B, Llama-3.2-3B and
Llama-3-8B (bf16, vocabulary 128256, the published configs), each written tensor by tensor
(never the whole model in memory), built in a fresh process; per build: wall time per stage,
peak RSS of the whole process tree (summed over its processes, polled) and of each process
(anonymous / file-backed, from the build's own summary), the engine dir's size, and ratios to
the model's and each rank's weight bytes; then `trtbuild run` on the 8B TP=2 dir generates 8
tokens on CPU. Targets (issue 26): every stage before the engine builds peaks at
≤ 0.25 × model weight bytes + 1.5 GiB; each rank's engine build at ≤ 2.2 × its weight bytes + 1 GiB.

    python benchmarks/build_scale.py --only 1b              # one row (1b, 3b, 8b-tp2, 8b-int4)
    python benchmarks/build_scale.py                        # all four (the 8B rows need ≈ 50 GB of disk)
    python benchmarks/build_scale.py --only 8b-tp2 --only 8b-int4 --tmp /big/disk

Checkpoints and engine dirs go to a temporary dir that is removed at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
GIB = 2**30

LLAMA_3 = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, rms_norm_eps=1e-5,
               rope_theta=500000.0, attention_bias=False, bos_token_id=128000, eos_token_id=128001,
               torch_dtype="bfloat16", hidden_act="silu")
LLAMA_32_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 8192}
CONFIGS = {  # published config.json values
    "llama-3.2-1b": dict(LLAMA_3, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, max_position_embeddings=131072, tie_word_embeddings=True,
                         rope_scaling=LLAMA_32_ROPE),
    "llama-3.2-3b": dict(LLAMA_3, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                         num_key_value_heads=8, head_dim=128, max_position_embeddings=131072, tie_word_embeddings=True,
                         rope_scaling=LLAMA_32_ROPE),
    "llama-3-8b": dict(LLAMA_3, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, max_position_embeddings=8192, tie_word_embeddings=False),
}


@dataclass(frozen=True)
class Row:
    name: str
    model: str
    tensor: int
    quantization: dict | None = None
    generate: bool = False


ROWS = {
    "1b": Row("1b", "llama-3.2-1b", 1),
    "3b": Row("3b", "llama-3.2-3b", 1),
    "8b-tp2": Row("8b-tp2", "llama-3-8b", 2, generate=True),
    "8b-int4": Row("8b-int4", "llama-3-8b", 1, {"mode": "int4_weight_only", "algorithm": "rtn", "group_size": 128},
                   generate=True),
}


def tensor_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    h, inter, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    d = config.get("head_dim") or h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    shapes = {"model.embed_tokens.weight": (config["vocab_size"], h)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                       p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                       p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                       p + "mlp.down_proj.weight": (h, inter)})
    shapes["model.norm.weight"] = (h,)
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (config["vocab_size"], h)
    return shapes


def write_checkpoint(directory: Path, config: dict, shard_bytes: int = 4 * GIB, seed: int = 0) -> int:
    """Random bf16 weights in safetensors shards, one tensor in memory at a time; returns the bytes."""
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(REPO / "models" / "tiny-code" / name, directory / name)
    shapes = list(tensor_shapes(config).items())
    shards, current, size = [], [], 0
    for name, shape in shapes:
        nbytes = 2 * int(torch.tensor(shape).prod())
        if current and size + nbytes > shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append((name, shape, nbytes))
        size += nbytes
    shards.append(current)
    generator = torch.Generator().manual_seed(seed)
    total = 0
    for index, shard in enumerate(shards):
        header, offset = {}, 0
        for name, shape, nbytes in shard:
            header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        blob = json.dumps(header).encode()
        blob += b" " * (-len(blob) % 8)
        with open(directory / f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors", "wb") as out:
            out.write(struct.pack("<Q", len(blob)) + blob)
            for name, shape, nbytes in shard:
                if len(shape) == 1:
                    tensor = torch.ones(shape, dtype=torch.bfloat16)
                else:
                    tensor = (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)
                out.write(tensor.view(torch.uint8).numpy().tobytes())
                total += nbytes
                del tensor
    return total


class TreeSampler:
    """Polls the RSS of a process and all its descendants (summed) every ``interval_s``."""

    def __init__(self, pid: int, interval_s: float = 0.2):
        self.pid, self.interval_s = pid, interval_s
        self.peak = 0
        self.marks: dict[str, int] = {}  # tree peak up to a named moment
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _tree(self) -> list[int]:
        children: dict[int, list[int]] = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat") as handle:
                        ppid = int(handle.read().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
                children.setdefault(ppid, []).append(int(entry))
        out, todo = [], [self.pid]
        while todo:
            pid = todo.pop()
            out.append(pid)
            todo += children.get(pid, [])
        return out

    @staticmethod
    def _rss(pid: int) -> int:
        try:
            with open(f"/proc/{pid}/statm") as handle:
                return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:
            return 0

    def _run(self) -> None:
        while not self.stop.is_set():
            self.peak = max(self.peak, sum(self._rss(pid) for pid in self._tree()))
            self.stop.wait(self.interval_s)

    def mark(self, name: str) -> None:
        self.marks[name] = self.peak

    def close(self) -> int:
        self.stop.set()
        self.thread.join()
        return self.peak


def build(row: Row, checkpoint: Path, work: Path) -> dict:
    spec = {"model": {"checkpoint": str(checkpoint), "dtype": "float16"},
            "build": {"max_batch_size": 2, "max_input_len": 128, "max_seq_len": 512, "targets": ["sm89"]},
            "parallel": {"tensor": row.tensor}}
    if row.quantization:
        spec["quantization"] = row.quantization
    import yaml

    spec_path = work / f"{row.name}.yaml"
    spec_path.write_text(yaml.safe_dump(spec))
    out = work / f"{row.name}-engine"
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "trtbuild.cli", "build", str(spec_path), "-o", str(out),
                             "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    sampler = TreeSampler(proc.pid)
    log = []
    for line in proc.stderr:  # progress: note the tree's peak when the engine stage starts
        log.append(line)
        if line.startswith("▸ engine"):
            sampler.mark("before_engines")
    stdout = proc.stdout.read()
    proc.wait()
    tree_peak = sampler.close()
    if proc.returncode != 0:
        raise SystemExit(f"{row.name}: build failed (exit {proc.returncode}):\n{''.join(log[-20:])}")
    summary = json.loads(stdout)
    summary.update(wall_s=time.perf_counter() - start, tree_peak=tree_peak,
                   progress=[line.rstrip() for line in log if line.startswith(("✓", "  export", "  numerics"))],
                   tree_peak_before_engines=sampler.marks.get("before_engines", tree_peak), out=str(out))
    return summary


def generate(out: str) -> str:
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "trtbuild.cli", "run", out, "--prompt", "def main():",
                           "--max-tokens", "8", "--backend", "onnxruntime"], capture_output=True, text=True)
    last = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else str(proc.returncode)
    if proc.returncode != 0 or "[8 tokens" not in proc.stdout + proc.stderr:
        return f"run failed: {last}"
    return f"8 tokens on CPU in {time.perf_counter() - started:.0f} s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append", choices=list(ROWS), help="rows to run (repeatable; default all)")
    parser.add_argument("--tmp", type=Path, default=None, help="where checkpoints and engine dirs go (removed after)")
    args = parser.parse_args()
    rows = [ROWS[name] for name in (args.only or list(ROWS))]
    work = Path(tempfile.mkdtemp(prefix="build-scale-", dir=args.tmp))
    results = []
    try:
        for row in rows:
            config = CONFIGS[row.model]
            weights = 2 * sum(int(torch.tensor(s).prod()) for s in tensor_shapes(config).values())
            need = 3.2 * weights  # checkpoint + export data + rank data + engines, with margin
            free = shutil.disk_usage(work).free
            if free < need:
                print(f"skip {row.name}: needs ≈ {need / 1e9:.0f} GB of disk, {free / 1e9:.0f} GB free in {work}",
                      file=sys.stderr)
                continue
            checkpoint = work / row.model
            if not checkpoint.exists():
                started = time.perf_counter()
                write_checkpoint(checkpoint, config)
                print(f"{row.model}: wrote {weights / GIB:.2f} GiB in {time.perf_counter() - started:.0f} s",
                      file=sys.stderr)
            print(f"{row.name}: building …", file=sys.stderr)
            summary = build(row, checkpoint, work)
            summary["generated"] = generate(summary["out"]) if row.generate else ""
            results.append((row, weights, summary))
            print(json.dumps({"row": row.name, "weights": weights, **summary}), file=sys.stderr)
            shutil.rmtree(summary["out"], ignore_errors=True)
            if not any(r.model == row.model for r in rows[rows.index(row) + 1:]):
                shutil.rmtree(checkpoint, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(render(results))


def render(results) -> str:
    header = ["row", "weights GiB", "stages s (export/passes/write/engines)", "tree peak before engines GiB",
              "× weights", "target GiB", "ok", "engine peak GiB (anon/file)", "× rank weights", "target GiB", "ok",
              "dir GiB", "run"]
    lines = []
    for row, weights, s in results:
        stages = {}
        for stage in s["stages"]:
            key = stage["stage"].split(" ")[0]
            stages[key] = stages.get(key, 0.0) + stage["seconds"]
        times = "/".join(f"{stages.get(k, 0):.0f}" for k in ("export", "passes", "write", "engine"))
        before = s["tree_peak_before_engines"]
        target = 0.25 * weights + 1.5 * GIB
        engines = [p for p in s["processes"] if p["process"].startswith("engine")]
        ranks = {e["rank"]: e["weight_bytes"] for e in s["engines"]}
        worst = max(engines, key=lambda p: p["peak_rss_bytes"])
        rank_bytes = max(ranks.values())
        e_target = 2.2 * rank_bytes + GIB
        lines.append([row.name, f"{weights / GIB:.2f}", times, f"{before / GIB:.2f}", f"{before / weights:.2f}",
                      f"{target / GIB:.2f}", "yes" if before <= target else "NO",
                      f"{worst['peak_rss_bytes'] / GIB:.2f} ({worst['anon_bytes'] / GIB:.2f}/{worst['file_bytes'] / GIB:.2f})",
                      f"{worst['peak_rss_bytes'] / rank_bytes:.2f}", f"{e_target / GIB:.2f}",
                      "yes" if all(p["peak_rss_bytes"] <= e_target for p in engines) else "NO",
                      f"{s['dir_bytes'] / GIB:.2f}", s["generated"]])
    widths = [max(len(str(r[i])) for r in [header, *lines]) for i in range(len(header))]
    fmt = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    return "\n".join([fmt(header), fmt(["-" * w for w in widths]), *map(fmt, lines)])


if __name__ == "__main__":
    main()

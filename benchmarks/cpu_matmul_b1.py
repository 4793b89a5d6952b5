#!/usr/bin/env python3
"""How fast a batch-1 float32 MatMul streams its weights on the CPU, form against form.

    python benchmarks/cpu_matmul_b1.py [--rounds 21] [--shapes qkv,up,down,o,head] [--forms ...] [--json]

Each shape of SmolLM2-135M (x [1, K] times a float32 weight [K, N]) is held as 30 distinct weights
(one per layer, as in the model; the LM head once), so a form's pass reads 30 weights that the
other forms' passes have pushed out of the caches. Every form runs in this one process and the
forms take turns, round after round (the order rotated each round, a pause between passes so that
no thread pool still spins into the next form); a figure is the median over rounds, in GB/s of
weights read, with its ratio to ONNX Runtime's MatMul on a constant B (the form our engines run).

Forms:
- ort MatMul const: MatMul(x, W) with W an initializer, prepacked by MLAS (our engines before
  plugins/onnxruntime/huge_pages.py), on 4 KiB pages; "huge pages (runtime)": the same session
  made with what it added collapsed onto 2 MiB pages, as the runtime does (which also collapses the heap).
- ort ... 1 thread / no spin / pinned / denormal=0: the same graph, one session option changed.
- ort MatMul no prepack: the same graph with `session.disable_prepacking`.
- ort MatMul B input: W a graph input, bound once (never constant, never prepacked).
- ort Gemm transB: Gemm(x, W^T [N, K], transB=1), constant (prepacked), and without prepacking.
- ort FusedMatMul transB: com.microsoft FusedMatMul(x, W^T, transB=1), constant.
- torch F.linear: F.linear(x, W^T) at the same thread count (MKL / oneDNN), one call a weight.
- torch matmul: x @ W, W [K, N].
- read AVX-512: the ceiling, benchmarks/cpu_read_bandwidth.c (compiled here with the system's C
  compiler) summing every float of the same weights with AVX-512 loads, 2 threads and 1.
- ..., huge pages: the weights copied into memory advised MADV_HUGEPAGE (2 MiB pages). Every
  other form's weights are copied into memory advised MADV_NOHUGEPAGE (4 KiB pages: with
  transparent huge pages set to `madvise`, as on the machine this was written on, ONNX Runtime's
  own buffers, its prepacked weights among them, get those).
"""
from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import mmap
import subprocess
import tempfile
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from trtbuild.builder.progress import table as format_table  # noqa: E402

LAYERS = 30
# name: (K, N, copies) for SmolLM2-135M: hidden 576, MLP 1536, 9 heads + 3 KV heads of 64.
SHAPES = {
    "qkv": (576, 960, LAYERS),
    "o": (576, 576, LAYERS),
    "up": (576, 1536, LAYERS),
    "down": (1536, 576, LAYERS),
    "head": (576, 49152, 1),
}
HUGE = 2 << 20
MADV_HUGEPAGE, MADV_NOHUGEPAGE = 14, 15
PAUSE_S = 0.02  # longer than ONNX Runtime's and OpenMP's spin before their threads sleep


@dataclass(frozen=True)
class Pass:
    run: Callable[[], object]  # one pass over every weight: what is timed
    setup: Callable[[], None] = lambda: None  # untimed, before each pass


@dataclass(frozen=True)
class Form:
    name: str
    make: Callable[[list[np.ndarray], np.ndarray, int], Pass]


def _graph(weights: list[np.ndarray], op: str, transposed: bool, as_input: bool):
    """One ONNX graph of len(weights) independent x-times-weight nodes, every product an output."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    k = weights[0].shape[0]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, k])
    inputs, inits, nodes, outputs = [x], [], [], []
    for i, w in enumerate(weights):
        b = np.ascontiguousarray(w.T) if transposed else w  # [N, K] or [K, N]
        name = f"w{i}"
        if as_input:
            inputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, list(b.shape)))
        else:
            inits.append(numpy_helper.from_array(b, name))
        attrs = {"transB": 1} if transposed else {}
        domain = "com.microsoft" if op == "FusedMatMul" else ""
        nodes.append(helper.make_node(op, ["x", name], [f"y{i}"], domain=domain, **attrs))
        outputs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, [1, w.shape[1]]))
    graph = helper.make_graph(nodes, "b1", inputs, outputs, inits)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return onnx.helper.make_model(graph, opset_imports=opsets)


def _anon_huge_bytes() -> int:
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1]) * 1024
    return 0


def _ort(op: str = "MatMul", transposed: bool = False, as_input: bool = False,
         config: dict[str, str] | None = None, one_thread: bool = False, huge_pages: bool = False):
    def make(weights, x, threads):
        import onnxruntime as ort

        from trtbuild.plugins.onnxruntime import huge_pages as pages

        so = ort.SessionOptions()
        so.intra_op_num_threads = 1 if one_thread else threads
        so.inter_op_num_threads = 1
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        so.log_severity_level = 3
        for key, value in (config or {}).items():
            so.add_session_config_entry(key, value)
        model = _graph(weights, op, transposed, as_input).SerializeToString()
        # The runtime's sessions (plugins/onnxruntime/session.py) collapse what they add onto 2 MiB
        # pages; these sessions are made directly, on 4 KiB pages, but for the huge_pages form.
        before, ranges = _anon_huge_bytes(), pages.anonymous_ranges()
        sess = ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])
        if huge_pages:
            # What the session added only (the runtime collapses the whole heap as well, which here
            # would reach the other forms' buffers later placed in heap memory freed before them).
            pages.collapse(pages.added_ranges(ranges, pages.anonymous_ranges()))
            print(f"  its session put {(_anon_huge_bytes() - before) / 1e6:.0f} MB on 2 MiB pages "
                  f"(weights {sum(w.nbytes for w in weights) / 1e6:.0f} MB)", file=sys.stderr)
        binding = sess.io_binding()
        binding.bind_cpu_input("x", x)
        if as_input:  # OrtValues over the arrays themselves: no copy a run
            for i, w in enumerate(weights):
                binding.bind_ortvalue_input(f"w{i}", ort.OrtValue.ortvalue_from_numpy(w))
        for out in sess.get_outputs():
            binding.bind_output(out.name, "cpu")
        return Pass(lambda: sess.run_with_iobinding(binding))
    return make


def _torch(kind: str, one_thread: bool = False):
    def make(weights, x, threads):
        import torch
        import torch.nn.functional as F

        count = 1 if one_thread else threads
        xt = torch.from_numpy(x)
        if kind == "linear":
            ws = [torch.from_numpy(np.ascontiguousarray(w.T)) for w in weights]  # [N, K]
            return _with_threads(count, lambda: [F.linear(xt, w) for w in ws])
        ws = [torch.from_numpy(w) for w in weights]  # [K, N]
        return _with_threads(count, lambda: [xt @ w for w in ws])
    return make


def _with_threads(count: int, run: Callable[[], object]) -> Pass:
    """``run``, torch's thread count (a process-wide setting) set to ``count`` before each pass."""
    import torch

    return Pass(run, setup=lambda: torch.set_num_threads(count))


def page_copy(w: np.ndarray, huge: bool) -> np.ndarray:
    """A copy of ``w`` in anonymous memory of its own, advised MADV_HUGEPAGE (2 MiB pages) or
    MADV_NOHUGEPAGE (4 KiB pages; numpy itself advises huge pages for arrays of 4 MiB and more)."""
    size = -(-w.nbytes // HUGE) * HUGE
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf.madvise(MADV_HUGEPAGE if huge else MADV_NOHUGEPAGE)
    out = np.frombuffer(buf, dtype=w.dtype, count=w.size).reshape(w.shape)
    out[...] = w
    return out


def _on_huge_pages(make):
    return lambda weights, x, threads: make([page_copy(w, huge=True) for w in weights], x, threads)


def _read_library() -> ctypes.CDLL:
    """benchmarks/cpu_read_bandwidth.c built once per source text under the repo's build/ (ours,
    not a shared temp dir another user could plant a library in), written under a temporary name
    and renamed, so a killed compiler leaves nothing that loads."""
    source = REPO / "benchmarks" / "cpu_read_bandwidth.c"
    digest = hashlib.sha256(source.read_bytes()).hexdigest()[:12]
    lib = REPO / "build" / "benchmarks" / f"cpu_read_bandwidth-{digest}.so"
    if not lib.exists():
        lib.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=lib.parent)) / lib.name
        subprocess.run(["cc", "-O2", "-mavx512f", "-shared", "-fPIC", "-pthread", "-o", str(staging), str(source)],
                       check=True)
        staging.replace(lib)
        staging.parent.rmdir()
    dll = ctypes.CDLL(str(lib))
    dll.read_weights.restype = ctypes.c_float
    dll.read_weights.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int]
    return dll


def _read(one_thread: bool = False):
    def make(weights, x, threads):
        dll = _read_library()
        ptrs = (ctypes.c_void_p * len(weights))(*[w.ctypes.data for w in weights])
        count = 1 if one_thread else threads
        if weights[0].size % 64:
            raise ValueError(f"read ceiling: {weights[0].size} floats a weight is not a multiple of 64")
        return Pass(lambda: dll.read_weights(ptrs, len(weights), weights[0].size, count))
    return make


FORMS = (
    # made first, while the heap only grows: it collapses only the memory new to the process
    Form("ort MatMul const, huge pages (runtime)", _ort(huge_pages=True)),
    Form("ort MatMul const", _ort()),
    Form("ort MatMul const, 1 thread", _ort(one_thread=True)),
    Form("ort MatMul const, no spin", _ort(config={"session.intra_op.allow_spinning": "0"})),
    Form("ort MatMul const, pinned", _ort(config={"session.intra_op_thread_affinities": "2"})),
    Form("ort MatMul const, denormal=0", _ort(config={"session.set_denormal_as_zero": "1"})),
    Form("ort MatMul no prepack", _ort(config={"session.disable_prepacking": "1"})),
    Form("ort MatMul B input", _ort(as_input=True)),
    Form("ort MatMul B input, huge pages", _on_huge_pages(_ort(as_input=True))),
    Form("ort Gemm transB", _ort(op="Gemm", transposed=True)),
    Form("ort Gemm transB no prepack", _ort(op="Gemm", transposed=True,
                                            config={"session.disable_prepacking": "1"})),
    Form("ort FusedMatMul transB", _ort(op="FusedMatMul", transposed=True)),
    Form("torch F.linear", _torch("linear")),
    Form("torch F.linear, 1 thread", _torch("linear", one_thread=True)),
    Form("torch matmul", _torch("matmul")),
    Form("torch matmul, huge pages", _on_huge_pages(_torch("matmul"))),
    Form("read AVX-512", _read()),
    Form("read AVX-512, 1 thread", _read(one_thread=True)),
    Form("read AVX-512, huge pages", _on_huge_pages(_read())),
    Form("read AVX-512, huge pages, 1 thread", _on_huge_pages(_read(one_thread=True))),
)
BASELINE = FORMS[1].name


def measure(shape: str, forms: list[Form], rounds: int, threads: int) -> dict[str, float]:
    """Seconds of one pass (all copies of the shape's weight) for each form: (median, best)."""
    k, n, copies = SHAPES[shape]
    rng = np.random.default_rng(0)
    weights = [page_copy(rng.standard_normal((k, n), dtype=np.float32) * 0.02, huge=False) for _ in range(copies)]
    x = rng.standard_normal((1, k), dtype=np.float32)
    runs = [(f.name, f.make(weights, x, threads)) for f in forms]
    for _, one in runs:  # warm-up: first-run allocations, prepacking, thread pool start
        one.setup()
        one.run()
        one.run()
    times: dict[str, list[float]] = {name: [] for name, _ in runs}
    for r in range(rounds):
        for name, one in runs[r % len(runs):] + runs[:r % len(runs)]:
            one.setup()
            time.sleep(PAUSE_S)
            t0 = time.perf_counter()
            one.run()
            times[name].append(time.perf_counter() - t0)
    return {name: (statistics.median(ts), min(ts)) for name, ts in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=21)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--forms", default="", help="comma-separated prefixes of form names (default all)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    shapes = args.shapes.split(",")
    for s in shapes:
        if s not in SHAPES:
            sys.exit(f"--shapes: unknown shape {s!r}; valid: {', '.join(SHAPES)}")
    wanted = [w.strip() for w in args.forms.split(",") if w.strip()]
    forms = [f for f in FORMS if not wanted or any(f.name.startswith(w) for w in wanted)]
    if BASELINE not in [f.name for f in forms]:
        forms.insert(0, FORMS[1])
    if len(shapes) > 1:  # a process per shape: a fresh heap for the huge-pages form (see FORMS)
        results = {}
        for shape in shapes:
            child = ["--shapes", shape, "--rounds", str(args.rounds), "--threads", str(args.threads),
                     "--forms", args.forms] + (["--json"] if args.json else [])
            out = subprocess.run([sys.executable, __file__, *child], check=True, stdout=subprocess.PIPE,
                                 text=True).stdout
            if args.json:
                results.update(json.loads(out))
            else:
                print(out, end="", flush=True)
        if args.json:
            print(json.dumps(results, indent=1))
        return
    results = {}
    for shape in shapes:
        k, n, copies = SHAPES[shape]
        secs = measure(shape, forms, args.rounds, args.threads)
        nbytes = k * n * 4 * copies
        results[shape] = {name: {"median_us": med * 1e6 / copies, "best_us": best * 1e6 / copies,
                                 "median_GB/s": nbytes / med / 1e9, "best_GB/s": nbytes / best / 1e9}
                          for name, (med, best) in secs.items()}
        if not args.json:
            base_med, base_best = secs[BASELINE]
            rows = [[name, f"{med * 1e6 / copies:.0f}", f"{nbytes / med / 1e9:.1f}", f"{base_med / med:.2f}",
                     f"{nbytes / best / 1e9:.1f}", f"{base_best / best:.2f}"]
                    for name, (med, best) in secs.items()]
            print(f"\n{shape}: x [1, {k}] times W [{k}, {n}], {copies} weight(s) of "
                  f"{k * n * 4 / 1e6:.1f} MB, {args.threads} threads, {args.rounds} rounds")
            print(format_table(rows, ["form", "median µs a weight", "median GB/s", "× baseline",
                                      "best GB/s", "best × baseline"]))
        sys.stdout.flush()
    if args.json:
        print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

"""The one ONNX Runtime configuration every CPU path uses: the build's numerics check, the CPU
runtime, ``trtbuild eval`` and the tests all run a rank graph the same way, so what the check
accepted is what eval measures and the runtime serves."""
from __future__ import annotations

from contextlib import nullcontext
from enum import Enum
from pathlib import Path


class Spinning(Enum):
    """How a session's worker threads wait between ops.

    A decode step is ~100–200 small ops, and waking a sleeping worker for each costs more than
    most ops' arithmetic: on 2 cores (benchmarks/cpu_decode.py) spinning makes a decode step
    1.5–2.1× faster. But an idle worker keeps spinning for ~40 ms after its session's run
    returns, so several spinning sessions on the same cores starve each other: the runtime keeps
    one session per engine (builder/emit/cpu_step_model.py), and sessions that take turns within a
    step (tensor-parallel segments) sleep."""

    always = "always"
    never = "never"


class CpuActivations(Enum):
    """What ONNX Runtime's n-bit GEMM multiplies int4/int8 weights with where it replaces a
    ``DequantizeLinear → MatMul`` (its accuracy level).

    ``float``: the activations as they are (level 1, fp32): the graph's arithmetic, what the
    numerics check and perplexity of the weights alone describe. ``int8``: activations
    quantized to int8 per block on the fly (level 4: integer dot products), faster on CPUs with
    them, at an accuracy cost the build's numerics check and ``trtbuild eval`` measure; only
    where a spec asks for it (quantization.cpu_activations). TensorRT never reads this."""

    float = "float"
    int8 = "int8"

    @property
    def accuracy_level(self) -> int:
        return 4 if self is CpuActivations.int8 else 1


def session_options(threads: int = 0, external_data_dir: Path | None = None,
                    spinning: Spinning = Spinning.always, activations: CpuActivations = CpuActivations.float,
                    float_gemms: bool = False):
    """``threads`` 0 lets ONNX Runtime choose; ``external_data_dir`` resolves the weights of a
    model handed over in memory (a graph segment, the CPU decode graph, a simulated FP4 graph)
    from that folder. ``spinning``: see Spinning; numerics are the same either way.
    ``activations``: see CpuActivations (an engine dir's is ``EngineDir.cpu_activations``).
    ``float_gemms``: no Q/DQ fusion into integer kernels (plugins/onnxruntime/int8_gemm.py: a
    graph that quantizes activations, on a CPU whose int8 GEMM saturates)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.intra_op_num_threads = threads
    options.add_session_config_entry("session.intra_op.allow_spinning",
                                     "0" if spinning == Spinning.never else "1")
    # DequantizeLinear → MatMul may become ONNX Runtime's n-bit GEMM; its activations stay
    # float unless the spec asked for int8 (CpuActivations).
    options.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", str(activations.accuracy_level))
    if float_gemms:
        options.add_session_config_entry("session.disable_quant_qdq", "1")
    if external_data_dir is not None:
        options.add_session_config_entry("session.model_external_initializers_file_folder_path",
                                         str(external_data_dir))
    return options


def session(model, threads: int = 0, external_data_dir: Path | None = None,
            spinning: Spinning = Spinning.always, activations: CpuActivations = CpuActivations.float,
            huge_pages: bool = False):
    """An InferenceSession on the CPU for a model path, a serialized model or a ModelProto; with
    ``huge_pages`` its weights are moved onto 2 MiB pages after it loads, where the kernel allows
    (plugins/onnxruntime/huge_pages.py: batch-1 steps stream them all; a copy at load, so for
    sessions that decode, not a build's one-shot checks). A graph that quantizes activations
    (W8A8) runs its GEMMs in float where this CPU's int8 GEMM saturates (int8_gemm.py)."""
    import onnx
    import onnxruntime as ort

    from trtbuild.plugins.onnxruntime.huge_pages import collapse_added
    from trtbuild.plugins.onnxruntime.int8_gemm import needs_float_gemms

    source = model.SerializeToString() if isinstance(model, onnx.ModelProto) else \
        str(model) if isinstance(model, Path) else model
    options = session_options(threads, external_data_dir, spinning, activations, needs_float_gemms(model))
    with collapse_added() if huge_pages else nullcontext():
        return ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])


def run(session, feeds: dict) -> dict:
    """All outputs by name, feeding each input the session has from ``feeds``."""
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, {i.name: feeds[i.name] for i in session.get_inputs()})))

"""The one ONNX Runtime configuration every CPU path uses: the build's numerics check, the CPU
runtime, ``trtbuild eval`` and the tests all run a rank graph the same way, so what the check
accepted is what eval measures and the runtime serves."""
from __future__ import annotations

from enum import Enum
from pathlib import Path


class Spinning(Enum):
    """How a session's worker threads wait between ops.

    A decode step is ~100–200 small ops, and waking a sleeping worker for each costs more than
    most ops' arithmetic: on 2 cores (benchmarks/cpu_decode.py) spinning makes a decode step
    1.5–2.1× faster. But an idle worker keeps spinning for ~40 ms after its session's run
    returns, so several spinning sessions on the same cores starve each other: the runtime keeps
    one session per engine (contract/cpu_step_graph.py), and sessions that take turns within a
    step (tensor-parallel segments) sleep."""

    always = "always"
    never = "never"


def session_options(threads: int = 0, external_data_dir: Path | None = None,
                    spinning: Spinning = Spinning.always):
    """``threads`` 0 lets ONNX Runtime choose; ``external_data_dir`` resolves the weights of a
    model handed over in memory (a graph segment, the CPU decode graph, a simulated FP4 graph)
    from that folder. ``spinning``: see Spinning; numerics are the same either way."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.intra_op_num_threads = threads
    options.add_session_config_entry("session.intra_op.allow_spinning",
                                     "0" if spinning == Spinning.never else "1")
    # DequantizeLinear → MatMul may become ONNX Runtime's n-bit GEMM; keep its activations in
    # float (accuracy level 1 = fp32) so it computes what the graph says, not an int8 proxy.
    options.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "1")
    if external_data_dir is not None:
        options.add_session_config_entry("session.model_external_initializers_file_folder_path",
                                         str(external_data_dir))
    return options


def session(model, threads: int = 0, external_data_dir: Path | None = None,
            spinning: Spinning = Spinning.always):
    """An InferenceSession on the CPU for a model path, a serialized model or a ModelProto."""
    import onnx
    import onnxruntime as ort

    source = model.SerializeToString() if isinstance(model, onnx.ModelProto) else \
        str(model) if isinstance(model, Path) else model
    return ort.InferenceSession(source, session_options(threads, external_data_dir, spinning),
                                providers=["CPUExecutionProvider"])


def run(session, feeds: dict) -> dict:
    """All outputs by name, feeding each input the session has from ``feeds``."""
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, {i.name: feeds[i.name] for i in session.get_inputs()})))

"""A request's greedy tokens on the CPU runtime do not depend on what else runs in its steps:
float32 (specs/tiny-code.yaml) gives each of eight code prompts the same 32 tokens alone, in a
batch of eight, and in that batch rotated (other neighbours, another row). specs/README.md
(`cpu_activations`) says what holds per mode."""
from __future__ import annotations

from trtbuild.runtime.core.sampling import SamplingParams
from trtbuild.runtime.llm import LLM

from test_quantization import prompt_ids

PROMPTS = ["def f(x):\n    return", "class Node:\n", "import os\nimport sys\n\ndef main(", "for i in range(10):\n    print(",
           "# sort a list\ndef sort(items):", "x = [1, 2, 3]\ny =", "while True:\n    line = input()\n",
           "def add(a, b):\n    \"\"\""]


def batch_dependence(engine) -> dict[str, list[bool]]:
    """Per prompt, whether its tokens in a batch of eight (as given, and rotated by three rows)
    equal its tokens alone."""
    llm = LLM(engine, backend="onnxruntime", threads=2)
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    ids = [prompt_ids(p) for p in PROMPTS]
    alone = [llm.generate([p], params)[0].token_ids for p in ids]
    together = [o.token_ids for o in llm.generate(ids, params)]
    rotated = [o.token_ids for o in llm.generate(ids[3:] + ids[:3], params)]
    rotated = rotated[-3:] + rotated[:-3]  # back in prompt order
    assert all(len(t) == 32 for t in alone)
    return {"batch of 8": [a == t for a, t in zip(alone, together)],
            "rotated": [a == r for a, r in zip(alone, rotated)]}


def test_float32_greedy_tokens_are_the_same_alone_and_beside_others(tiny_engine):
    assert batch_dependence(tiny_engine) == {"batch of 8": [True] * 8, "rotated": [True] * 8}


def test_float32_decode_logits_of_a_row_are_bitwise_the_same_alone_and_in_a_batch(tiny_engine):
    """One plain decode step of the CPU decode graph: eight rows of different cached lengths
    (40–89 tokens) at once, and each alone; statistic max abs difference, tolerance 0."""
    import numpy as np
    import onnx

    from trtbuild.builder.emit.cpu_step_model import decode_branch
    from trtbuild.contract.step import StepArrays
    from trtbuild.plugins.onnxruntime import session as ort_config
    from trtbuild.runtime.backends.onnxruntime.step_graph import fill_decode_inputs
    from trtbuild.runtime.core.kv_pools import PoolShape
    from trtbuild.runtime.engine_dir import load

    d = load(tiny_engine)
    session = ort_config.session(decode_branch(onnx.load(tiny_engine / "rank0.cpu.onnx", load_external_data=False)), 2,
                                 tiny_engine)
    names = {i.name for i in session.get_inputs()}
    shape = PoolShape.of(d, np.float32, 0, 16)
    rng = np.random.default_rng(0)
    caches = {f"past_{n}": rng.standard_normal((8, *shape.slot), dtype=np.float32) for n in shape.names}
    lengths = [40 + 7 * i for i in range(8)]

    def logits(rows: list[int]) -> np.ndarray:  # [len(rows), 1, V]
        arrays = StepArrays.empty(len(rows), 1, 1, d.max_seq_len)
        fill_decode_inputs(arrays.input_ids, arrays.write_index, arrays.kv_length, [[5 + i] for i in rows],
                           [lengths[i] for i in rows])
        feeds = {**arrays.as_dict(), **{name: cache[rows] for name, cache in caches.items()}}
        return session.run(["logits"], {k: v for k, v in feeds.items() if k in names})[0]

    alone = np.concatenate([logits([i]) for i in range(8)])
    assert np.abs(logits(list(range(8))) - alone).max() == 0.0

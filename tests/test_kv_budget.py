"""The KV budget on the bundled model's engine dir (ONNX Runtime backend): many requests on a
budget too small to hold them preempt and recompute, yet give transformers' greedy tokens;
prefix blocks are shared by hash; the host pools are demand-paged and give pages back;
speculation and structured outputs keep their tokens under preemption."""
from __future__ import annotations

import pytest

from trtbuild.contract.speculation import Source
from trtbuild.runtime.core.kv_budget import kv_bytes_per_token
from trtbuild.runtime.core.kv_pools import smaps_field
from trtbuild.runtime.core.sampling import SamplingParams
from trtbuild.runtime.engine_dir import load
from trtbuild.runtime.llm import LLM
from trtbuild.runtime.server.metrics import Metrics
from trtbuild.runtime.speculation.host import SpeculationMode
from trtbuild.runtime.structured import JsonSchema, Regex

from conftest import TINY_CODE
from ort_greedy import transformers_greedy

pytestmark = pytest.mark.slow

TEXTS = ["def fibonacci(n):\n", "import os\n", "class Stack:\n    def __init__(self):\n        self.",
         "    for i in range(len(", "# Copyright", "def __repr__(self):\n        return '<%s %r>' % (",
         "from collections import", "x"]
BLOCK = 16


def _budget(engine_dir, blocks: int) -> int:
    """kv_cache_memory for ``blocks`` blocks of BLOCK tokens."""
    return blocks * BLOCK * kv_bytes_per_token(load(engine_dir))


def _pool_flags(pools) -> set[str]:
    """The VmFlags of the mapping that holds the first pool (/proc/self/smaps)."""
    return set(smaps_field(next(iter(pools.pools.values())).ctypes.data, "VmFlags"))


@pytest.fixture(scope="module")
def prompts(tiny_engine):
    with LLM(tiny_engine, backend="onnxruntime", threads=2) as llm:
        return [llm.tokenizer.encode(f"{TEXTS[i % 8]}{' ' * (i // 8)}").ids for i in range(32)]


def test_32_requests_on_a_small_budget_preempt_and_give_transformers_tokens(tiny_engine, prompts):
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    # 12 blocks: 192 tokens for 8 rows of up to 46 tokens each; the prefix cache shares them too.
    with LLM(tiny_engine, backend="onnxruntime", threads=2, kv_cache_memory=_budget(tiny_engine, 12),
             block_size=BLOCK) as llm:
        assert llm.scheduler.kv.num_blocks == 12
        outs = llm.generate(prompts, params)
        kv = llm.scheduler.kv
        assert kv.stats.preemptions > 0
        assert [o.token_ids for o in outs] == transformers_greedy(TINY_CODE, prompts, params.max_tokens)
        # Idle: the rows gave every block and every page back; only cached blocks stay resident.
        pools = llm.engine.kv
        assert kv.num_used == kv.num_cached
        block_bytes = BLOCK * kv_bytes_per_token(load(tiny_engine))   # one page per cache tensor here
        assert pools.resident_bytes() == kv.num_cached * block_bytes
        assert all(not pool.any() for pool in pools.pools.values())  # released rows read back as zeros
        assert "nr" in _pool_flags(pools)                              # MAP_NORESERVE


def test_a_shared_prefix_is_served_from_the_same_cached_blocks(tiny_engine):
    with LLM(tiny_engine, backend="onnxruntime", threads=2) as llm:
        shared = llm.tokenizer.encode("import os\nimport sys\n\n\ndef main(argv):\n    parser = argparse." * 2).ids
        shared = shared[:40]                                  # two full blocks and 8 tokens
        first, second = shared + llm.tokenizer.encode(" return").ids, shared + llm.tokenizer.encode(" if").ids
        params = SamplingParams(max_tokens=12, ignore_eos=True)
        kv = llm.scheduler.kv
        a = llm.submit(first, params)
        done = {c.rid: c for c in llm.run_until_done()}
        saved = kv.cached_blocks()
        assert len(saved) == (len(first)) // BLOCK == 2 and [kv.ref_count(b) for b in saved] == [0, 0]
        b = llm.submit(second, params)
        llm.step()                                            # admitted: its first two blocks are A's
        assert kv.uses(b) == saved and [kv.ref_count(x) for x in saved] == [1, 1]
        done.update({c.rid: c for c in llm.run_until_done()})
        assert (kv.stats.hits, done[b].cached_tokens, done[a].cached_tokens) == (2, 32, 0)
        assert [done[a].token_ids, done[b].token_ids] == transformers_greedy(TINY_CODE, [first, second], 12)
        metrics = Metrics()                                   # what the server's /metrics shows
        metrics.observe_engine(llm)
        samples = {line.split()[0]: float(line.split()[1]) for line in metrics.text().decode().splitlines()
                   if line.startswith("trtbuild:")}
        assert samples["trtbuild:prefix_cache_hit_blocks"] == 2 and samples["trtbuild:num_preemptions"] == 0
        assert samples["trtbuild:kv_blocks_used"] == kv.num_cached == 2   # B shares A's two blocks
        assert samples["trtbuild:kv_blocks_free"] == kv.num_blocks - 2


def test_rows_cost_the_pages_they_write(tiny_engine):
    with LLM(tiny_engine, backend="onnxruntime", threads=2, prefix_cache=False) as llm:
        pools = llm.engine.kv
        assert pools.resident_bytes() == 0                   # 8 rows of 1024 positions, nothing written yet
        rid = llm.submit(llm.tokenizer.encode("def fibonacci(n):\n").ids, SamplingParams(max_tokens=60, ignore_eos=True))
        for _ in range(4):
            llm.step()
        d = load(tiny_engine)
        written = llm.scheduler.requests[rid].written
        assert written > 20
        # Per cache tensor and KV head, the row's positions [0, written) fill whole pages of
        # 4096 / (head_dim × 4 bytes) positions; no other page of the 8 rows is backed.
        per_page = 4096 // (d.head_dim * 4)
        assert pools.resident_bytes() == 2 * d.num_layers * d.num_kv_heads * -(-written // per_page) * 4096
        llm.run_until_done()                                 # it ends in a step: nothing runs after it
        assert pools.resident_bytes() == 0


def test_structured_outputs_keep_their_tokens_under_preemption(tiny_engine):
    constraints = [JsonSchema({"type": "object", "additionalProperties": False, "required": ["name", "size"],
                               "properties": {"name": {"type": "string", "maxLength": 12},
                                              "size": {"type": "integer"}}}),
                   Regex(r"[0-9]{3}-[a-z]{2,4}")]
    prompts = ["def f(x):", "class A:", "import os\n", "# Copyright"] * 2
    params = [SamplingParams(max_tokens=40, constraint=constraints[i % 2]) for i in range(8)]
    with LLM(tiny_engine, backend="onnxruntime", threads=2) as llm:
        expected = [o.token_ids for o in llm.generate(prompts, params)]
    with LLM(tiny_engine, backend="onnxruntime", threads=2, kv_cache_memory=_budget(tiny_engine, 4),
             block_size=BLOCK) as llm:
        got = [o.token_ids for o in llm.generate(prompts, params)]
        assert llm.scheduler.kv.stats.preemptions > 0
    assert got == expected


def test_prompt_lookup_keeps_its_tokens_under_preemption(speculation_engine):
    body = ("def moving_average(values, window):\n    total = 0.0\n    out = []\n    for i, v in enumerate(values):\n"
            "        total += v\n        if i >= window:\n            total -= values[i - window]\n")
    prompts = [body + "\n# again:\n" + body[:20 + 7 * i] for i in range(8)]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    with LLM(speculation_engine, backend="onnxruntime", threads=2, speculation=()) as llm:
        expected = [o.token_ids for o in llm.generate(prompts, params)]
    with LLM(speculation_engine, backend="onnxruntime", threads=2, speculation=(Source.prompt_lookup,),
             speculation_mode=SpeculationMode.always, kv_cache_memory=_budget(speculation_engine, 20),
             block_size=BLOCK) as llm:
        got = llm.generate(prompts, params)
        assert llm.scheduler.kv.stats.preemptions > 0 and sum(o.accepted_tokens for o in got) > 0
    assert [o.token_ids for o in got] == expected


def test_a_budget_that_cannot_hold_a_request_refuses_it_in_one_line(tiny_engine):
    with LLM(tiny_engine, backend="onnxruntime", threads=2, kv_cache_memory=_budget(tiny_engine, 2),
             block_size=BLOCK) as llm:
        with pytest.raises(ValueError, match=r"needs 3 KV blocks of 16 tokens; the KV budget \(kv_cache_memory\) "
                                             r"holds 2$"):
            llm.generate([[1] * 30], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="kv_cache_memory: 'lots' is not a KV budget; give bytes"):
        LLM(tiny_engine, backend="onnxruntime", kv_cache_memory="lots")
    with pytest.raises(ValueError, match="block_size 12: 12 is not a power of two; valid: a power of two dividing max_seq_len"):
        LLM(tiny_engine, backend="onnxruntime", block_size=12)


def test_medusa_trees_keep_their_tokens_under_preemption(medusa_engine):
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    with LLM(medusa_engine, backend="onnxruntime", threads=2, medusa_tree_size=0, multi_step=1) as llm:
        expected = [o.token_ids for o in llm.generate(TEXTS, params)]
    with LLM(medusa_engine, backend="onnxruntime", threads=2, medusa_tree_size=8, multi_step=1,
             kv_cache_memory=_budget(medusa_engine, 10), block_size=BLOCK) as llm:
        got = llm.generate(TEXTS, params)
        assert llm.scheduler.kv.stats.preemptions > 0 and sum(o.accepted_tokens for o in got) > 0
    assert [o.token_ids for o in got] == expected


def test_a_tensor_rank_returns_a_discarded_slots_pages(tiny_engine):
    """What rank 0 broadcasts when slots hold nothing (runtime/parallel/protocol.py Discard), decoded
    and run on another rank's engine as serve_rank does: its pages go back."""
    from trtbuild.runtime.core.step import Discard
    from trtbuild.runtime.parallel.protocol import decode, encode
    from trtbuild.runtime.parallel.rank_engines import run_message

    with LLM(tiny_engine, backend="onnxruntime", threads=2, prefix_cache=False) as llm:
        rank = llm.engine  # stands in for rank 1's engine: the same class, its own pools
        rid = llm.submit(llm.tokenizer.encode("def fibonacci(n):\n").ids, SamplingParams(max_tokens=60, ignore_eos=True))
        for _ in range(3):
            llm.step()
        slot = llm.scheduler.slots.slot_of(rid)
        assert rank.kv.resident_bytes() > 0
        run_message(rank, decode(*encode(Discard((slot,), ())), rank=1))
        assert rank.kv.resident_bytes() == 0

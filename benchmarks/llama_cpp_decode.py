"""llama.cpp's decode speed through llama-cpp-python's C API, at batch 1 and 8, measured as
cpu_decode.py measures trtbuild: the same random prompts, greedy, each new token detokenized.

The high-level ``Llama`` object decodes one sequence; batch 8 needs the C API: one context with
8 sequences (``n_seq_max``), a prefill batch holding all 8 prompts (logits at each prompt's last
token), then decode batches of one token per sequence, each sequence's argmax taken from its own
logits row. Batch 1 runs the same code with one sequence, so the two rows compare."""
from __future__ import annotations

import ctypes
import statistics
import time
from pathlib import Path

import numpy as np


def _quiet_callback():
    import llama_cpp as lc

    return lc.llama_log_callback(lambda level, text, data: None)


_QUIET = None


class LlamaCpp:
    """A model and a context sized for ``batch`` sequences of ``prompt_len + new_tokens``."""

    def __init__(self, path: Path, threads: int, batch: int, prompt_len: int, new_tokens: int):
        import llama_cpp as lc

        self.lc = lc
        global _QUIET
        _QUIET = _QUIET or _quiet_callback()  # kept alive: llama.cpp holds the pointer
        lc.llama_log_set(_QUIET, ctypes.c_void_p())  # its per-tensor load log would flood the output
        lc.llama_backend_init()
        model_params = lc.llama_model_default_params()
        self.model = lc.llama_model_load_from_file(str(path).encode(), model_params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        params = lc.llama_context_default_params()
        params.n_seq_max = batch
        params.n_ctx = batch * (prompt_len + new_tokens)
        params.n_batch = params.n_ubatch = batch * prompt_len  # the whole prefill in one decode call
        params.n_threads = params.n_threads_batch = threads
        self.ctx = lc.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not make a context")
        self.vocab = lc.llama_model_get_vocab(self.model)
        self.n_vocab = lc.llama_vocab_n_tokens(self.vocab)
        self.batch = lc.llama_batch_init(batch * prompt_len, 0, 1)
        self.piece = ctypes.create_string_buffer(256)

    def close(self) -> None:
        self.lc.llama_batch_free(self.batch)
        self.lc.llama_free(self.ctx)
        self.lc.llama_model_free(self.model)

    def _decode(self, items: list[tuple[int, int, int, bool]]) -> None:
        """One llama_decode of (token, position, sequence, wants logits) items."""
        b = self.batch
        b.n_tokens = len(items)
        for i, (token, pos, seq, logits) in enumerate(items):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, logits
            b.seq_id[i][0] = seq
        if self.lc.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")

    def _argmax(self, output: int) -> int:
        row = self.lc.llama_get_logits_ith(self.ctx, output)
        return int(np.ctypeslib.as_array(row, shape=(self.n_vocab,)).argmax())

    def _detokenize(self, token: int) -> bytes:
        n = self.lc.llama_token_to_piece(self.vocab, token, self.piece, len(self.piece), 0, False)
        return self.piece.raw[:max(n, 0)]

    def run(self, prompts: list[list[int]], new_tokens: int) -> tuple[float, float]:
        """(decode tok/s: median over steps of rows / step time, prefill s) for greedy generation
        of ``new_tokens`` tokens after each prompt."""
        self.lc.llama_memory_clear(self.lc.llama_get_memory(self.ctx), True)
        rows, length = len(prompts), len(prompts[0])
        start = time.perf_counter()
        self._decode([(t, pos, seq, pos == length - 1)
                      for seq, prompt in enumerate(prompts) for pos, t in enumerate(prompt)])
        tokens = [self._argmax((seq + 1) * length - 1) for seq in range(rows)]
        for token in tokens:
            self._detokenize(token)
        prefill, steps = time.perf_counter() - start, []
        for step in range(new_tokens - 1):
            begin = time.perf_counter()
            self._decode([(t, length + step, seq, True) for seq, t in enumerate(tokens)])
            tokens = [self._argmax(seq) for seq in range(rows)]
            for token in tokens:
                self._detokenize(token)
            steps.append(time.perf_counter() - begin)
        return rows / statistics.median(steps), prefill

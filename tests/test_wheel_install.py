"""The wheel, installed (not editable) into a fresh virtual environment, builds, runs and serves the
bundled model. CI installs editable, which imports every folder of the checkout whether or not the
wheel would ship it; this is the install a user gets from `pip install .` (a hand-kept package list
once left out runtime/speculation/sources/, and every non-editable `trtbuild run` failed)."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import urllib.request
from pathlib import Path

import pytest
from serving import serving
import yaml

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
NOT_INSTALLED = {"tests"}   # setup.py's own rule: every other root folder with an __init__.py ships
PROMPT = "def fibonacci(n):"


def _clean_env() -> dict[str, str]:
    """This environment without PYTHONPATH (a development shim there would import the checkout,
    not the installed wheel)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1", HF_HUB_OFFLINE="1")
    return env


def _check(command: list, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in command], cwd=cwd, env=_clean_env(), capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"{command} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return proc


def _copy_sources(dst: Path) -> Path:
    """What `pip install .` reads, copied out of the checkout (setuptools writes build/ and
    *.egg-info beside the sources it builds)."""
    dst.mkdir()
    for name in ("setup.py", "pyproject.toml", "README.md"):
        if (REPO / name).is_file():
            shutil.copy2(REPO / name, dst / name)
    for folder in sorted(REPO.iterdir()):
        if (folder / "__init__.py").is_file() and folder.name not in NOT_INSTALLED:
            shutil.copytree(folder, dst / folder.name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    return dst


def _build_wheel(src: Path, dist: Path) -> Path:
    isolation = [] if importlib.util.find_spec("setuptools") is None else ["--no-build-isolation"]
    _check([sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "-w", dist, src], cwd=src.parent, timeout=600)
    (wheel,) = dist.glob("trtbuild-*.whl")
    return wheel


def _venv_with_wheel(venv: Path, wheel: Path) -> Path:
    """A venv that sees this environment's packages (torch, onnxruntime, ...) through a .pth file,
    with the wheel installed into its own site-packages. A directory named in a .pth is put on
    sys.path without reading that directory's own .pth files, so this environment's editable
    trtbuild (an import hook installed by one) stays out of the venv."""
    _check([sys.executable, "-m", "venv", "--without-pip", venv], cwd=venv.parent, timeout=120)
    python = venv / "bin" / "python"
    site = _check([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=venv,
                  timeout=60).stdout.strip()
    ours = dict.fromkeys(sysconfig.get_paths()[key] for key in ("purelib", "platlib"))
    (Path(site) / "test_environment.pth").write_text("".join(f"{path}\n" for path in ours))
    _check([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", "--ignore-installed",
            wheel], cwd=venv.parent, timeout=600)
    return python


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        assert response.status == 200
        return json.loads(response.read())


def test_wheel_installs_builds_runs_and_serves(tmp_path):
    wheel = _build_wheel(_copy_sources(tmp_path / "src"), tmp_path / "dist")
    venv = tmp_path / "venv"
    python = _venv_with_wheel(venv, wheel)
    trtbuild = venv / "bin" / "trtbuild"

    # Outside the checkout, so nothing can import from it by the working directory.
    work = tmp_path / "work"
    (work / "specs").mkdir(parents=True)
    spec = yaml.safe_load((REPO / "specs" / "tiny-code.yaml").read_text())
    spec["model"]["checkpoint"] = str(REPO / "models" / "tiny-code")
    (work / "specs" / "tiny-code.yaml").write_text(yaml.safe_dump(spec))

    imported = _check([python, "-c", "import trtbuild.runtime.llm as m; print(m.__file__)"], cwd=work, timeout=120)
    assert Path(imported.stdout.strip()).resolve().is_relative_to(venv.resolve()), imported.stdout

    _check([trtbuild, "build", "specs/tiny-code.yaml", "-o", "build/tiny-code"], cwd=work, timeout=900)
    ran = _check([trtbuild, "run", "build/tiny-code", "--prompt", PROMPT, "--max-tokens", "8", "--json"], cwd=work,
                 timeout=300)
    completion = json.loads(ran.stdout)
    assert len(completion["token_ids"]) >= 1 and completion["text"], completion

    with serving([str(trtbuild), "serve", "build/tiny-code", "--port", "0"], tmp_path / "serve.log", cwd=work,
                 env=_clean_env(), start_s=120, stop_s=30) as server:
        served = _post(f"{server.base}/v1/completions",
                       {"model": "tiny-code", "prompt": PROMPT, "max_tokens": 8, "temperature": 0})
    # Both greedy on one engine dir: the server's text is `trtbuild run`'s.
    assert served["choices"][0]["text"] == completion["text"]
    assert served["usage"]["completion_tokens"] == len(completion["token_ids"])
    assert server.proc.returncode == 0, server.log_text()

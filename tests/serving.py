"""``trtbuild serve`` in a subprocess on 127.0.0.1, port 0 (the port it prints is the one it
bound), always stopped: SIGTERM, then SIGKILL if it lingers."""
from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

ANNOUNCED = re.compile(r"trtbuild serve: (\S+) \(.*\) on http://127\.0\.0\.1:(\d+)")  # model, port


@dataclass
class Served:
    proc: subprocess.Popen
    base: str
    log: Path
    model: str

    @property
    def port(self) -> int:
        return int(self.base.rsplit(":", 1)[1])

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


KEY = "test-key"   # the API key of the shared ``server`` fixture (tests/conftest.py)


@contextmanager
def served(engine_dir: Path, log: Path, *args: str, api_key: str | None = None, model: str = "tiny"):
    command = [sys.executable, "-m", "trtbuild.cli", "serve", str(engine_dir), "--port", "0",
               "--model-name", model, "--backend", "onnxruntime", *args]
    if api_key:
        command += ["--api-key", api_key]
    with serving(command, log) as server:
        yield server


@contextmanager
def serving(command: list[str], log: Path, cwd: Path | None = None, env: dict | None = None,
            start_s: float = 90, stop_s: float = 15):
    """Any command that starts ``trtbuild serve`` (port 0): yields once it announced its port; then
    SIGTERM (SIGKILL after ``stop_s``). The caller reads ``proc.returncode`` afterwards."""
    with open(log, "w") as sink:
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=sink, cwd=cwd, env=env)
    try:
        deadline = time.monotonic() + start_s
        while not (found := ANNOUNCED.search(log.read_text(errors="replace"))):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"the server did not start (exit {proc.poll()}):\n{log.read_text(errors='replace')}")
            time.sleep(0.1)
        assert int(found.group(2)) != 0
        yield Served(proc, f"http://127.0.0.1:{found.group(2)}", log, found.group(1))
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=stop_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

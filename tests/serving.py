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

ANNOUNCED = re.compile(r"trtbuild serve: \S+ \(.*\) on http://127\.0\.0\.1:(\d+)")


@dataclass
class Served:
    proc: subprocess.Popen
    base: str
    log: Path

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
    with open(log, "w") as sink:
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=sink)
    try:
        deadline = time.monotonic() + 90
        while not (found := ANNOUNCED.search(log.read_text(errors="replace"))):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"the server did not start:\n{log.read_text(errors='replace')}")
            time.sleep(0.1)
        assert int(found.group(1)) != 0
        yield Served(proc, f"http://127.0.0.1:{found.group(1)}", log)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

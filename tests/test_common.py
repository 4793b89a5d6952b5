"""The helpers in common/: an exception's first line, and a child that dies with its parent."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from trtbuild.contract.errors import first_line


@pytest.mark.parametrize("exc, line", [
    (ValueError("bad header\nTraceback detail"), "bad header"),
    (ValueError("\n  indented first line\nmore"), "indented first line"),  # leading blank lines skipped
    (RuntimeError(""), "RuntimeError"),
    (KeyError(), "KeyError"),
    (OSError("   "), "OSError"),
])
def test_first_line_is_the_first_line_or_the_type(exc, line):
    assert first_line(exc) == line


# The parent starts a child that calls die_with_parent, prints the child's pid, and sleeps; the
# test kills the parent with SIGKILL (no cleanup runs) and expects the child gone.
_PARENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "from trtbuild.contract.processes import die_with_parent; "
                          "die_with_parent(); print('ready', flush=True); import time; time.sleep(60)"],
                         stdout=subprocess.PIPE, text=True)
assert child.stdout.readline() == "ready\\n"
print(child.pid, flush=True)
time.sleep(60)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_child_that_dies_with_its_parent_ends_when_the_parent_is_killed():
    parent = subprocess.Popen([sys.executable, "-c", _PARENT], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    parent.kill()
    parent.wait()
    for _ in range(200):  # up to 10 s for the kernel's SIGKILL to land (a busy machine)
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        if _zombie(child):  # killed, not yet reaped by init
            break
        time.sleep(0.05)
    else:
        os.kill(child, signal.SIGKILL)
        pytest.fail(f"child {child} outlived its killed parent")


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return False

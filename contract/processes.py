"""A child process's lifetime tied to its parent's."""
from __future__ import annotations

import ctypes
import signal

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent() -> None:
    """Linux: this process gets SIGKILL when its parent dies, even by SIGKILL (no orphaned export
    worker or tensor-parallel rank). Elsewhere nothing: the parent's own cleanup ends its children."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:  # no libc.so.6: not Linux
        pass

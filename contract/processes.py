"""A child process's lifetime tied to its parent's, and the machine's memory that sizes processes."""
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


def meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes by field (MemTotal, MemAvailable, SwapTotal, …): what sizes a build's
    engine processes, the CPU runtime's ranks and a share-of-memory KV budget. Linux only."""
    fields = {}
    with open("/proc/meminfo") as handle:
        for line in handle:
            key, _, value = line.partition(":")
            fields[key] = int(value.split()[0]) * 1024
    return fields


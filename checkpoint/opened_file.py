"""A checkpoint file held open from the read of its header to the last read of its data.

Every byte a weight read maps comes through the handle the header was checked on, never from
the path opened again: a file replaced at its path (a new download moved over it) or changed
in place since its header was read is refused in one line before any of its bytes are used,
rather than read as the tensors of a header that does not describe it.
"""
from __future__ import annotations

import mmap
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import CheckpointError


@dataclass(frozen=True)
class FileIdentity:
    """Which file a path named, and its state: a change to any field is a different file."""

    device: int
    inode: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, status: os.stat_result) -> "FileIdentity":
        return cls(status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns)


class OpenedFile:
    """``path`` opened for reading; ``identity`` is the file as it was when opened."""

    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            self.handle = open(self.path, "rb")  # noqa: SIM115  (held for the file's lifetime)
        except OSError as exc:
            raise CheckpointError(f"{self.path}: cannot be opened ({exc.strerror})") from None
        self.identity = FileIdentity.of(os.fstat(self.handle.fileno()))

    def fileno(self) -> int:
        return self.handle.fileno()

    def check(self) -> None:
        """CheckpointError if the file changed since it was opened, or its path names another file now."""
        now = FileIdentity.of(os.fstat(self.fileno()))
        if now != self.identity:
            raise CheckpointError(f"{self.path}: changed since its header was read ({self.identity.size} bytes "
                                  f"then, {now.size} now); leave the file unchanged during a build")
        try:
            named = FileIdentity.of(os.stat(self.path))
        except OSError:
            named = None
        if named != self.identity:
            raise CheckpointError(f"{self.path}: replaced by another file since its header was read; "
                                  "leave the file unchanged during a build")

    def bytes_at(self, offset: int, count: int, writable: bool = False) -> np.ndarray:
        """Bytes [offset, offset + count) as a uint8 array [count] mapped from the open file:
        ``writable`` maps them copy-on-write (a write lands in private memory, never in the file,
        and no other read sees it), else read-only."""
        self.check()
        if count == 0:
            return np.zeros(0, np.uint8)
        start = offset // mmap.ALLOCATIONGRANULARITY * mmap.ALLOCATIONGRANULARITY
        try:
            view = mmap.mmap(self.fileno(), offset - start + count, offset=start,
                             access=mmap.ACCESS_COPY if writable else mmap.ACCESS_READ)
        except (ValueError, OSError) as exc:
            raise CheckpointError(f"{self.path}: bytes [{offset}, {offset + count}) cannot be mapped ({exc})") from None
        return np.frombuffer(view, np.uint8, count=count, offset=offset - start)

    def close(self) -> None:
        self.handle.close()

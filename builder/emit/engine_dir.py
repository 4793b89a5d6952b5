"""Write an engine dir atomically: build under a temporary sibling name, rename at the end.

A killed or failed build leaves no directory that loads: the final name appears only
once every file and the manifest are written.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from ..errors import UserError

MANIFEST = "manifest.json"


def check_destination(out: Path) -> None:
    if out.exists() and not (out.is_dir() and (out / MANIFEST).is_file()):
        raise UserError(f"{out}: exists and is not a trtbuild engine dir; choose another -o or remove it")


@contextmanager
def staged(out: Path) -> Iterator[Path]:
    """Yields a temporary dir next to ``out``; on success it replaces ``out``, on error it is removed."""
    out = Path(out)
    check_destination(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
        _make_readable(tmp)
        old = None
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            out.rename(old)
        tmp.rename(out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _make_readable(root: Path) -> None:
    """mkdtemp and some writers create owner-only files; an engine dir is meant to be shipped."""
    root.chmod(0o755)
    for path in root.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)

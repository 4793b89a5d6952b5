"""Write an engine dir atomically: build under a temporary sibling name, rename at the end.

A killed or failed build leaves no directory that loads: the final name appears only
once every file and the manifest are written.
"""
from __future__ import annotations

import os
import re
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from ..errors import UserError

from ...contract.json_file import parse_json
from ...contract.manifest import MANIFEST  # noqa: E402,F401  (re-exported for callers)


def check_destination(out: Path) -> None:
    """``out`` may be replaced only if trtbuild wrote it: a manifest of ours whose file list
    names every file in the dir. Anything else is the user's and is never deleted."""
    if not out.exists():
        for parent in out.parents:
            if parent.exists() and not parent.is_dir():
                raise UserError(f"-o {out}: {parent} is a file, not a directory")
        return
    foreign = _foreign_files(out)
    if foreign:
        raise UserError(f"-o {out}: exists and is not an engine dir trtbuild wrote ({foreign}); "
                        "choose another -o or move it away")


def _foreign_files(out: Path) -> str | None:
    """Why ``out`` is not ours, or None if every file in it is listed in its own manifest."""
    if not out.is_dir():
        return "not a directory"
    try:
        manifest = parse_json((out / MANIFEST).read_bytes(), str(out / MANIFEST))  # nesting bounded
    except FileNotFoundError:
        return f"no {MANIFEST}"
    except (OSError, ValueError):
        return f"{MANIFEST} is not a trtbuild manifest"
    if not (isinstance(manifest, dict) and isinstance(manifest.get("schema_version"), int)
            and isinstance(manifest.get("files"), dict) and isinstance(manifest.get("ranks"), list)):
        return f"{MANIFEST} is not a trtbuild manifest"
    listed = set(manifest["files"]) | {MANIFEST}
    extra = sorted(str(p.relative_to(out)) for p in out.rglob("*")
                   if not p.is_dir() and str(p.relative_to(out)) not in listed)
    if extra:
        return f"holds files its manifest does not list: {', '.join(extra[:3])}{' …' if len(extra) > 3 else ''}"
    return None


def _clear_stale(out: Path) -> None:
    """Temporaries of earlier builds to the same place whose process is gone (killed builds). A
    previous engine dir moved aside (``.old-``) by a build that died before its own dir took the
    name is put back, never deleted: it is the last good build."""
    pattern = re.compile(rf"^\.{re.escape(out.name)}\.(tmp|old)-(\d+)-")
    for sibling in sorted(out.parent.iterdir()) if out.parent.is_dir() else ():
        found = pattern.match(sibling.name)
        if not (found and sibling.is_dir() and not _alive(int(found.group(2)))):
            continue
        if found.group(1) == "old" and not out.exists() and _foreign_files(sibling) is None:
            sibling.rename(out)
        else:
            shutil.rmtree(sibling, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextmanager
def staged(out: Path) -> Iterator[Path]:
    """Yields a temporary dir next to ``out``; on success it replaces ``out``, on error it is removed."""
    out = Path(out)
    check_destination(out)
    created = [p for p in reversed(out.parents) if not p.exists()]  # removed again if the build fails
    out.parent.mkdir(parents=True, exist_ok=True)
    _clear_stale(out)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-{os.getpid()}-", dir=out.parent))
    try:
        yield tmp
        _make_readable(tmp)
        old = None
        if out.exists():
            check_destination(out)  # still ours, after the minutes the build took
            old = out.with_name(f".{out.name}.old-{os.getpid()}-")
            out.rename(old)
        try:
            tmp.rename(out)
        except BaseException:
            if old is not None:
                old.rename(out)  # the previous engine dir back under its name
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for parent in reversed(created):
            try:
                parent.rmdir()  # only if empty: nothing of anyone else's
            except OSError:
                break
        raise


def _make_readable(root: Path) -> None:
    """mkdtemp and some writers create owner-only files; an engine dir is meant to be shipped."""
    root.chmod(0o755)
    for path in root.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)

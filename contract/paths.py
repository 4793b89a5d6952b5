"""The one rule for reading a file named by untrusted input (a checkpoint's index, an engine dir's
manifest): the name must lead to a file inside the dir, never outside it through an absolute path,
``..`` or a symbolic link. Every reader of a checkpoint or engine dir asks here."""
from __future__ import annotations

from pathlib import Path


def path_inside(root: Path, name: str | Path) -> Path | None:
    """``root/name`` if it stays inside ``root`` once links are resolved, else None."""
    if not isinstance(name, (str, Path)) or not str(name) or Path(name).is_absolute() or ".." in Path(name).parts:
        return None
    base = Path(root).resolve()
    try:
        (base / name).resolve().relative_to(base)
    except ValueError:  # a link leading out of the dir
        return None
    return Path(root) / name

"""A JSON object from a file, or one line saying what is wrong with it (for untrusted files:
manifests, checkpoint configs)."""
from __future__ import annotations

import json
from pathlib import Path


def read_json_object(path: Path) -> dict:
    """Raises ValueError naming the file: not UTF-8, not JSON (where), or not an object."""
    try:
        value = json.loads(Path(path).read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not UTF-8 text") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: not a JSON object")
    return value

"""A JSON object from a file, or one line saying what is wrong with it (for untrusted files:
manifests, checkpoint configs and indexes, safetensors headers)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from .errors import first_line

# Far deeper than any manifest or config.json, far shallower than the depth at which Python's
# parser raises RecursionError (about 1000).
MAX_NESTING = 64

# A string that never closes runs to the end of the input: one pass, not a rescan from every
# later quote (quadratic: 20k escaped quotes took 12 s).
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*(?:"|\\?\Z)', re.DOTALL)


def nesting_depth(raw: bytes) -> int:
    """How deep ``[``/``{`` nest in JSON text, brackets inside strings not counted; measured
    without parsing, so a hostile ``[[[[...`` never reaches the recursive parser."""
    codes = np.frombuffer(_STRING.sub(b'""', raw), dtype=np.uint8)
    # "[" and "{" are 0x5b and 0x7b, "]" and "}" 0x5d and 0x7d: equal once bit 0x20 is cleared.
    folded = codes & 0xDF
    brackets = folded[(folded == 0x5B) | (folded == 0x5D)]                # [M] the brackets alone, in order
    steps = np.where(brackets == 0x5B, 1, -1).astype(np.int32)            # +1 opens, -1 closes
    return int(np.cumsum(steps, dtype=np.int32).max(initial=0))          # the depth after each bracket


class _DuplicateKey(ValueError):
    pass


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    # json.loads keeps the last of two equal keys; two readers of one file could then disagree.
    seen = set()
    for key, _ in pairs:
        if key in seen:
            raise _DuplicateKey(f"key {key!r} appears twice in one object")
        seen.add(key)
    return dict(pairs)


def parse_json(raw: bytes, where: str, max_nesting: int = MAX_NESTING):
    """The value of JSON text read from ``where`` (named in every error); raises ValueError for
    text that is not UTF-8, not JSON, nested deeper than ``max_nesting``, or with a key twice in
    one object."""
    depth = nesting_depth(raw)
    if depth > max_nesting:
        raise ValueError(f"{where}: JSON nested {depth} levels deep (at most {max_nesting})")
    try:
        return json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_keys)
    except UnicodeDecodeError:
        raise ValueError(f"{where}: not UTF-8 text") from None
    except _DuplicateKey as exc:
        raise ValueError(f"{where}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    except ValueError as exc:  # an integer longer than Python's int_max_str_digits
        raise ValueError(f"{where}: not valid JSON ({first_line(exc)})") from None


def read_json_object(path: Path) -> dict:
    """Raises ValueError naming the file: not UTF-8, not JSON (where), too deep, or not an object."""
    value = parse_json(Path(path).read_bytes(), str(path))
    if not isinstance(value, dict):
        raise ValueError(f"{path}: not a JSON object")
    return value

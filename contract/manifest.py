"""manifest.json's schema version and file hashing: what builder writes and runtime checks."""
from __future__ import annotations

import hashlib
from pathlib import Path

# Bump on any incompatible change of manifest.json. 2: tensor parallelism; each entry of
# ``ranks`` carries its KV heads, I/O table and weight bytes (the top-level ``io`` is gone).
SCHEMA_VERSION = 2


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()

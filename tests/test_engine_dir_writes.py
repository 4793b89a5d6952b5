"""builder/emit/engine_dir.staged: the final name appears only when the new dir is complete, and
the previous engine dir is never lost, whatever fails between the two renames."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from trtbuild.builder.emit import engine_dir
from trtbuild.builder.emit.engine_dir import staged


def _write_ours(path: Path, marker: str) -> None:
    """A dir trtbuild would have written: every file listed in its manifest."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "rank0.engine").write_text(marker)
    (path / "manifest.json").write_text(json.dumps({"schema_version": 7, "ranks": [{}],
                                                    "files": {"rank0.engine": {}}}))


def test_a_failed_final_rename_puts_the_previous_dir_back(tmp_path, monkeypatch):
    out = tmp_path / "engines"
    _write_ours(out, "previous build")
    real_rename = Path.rename

    def failing_rename(self, target):
        if self.name.startswith(".engines.tmp-"):
            raise OSError("disk full")
        return real_rename(self, target)

    monkeypatch.setattr(Path, "rename", failing_rename)
    with pytest.raises(OSError, match="disk full"):
        with staged(out) as tmp:
            _write_ours(tmp, "new build")
    assert (out / "rank0.engine").read_text() == "previous build"
    assert [p.name for p in tmp_path.iterdir()] == ["engines"]


def test_the_previous_dir_left_aside_by_a_killed_build_is_restored_not_swept(tmp_path, monkeypatch):
    out = tmp_path / "engines"
    # A build (pid 999999, gone) moved the last good dir aside, then died before its own rename.
    _write_ours(tmp_path / ".engines.old-999999-", "last good build")
    monkeypatch.setattr(engine_dir, "_alive", lambda pid: pid == os.getpid())

    class Stop(Exception):
        pass

    with pytest.raises(Stop):
        with staged(out):
            assert (out / "rank0.engine").read_text() == "last good build"
            raise Stop  # this build fails too: the restored dir stays
    assert (out / "rank0.engine").read_text() == "last good build"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["engines"]


def test_a_stale_old_dir_beside_a_newer_build_is_swept(tmp_path, monkeypatch):
    out = tmp_path / "engines"
    _write_ours(out, "newer build")
    _write_ours(tmp_path / ".engines.old-999999-", "superseded")
    monkeypatch.setattr(engine_dir, "_alive", lambda pid: pid == os.getpid())
    with staged(out) as tmp:
        _write_ours(tmp, "this build")
    assert (out / "rank0.engine").read_text() == "this build"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["engines"]

"""Engine dirs and checkpoints as untrusted input; builds that never destroy a user's files.

Every tampering of a built engine dir must stop loading with one line naming the file (and
make `trtbuild inspect` exit non-zero); `-o` never replaces a directory trtbuild did not
write; no entry point that reads a checkpoint unpickles anything.
"""
from __future__ import annotations

import re
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, TINY_CODE

pytestmark = pytest.mark.slow


def _manifest(d: Path) -> dict:
    return json.loads((d / "manifest.json").read_text())


def _write(d: Path, manifest: dict) -> None:
    (d / "manifest.json").write_text(json.dumps(manifest))


def _flip(d: Path):
    data = d / "rank0.onnx.data"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))


def _truncate(d: Path):
    data = d / "rank0.onnx.data"
    data.write_bytes(data.read_bytes()[:-4096])


def _delete(d: Path):
    (d / "rank0.onnx.data").unlink()


def _unlist(d: Path):
    m = _manifest(d)
    del m["files"]["rank0.onnx.data"]
    _flip(d)
    _write(d, m)


def _empty_files(d: Path):
    m = _manifest(d)
    m["files"] = {}
    _write(d, m)


def _relocate_outside(d: Path):
    outside = d.parent / "elsewhere"
    outside.mkdir()
    shutil.copy(d / "rank0.onnx", outside / "rank0.onnx")
    m = _manifest(d)
    m["ranks"][0]["onnx"] = str(outside / "rank0.onnx")
    _write(d, m)


def _dotdot(d: Path):
    m = _manifest(d)
    m["ranks"][0]["onnx"] = "../rank0.onnx"
    _write(d, m)


def _list_outside(d: Path):
    m = _manifest(d)
    m["files"]["../../../../etc/hostname"] = {"sha256": "0" * 64, "bytes": 1}
    _write(d, m)


def _symlink_out(d: Path):
    (d / "tokenizer.json").unlink()
    (d / "tokenizer.json").symlink_to("/etc/hostname")


def _swap_data(d: Path):
    (d / "rank0.onnx.data").write_bytes((d / "rank0.onnx.data").read_bytes()[::-1])


def _truncated_manifest(d: Path):
    text = (d / "manifest.json").read_text()
    (d / "manifest.json").write_text(text[: len(text) // 2])


def _not_a_mapping(d: Path):
    (d / "manifest.json").write_text("[1, 2, 3]")


def _missing_keys(d: Path):
    m = _manifest(d)
    del m["ranks"]
    _write(d, m)


def _not_utf8(d: Path):
    (d / "manifest.json").write_bytes(b"\xff\xfe{")


def _foreign_data_location(d: Path):
    import onnx
    model = onnx.load(d / "rank0.onnx", load_external_data=False)
    tensor = next(t for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL)
    for entry in tensor.external_data:
        if entry.key == "location":
            entry.value = "../../foreign.data"
    onnx.save_model(model, d / "rank0.onnx")
    m = _manifest(d)
    from trtbuild.contract.manifest import sha256_file
    m["files"]["rank0.onnx"] = {"sha256": sha256_file(d / "rank0.onnx"), "bytes": (d / "rank0.onnx").stat().st_size}
    _write(d, m)


def _edit_cpu_step_model(d: Path):
    """A node of the CPU step model retargeted (a rewrite after the build): its hash no longer matches."""
    import onnx
    model = onnx.load(d / "rank0.cpu.onnx", load_external_data=False)
    model.graph.node[-1].name = "tampered"
    onnx.save_model(model, d / "rank0.cpu.onnx")


def _unlist_cpu_step_model(d: Path):
    m = _manifest(d)
    del m["files"]["rank0.cpu.onnx"]
    _write(d, m)


def _cpu_step_model_reads_elsewhere(d: Path):
    """The CPU step model's decode branch pointed at a file outside the dir, its hash updated."""
    import onnx
    from trtbuild.contract.manifest import sha256_file
    model = onnx.load(d / "rank0.cpu.onnx", load_external_data=False)
    branch = next(a.g for a in model.graph.node[0].attribute if a.name == "then_branch")
    tensor = next(t for t in branch.initializer if t.data_location == onnx.TensorProto.EXTERNAL)
    next(e for e in tensor.external_data if e.key == "location").value = "../../foreign.data"
    onnx.save_model(model, d / "rank0.cpu.onnx")
    m = _manifest(d)
    m["files"]["rank0.cpu.onnx"] = {"sha256": sha256_file(d / "rank0.cpu.onnx"),
                                    "bytes": (d / "rank0.cpu.onnx").stat().st_size}
    _write(d, m)


TAMPERING = {
    "flip a weight byte": (_flip, "rank0.onnx.data: sha256 differs"),
    "truncate the weights": (_truncate, "rank0.onnx.data: sha256 differs"),
    "delete the weights": (_delete, "rank0.onnx.data: missing"),
    "unlist the weights (and corrupt them)": (_unlist, "rank0.onnx.data: needed by the engine dir but not listed"),
    "empty the file list": (_empty_files, "needed by the engine dir but not listed"),
    "graph outside the dir (absolute)": (_relocate_outside, "ranks[0].onnx"),
    "graph outside the dir (../)": (_dotdot, "ranks[0].onnx '../rank0.onnx' is not a file name inside"),
    "list a file outside the dir": (_list_outside, "is not inside the engine dir"),
    "symlink out of the dir": (_symlink_out, "'tokenizer.json' is not inside the engine dir"),
    "swap weight bytes": (_swap_data, "rank0.onnx.data: sha256 differs"),
    "truncated manifest": (_truncated_manifest, "manifest.json: not valid JSON"),
    "manifest not a mapping": (_not_a_mapping, "manifest.json: not a JSON object"),
    "manifest missing keys": (_missing_keys, "manifest.json: missing keys ranks"),
    "manifest not UTF-8": (_not_utf8, "manifest.json: not UTF-8"),
    "graph reads weights elsewhere": (_foreign_data_location, "reads weights from '../../foreign.data'"),
    "edit the CPU step model": (_edit_cpu_step_model, "rank0.cpu.onnx: sha256 differs"),
    "unlist the CPU step model": (_unlist_cpu_step_model, "rank0.cpu.onnx: needed by the engine dir but not listed"),
    "CPU step model reads weights elsewhere": (_cpu_step_model_reads_elsewhere,
                                               "reads weights from '../../foreign.data', not the rank's data "
                                               "file 'rank0.onnx.data'"),
}


@pytest.mark.parametrize("case", list(TAMPERING))
def test_tampered_engine_dir_is_refused_in_one_line(tiny_engine, tmp_path, case):
    tamper, message = TAMPERING[case]
    d = tmp_path / "copy"
    shutil.copytree(tiny_engine, d)
    tamper(d)
    for command in (["run", str(d), "--prompt", "def f(x):", "--max-tokens", "4", "--backend", "onnxruntime"],
                    ["eval", str(d), "--data", str(TINY_CODE / "heldout.txt"), "--max-tokens", "600"],
                    ["inspect", str(d)]):
        proc = subprocess.run([sys.executable, "-m", "trtbuild.cli", *command], capture_output=True, text=True)
        assert proc.returncode != 0, (case, command, proc.stdout[-500:])
        last = proc.stderr.strip().splitlines()[-1]
        assert last.startswith("error: ") and message in last and "Traceback" not in proc.stderr, (case, command, proc.stderr[-800:])


@pytest.mark.parametrize("section, field, value, valid", [
    ("quantization", "cpu_activations", "int3", "is not one of float, int8"),
    ("runtime", "multi_step", 0, "is not an integer ≥ 1"),
    ("runtime", "multi_step", "8", "is not an integer ≥ 1"),
])
def test_an_invalid_runtime_setting_in_a_manifest_is_refused_in_one_line(tiny_engine, tmp_path, section, field, value,
                                                                         valid):
    d = tmp_path / "copy"
    shutil.copytree(tiny_engine, d)
    m = _manifest(d)
    m["spec"].setdefault(section, {})[field] = value
    _write(d, m)
    for command in (["run", str(d), "--prompt", "def f(x):", "--max-tokens", "4", "--backend", "onnxruntime"],
                    ["eval", str(d), "--data", str(TINY_CODE / "heldout.txt"), "--max-tokens", "600"]):
        proc = subprocess.run([sys.executable, "-m", "trtbuild.cli", *command], capture_output=True, text=True)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, (command, proc.stderr[-800:])
        assert proc.stderr.strip().splitlines()[-1] == (f"error: {d / 'manifest.json'}: spec.{section}.{field} "
                                                        f"{value!r} {valid}"), proc.stderr


def test_a_manifest_written_before_multi_step_runs_with_its_default(tiny_engine, tmp_path):
    from trtbuild.contract.manifest import DEFAULT_MULTI_STEP
    from trtbuild.runtime.engine_dir import load

    d = tmp_path / "copy"
    shutil.copytree(tiny_engine, d)
    m = _manifest(d)
    del m["spec"]["runtime"]["multi_step"]
    _write(d, m)
    assert load(d).multi_step == DEFAULT_MULTI_STEP == 8


def test_build_never_replaces_a_directory_it_did_not_write(tmp_path):
    web_app = tmp_path / "site"
    (web_app / "src").mkdir(parents=True)
    (web_app / "manifest.json").write_text('{"name": "my web app", "icons": []}')
    (web_app / "README.md").write_text("mine")
    proc = subprocess.run([sys.executable, "-m", "trtbuild.cli", "build", str(REPO / "specs" / "tiny-code.yaml"),
                           "-o", str(web_app)], capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.strip().startswith(f"error: -o {web_app}: exists and is not an engine dir")
    assert sorted(p.name for p in web_app.iterdir()) == ["README.md", "manifest.json", "src"]


def test_rebuild_replaces_its_own_dir_but_not_one_with_foreign_files(tiny_engine, tmp_path):
    from trtbuild.builder.emit.engine_dir import check_destination
    from trtbuild.builder.errors import UserError

    d = tmp_path / "engine"
    shutil.copytree(tiny_engine, d)
    check_destination(d)  # every file listed: ours to replace
    (d / "notes.txt").write_text("the user's")
    with pytest.raises(UserError, match="holds files its manifest does not list: notes.txt"):
        check_destination(d)
    with pytest.raises(UserError, match="is a file, not a directory"):
        check_destination(d / "notes.txt" / "out")


def _pickle_checkpoint(tmp_path: Path, marker: Path) -> Path:
    """A checkpoint whose only weights are a pickle that creates ``marker`` when unpickled."""
    import pickle

    class Payload:
        def __reduce__(self):
            return (Path.touch, (marker,))

    ckpt = tmp_path / "pickled"
    ckpt.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY_CODE / name, ckpt / name)
    (ckpt / "pytorch_model.bin").write_bytes(pickle.dumps(Payload()))
    return ckpt


@pytest.mark.parametrize("entry", ["eval", "eval --reference", "medusa train", "build"])
def test_no_checkpoint_entry_point_unpickles(tmp_path, entry):
    marker = tmp_path / "PWNED"
    ckpt = _pickle_checkpoint(tmp_path, marker)
    data = str(TINY_CODE / "heldout.txt")
    commands = {
        "eval": ["eval", str(ckpt), "--data", data, "--max-tokens", "600"],
        "eval --reference": ["eval", str(TINY_CODE), "--data", data, "--max-tokens", "600", "--reference", str(ckpt)],
        "medusa train": ["medusa", "train", str(ckpt), "--data", data, "--heads", "1", "--steps", "1", "-o",
                         str(tmp_path / "heads")],
    }
    if entry == "build":
        spec = tmp_path / "spec.yaml"
        spec.write_text(f"model: {{checkpoint: {ckpt}, dtype: float32}}\nbuild: {{max_seq_len: 1024}}\n")
        commands["build"] = ["build", str(spec), "-o", str(tmp_path / "out")]
    proc = subprocess.run([sys.executable, "-m", "trtbuild.cli", *commands[entry]], capture_output=True, text=True)
    assert proc.returncode == 2, proc.stderr[-800:]
    assert "holds only pickle weights (pytorch_model.bin)" in proc.stderr.strip().splitlines()[-1]
    assert not marker.exists() and "Traceback" not in proc.stderr


def _session_processes(sid: int) -> list[int]:
    """Live processes of session ``sid`` (a build started in its own session, with every child)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[3]) == sid and fields[0] != "Z":  # fields after the name: state, ppid, pgrp, session
            found.append(int(stat.parent.name))
    return found


def test_killed_builds_leave_no_orphans_and_the_next_build_works(tmp_path):
    import os
    import signal
    import time

    out = tmp_path / "engine"
    command = [sys.executable, "-m", "trtbuild.cli", "build", str(REPO / "specs" / "tiny-code.yaml"), "-o", str(out)]
    for sig, after_s in ((signal.SIGTERM, 0.5), (signal.SIGKILL, 4.0)):
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 120  # on a loaded machine the export worker starts late
        while len(_session_processes(proc.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(after_s)  # into the export worker's work
        assert len(_session_processes(proc.pid)) > 1, "the build has no worker yet"
        os.kill(proc.pid, sig)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 10
        while _session_processes(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _session_processes(proc.pid) == [], f"orphans after {sig.name}"
        assert not out.exists()
    stale = [p.name for p in tmp_path.iterdir() if p.name.startswith(".engine.tmp-")]
    assert stale, "SIGKILL leaves its staging dir (nothing runs to remove it)"
    proc = subprocess.run(command, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-1000:]
    assert [p.name for p in tmp_path.iterdir()] == ["engine"]  # the next build cleared the dead build's temporaries


def test_prompts_and_workloads_outside_the_vocabulary_are_refused(tiny_engine, tmp_path):
    from trtbuild.runtime.bench import load_workload
    from trtbuild.runtime.llm import LLM
    from trtbuild.runtime.core.sampling import SamplingParams

    llm = LLM(tiny_engine, backend="onnxruntime")
    for prompt, message in (([5, -1], "token id -1 is outside the vocabulary [0, 4096)"),
                            ([4096], "token id 4096 is outside"),
                            ([1.5], "prompt: token ids are integers, got 1.5 (float)"),
                            ([True], "prompt: token ids are integers, got True (bool)"),
                            ("caf\udce9", "prompt: not valid UTF-8 text")):
        with pytest.raises(ValueError, match=re.escape(message)):
            llm.generate([prompt], SamplingParams(max_tokens=2))
    assert not llm.has_work()  # nothing half-queued
    import numpy as np

    (ids,) = llm.generate([np.array([5, 17, 300])], SamplingParams(max_tokens=2))  # numpy ids are ids
    assert ids.prompt_token_ids == [5, 17, 300] and all(type(t) is int for t in ids.prompt_token_ids)
    (done,) = llm.generate(["def f(x):"], SamplingParams(max_tokens=3, temperature=1.0, top_k=10**6, seed=1))
    assert len(done.token_ids) == 3  # top_k beyond the vocabulary keeps every token
    workload = tmp_path / "w.jsonl"
    workload.write_text('{"prompt": [1, 2], "max_tokens": 4}\n{"prompt": [3, -7], "max_tokens": 4}\n')
    with pytest.raises(ValueError, match=r"w.jsonl:2: .*token id -7 is outside"):
        load_workload(workload, llm.tokenizer)

"""Side files (tokenizer, its config and chat template, generation config): the build copies them
from wherever the checkpoint keeps them and checks the tokenizer against the model; the runtime
reads only those the manifest lists, and refuses one the build did not write."""
from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from trtbuild.builder.errors import UserError
from trtbuild.builder.frontend.side_files import check_side_files, checkpoint_side_files
from trtbuild.runtime.engine_dir import EngineDirError, load
from trtbuild.runtime.server.chat import chat_template

from conftest import TINY_CODE, write_spec

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def _copy(engine: Path, tmp_path: Path) -> Path:
    out = tmp_path / "engine"
    shutil.copytree(engine, out)
    return out


def _list(engine: Path, name: str, content: str | None) -> None:
    """Rewrites the dir as a build would have: ``name`` written with ``content`` (None: absent)."""
    manifest = json.loads((engine / "manifest.json").read_text())
    if content is None:
        (engine / name).unlink(missing_ok=True)
        manifest["files"].pop(name, None)
    else:
        (engine / name).write_text(content)
        manifest["files"][name] = {"sha256": hashlib.sha256(content.encode()).hexdigest(),
                                   "bytes": len(content.encode())}
    manifest["side_files"][name] = content is not None
    (engine / "manifest.json").write_text(json.dumps(manifest))


def test_a_side_file_dropped_in_after_the_build_is_refused_not_read(tiny_engine, tmp_path):
    engine = _copy(tiny_engine, tmp_path)
    _list(engine, "generation_config.json", None)  # a dir built from a checkpoint without one
    assert load(engine).eos_token_ids() == (0,)    # config.json's
    (engine / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 13]}))
    with pytest.raises(EngineDirError, match=r"generation_config.json: not written by the build .* records it absent"):
        load(engine)


def test_the_chat_template_comes_from_chat_template_jinja_before_tokenizer_config(tiny_engine, tmp_path):
    engine = _copy(tiny_engine, tmp_path)
    assert load(engine).chat_template() is None  # the bundled model has none: the server's default
    config = json.loads((engine / "tokenizer_config.json").read_text())
    _list(engine, "tokenizer_config.json", json.dumps({**config, "chat_template": "{{ 'from config' }}"}))
    assert load(engine).chat_template() == "{{ 'from config' }}"
    _list(engine, "chat_template.jinja", CHATML)
    template = chat_template(load(engine))
    assert template.render([{"role": "user", "content": "hi"}]) == \
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_the_chat_template_gets_the_tokenizers_special_tokens(tiny_engine, tmp_path):
    engine = _copy(tiny_engine, tmp_path)
    _list(engine, "chat_template.jinja", "{{ bos_token }}{{ messages[0]['content'] }}{{ eos_token }}")
    assert chat_template(load(engine)).render([{"role": "user", "content": "x"}]) == "<|endoftext|>x<|endoftext|>"


def test_checkpoint_side_files_include_chat_template_jinja(tmp_path):
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(TINY_CODE / name, checkpoint / name)
    (checkpoint / "chat_template.jinja").write_text(CHATML)
    files = checkpoint_side_files(checkpoint)
    assert sorted(files) == ["chat_template.jinja", "config.json", "tokenizer.json", "tokenizer_config.json"]
    assert files["chat_template.jinja"] == CHATML.encode()
    check_side_files(files, checkpoint, vocab_size=4096)


def test_a_side_file_linking_out_of_the_checkpoint_is_refused(tmp_path):
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (tmp_path / "elsewhere.json").write_text("{}")
    (checkpoint / "generation_config.json").symlink_to(tmp_path / "elsewhere.json")
    with pytest.raises(UserError, match="generation_config.json: not a regular file inside the checkpoint dir"):
        checkpoint_side_files(checkpoint)


def _tokenizer_with_added_tokens(tmp_path: Path, count: int) -> Path:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(TINY_CODE / "tokenizer.json"))
    tokenizer.add_special_tokens([f"<|tool_{i}|>" for i in range(count)])
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    return path


def test_tokenizer_ids_past_the_vocabulary_are_refused(tmp_path):
    files = {"tokenizer.json": _tokenizer_with_added_tokens(tmp_path, 2).read_bytes()}
    with pytest.raises(UserError, match=r"tokenizer.json: 2 token id\(s\) outside the model's vocabulary of 4096 "
                                        r"\(config.json vocab_size\): '<\|tool_0\|>' = 4096, '<\|tool_1\|>' = 4097"):
        check_side_files(files, tmp_path, vocab_size=4096)


def test_cli_refuses_a_tokenizer_past_the_vocabulary_before_any_work(tmp_path):
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    for path in TINY_CODE.iterdir():
        if path.is_file() and path.name != "tokenizer.json":
            shutil.copyfile(path, checkpoint / path.name)
    _tokenizer_with_added_tokens(checkpoint, 1)
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "trtbuild.cli", "build",
                           str(write_spec(tmp_path / "spec.yaml", checkpoint)), "-o", str(out)],
                          capture_output=True, text=True)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(f"error: {checkpoint / 'tokenizer.json'}: 1 token id(s) outside")
    assert not out.exists()


def test_a_checkpoint_without_a_tokenizer_is_refused(tmp_path):
    with pytest.raises(UserError, match="no tokenizer.json; the engine dir needs the checkpoint's tokenizer"):
        check_side_files({}, tmp_path, vocab_size=4096)


def test_end_of_sequence_ids_outside_the_vocabulary_are_refused_at_build(tmp_path):
    files = {"tokenizer.json": (TINY_CODE / "tokenizer.json").read_bytes(),
             "generation_config.json": json.dumps({"eos_token_id": [0, 99999]}).encode()}
    with pytest.raises(UserError, match=r"generation_config.json: eos_token_id \[0, 99999\] must be token ids "
                                        r"below vocab_size 4096"):
        check_side_files(files, tmp_path, vocab_size=4096)


def test_every_reader_of_a_checkpoints_tokenizer_checks_it_fits_the_vocabulary(tmp_path):
    """Calibration, eval and medusa train take the tokenizer from checkpoint_tokenizer: the same check."""
    from trtbuild.checkpoint.errors import CheckpointError
    from trtbuild.checkpoint.tokenizer import checkpoint_tokenizer

    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    shutil.copyfile(TINY_CODE / "config.json", checkpoint / "config.json")
    _tokenizer_with_added_tokens(checkpoint, 1)
    with pytest.raises(CheckpointError, match=r"tokenizer.json: 1 token id\(s\) outside the model's vocabulary"):
        checkpoint_tokenizer(checkpoint)


def test_checkpoint_files_linking_out_of_the_dir_are_refused_by_every_reader(tmp_path):
    from trtbuild.checkpoint.errors import CheckpointError
    from trtbuild.checkpoint.safetensors_files import read_index
    from trtbuild.checkpoint.source import config_dict

    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (tmp_path / "outside.json").write_text("{}")
    for name in ("config.json", "model.safetensors.index.json"):
        (checkpoint / name).symlink_to(tmp_path / "outside.json")
    with pytest.raises(CheckpointError, match="config.json: not a regular file inside the checkpoint dir"):
        config_dict(checkpoint)
    with pytest.raises(CheckpointError, match="model.safetensors.index.json: not a regular file inside"):
        read_index(checkpoint)

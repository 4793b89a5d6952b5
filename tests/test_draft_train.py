"""Draft head training (`trtbuild draft train`): the training-time-test masks against what
drafting attends to, the reduced vocabulary, the training forward against the exported step, and
training on the bundled model end to end (the loss falls, held-out top-1 beats the best unigram,
the dir loads, the CLI's table and its one-line refusals)."""
from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from trtbuild.builder.draft_head.model import DraftHead, DraftHeadStep, load_draft_head
from trtbuild.builder.draft_head.train import DraftTrainOptions, TrainPrecision, train_draft_head, ttt_mask, unroll
from trtbuild.builder.draft_head.vocab import OUTSIDE, draft_vocabulary, target_to_draft
from trtbuild.builder.errors import UserError
from trtbuild.cli.main import main
from trtbuild.contract.draft_head import CONFIG_FILE, WEIGHTS_FILE, DraftHeadConfig, DraftLayerShape, default_taps

from conftest import TINY_CODE

DATA = TINY_CODE / "heldout.txt"
SMALL = dict(draft_vocab=1024, seq_len=48, sequences=48, prompt_len=16, steps=80, batch=4, lr=3e-3)


def random_draft(seed: int = 0, vocab: int = 100, k: int = 20) -> DraftHead:
    torch.manual_seed(seed)
    shape = DraftLayerShape(hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16,
                            rms_norm_eps=1e-5, rope_theta=10000.0)
    config = DraftHeadConfig(taps=(0, 1, 2), target_vocab_size=vocab, target_num_layers=3, draft_vocab_size=k,
                             layer=shape)
    draft = DraftHead(config, nn.Embedding(vocab, 64))
    with torch.no_grad():
        for name, param in draft.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
        draft.draft_to_target.copy_(torch.randperm(vocab)[:k])
    return draft.eval()


def test_ttt_mask_is_exactly_what_each_depth_sees():
    # Depth 3 at position p: verified prefix ends at q = p - 2; keys are pass 1 at ≤ q, pass 2 at
    # q + 1 (the first chain step), pass 3 at q + 2 = p (itself).
    expected = torch.tensor([
        # pass 1      pass 2      pass 3
        [0, 0, 0, 0,  0, 0, 0, 0,  1, 0, 0, 0],   # p = 0 (q < 0: no verified prefix, not scored)
        [0, 0, 0, 0,  1, 0, 0, 0,  0, 1, 0, 0],   # p = 1 (q < 0: not scored)
        [1, 0, 0, 0,  0, 1, 0, 0,  0, 0, 1, 0],   # p = 2, q = 0
        [1, 1, 0, 0,  0, 0, 1, 0,  0, 0, 0, 1],   # p = 3, q = 1
    ], dtype=torch.bool)
    assert torch.equal(ttt_mask(4, 3), expected)
    assert torch.equal(ttt_mask(4, 1), torch.ones(4, 4, dtype=torch.bool).tril())


@torch.no_grad()
def test_each_depth_of_the_unrolled_pass_equals_drafting_a_chain():
    """Depth j at p of the training unroll == the j-th token of a chain drafted step by step after
    a target-verified prefix ending at q = p - j + 1 (keys cached as inference caches them)."""
    draft, depth, length = random_draft(), 3, 10
    ids = torch.randint(0, 100, (1, length))
    taps = torch.randn(1, length, 3 * 64).to(torch.bfloat16)
    unrolled = unroll(draft, ids, taps, depth)                       # depth × [1, L-1, K]
    features = draft.fuse_taps(taps.float())                         # [1, L, H]
    for q in range(0, length - depth):
        causal = torch.ones(q + 1, q + 1, dtype=torch.bool).tril()[None, None]
        positions = torch.arange(q + 1)[None]
        logits, hidden, kv = draft(ids[:, 1:q + 2], features[:, :q + 1], positions, causal)
        assert torch.allclose(logits[0, q], unrolled[0][0, q], atol=1e-5)
        cache, feature = [kv], hidden[:, q:q + 1]
        for j in range(2, depth + 1):
            p = q + j - 1
            sees_all = torch.ones(1, 1, 1, q + j, dtype=torch.bool)
            logits, hidden, kv = draft(ids[:, p + 1:p + 2], feature, torch.tensor([[p]]), sees_all, cache)
            assert torch.allclose(logits[0, 0], unrolled[j - 1][0, p], atol=1e-5), (q, j)
            cache, feature = cache + [kv], hidden


@torch.no_grad()
def test_training_forward_equals_the_exported_step():
    draft, batch, seq, s_max = random_draft(seed=1), 2, 7, 16
    step = DraftHeadStep(draft, s_max).eval()
    ids = torch.randint(0, 100, (batch, seq))
    features = torch.randn(batch, seq, 64)
    positions = torch.arange(seq)[None].expand(batch, seq)
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    logits, hidden, _ = draft(ids, features, positions, causal[None, None].expand(batch, 1, seq, seq))
    mask = torch.zeros(batch, 1, seq, s_max, dtype=torch.bool)
    mask[..., :seq] = causal
    empty = torch.zeros(batch, 2, s_max, 16)
    step_logits, step_hidden, _, _ = step(ids, positions, torch.zeros(batch, dtype=torch.int64),
                                          torch.full((batch,), seq), mask, positions, features, empty, empty)
    assert (step_logits - logits).abs().max() < 1e-5
    assert (step_hidden - hidden).abs().max() < 1e-5


def test_vocabulary_is_the_most_frequent_argmaxes_ties_by_id():
    argmax = torch.tensor([[3, 3, 1, 2, 2, 0, 4, 4]])
    assert draft_vocabulary(argmax, 3, 6).tolist() == [2, 3, 4]
    assert draft_vocabulary(argmax, 6, 6).tolist() == [2, 3, 4, 0, 1, 5]   # 5 never predicted: last
    assert target_to_draft(torch.tensor([2, 3, 4]), 6).tolist() == [OUTSIDE, OUTSIDE, 0, 1, 2, OUTSIDE]


@pytest.fixture(scope="module", params=[TrainPrecision.float32, TrainPrecision.bfloat16])
def trained(tmp_path_factory, request):
    """A draft trained in each precision (bfloat16 runs on any CPU, fast only with AMX)."""
    out = tmp_path_factory.mktemp("draft") / "head"
    lines = []
    report = train_draft_head(TINY_CODE, [DATA], out, DraftTrainOptions(**SMALL, precision=request.param),
                              progress=lines.append)
    return report, out, lines


def test_training_lowers_the_loss_and_beats_the_best_unigram(trained):
    report, out, lines = trained
    first, last = report.losses[:10], report.losses[-10:]
    assert sum(last) / 10 < 0.5 * sum(first) / 10
    acc = report.config.accuracy
    assert acc["top1"] > acc["unigram_top1"] + 0.1
    assert acc["top5"] >= acc["top1"]
    assert len(acc["by_depth_top1"]) == 3 and acc["by_depth_top1"][0] == acc["top1"]
    assert 0 < acc["vocab_coverage"] <= 1
    assert any("eta" in line for line in lines if "target pass" in line)
    assert any("eta" in line for line in lines if "step" in line)
    precision = report.config.training["options"]["precision"]
    assert report.config.training["precision"] == precision and f"  training in {precision}" in lines


def test_the_written_dir_loads_with_what_training_returned(trained):
    report, out, _ = trained
    from trtbuild.builder.frontend.checkpoint import load_model

    embed = load_model(TINY_CODE, torch.float32).model.embed_tokens
    loaded = load_draft_head(out, embed)
    assert loaded.config.accuracy == report.config.accuracy
    assert loaded.config.draft_vocab_size == 1024
    training = json.loads((out / CONFIG_FILE).read_text())["training"]
    assert training["text"] == [{"name": DATA.name, "tokens": training["text"][0]["tokens"]}]
    assert training["text"][0]["tokens"] > 10_000 and training["steps"] == SMALL["steps"]
    assert training["ttt_depth"] == 3 and training["peak_rss_mib"] > 0
    ids = loaded.draft_to_target
    assert len(set(ids.tolist())) == 1024 and int(ids.max()) < 4096
    # A draft dir is shipped beside specs: readable by others, and nothing staged left behind.
    assert sorted(p.name for p in out.iterdir()) == [CONFIG_FILE, WEIGHTS_FILE]
    assert {(out / name).stat().st_mode & 0o777 for name in (CONFIG_FILE, WEIGHTS_FILE)} == {0o644}


def test_cli_trains_and_prints_the_held_out_table(tmp_path):
    result = CliRunner().invoke(main, ["draft", "train", str(TINY_CODE), "--data", str(DATA), "-o",
                                       str(tmp_path / "d"), "--draft-vocab", "512", "--seq-len", "32",
                                       "--sequences", "16", "--steps", "6", "--taps", "1,3,5",
                                       "--prompt-len", "8", "--precision", "float32"])
    assert result.exit_code == 0, result.output
    assert "training in float32" in result.stderr
    assert "depth 3" in result.stdout and "best unigram" in result.stdout
    config = json.loads((tmp_path / "d" / CONFIG_FILE).read_text())
    assert config["taps"] == [1, 3, 5] and config["draft_vocab_size"] == 512


@pytest.mark.parametrize("args, message", [
    (["--draft-vocab", "1"], "--draft-vocab 1: must be ≥ 2"),
    (["--seq-len", "5"], "--seq-len 5: must be ≥ --ttt-depth + 8"),
    (["--taps", "1,2,6"], "--taps 1,2,6: 3 decoder layers in [0, 6)"),
    (["--taps", "x"], "--taps 'x': three comma-separated"),
    (["--heads", "2"], "--heads: not an option of --kind head"),
    (["--kind", "medusa", "--precision", "bfloat16"], "--precision: not an option of --kind medusa"),
    (["--kind", "medusa", "--draft-vocab", "9"], "--draft-vocab: not an option of --kind medusa"),
    (["--kind", "medusa", "--steps", "0"], "--steps 0 / --batch 4 / --sequences 640: steps and batch must be ≥ 1"),
    (["--kind", "medusa", "--batch", "-1"], "--steps 300 / --batch -1 / --sequences 640"),
    (["--kind", "medusa", "--lr", "0"], "--lr 0.0: must be > 0"),
])
def test_cli_refuses_bad_options_in_one_line(tmp_path, args, message):
    result = CliRunner().invoke(main, ["draft", "train", str(TINY_CODE), "--data", str(DATA), "-o",
                                       str(tmp_path / "d"), *args])
    assert result.exit_code == 2
    assert result.stderr.count("\n") == 1 and message in result.stderr
    assert not (tmp_path / "d").exists()


def test_cli_refuses_a_missing_data_file(tmp_path):
    result = CliRunner().invoke(main, ["draft", "train", str(TINY_CODE), "--data", str(tmp_path / "no.txt"),
                                       "-o", str(tmp_path / "d")])
    assert result.exit_code == 2 and result.stderr == f"error: --data {tmp_path / 'no.txt'}: not a file\n"


def test_cli_kind_medusa_trains_medusa_heads(tmp_path):
    result = CliRunner().invoke(main, ["draft", "train", str(TINY_CODE), "--data", str(DATA), "-o",
                                       str(tmp_path / "m"), "--kind", "medusa", "--heads", "2", "--steps", "3",
                                       "--sequences", "8", "--seq-len", "32", "--prompt-len", "8"])
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "m" / "config.json").read_text())["medusa_num_heads"] == 2


@pytest.mark.parametrize("num_layers", range(3, 81))
def test_default_taps_are_three_distinct_increasing_layers(num_layers):
    taps = default_taps(num_layers)
    assert len(taps) == 3 and 0 <= taps[0] < taps[1] < taps[2] < num_layers, taps


def test_default_taps_are_eagle3s_layers_on_a_deep_target():
    assert default_taps(30) == (2, 15, 27) and default_taps(32) == (2, 16, 29)


def test_options_refuse_taps_out_of_range():
    with pytest.raises(UserError, match="--taps 0,1,30"):
        DraftTrainOptions(taps=(0, 1, 30)).checked_taps(30)


@torch.no_grad()
def test_collected_windows_are_the_targets_greedy_text_taps_and_argmax():
    from trtbuild.builder.draft_head.data import collect
    from trtbuild.builder.frontend.checkpoint import load_model

    model = load_model(TINY_CODE, torch.float32).eval()
    windows = torch.randint(0, 4096, (3, 20), generator=torch.Generator().manual_seed(0))
    ids, taps, argmax = collect(model, windows, (0, 2, 5), 8, lambda _: None)
    assert torch.equal(ids[:, :8], windows[:, :8])
    assert torch.equal(ids[:, 8:], argmax[:, 7:-1])        # greedy: each new token is the last argmax
    full = model(input_ids=ids, output_hidden_states=True)  # teacher-forced over the same text
    assert torch.equal(full.logits.argmax(-1), argmax)
    # decoder layer i's output is hidden_states[i + 1]; the last layer's tap is before the final
    # norm (transformers' last hidden state is after it)
    last = model.model.norm(taps[..., 512:].float())
    reference = torch.cat((full.hidden_states[1], full.hidden_states[3]), dim=-1)   # [3, 20, 512]
    assert ((last - full.hidden_states[6]).abs() / (full.hidden_states[6].abs() + 1e-2)).max() < 2 ** -6
    error = (taps[..., :512].float() - reference).abs() / (reference.abs() + 1e-2)
    assert error.max() < 2 ** -7   # bfloat16 rounding


def test_held_out_windows_are_text_no_training_window_reads():
    """Held-out windows come from the last share of each file, past every training window, and a
    file given twice adds no window twice (a held-out twin of a training window read 0.73 top-1
    where answers to new questions kept 0.11–0.44)."""
    import numpy as np

    from trtbuild.builder.draft_head.data import prompt_windows
    from trtbuild.checkpoint.tokenizer import checkpoint_tokenizer

    tokenizer = checkpoint_tokenizer(TINY_CODE)
    stream = tokenizer.encode(DATA.read_text()).ids[:6000]
    windows, held = prompt_windows(tokenizer, [stream, stream], ["a.txt", "a.txt"], count=40, length=48,
                                   prompt_len=16, seed=0, held_fraction=0.1)
    rows = [tuple(w) for w in windows.tolist()]
    assert len(rows) == len(set(rows)) and held.any() and (~held).any()
    text = np.asarray(stream)

    def start_of(row):  # where the window sits in the file
        return next(s for s in range(len(text) - 47) if tuple(text[s:s + 48]) == row)

    held_starts = [start_of(r) for r, h in zip(rows, held) if h]
    train_ends = [start_of(r) + 48 for r, h in zip(rows, held) if not h]
    assert max(train_ends) <= min(held_starts) and min(held_starts) >= int(0.9 * len(text)) - 48


@pytest.mark.parametrize("precision, amx, autocast", [
    (TrainPrecision.float32, True, False), (TrainPrecision.bfloat16, False, True),
    (TrainPrecision.auto, True, True), (TrainPrecision.auto, False, False)])
def test_precision_decides_whether_the_training_passes_run_under_bfloat16_autocast(
        tmp_path, monkeypatch, precision, amx, autocast):
    from trtbuild.builder.draft_head import train

    seen = []
    loss = train._loss

    def recording(*args, **kwargs):
        seen.append(torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16)
        return loss(*args, **kwargs)
    monkeypatch.setattr(train, "_loss", recording)
    monkeypatch.setattr(train, "cpu_has_amx_bf16", lambda: amx)
    options = DraftTrainOptions(**{**SMALL, "steps": 2, "sequences": 8}, precision=precision)
    report = train_draft_head(TINY_CODE, [DATA], tmp_path / "d", options, progress=lambda _: None)
    assert seen == [autocast, autocast]
    resolved = "bfloat16" if autocast else "float32"
    assert report.config.training["precision"] == resolved
    assert report.config.training["options"]["precision"] == precision.value   # what was asked


def test_cli_precision_choices_are_the_enums():
    option = next(p for p in main.commands["draft"].commands["train"].params if p.name == "precision")
    assert list(option.type.choices) == [p.value for p in TrainPrecision]

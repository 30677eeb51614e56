"""`python -m app.memorization`: a small model trained to memorise a short text many times
reproduces it exactly, and the same model trained with the Goldfish loss does not.

The text is 200 random lowercase letters, repeated 30 times: nothing in it can be guessed from
the rest, so a continuation is reproduced only if it was memorised. Trained 200 steps at a high
learning rate, the plain model's loss falls to ~0.02 and it reproduces every passage tested
(measured: 16/16). With goldfish_k = 4 (h = 13, the paper's setting) a quarter of the targets
never receive a gradient; every 32-token continuation holds ~8 of them, each a 1-in-26 guess, so
none is reproduced (measured: 0/16). The bounds (>= 0.9, <= 0.1) leave room on both sides.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from test_goldfish import write_tokens

from app.errors import DataError
from app.memorization import passages
from conftest import run_app, run_mpi

SEQ = 64


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    prefix = tmp_path_factory.mktemp("text") / "text"
    letters = (np.random.default_rng(5).integers(0, 26, size=200) + ord("a")).tolist()
    write_tokens(str(prefix), [letters * 30])
    return prefix


def train(prefix, run_dir, goldfish_k: int) -> None:
    sets = (
        "data.kind=memmap", f"data.path={prefix}", "model.vocab_size=258", f"model.seq_len={SEQ}",
        "model.layers=2", "model.hidden=64", "model.heads=4", "train.global_batch=16", "train.micro_batch=8",
        "train.steps=200", "optim.lr=3e-3", "optim.warmup_steps=10", "run.log_every=100",
        f"train.goldfish_k={goldfish_k}", "train.goldfish_context=13", f"run.dir={run_dir}", "run.resume=none",
    )  # fmt: skip
    out = run_app(1, "inputs/gpt_tiny.yaml", *[a for s in sets for a in ("--set", s)])
    assert out.returncode == 0, out.stdout + out.stderr


def memorization(ranks: int, run_dir, prefix) -> dict:
    args = ("--data", str(prefix), "--passages", "16", "--prefix-tokens", "16", "--continuation-tokens", "32")
    out = run_mpi(ranks, sys.executable, "-m", "app.memorization", str(run_dir / "checkpoints"), *args, "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "gridlm: memorization | " in out.stdout
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.full
def test_a_memorised_text_is_reproduced_without_goldfish_and_not_with_it(text, tmp_path):
    train(text, tmp_path / "plain", 0)
    train(text, tmp_path / "goldfish", 4)
    plain = memorization(1, tmp_path / "plain", text)
    goldfish = memorization(1, tmp_path / "goldfish", text)
    assert plain["passages"] == goldfish["passages"] == 16
    assert plain["exact_share"] >= 0.9, plain
    assert goldfish["exact_share"] <= 0.1, goldfish
    # Tensor parallel over 2 ranks decodes the same tokens: the same measure.
    assert memorization(2, tmp_path / "plain", text)["exact"] == plain["exact"]


def test_passages_are_training_windows_evenly_spaced():
    tokens = np.arange(1000)
    got = passages(tokens, 64, 4, 16, 32)
    # (1000 - 1) // 64 = 15 windows of 65 tokens, as the sampler reads them; 4 evenly spaced: 0, 5, 9, 14.
    assert [int(row[0]) for row in got] == [0, 5 * 64, 9 * 64, 14 * 64]
    assert got.shape == (4, 48) and (np.diff(got, axis=1) == 1).all()
    assert len(passages(tokens, 64, 100, 16, 32)) == 15  # no more than there are
    # The sampler never reads window 15 (tokens 960 .. 1024 of 1010): no passage starts there.
    assert len(passages(np.arange(1010), 64, 100, 16, 32)) == 15
    with pytest.raises(DataError, match="fewer than a training window of model.seq_len"):
        passages(np.arange(40), 64, 4, 16, 32)


def test_a_passage_longer_than_a_training_window_is_refused_naming_the_options():
    """Found in review: on llama (rotary positions) P + C was not limited, so --prefix-tokens 60
    --continuation-tokens 60 on seq_len 64 measured passages across two windows, which the model never
    saw as one sample; gpt2's limit was told as generate's --max-new-tokens. A passage is the start of
    one window of seq_len + 1 tokens."""
    assert passages(np.arange(1000), 64, 2, 33, 32).shape == (2, 65)  # a whole window
    with pytest.raises(DataError, match=r"--prefix-tokens 60 \+ --continuation-tokens 60 = 120 tokens") as refused:
        passages(np.arange(1000), 64, 2, 60, 60)
    assert "fix: --continuation-tokens 5" in str(refused.value) and "--max-new-tokens" not in str(refused.value)


# ---- which tokens passages come from (a checkpoint trained with data.split) ----

SPLIT_SEQ = 16


@pytest.fixture(scope="module")
def split_run(tmp_path_factory):
    """A tiny gpt2 trained 2 steps on 60 byte-level documents with data.split = 0.2: the token file and
    the run directory."""
    from test_eval import documents

    tmp = tmp_path_factory.mktemp("split")
    prefix = tmp / "docs"
    write_tokens(str(prefix), documents(60, seed=3))
    sets = (
        "data.kind=memmap", f"data.path={prefix}", "data.split=0.2", "model.vocab_size=320",
        f"model.seq_len={SPLIT_SEQ}", "model.layers=2", "model.hidden=32", "model.heads=4", "train.global_batch=4",
        "train.micro_batch=2", "train.steps=2", f"run.dir={tmp / 'run'}", "run.resume=none",
    )  # fmt: skip
    out = run_app(1, "inputs/gpt_tiny.yaml", *[a for s in sets for a in ("--set", s)])
    assert out.returncode == 0, out.stdout + out.stderr
    return prefix, tmp / "run" / "checkpoints"


def _memorization(checkpoints, *args: str):
    return run_mpi(1, sys.executable, "-m", "app.memorization", str(checkpoints), *map(str, args), timeout=120)


def test_passages_of_the_training_data_come_from_its_train_part_only(split_run, tmp_path):
    """Found in review: passages were spaced over the whole --data file, and for a run trained with
    data.split = 0.2 a third of them started in held-out documents the model never trained on, which
    understated exact_share. From the run's training data (or a copy of it) they come from the train
    part only; another file is measured too, and the line says it may not be training text."""
    from app.data.memmap import MemmapTokens

    prefix, checkpoints = split_run
    train = MemmapTokens(str(prefix), SPLIT_SEQ, 320, 0, 0.2, "train")
    windows = (train.stop - 1) // SPLIT_SEQ  # the train part's windows: the most passages there are
    copy = tmp_path / "copy"
    for ext in (".bin", ".json", ".idx.npy"):
        (tmp_path / f"copy{ext}").write_bytes(Path(f"{prefix}{ext}").read_bytes())
    for data in (prefix, copy):
        out = _memorization(checkpoints, "--data", data, "--passages", 10_000, "--prefix-tokens", 8,
                            "--continuation-tokens", 9, "--json")  # fmt: skip
        assert out.returncode == 0, out.stdout + out.stderr
        record = json.loads(out.stdout.strip().splitlines()[-1])
        assert record["passages"] == windows and record["training_data"] is True, record
        assert "(the training data's train part, before the last 0.2 of its documents (data.split))" in out.stdout
    other = tmp_path / "other"
    write_tokens(str(other), [list(range(200))])
    out = _memorization(checkpoints, "--data", other, "--passages", 4, "--prefix-tokens", 8, "--continuation-tokens",
                        8, "--json")  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1])["training_data"] is False
    assert f"not the run's training data ({prefix}): may not be training text" in out.stdout, out.stdout


def test_memorization_mistakes_are_told_its_own_options(split_run, tmp_path):
    """Found in review: a --data file of another tokenizer than the training data's was measured, exit 0
    (nonsense); a missing --data was told to "set data.path", ids beyond the model's vocabulary to
    "set model.vocab_size ... in the deck" (memorization has no deck), a passage too long to
    --max-new-tokens (generate's option)."""
    prefix, checkpoints = split_run
    bpe, wide = tmp_path / "bpe", tmp_path / "wide"
    write_tokens(str(bpe), [list(range(200))])
    meta = json.loads((tmp_path / "bpe.json").read_text())
    meta.update(tokenizer="huggingface", tokenizer_path="/x/tokenizer.json", tokenizer_sha256="ab" * 32)
    (tmp_path / "bpe.json").write_text(json.dumps(meta))
    write_tokens(str(wide), [list(range(200))], vocab_size=400)
    cases = [
        (("--data", bpe), ["--data: ", "were tokenized differently", "--any-tokenizer"]),
        (("--data", tmp_path / "missing"), ["does not exist", "and pass its PREFIX as --data"]),
        (("--data", wide), ["vocab_size 400", "pass a --data file prepared with the checkpoint's tokenizer"]),
        (("--data", prefix, "--prefix-tokens", 10, "--continuation-tokens", 10), ["fix: --continuation-tokens 7"]),
    ]
    for args, says in cases:
        out = _memorization(checkpoints, "--prefix-tokens", 8, "--continuation-tokens", 8, *args)
        assert out.returncode == 2 and "Traceback" not in out.stderr, (args, out.stdout + out.stderr)
        lines = [line for line in out.stderr.splitlines() if line.startswith("gridlm: ")]
        assert len(lines) == 1, (args, out.stderr)
        line = lines[0]
        assert all(s in line for s in says), (args, line)
        assert "data.path" not in line and "in the deck" not in line and "--max-new-tokens" not in line, line
    # --any-tokenizer measures the file anyway (its token file may have been prepared again since).
    out = _memorization(checkpoints, "--data", bpe, "--passages", 2, "--prefix-tokens", 8, "--continuation-tokens", 8,
                        "--any-tokenizer")  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr

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

import numpy as np
import pytest
from test_goldfish import write_tokens

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
    # (1000 - 48) // 64 + 1 = 15 windows; 4 of them evenly spaced: 0, 5, 9, 14 (rounded).
    assert [int(row[0]) for row in got] == [0, 5 * 64, 9 * 64, 14 * 64]
    assert got.shape == (4, 48) and (np.diff(got, axis=1) == 1).all()
    assert len(passages(tokens, 64, 100, 16, 32)) == 15  # no more than there are
    with pytest.raises(Exception, match="fewer than --prefix-tokens"):
        passages(np.arange(40), 64, 4, 16, 32)

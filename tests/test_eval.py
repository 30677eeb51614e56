"""Evaluation (app/eval): held-out data kept apart from training (data.split), the validation loss
equal on 1 rank and on grids, `python -m app.eval` on a checkpoint equal to the in-training value,
and the mistakes it refuses.

Tolerance of the grid comparisons (fp32): evaluation is the forward pass of training, so its
values differ between grids only by the summation order of tp's partial sums and the softmax
denominator over vocab shards (~1e-7 relative), after a few training steps that differ by the
same (tests/test_parallel_equivalence.py measured 1.2e-7 relative on the loss); we allow 1e-5
relative, as that file does. A wrong shard or a missing micro-batch moves the loss at the 1e-3
level."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_goldfish import write_tokens
from test_parallel_equivalence import TINY, Case, t3d

from app.data.memmap import MemmapTokens, split_point
from app.deck import load_deck, resolve_for_world
from app.errors import DataError, DeckError
from app.eval import evaluate
from app.train import Trainer
from conftest import REPO, grid_trainer, read_metrics, run_app, run_mpi, settle, train_steps

EVAL_RTOL = 1e-5
STEPS = 3


def documents(n: int, seed: int = 0) -> list[list[int]]:
    """n byte-level documents of 20 to 120 tokens, each a different length."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size=20 + 7 * i % 100).tolist() for i in range(n)]


# ---- data.split: train and validation are disjoint ----


def test_data_split_keeps_train_and_validation_apart(tmp_path):
    prefix = str(tmp_path / "docs")
    docs = documents(40)
    write_tokens(prefix, docs)
    seq = 8
    train = MemmapTokens(prefix, seq, 257, seed=1, split=0.1, part="train")
    val = MemmapTokens(prefix, seq, 257, seed=1, split=0.1, part="val")
    whole = MemmapTokens(prefix, seq, 257, seed=1)
    boundary = split_point(whole.doc_offsets, 0.1)
    assert boundary == whole.doc_offsets[36]  # ceil(0.1 x 40) = 4 documents held out: a document boundary
    assert (train.start, train.stop, val.start, val.stop) == (0, boundary, boundary, len(whole.tokens))

    def tokens_read(data: MemmapTokens) -> set[int]:
        """Positions of every token the part's samples read, over two epochs (index wraps)."""
        read: set[int] = set()
        for i in range(2 * data.num_samples):
            w = data.window_of(i)
            start = data.start + w * seq
            read.update(range(start, start + seq + 1))
            np.testing.assert_array_equal(data.sample(i), np.asarray(whole.tokens[start : start + seq + 1]))
        return read

    train_read, val_read = tokens_read(train), tokens_read(val)
    assert max(train_read) < boundary <= min(val_read)
    assert not train_read & val_read
    assert train.num_samples == (boundary - 1) // seq and val.num_samples == (len(whole.tokens) - boundary - 1) // seq
    assert whole.num_samples == MemmapTokens(prefix, seq, 257, seed=1, split=0.0).num_samples  # 0 = no split


def test_an_evaluation_reading_more_samples_than_the_held_out_windows_is_warned_about(tmp_path):
    """Found in review (2026-11-30): eval.batches x global_batch samples past the held-out part's windows
    wrap into another epoch's order, so some windows counted twice in the val loss, and nothing said
    so. The trainer logs this warning with the numbers and the eval.batches that fits."""
    from app.eval import HeldOut, held_out_note

    prefix = str(tmp_path / "docs")
    write_tokens(prefix, documents(40))
    val = MemmapTokens(prefix, 16, 257, seed=1, split=0.2, part="val")
    sets = ("data.kind=memmap", f"data.path={prefix}", "data.split=0.2", "model.seq_len=16", "model.vocab_size=257",
            "train.global_batch=8", "train.micro_batch=2", "eval.every=1")  # fmt: skip
    fits = val.num_samples // 8
    assert fits >= 1
    for batches, warned in ((fits, False), (fits + 1, True)):
        deck = load_deck(REPO / "inputs/gpt_tiny.yaml", (*sets, f"eval.batches={batches}"))
        note = held_out_note(deck, HeldOut(val, "the val part"))
        assert (note is not None) == warned, note
        if warned:
            assert f"reads {8 * batches:,} samples" in note and f"has {val.num_samples:,} windows" in note, note
            assert f"{8 * batches - val.num_samples:,} reads repeat a window (up to 2 reads of one)" in note, note
            assert f"eval.batches to {fits}" in note
    # Many more reads than windows: each window read up to ceil(reads / windows) times (found in review,
    # 2026-11-30: "read twice" whatever the count), and the fix says hold out more once.
    deck = load_deck(REPO / "inputs/gpt_tiny.yaml", (*sets, "train.global_batch=256", "train.micro_batch=8"))
    note = held_out_note(deck, HeldOut(val, "the val part"))
    reads = deck.eval.batches * 256
    assert note is not None and f"up to {-(-reads // val.num_samples)} reads of one" in note, note
    assert note.endswith("hold out more tokens (data.split, eval.path)"), note


def test_data_split_holds_out_the_ceiling_of_the_written_fraction_of_the_documents():
    """Found in review (2026-11-30): ceil(0.07 x 100) in floats is 8 (0.07 x 100 = 7.000000000000001); the
    docs say ceil(f x D) of the decimal written, 7. Checked against exact decimals for many f and D."""
    from fractions import Fraction

    for fraction in (0.07, 0.1, 0.05, 0.2, 0.01, 0.3, 0.15, 0.29, 0.57):
        for documents in range(1, 400):
            offsets = np.arange(documents + 1)
            held = documents - split_point(offsets, fraction)
            assert held == -(-Fraction(str(fraction)) * documents // 1), (fraction, documents, held)


def test_data_split_that_leaves_a_part_without_a_window_names_the_key(tmp_path):
    prefix = str(tmp_path / "docs")
    write_tokens(prefix, [[1] * 200, [2] * 3])  # the held-out last document: 4 tokens
    with pytest.raises(DataError, match=r"data.split = 0.1 .* val part 4 tokens .* fewer than model.seq_len"):
        MemmapTokens(prefix, 16, 257, seed=1, split=0.1, part="val")


def test_an_eval_path_of_another_tokenizer_than_the_training_data_is_refused(tmp_path):
    """Found in review (2026-11-30): eval.path was never compared with the training data, whose blend
    files must share a tokenizer: a held-out file of another tokenizer gave a val loss that means
    nothing, logged without a word."""

    train, held = str(tmp_path / "train"), str(tmp_path / "held")
    write_tokens(train, documents(60, seed=3))
    write_tokens(held, documents(20, seed=4))
    meta_path = Path(held + ".json")
    meta = json.loads(meta_path.read_text())
    meta.update(tokenizer="huggingface", tokenizer_path="/x/tokenizer.json", tokenizer_sha256="ab" * 32)
    meta_path.write_text(json.dumps(meta))
    sets = ("data.kind=memmap", f"data.path={train}", f"eval.path={held}", "eval.every=1", "train.steps=1",
            "model.vocab_size=257", f"run.dir={tmp_path / 'run'}")  # fmt: skip
    out = run_app(1, "inputs/gpt_tiny.yaml", *(a for x in sets for a in ("--set", x)))
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stdout + out.stderr
    assert f"eval.path: {held}.json and {train}.json were tokenized differently" in out.stderr, out.stderr
    assert "tokenizer: 'byte' vs 'huggingface'" in out.stderr and "fix: prepare the held-out text" in out.stderr


@pytest.mark.parametrize(
    "sets, key, match",
    [
        (("eval.every=5", "data.kind=memmap", "data.path=x"), "eval.every", "needs held-out data"),
        (("data.split=0.1",), "data.split", "only with data.kind = memmap"),
        (("data.split=0.1", "data.kind=memmap", "data.path=x", "eval.path=y"), "data.split", "reads eval.path"),
        (("data.split=0.6", "data.kind=memmap", "data.path=x"), "data.split", "must be <= 0.5"),
    ],
)
def test_deck_refuses_evaluation_without_held_out_data(sets, key, match):
    with pytest.raises(DeckError, match=match) as err:
        load_deck(REPO / "inputs/gpt_tiny.yaml", sets)
    assert err.value.key == key


# ---- python -m app.eval: a checkpoint's loss equals the in-training evaluation ----

SMALL = (
    "--set", "model.vocab_size=320", "--set", "model.seq_len=16", "--set", "model.layers=2", "--set",
    "model.hidden=32", "--set", "model.heads=4", "--set", "train.global_batch=8", "--set", "train.micro_batch=2",
    "--set", "optim.lr=3.0e-3", "--set", "run.log_every=1", "--set", "eval.batches=2",
)  # fmt: skip


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 2-rank (dp 2) training with an evaluation every 2 steps and a checkpoint at each: the data
    flags, the run directory, the job's output and its metrics by step."""
    tmp_path = tmp_path_factory.mktemp("trained")
    prefix = str(tmp_path / "docs")
    write_tokens(prefix, documents(60, seed=3))
    run_dir = tmp_path / "run"
    data = ("--set", "data.kind=memmap", "--set", f"data.path={prefix}", "--set", "data.split=0.2")
    train = run_mpi(
        2, sys.executable, "-m", "app", "inputs/gpt_tiny.yaml", *SMALL, *data, "--set", "train.steps=4",
        "--set", "eval.every=2", "--set", f"run.dir={run_dir}", "--set", "checkpoint.every=2",
        "--set", "checkpoint.keep=0",
    )  # fmt: skip
    assert train.returncode == 0, train.stderr[-3000:]
    return data, run_dir, train, {r["step"]: r for r in read_metrics(run_dir)}


def test_in_training_evaluation_is_logged_recorded_and_summarised(trained):
    _, run_dir, train, records = trained
    assert {s for s, r in records.items() if "val_loss" in r} == {2, 4}
    assert records[2]["val_perplexity"] == pytest.approx(math.exp(records[2]["val_loss"]))
    assert records[2]["val_loss"] != records[4]["val_loss"]  # the model changed in between
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["eval"]["step"] == 4 and summary["eval"]["loss"] == records[4]["val_loss"]
    assert summary["eval"]["tokens"] == 2 * 8 * 16 and "data.split" in summary["eval"]["source"]
    assert "| val loss" in train.stdout


# The step-2 checkpoint, written on dp 2, evaluated on 1 rank and (full tier) on pp 2: evaluation on
# the pipeline and other grids is also the 8-rank group's test_eval_loss_on_a_grid_matches_single_rank.
@pytest.mark.parametrize(
    "ranks, grid", [(1, ()), pytest.param(2, ("--set", "parallel.pp=2"), marks=pytest.mark.full)], ids=["1-rank", "pp2"]
)
def test_app_eval_of_a_checkpoint_equals_the_in_training_evaluation_on_another_grid(trained, tmp_path, ranks, grid):
    data, run_dir, _, records = trained
    checkpoint = run_dir / "checkpoints" / "step_0000002.h5"
    out_file = tmp_path / f"eval{ranks}.json"
    out = run_mpi(
        ranks, sys.executable, "-m", "app.eval", "inputs/gpt_tiny.yaml", *SMALL, *data, *grid,
        "--set", f"run.dir={tmp_path / 'eval'}", "--checkpoint", str(checkpoint), "--out", str(out_file),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out_file.read_text())
    assert result["step"] == 2 and result["checkpoint"] == str(checkpoint)
    assert result["loss"] == pytest.approx(records[2]["val_loss"], rel=EVAL_RTOL)
    assert f"val loss {result['loss']:.4f}" in out.stdout


def test_app_eval_mistakes_end_every_rank_with_a_message(tmp_path):
    prefix = str(tmp_path / "docs")
    write_tokens(prefix, documents(10))
    cases = [
        # No checkpoint there.
        (("--checkpoint", str(tmp_path / "none.h5")), "--checkpoint", "no such file"),
        # Memmap data and nothing held out (found before the checkpoint is looked for).
        (("--set", "data.kind=memmap", "--set", f"data.path={prefix}", "--checkpoint", str(tmp_path)),
         "set eval.path", "needs held-out data"),
        # An eval.path whose files are missing.
        (("--set", f"eval.path={tmp_path / 'missing'}", "--checkpoint", str(tmp_path / "none.h5")),
         "eval.path", "does not exist"),
    ]  # fmt: skip
    for args, key, says in cases:
        out = run_mpi(2, sys.executable, "-m", "app.eval", "inputs/gpt_tiny.yaml", *SMALL, *args, timeout=120)
        assert out.returncode == 2, (args, out.returncode, out.stderr[-2000:])
        lines = [line for line in out.stderr.splitlines() if line.startswith("gridlm: ")]
        assert len(lines) == 1 and key in lines[0] and says in lines[0], out.stderr[-2000:]
        assert "Traceback" not in out.stderr


def _app_eval(*args: str) -> subprocess.CompletedProcess:
    """`python -m app.eval inputs/gpt_tiny.yaml` on one rank with SMALL and `args`."""
    return run_mpi(1, sys.executable, "-m", "app.eval", "inputs/gpt_tiny.yaml", *SMALL, *args, timeout=120)


def _refused(out: subprocess.CompletedProcess) -> str:
    """The one `gridlm:` line of a run that ended with exit 2 and no traceback."""
    assert out.returncode == 2, (out.returncode, out.stdout[-2000:], out.stderr[-2000:])
    lines = [line for line in out.stderr.splitlines() if line.startswith("gridlm: ")]
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    return lines[0]


def test_app_eval_refuses_a_deck_whose_model_computes_another_function_than_the_checkpoint(trained, tmp_path):
    """Found in review: the evaluation compared only the model's shapes with the checkpoint's, so a deck
    with another model.layernorm_eps (or rope_theta, moe_top_k) evaluated another function, exit 0
    (a llama tp2 checkpoint's loss moved 6.2510 -> 6.2383). Every such key is named with its --set fix,
    and the message is the tool's (no run.resume)."""
    data, run_dir, _, _ = trained
    checkpoint = str(run_dir / "checkpoints" / "step_0000002.h5")
    said = _refused(_app_eval(*data, "--set", "model.layernorm_eps=0.5", "--set", f"run.dir={tmp_path}",
                              "--checkpoint", checkpoint))  # fmt: skip
    assert "model.layernorm_eps = 1e-05 (the deck has 0.5)" in said, said
    assert "fix: --set model.layernorm_eps=1e-05" in said and "run.resume" not in said, said


def test_the_keys_that_change_the_function_are_compared_by_app_eval_and_not_by_a_resume(tmp_path):
    """`io.function_keys`: layernorm_eps always, rope_theta for rotary positions, moe_top_k with experts;
    not dropout, attention_kernel, moe_capacity_factor or the router losses' weights, which evaluation
    does not compute with. A resume keeps comparing the shapes only (a rope_theta changed on purpose
    for a longer context stays possible there)."""
    from app.checkpoint.io import EVAL, RESUME, changed_function, changed_schedule, check_model
    from app.deck_yaml import dump_yaml
    from app.errors import CheckpointError

    llama = ("model.arch=llama", "model.kv_heads=2", "model.moe_experts=4", "model.moe_top_k=2")
    saved = load_deck(REPO / "inputs/gpt_tiny.yaml", llama)
    header = {"deck": dump_yaml(saved.to_dict(), sort_keys=False)}
    path = tmp_path / "step_0000001.h5"
    harmless = ("model.dropout=0.1", "model.attention_kernel=math", "model.moe_capacity_factor=1.5",
                "model.moe_aux_loss_coef=0.5", "model.moe_z_loss_coef=0.1", "model.init_std=0.5")  # fmt: skip
    check_model(header, load_deck(REPO / "inputs/gpt_tiny.yaml", (*llama, *harmless)), path, EVAL)
    for changed, fix in (("model.layernorm_eps=0.5", "--set model.layernorm_eps=1e-05"),
                         ("model.rope_theta=500", "--set model.rope_theta=10000.0"),
                         ("model.moe_top_k=1", "--set model.moe_top_k=2")):  # fmt: skip
        deck = load_deck(REPO / "inputs/gpt_tiny.yaml", (*llama, changed))
        with pytest.raises(CheckpointError, match=re.escape(fix)):
            check_model(header, deck, path, EVAL)
        check_model(header, deck, path, RESUME)  # a resume's check is unchanged: shapes only
        key = changed.split("=")[0].removeprefix("model.")
        assert [change[0] for change in changed_function(header, deck, path)] == [key]  # which a resume says
    assert changed_function(header, load_deck(REPO / "inputs/gpt_tiny.yaml", (*llama, *harmless)), path) == []
    assert changed_schedule(header, load_deck(REPO / "inputs/gpt_tiny.yaml", llama), path) == []
    assert changed_schedule(header, load_deck(REPO / "inputs/gpt_tiny.yaml", (*llama, "optim.lr=0.5")), path) == [
        ("optim.lr", 1e-3, 0.5)
    ]
    # A gpt2 model has learned positions: its rope_theta computes nothing.
    gpt2 = {"deck": dump_yaml(load_deck(REPO / "inputs/gpt_tiny.yaml").to_dict(), sort_keys=False)}
    check_model(gpt2, load_deck(REPO / "inputs/gpt_tiny.yaml", ("model.rope_theta=500",)), path, EVAL)


def test_a_resume_that_changes_the_model_s_function_says_so_and_goes_on(trained, tmp_path):
    """A resume takes the deck's layernorm_eps or rope_theta (a larger rope_theta extends the context on
    purpose) but no longer silently: the log names the key, the trained value and the new one."""
    data, run_dir, _, _ = trained
    checkpoint = run_dir / "checkpoints" / "step_0000002.h5"
    resumed = run_app(1, "inputs/gpt_tiny.yaml", *SMALL, *data, "--set", "train.steps=3", "--set",
                      f"run.dir={tmp_path / 'run'}", "--set", f"run.resume={checkpoint}",
                      "--set", "model.layernorm_eps=0.001", "--set", "checkpoint.at_exit=false")  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (
        "gridlm: warning: this deck changes the checkpoint's model: model.layernorm_eps = 0.001 (trained with 1e-05)"
        in resumed.stdout
    ), resumed.stdout[-3000:]
    # train.steps 3 of a run trained for 4: its decay ends a step sooner (found in review: said nowhere).
    from app.optim.optimizer import learning_rate

    optim = load_deck(REPO / "inputs/gpt_tiny.yaml", ("optim.lr=3.0e-3",)).optim
    assert (
        "gridlm: warning: this deck changes the checkpoint's optimizer or schedule: train.steps = 3 (trained with 4); "
        f"training goes on with the deck's values, the schedule over its train.steps: the learning rate of step 3 is "
        f"{learning_rate(optim, 2, 3):.2e} ({learning_rate(optim, 2, 4):.2e} on the checkpoint's)" in resumed.stdout
    ), resumed.stdout[-3000:]


def test_app_eval_refuses_held_out_tokens_of_another_tokenizer_than_the_checkpoints_training_data(trained, tmp_path):
    """Found in review: training compares eval.path's tokenizer with data.path's, app.eval never did: a
    held-out file of another tokenizer gave a val loss that means nothing, exit 0. It is compared with
    the checkpoint's training data (its stored deck's data.path), and refused with training's message,
    also when the deck given to app.eval names no training data."""
    data, run_dir, _, _ = trained
    held = str(tmp_path / "held")
    write_tokens(held, documents(20, seed=4))
    meta = json.loads(Path(held + ".json").read_text())
    meta.update(tokenizer="huggingface", tokenizer_path="/x/tokenizer.json", tokenizer_sha256="ab" * 32)
    Path(held + ".json").write_text(json.dumps(meta))
    checkpoint = str(run_dir / "checkpoints" / "step_0000002.h5")
    for deck_data in (data[:4], ()):  # the deck's memmap data.path (no split), then synthetic data
        said = _refused(_app_eval(*deck_data, "--set", f"eval.path={held}", "--set", f"run.dir={tmp_path}",
                                  "--checkpoint", checkpoint))  # fmt: skip
        assert f"eval.path: {held}.json and " in said and "were tokenized differently" in said, said
        assert "tokenizer: 'byte' vs 'huggingface'" in said and "fix: prepare the held-out text" in said, said


def test_app_eval_never_writes_its_default_record_over_another_checkpoints(trained, tmp_path):
    """Found in review: the default output <run.dir>/eval/step_N.json names the step only, and two
    checkpoints of one step (another run's, evaluated with this deck) overwrote each other without a
    word. A record of another checkpoint is refused, naming --out; the same checkpoint's is replaced."""
    data, run_dir, _, _ = trained
    mine = run_dir / "checkpoints" / "step_0000002.h5"
    other = tmp_path / "other" / "step_0000002.h5"  # another run's checkpoint of the same step
    other.parent.mkdir()
    shutil.copyfile(mine, other)
    sets = (*data, "--set", f"run.dir={tmp_path / 'run'}")
    record = tmp_path / "run" / "eval" / "step_0000002.json"
    assert _app_eval(*sets, "--checkpoint", str(mine)).returncode == 0
    written = record.read_text()
    said = _refused(_app_eval(*sets, "--checkpoint", str(other)))
    assert f"{record} holds the evaluation of {mine}, not of {other}" in said and "--out FILE" in said, said
    assert record.read_text() == written
    assert _app_eval(*sets, "--checkpoint", str(other), "--out", str(tmp_path / "other.json")).returncode == 0


# ---- the validation loss on a grid equals the 1-rank value ----

_REFERENCES: dict = {}
EVAL_CASES = [
    Case(2, 2, 2, sp=True, virtual=2),
    Case(1, 2, 2, extra=("optim.zero=3", "train.goldfish_k=3", "train.goldfish_context=4")),
    t3d((1, 2, 2), 1, 2),
    # context parallelism: each cp rank reads its chunks of the held-out samples (Goldfish's
    # training reads whole samples for the masks)
    Case(2, 1, 2, cp=2, sp=True, extra=("train.goldfish_k=3", "train.goldfish_context=4")),
]


def _eval_sets(case: Case) -> tuple[str, ...]:
    return (*TINY, "eval.every=1000", "eval.batches=2", *(e for e in case.extra if e.startswith("train.goldfish")))


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("case", EVAL_CASES, ids=[c.id for c in EVAL_CASES])
def test_eval_loss_on_a_grid_matches_single_rank(runtime, grids, tmp_path, case):
    shared = _eval_sets(case)
    if shared not in _REFERENCES:  # the 1-rank reference on world rank 0, after STEPS steps
        grids.grid(1, 1, 1)
        value = None
        if runtime.rank == 0:
            solo = grid_trainer(grids, 1, 1, 1, (*shared, f"run.dir={tmp_path / 'solo'}"))
            train_steps(solo, STEPS)
            value = solo.evaluate()["loss"]
        settle(runtime.comm)
        _REFERENCES[shared] = runtime.comm.bcast(value, root=0)
    reference = _REFERENCES[shared]
    size = case.size
    sub = grids.runtime(size)
    run_dir = sub.comm.bcast(str(tmp_path / "grid"), root=0)
    deck = resolve_for_world(
        load_deck(REPO / "inputs/gpt_tiny.yaml", (*shared, *case.overrides(), f"run.dir={run_dir}")), size
    )
    grid = grids.grid(case.tp, case.pp, case.dp, deck.parallel.order, case.cp)
    if case.tensor:
        grid.tensor3d(case.tensor)
    value = None
    if grids.trains(size):
        trainer = Trainer(deck, sub, grid)
        train_steps(trainer, STEPS)
        result = trainer.evaluate()
        assert result["tokens"] == 2 * deck.train.global_batch * deck.model.seq_len
        value = result["loss"]
        again = trainer.evaluate()["loss"]  # evaluating changes nothing: the same samples, the same model
        assert again == value
    else:
        grids.stand_by(grid, deck.parallel.virtual_stages)
    settle(runtime.comm)
    value = next(x for x in runtime.comm.allgather(value) if x is not None)
    if runtime.is_root:
        print(f"\n{case.id}: eval loss {value:.6f} vs 1 rank {reference:.6f}")
    assert value == pytest.approx(reference, rel=EVAL_RTOL)


@pytest.mark.mpi
def test_goldfish_drops_targets_from_training_but_not_from_evaluation(runtime, shared_tmp, grids):
    """The same model evaluated with and without train.goldfish_k gives the same loss over every
    target, while the training losses of the first step differ."""
    dp = runtime.world_size

    def trainer(*sets: str) -> Trainer:
        deck = load_deck(REPO / "inputs/gpt_tiny.yaml", (*TINY, "eval.every=1", "eval.batches=1", *sets))
        deck = resolve_for_world(deck, dp)
        return Trainer(deck, runtime, grids.grid(1, 1, dp))

    plain = trainer(f"run.dir={shared_tmp / 'plain'}")
    goldfish = trainer(f"run.dir={shared_tmp / 'goldfish'}", "train.goldfish_k=2", "train.goldfish_context=3")
    assert plain.eval_data is not None
    a, b = evaluate(plain, plain.eval_data), evaluate(goldfish, plain.eval_data)
    assert a["loss"] == b["loss"] and a["tokens"] == b["tokens"] == 16 * 16
    losses = [train_steps(t, 1)[0] for t in (plain, goldfish)]
    assert goldfish.step_targets[0] < goldfish.step_targets[1] == plain.step_targets[0] == 16 * 16
    assert abs(losses[0] - losses[1]) > 1e-4


def test_the_grid_a_checkpoint_was_written_on_is_described_whole():
    """The resume and app.eval log lines name the checkpoint's grid with its cp and 3D shape (found in
    review: app.eval said "written on tp=1 pp=1 dp=1" of a cp 2 checkpoint)."""
    from app.checkpoint.io import describe_grid

    assert describe_grid({"tp": 1, "pp": 2, "dp": 1, "cp": 2, "zero": 0}) == "tp=1 cp=2 pp=2 dp=1"
    assert describe_grid({"tp": 2, "pp": 1, "dp": 4, "tensor": [1, 2, 1]}) == "tp=2 tensor=[1, 2, 1] pp=1 dp=4"
    assert describe_grid({"tp": 4, "pp": 1, "dp": 1}) == "tp=4 pp=1 dp=1"

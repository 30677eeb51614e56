"""Non-finite training (issue 14): a NaN/Inf loss or gradient norm under train.nonfinite
abort, skip and rollback, in fp32, bf16 and fp16; the fp16 loss-scale floor; strict JSON.

The end-to-end runs are real 2-rank jobs (`run_app`), so they are serial tests. Their
divergence is real: LAMB at optim.lr = 10 (the deck's ceiling), constant, with no warm-up,
grows the weight norms ~10x per step. On this model the gradient norm goes NaN at step 4
in fp32 and bf16; fp16 overflows first (the loss scale halves from step 2) and its loss is
NaN at step 7. The tests read the bad step from the message instead of hard-coding it.

Every run must leave only finite checkpoints, with the one written before the problem
still there and `latest` naming a finite one, and outputs that a strict JSON parser reads.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, Optional

import numpy as np
import pytest
import torch

from app.checkpoint.io import decode
from app.checkpoint.store import committed, read_latest
from app.errors import NonFiniteError
from app.metrics.report import MetricsWriter, TensorBoardWriter, dumps_strict, format_line, strict_json, write_summary
from app.optim.optimizer import LossScaler, NonFiniteGuard
from conftest import REPO, run_app

TINY = "inputs/gpt_tiny.yaml"
SMALL = (
    "model.vocab_size=64", "model.seq_len=16", "model.layers=2", "model.hidden=32", "model.heads=4",
    "train.global_batch=8", "train.micro_batch=2", "run.log_every=1",
)  # fmt: skip
DIVERGE = (
    *SMALL, "optim.name=lamb", "optim.lr=10", "optim.warmup_steps=0", "optim.schedule=constant",
    "checkpoint.every=1", "checkpoint.keep=1",
)  # fmt: skip
WHAT = r"(?:loss|gradient norm|loss and gradient norm)"


def _reject_constant(name: str) -> None:
    raise ValueError(f"not strict JSON: {name}")


def strict_loads(text: str) -> Any:
    """json.loads that refuses NaN, Infinity and -Infinity (as RFC 8259 parsers do)."""
    return json.loads(text, parse_constant=_reject_constant)


def nonfinite_datasets(path: Path) -> list[str]:
    """The /model and /optimizer datasets of a checkpoint that hold a NaN or Inf (serial h5py)."""
    import h5py

    bad: list[str] = []

    def visit(name: str, obj: Any) -> None:
        tensor = isinstance(obj, h5py.Dataset) and name.startswith(("model/", "optimizer/"))
        if tensor and not torch.isfinite(decode(obj[...], obj.attrs["dtype"])).all():
            bad.append(name)

    with h5py.File(path, "r") as f:
        f.visititems(visit)
    return bad


def diverge(tmp_path: Path, precision: str, *sets: str) -> tuple[int, str, Path]:
    """A 2-rank run of the diverging deck: (exit status, its output, run dir)."""
    run_dir = tmp_path / precision
    args = [arg for s in (*DIVERGE, f"train.precision={precision}", f"run.dir={run_dir}", *sets)
            for arg in ("--set", s)]  # fmt: skip
    out = run_app(2, TINY, *args)
    return out.returncode, out.stdout + out.stderr, run_dir


def check_outputs(text: str, run_dir: Path, good_step: int) -> tuple[list[dict], Optional[dict]]:
    """What every policy guarantees: no traceback; only finite committed checkpoints, among them
    the one of `good_step` (the last before the problem); `latest` finite; strict JSON with no
    step recorded twice or out of order. Returns (metrics records, summary or None)."""
    assert "Traceback" not in text and "internal error" not in text, text
    directory = run_dir / "checkpoints"
    steps = [step for step, _ in committed(directory)]
    assert good_step in steps, (steps, text)
    for _, path in committed(directory):
        assert nonfinite_datasets(path) == [], path
    latest = read_latest(directory)
    assert latest is not None and latest.is_file()
    records = [strict_loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    logged = [r["step"] for r in records]
    assert logged == sorted(set(logged)), logged
    summary_path = run_dir / "summary.json"
    summary = strict_loads(summary_path.read_text()) if summary_path.exists() else None
    return records, summary


def bad_step(text: str, pattern: str) -> int:
    """The step named by the one `gridlm: non-finite ...` line matching `pattern` (rank 0 prints it once)."""
    found = re.findall(pattern, text)
    assert len(found) == 1, text
    return int(found[0])


# ---- end to end: 2-rank jobs --------------------------------------------------------------


@pytest.mark.parametrize("precision", ["fp32", pytest.param("bf16", marks=pytest.mark.full), "fp16"])
def test_abort_stops_with_status_3_before_checkpointing_the_bad_state(tmp_path, precision):
    status, text, run_dir = diverge(tmp_path, precision, "train.steps=10", "train.nonfinite=abort")
    assert status == 3, text
    step = bad_step(text, rf"gridlm: non-finite {WHAT} at step (\d+) \(train\.nonfinite: abort\): stopped before the "
                          r"update, no checkpoint of this state was written; lower optim\.lr")  # fmt: skip
    records, summary = check_outputs(text, run_dir, step - 1)
    assert read_latest(run_dir / "checkpoints").name == f"step_{step - 1:07d}.h5"  # nothing after it
    assert [r["step"] for r in records] == list(range(1, step))
    assert summary is None  # the run did not finish


@pytest.mark.parametrize("precision", ["fp32", pytest.param("bf16", marks=pytest.mark.full), "fp16"])
def test_skip_drops_non_finite_steps_and_aborts_after_max_skipped_in_a_row(tmp_path, precision):
    # fp32 finishes (5 skipped steps allowed, at most 10); bf16 and fp16 allow 2 in a row.
    finish = precision == "fp32"
    steps, limit = (8, 10) if finish else (12, 2)
    status, text, run_dir = diverge(
        tmp_path, precision, f"train.steps={steps}", "train.nonfinite=skip", f"train.max_skipped={limit}"
    )
    warnings = re.findall(rf"gridlm: warning: non-finite {WHAT} at step (\d+): step skipped", text)
    first = int(warnings[0])
    records, summary = check_outputs(text, run_dir, first - 1)
    # A skipped step leaves the state finite, so checkpoints go on (checkpoint.every = 1); with
    # keep = 1, retention still keeps the one written before the first problem (check_outputs).
    last_saved = steps if finish else int(warnings[-1])
    assert read_latest(run_dir / "checkpoints").name == f"step_{last_saved:07d}.h5"
    flagged = [r for r in records if "nonfinite" in r]
    assert flagged and all(r[key] is None for r in flagged for key in r["nonfinite"])
    for r in flagged:
        if r["step"] < first:  # fp16 overflows before the divergence: the loss scaler skipped them
            assert precision == "fp16" and r["nonfinite"] == ["grad_norm"] and r["skipped_steps"] > 0
    assert re.search(r"step +\d+/\d+ \| loss (nan|[\d.]+) \|.* gnorm (nan|inf)", text)  # the log line says nan
    if finish:
        assert status == 0, text
        assert [int(w) for w in warnings] == list(range(first, steps + 1))
        assert summary["nonfinite_steps"] == len(warnings) and summary["rollbacks"] == 0
        assert summary["final_loss"] is None or math.isfinite(summary["final_loss"])
        assert "grad_norm" in records[-1]["nonfinite"]
    else:
        assert status == 3, text
        assert len(warnings) == limit
        bad_step(text, rf"gridlm: non-finite {WHAT} at step (\d+), after {limit} non-finite steps skipped in a row "
                       r"\(train\.nonfinite: skip, train\.max_skipped = 2\): training has diverged")  # fmt: skip
        assert summary is None


@pytest.mark.parametrize("precision", ["fp32", pytest.param("bf16", marks=pytest.mark.full), "fp16"])
def test_rollback_reloads_the_last_checkpoint_and_skips_the_bad_batches(tmp_path, precision):
    # fp32 finishes: each rollback skips one more batch, up to train.steps; bf16 and fp16 abort
    # after 2 rollbacks with no update in between.
    finish = precision == "fp32"
    steps, limit = (8, 10) if finish else (12, 2)
    status, text, run_dir = diverge(
        tmp_path, precision, f"train.steps={steps}", "train.nonfinite=rollback", f"train.max_skipped={limit}"
    )
    rollbacks = re.findall(
        rf"gridlm: warning: non-finite {WHAT} at step (\d+): rolled back to \S+ \(step (\d+)\)", text
    )
    first, good = int(rollbacks[0][0]), int(rollbacks[0][1])
    assert good == first - 1  # checkpoint.every = 1: the step before the problem
    # A replayed (skipped) batch is checkpointed like any step: each rollback goes to the step before.
    assert [int(back) for _, back in rollbacks] == [int(at) - 1 for at, _ in rollbacks]
    records, summary = check_outputs(text, run_dir, good)
    assert f"gridlm: step {first}: skipped the batch of samples [{8 * good}, {8 * first})" in text
    assert [r["step"] for r in records] == list(range(1, good + 1))  # cut back at each rollback
    if finish:
        assert status == 0, text
        assert [int(at) for at, _ in rollbacks] == list(range(first, steps + 1))
        assert summary["rollbacks"] == summary["nonfinite_steps"] == len(rollbacks)
        assert summary["final_loss"] == records[-1]["loss"]
        # The end-of-training checkpoint records the skipped batches (same parameters as `good`).
        assert read_latest(run_dir / "checkpoints").name == f"step_{steps:07d}.h5"
    else:
        assert status == 3, text
        assert len(rollbacks) == limit
        bad_step(text, rf"gridlm: non-finite {WHAT} at step (\d+), after {limit} rollbacks without an update in a "
                       r"row \(train\.nonfinite: rollback, train\.max_skipped = 2\)")  # fmt: skip
        assert read_latest(run_dir / "checkpoints").name == f"step_{int(rollbacks[-1][0]):07d}.h5"
        assert summary is None


def test_rollback_without_a_checkpoint_says_so(tmp_path):
    status, text, run_dir = diverge(tmp_path, "fp32", "train.steps=6", "train.nonfinite=rollback", "checkpoint.every=0")
    assert status == 3, text
    assert "Traceback" not in text
    bad_step(text, rf"gridlm: non-finite {WHAT} at step (\d+) \(train\.nonfinite: rollback\) and no checkpoint in "
                   r"\S+ to roll back to: set checkpoint\.every")  # fmt: skip
    assert committed(run_dir / "checkpoints") == []


def test_fp16_loss_scale_below_min_loss_scale_aborts(tmp_path):
    # The diverging deck overflows fp16 from step 2 on; a floor at the initial scale refuses the first halving.
    status, text, run_dir = diverge(tmp_path, "fp16", "train.steps=6", "train.min_loss_scale=65536")
    assert status == 3, text
    step = bad_step(text, r"gridlm: fp16 gradients overflow at step (\d+) with the loss scale at 65536: halving it "
                          r"would go below train\.min_loss_scale = 65536 .*; training has diverged: lower optim\.lr, "
                          r"use train\.precision: bf16")  # fmt: skip
    check_outputs(text, run_dir, step - 1)


# ---- in one job: a NaN on one rank only, rolled back or skipped ---------------------------


def _poison(trainer: Any, *batch_starts: int) -> None:
    """Make the last rank's loss NaN for the batches starting at samples `batch_starts` (its
    gradients stay finite: only the grid-wide check can tell the other ranks)."""
    real = trainer.forward_backward
    rt = trainer.runtime

    def forward_backward() -> torch.Tensor:
        start = trainer.sampler.consumed_samples
        loss = real()
        return loss * math.nan if start in batch_starts and rt.rank == rt.world_size - 1 else loss

    trainer.forward_backward = forward_backward


@pytest.mark.mpi
def test_a_nan_on_one_rank_is_rolled_back_on_every_rank_and_matches_skipping_the_batch(runtime, shared_tmp, grids):
    from app.deck import load_deck, resolve_for_world
    from app.train import Trainer

    base = (*SMALL, "train.steps=6", "checkpoint.every=2", "checkpoint.keep=1", "optim.lr=3e-3")

    def trainer(policy: str, *sets: str) -> Any:
        deck = load_deck(REPO / TINY, (*base, f"train.nonfinite={policy}", f"run.dir={shared_tmp / policy}", *sets))
        deck = resolve_for_world(deck, runtime.world_size)
        return Trainer(deck, runtime, grids.grid(1, 1, runtime.world_size))

    runs = {}
    for policy in ("skip", "rollback"):
        t = trainer(policy, "run.tensorboard=true") if policy == "rollback" else trainer(policy)
        _poison(t, 3 * 8)  # step 4's batch
        runs[policy] = (t, t.run())
        if t.run_lock is not None:
            t.run_lock.release()
    runtime.comm.Barrier()  # rank 0 has written the files
    skip, rollback = (strict_metrics(shared_tmp / p) for p in ("skip", "rollback"))
    assert [r["step"] for r in skip] == [1, 2, 3, 4, 5, 6] and skip[3]["nonfinite"] == ["loss"]
    # Rolled back to step 2, step 3 trained again (the same numbers), step 4's batch skipped.
    assert [r["step"] for r in rollback] == [1, 2, 3, 5, 6]
    assert [r["loss"] for r in rollback] == [r["loss"] for r in skip if r["step"] != 4]  # bitwise
    for policy, (t, summary) in runs.items():
        assert t.nonfinite_events == summary["nonfinite_steps"] == 1
        assert summary["rollbacks"] == (1 if policy == "rollback" else 0)
    assert runs["rollback"][1]["final_loss"] == rollback[-1]["loss"]
    skip_params = [p.detach().clone() for p in runs["skip"][0].model.parameters()]
    assert all(torch.equal(p.detach(), q) for p, q in zip(runs["rollback"][0].model.parameters(), skip_params))
    if runtime.is_root:  # TensorBoard dropped the events after the checkpoint's step, like metrics.jsonl
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(shared_tmp / "rollback" / "tb"))
        events.Reload()
        assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3, 5, 6]
    # A resumed run gets the count of non-finite steps back from the checkpoint header.
    resumed = trainer("rollback", "run.resume=auto", "train.steps=7")
    resumed.resume()
    assert resumed.steps_done == 6 and resumed.nonfinite_events == 1
    if resumed.run_lock is not None:
        resumed.run_lock.release()


@pytest.mark.mpi
def test_a_rolled_back_last_step_still_gets_its_final_evaluation(runtime, shared_tmp, grids):
    """Found in review (2026-11-30): the replay skips the bad batch of the last step without running
    the evaluation due after the last step, so the summary kept an earlier step's. 6 steps, evaluated
    every 3, step 6's batch poisoned: rolled back to step 4, step 5 trained again, step 6 skipped and
    evaluated with the parameters it leaves. And Goldfish's count over the job's steps counts each step
    once: the steps a rollback undid were counted again when replayed (found in review too)."""
    from app.deck import load_deck, resolve_for_world
    from app.train import Trainer

    sets = (*SMALL, "train.steps=6", "checkpoint.every=2", "checkpoint.keep=0", "eval.every=3",
            "train.nonfinite=rollback", "train.goldfish_k=4", f"run.dir={shared_tmp / 'last'}")  # fmt: skip
    deck = resolve_for_world(load_deck(REPO / TINY, sets), runtime.world_size)
    trainer = Trainer(deck, runtime, grids.grid(1, 1, runtime.world_size))
    _poison(trainer, 5 * 8)  # step 6's batch
    summary = trainer.run()
    if trainer.run_lock is not None:
        trainer.run_lock.release()
    assert summary["rollbacks"] == 1 and trainer.steps_done == 6
    assert summary["eval"] is not None and summary["eval"]["step"] == 6, summary["eval"]
    # Steps 1-5 trained (5 replayed once), step 6 skipped: 5 steps' targets.
    assert summary["goldfish"]["targets"] == 5 * deck.train.global_batch * deck.model.seq_len, summary["goldfish"]


@pytest.mark.mpi
def test_rollback_goes_to_this_jobs_checkpoint_and_a_streak_lasts_until_past_the_bad_step(runtime, shared_tmp, grids):
    """Three faults found in review (2026-11-30), each in one job of the small deck (8 samples a step):
    - a job resumed from an older file (step 4, while `latest` names step 8 of the line it left) rolls
      back to that file, not forward to `latest` (which trained past train.steps = 7, or raised
      UnboundLocalError when the rollback was its first step);
    - train.max_skipped counts rollbacks until an update past the bad step: the steps a rollback
      replays from its checkpoint (every 4 steps) no longer end the streak, so a second bad batch
      right after the first ends the job (max_skipped = 1) instead of rolling back again;
    - a job resumed from a checkpoint written inside a streak of skipped steps goes on counting it."""
    from app.deck import load_deck, resolve_for_world
    from app.train import Trainer

    base = (*SMALL, "checkpoint.keep=0", "optim.lr=3e-3")

    def job(name: str, *sets: str, poison: tuple[int, ...] = ()) -> Any:
        deck = load_deck(REPO / TINY, (*base, f"run.dir={shared_tmp / name}", *sets))
        t = Trainer(resolve_for_world(deck, runtime.world_size), runtime, grids.grid(1, 1, runtime.world_size))
        _poison(t, *poison)
        return t

    def run(t: Any) -> Any:
        try:
            return t.run()
        finally:
            t.close()
            if t.run_lock is not None:
                t.run_lock.release()

    run(job("line", "train.steps=8", "checkpoint.every=4"))  # step_4 and step_8; latest names step 8
    older = shared_tmp / "line" / "checkpoints" / "step_0000004.h5"
    back = job("line", "train.steps=7", "checkpoint.every=4", f"run.resume={older}", "train.nonfinite=rollback",
               poison=(5 * 8,))  # fmt: skip
    summary = run(back)
    assert back.guard.rollbacks == 1 and summary["rollbacks"] == 1
    assert back.steps_done == 7  # rolled back to step 4, step 5 again, step 6's batch skipped, step 7
    assert read_latest(shared_tmp / "line" / "checkpoints").name == "step_0000007.h5"

    streak = job("streak", "train.steps=9", "checkpoint.every=4", "train.nonfinite=rollback", "train.max_skipped=1",
                 poison=(5 * 8, 6 * 8))  # fmt: skip
    with pytest.raises(NonFiniteError, match=r"at step 7, after 1 rollbacks without an update in a row"):
        run(streak)
    assert streak.guard.rollbacks == 1

    run(job("skips", "train.steps=4", "checkpoint.every=1", "train.nonfinite=skip", "train.max_skipped=2",
            poison=(2 * 8, 3 * 8)))  # fmt: skip  # steps 3 and 4 skipped: step 4's checkpoint is 2 into a streak
    resumed = job("skips", "train.steps=6", "checkpoint.every=1", "train.nonfinite=skip", "train.max_skipped=2",
                  "run.resume=auto", poison=(4 * 8,))  # fmt: skip
    with pytest.raises(NonFiniteError, match=r"at step 5, after 2 non-finite steps skipped in a row"):
        run(resumed)


def strict_metrics(run_dir: Path) -> list[dict]:
    return [strict_loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# ---- the pure parts ---------------------------------------------------------------------


def test_strict_json_writes_null_for_non_finite_numbers_and_names_them():
    record = {"step": 3, "loss": math.nan, "grad_norm": math.inf, "lr": 1e-3, "mfu": None,
              "comm_s": {"dp": -math.inf, "tp": 0.0}, "list": [1.0, np.float32("nan"), 2]}  # fmt: skip
    clean, flagged = strict_json(record)
    assert flagged == ["loss", "grad_norm", "comm_s.dp", "list[1]"]
    assert clean["loss"] is None and clean["comm_s"] == {"dp": None, "tp": 0.0} and clean["list"] == [1.0, None, 2]
    assert record["loss"] != record["loss"]  # the input is left alone
    text = dumps_strict(record)
    parsed = strict_loads(text)
    assert parsed["nonfinite"] == flagged and parsed["step"] == 3 and parsed["mfu"] is None
    assert "NaN" not in text and "Infinity" not in text
    assert "nonfinite" not in strict_loads(dumps_strict({"step": 1, "loss": 2.5}))


def test_metrics_and_summary_files_are_strict_json(tmp_path):
    writer = MetricsWriter(tmp_path, enabled=True)
    for step in (1, 2, 3):
        writer.write({"step": step, "loss": math.nan if step == 2 else 1.0 / step})
    writer.truncate(2)  # a rollback to step 2's checkpoint
    writer.write({"step": 3, "loss": 0.25})
    records = [strict_loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3] and records[1] == {"step": 2, "loss": None, "nonfinite": ["loss"]}
    assert records[2]["loss"] == 0.25
    path = write_summary(tmp_path, {"final_loss": math.nan, "timers": {"forward_s": math.inf}, "steps": 3})
    summary = strict_loads(path.read_text())
    assert summary["final_loss"] is None and summary["nonfinite"] == ["final_loss", "timers.forward_s"]


def test_the_log_line_says_nan_and_tensorboard_skips_non_finite_scalars(tmp_path):
    record = {"step": 2, "loss": math.nan, "lr": 1e-3, "step_time_s": 0.01, "tokens_per_s": 100.0,
              "tflops_per_rank": 0.0, "mfu": None, "grad_norm": math.inf}  # fmt: skip
    line = format_line(record, 10)
    assert "loss nan |" in line and line.endswith("gnorm inf")
    board = TensorBoardWriter(tmp_path, enabled=False)
    written: list[str] = []

    class Recorder:
        def add_scalar(self, tag: str, value: float, step: int) -> None:
            written.append(tag)

        def flush(self) -> None:
            pass

    board.writer = Recorder()
    board.write(record)
    assert written == ["train/lr", "perf/step_time_s", "perf/tokens_per_s", "perf/model_tflops_per_gpu"]


def test_loss_scaler_halves_on_overflow_and_refuses_to_go_below_its_floor():
    scaler = LossScaler(8.0, window=2, min_scale=2.0)
    scaler.update(True, step=1)
    scaler.update(True, step=2)
    assert (scaler.scale, scaler.skipped) == (2.0, 2)
    with pytest.raises(NonFiniteError, match=r"at step 3 with the loss scale at 2: .* train\.min_loss_scale = 2 "
                                             r"\(2 steps skipped on overflow before\).*lower optim\.lr"):  # fmt: skip
        scaler.update(True, step=3)
    assert NonFiniteError.exit_code == 3
    scaler.update(False)
    scaler.update(False)
    assert scaler.scale == 4.0  # `window` clean steps double it
    unbounded = LossScaler(1.0, window=1000, min_scale=0.0)
    for step in range(1, 2000):  # a floor of 0 never aborts, and the scale stays positive
        unbounded.update(True, step)
    assert unbounded.scale > 0 and unbounded.skipped == 1999


def test_a_resumed_clean_count_past_a_smaller_window_still_doubles_the_scale():
    """Found in review: a checkpoint of a run with loss_scale_window 100, resumed with a window of 2,
    brought a clean count of 5: the test `clean == window` never held again and the scale could only halve."""
    scaler = LossScaler(1024.0, window=2)
    scaler.load_state_dict({"scale": 1024.0, "clean": 5, "skipped": 0})
    scaler.update(False)
    assert (scaler.scale, scaler.clean) == (2048.0, 0)


def test_nonfinite_guard_counts_streaks_and_aborts():
    with pytest.raises(NonFiniteError, match=r"non-finite loss and gradient norm at step 7 \(train\.nonfinite: "
                                             r"abort\).*use train\.precision: bf16"):  # fmt: skip
        NonFiniteGuard("abort", 10, "fp16").nonfinite(7, ["loss", "grad_norm"])
    skip = NonFiniteGuard("skip", 2, "fp32")
    assert skip.nonfinite(1, ["loss"]) == skip.nonfinite(2, ["loss"]) == "skip"
    skip.updated(3)  # a good step ends the streak
    assert skip.nonfinite(4, ["grad_norm"]) == skip.nonfinite(5, ["grad_norm"]) == "skip"
    with pytest.raises(NonFiniteError, match=r"gradient norm at step 6, after 2 non-finite steps skipped in a row"):
        skip.nonfinite(6, ["grad_norm"])
    assert skip.events == 5 and skip.rollbacks == 0
    rollback = NonFiniteGuard("rollback", 1, "bf16")
    assert rollback.nonfinite(3, ["loss"]) == "rollback" and rollback.rollbacks == 1
    with pytest.raises(NonFiniteError, match="after 1 rollbacks without an update in a row"):
        rollback.nonfinite(4, ["loss"])
    assert "bf16" not in rollback.fix()  # only fp16 runs are told to switch precision
    # A rollback's replay (steps up to the bad one) updates, but only an update past it ends the streak.
    replayed = NonFiniteGuard("rollback", 1, "fp32")
    assert replayed.nonfinite(6, ["loss"]) == "rollback"
    replayed.updated(5)  # step 5 trained again after the rollback to step 4
    with pytest.raises(NonFiniteError, match="at step 7, after 1 rollbacks without an update in a row"):
        replayed.nonfinite(7, ["loss"])
    past = NonFiniteGuard("rollback", 1, "fp32")
    past.nonfinite(6, ["loss"])
    past.updated(7)  # step 7 trained, past the bad batch: the streak is over
    assert past.nonfinite(9, ["loss"]) == "rollback" and past.in_a_row == 1
    resumed = NonFiniteGuard("skip", 2, "fp32")
    resumed.resumed(2, 4)  # a checkpoint of step 4 written 2 skipped steps into a streak
    resumed.updated(4)  # not past step 4
    with pytest.raises(NonFiniteError, match="after 2 non-finite steps skipped in a row"):
        resumed.nonfinite(5, ["loss"])
    assert "set checkpoint.every" in rollback.no_checkpoint(3, ["loss"], Path("ckpt"))

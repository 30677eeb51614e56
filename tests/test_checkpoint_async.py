"""Asynchronous checkpoints (checkpoint.async): the file written in the background while training
goes on equals the synchronous one tensor for tensor (values, dtypes, checksums); a run resumed
from it continues bitwise like the uninterrupted run; a write in flight is waited for at the end
of training and at a stop signal; without MPI_THREAD_MULTIPLE saves are synchronous with one
warning. MPI tests (>= 2 ranks) and jobs launched through mpirun (serial). A background write
that fails is in tests/test_checkpoint_failures.py."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest
import torch
from test_checkpoint import SMALL  # the same tiny model as the synchronous checkpoint tests

import app.checkpoint.background as background
from app.checkpoint.io import load, read_header, save
from app.checkpoint.slabs import dataset_checksum
from app.checkpoint.store import read_latest, step_file
from conftest import REPO, app_env, grid_trainer, read_metrics, sigterm_after_step, train_steps

GRIDS = {2: (1, 2, 1), 4: (2, 1, 2)}  # tp, pp, dp: pp at 2 ranks, tp and dp (ZeRO-1 below) at 4
ASYNC = "checkpoint.async=true"


def _trainer(grids, run_dir, *extra: str):
    return grid_trainer(grids, *GRIDS[grids.world.world_size], (*SMALL, f"run.dir={run_dir}", *extra))


def _all_ranks_ok(runtime, problems: list[str]) -> None:
    """Assert on every rank after every rank got here (no rank left in a collective)."""
    problems = sum(runtime.comm.allgather(problems), [])
    assert not problems, "\n".join(problems)


def _slow_writes(monkeypatch, seconds: float) -> None:
    """The writer thread starts its (real) write `seconds` late, so that it is surely in flight
    when the step loop reaches the point under test."""
    real = background.write

    def late(*args, **kwargs):
        time.sleep(seconds)
        return real(*args, **kwargs)

    monkeypatch.setattr(background, "write", late)


def _datasets(path) -> dict[str, tuple[np.ndarray, dict]]:
    """Every dataset of a checkpoint: (values as stored, attributes)."""
    out = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, obj: out.__setitem__(name, (obj[()], dict(obj.attrs))) if isinstance(obj, h5py.Dataset) else None)  # fmt: skip
    return out


CASES = {
    "fp32-independent": ("optim.zero=1",),
    "bf16-collective": ("train.precision=bf16", "checkpoint.io=collective", "model.dropout=0.1"),
}


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("extra", CASES.values(), ids=CASES.keys())
def test_the_background_file_equals_the_synchronous_one_while_training_goes_on(
    runtime, grids, shared_tmp, monkeypatch, extra
):
    """The snapshot is a copy: two more steps change every tensor while the write is in flight,
    and the file still holds the state of the step it was taken at, bit for bit."""
    trainer = _trainer(grids, shared_tmp, ASYNC, *extra)
    assert trainer.writer is not None, "Open MPI 4 under mpi4py provides MPI_THREAD_MULTIPLE"
    train_steps(trainer, 2)
    synchronous = save(trainer, shared_tmp / "sync").path
    _slow_writes(monkeypatch, 0.5)
    pending = trainer.save("test")
    assert trainer.writer.in_flight and pending.blocked == pending.seconds
    before = trainer.dp.param_buffer.clone()
    train_steps(trainer, 2)  # the state moves on under the write
    moved = not torch.equal(before, trainer.dp.param_buffer)
    saved = trainer.finish_save()
    assert saved.path == step_file(shared_tmp / "checkpoints", 2) and saved.step == 2
    assert 0 < saved.blocked < saved.seconds, (saved.blocked, saved.seconds)
    assert trainer.checkpoints[-1]["background"] and trainer.checkpoints[-1]["blocked_seconds"] == saved.blocked
    problems = [] if moved else [f"rank {runtime.rank}: training did not change the parameters"]
    if runtime.is_root:
        assert read_latest(shared_tmp / "checkpoints") == saved.path
        a, b = _datasets(synchronous), _datasets(saved.path)
        assert sorted(a) == sorted(b) and len(a) > 50
        for name, (values, attrs) in a.items():
            if not (values.dtype == b[name][0].dtype and np.array_equal(values, b[name][0])):
                problems.append(f"{name}: the values differ")
            if attrs != b[name][1]:  # dtype and checksum
                problems.append(f"{name}: attributes {attrs} != {b[name][1]}")
            if int(attrs["checksum"]) != dataset_checksum(b[name][0]):
                problems.append(f"{name}: the checksum does not match the values")
        head_a, head_b = read_header(synchronous), read_header(saved.path)
        for key in ("step", "consumed_samples", "sampler", "optimizer_steps", "loss_scaler", "grid", "committed"):
            if head_a[key] != head_b[key]:
                problems.append(f"header {key}: {head_a[key]!r} != {head_b[key]!r}")
    _all_ranks_ok(runtime, problems)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_a_run_resumed_from_a_background_checkpoint_continues_like_the_uninterrupted_one(runtime, grids, shared_tmp):
    straight = _trainer(grids, shared_tmp / "straight", "optim.zero=1")
    expected = train_steps(straight, 5)
    first = _trainer(grids, shared_tmp / "first", "optim.zero=1", ASYNC)
    train_steps(first, 3)
    first.save("test")
    train_steps(first, 1)  # while the write is (or may be) in flight
    path = first.finish_save().path
    resumed = _trainer(grids, shared_tmp / "resumed", "optim.zero=1", f"run.resume={path}")
    assert resumed.resume()["step"] == 3
    assert train_steps(resumed, 2) == expected[3:]  # bitwise: the same floats


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_a_write_in_flight_is_waited_for_at_the_end_of_training(runtime, grids, shared_tmp, monkeypatch):
    """train.steps = 4, every 2 steps: step 4's write is still in flight when the loop ends (it
    starts late); the end waits for it instead of writing another, and it is `latest`."""
    _slow_writes(monkeypatch, 0.5)
    trainer = _trainer(grids, shared_tmp, ASYNC, "checkpoint.every=2", "train.steps=4", "checkpoint.at_exit=true")
    summary = trainer.run()
    assert not trainer.writer.in_flight
    records = summary["checkpoints"]
    assert [(c["step"], c["reason"], c["background"]) for c in records] == [(2, "every 2 steps", True), (4, "every 2 steps", True)]  # fmt: skip
    # Step 2's write went on under steps 3 and 4; the end waited for step 4's, which started late.
    assert 0 < records[0]["blocked_seconds"] < records[0]["seconds"] and records[1]["blocked_seconds"] > 0.4, records
    directory = shared_tmp / "checkpoints"
    assert read_latest(directory) == step_file(directory, 4)
    fresh = _trainer(grids, shared_tmp / "fresh", f"run.resume={directory}")
    assert fresh.resume()["step"] == 4
    same = torch.equal(fresh.dp.param_buffer, trainer.dp.param_buffer)
    _all_ranks_ok(runtime, [] if same else [f"rank {runtime.rank}: the loaded parameters are not the trained ones"])


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_a_stop_signal_waits_for_the_write_in_flight_and_latest_loads(runtime, grids, shared_tmp, monkeypatch):
    """SIGTERM on one rank after step 2, which started a background write: every rank stops after
    step 2 once that write committed, and writes no second checkpoint of the step."""
    _slow_writes(monkeypatch, 0.5)
    trainer = _trainer(grids, shared_tmp, ASYNC, "checkpoint.every=2", "train.steps=20")
    sigterm_after_step(trainer, runtime, 2)
    summary = trainer.run()
    assert trainer.steps_done == 2 and summary["interrupted"] == "SIGTERM"
    assert [(c["step"], c["background"]) for c in summary["checkpoints"]] == [(2, True)]
    directory = shared_tmp / "checkpoints"
    assert read_latest(directory) == step_file(directory, 2) and not list(directory.glob("*.tmp*"))
    assert load(_trainer(grids, shared_tmp / "fresh"), step_file(directory, 2))["step"] == 2


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_a_write_committed_while_the_run_ends_on_another_error_is_logged(
    runtime, grids, shared_tmp, monkeypatch, capsys
):
    """Step 3 fails on every rank while step 2's background write is in flight: closing the trainer
    (as `train` does after any error) waits for it, and the log names the checkpoint it committed,
    where the next job resumes (it was waited for, then said nothing)."""
    from app.errors import DataError

    _slow_writes(monkeypatch, 0.5)
    trainer = _trainer(grids, shared_tmp, ASYNC, "checkpoint.every=2", "train.steps=20")
    run_step = trainer.step

    def fails_at_3():
        if trainer.steps_done == 2:
            raise DataError("planted failure of step 3")
        return run_step()

    trainer.step = fails_at_3
    with pytest.raises(DataError, match="planted"):
        trainer.run()
    assert trainer.writer.in_flight
    trainer.close()
    directory = shared_tmp / "checkpoints"
    assert read_latest(directory) == step_file(directory, 2)
    logged = capsys.readouterr().out
    line = f"checkpoint step 2 (every 2 steps) -> {step_file(directory, 2)}: written in the background and committed"
    _all_ranks_ok(
        runtime, [] if runtime.rank != 0 or line in logged else [f"not logged: {line!r} in {logged[-600:]!r}"]
    )


# ---- jobs through mpirun: the real launch (watchdog, signals, thread level) -------------------


def _command(run_dir, steps: int, *extra: str) -> list[str]:
    sets = [*SMALL, f"train.steps={steps}", "run.log_every=1", f"run.dir={run_dir}", "run.resume=auto", ASYNC, *extra]
    cmd = ["mpirun", "-n", "2", sys.executable, "-m", "app", "inputs/gpt_tiny.yaml"]
    return cmd + [a for s in sets for a in ("--set", s)]


def test_without_thread_multiple_saves_are_synchronous_after_one_warning(tmp_path):
    """MPI4PY_RC_THREAD_LEVEL=serialized: mpi4py asks MPI for MPI_THREAD_SERIALIZED only."""
    env = {**app_env(), "MPI4PY_RC_THREAD_LEVEL": "serialized"}
    job = subprocess.run(
        _command(tmp_path, 4, "checkpoint.every=2"), cwd=REPO, env=env, capture_output=True, text=True, timeout=180
    )
    log = job.stdout + job.stderr
    assert job.returncode == 0, log
    warnings = [line for line in log.splitlines() if "checkpoint.async needs MPI_THREAD_MULTIPLE" in line]
    assert len(warnings) == 1 and "MPI_THREAD_SERIALIZED: checkpoints are written synchronously" in warnings[0], log
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [(c["step"], c["background"]) for c in summary["checkpoints"]] == [(2, False), (4, False)]
    assert all(c["blocked_seconds"] == c["seconds"] for c in summary["checkpoints"])
    assert read_latest(tmp_path / "checkpoints") == step_file(tmp_path / "checkpoints", 4)


def test_a_rank_without_a_spare_core_for_the_writer_is_warned_about(tmp_path):
    """Bound to one core each (mpirun --bind-to core), the writer thread would share it with
    training: rank 0 warns once. Unbound (two cores, one torch thread each), it does not."""
    logs = {}
    for binding in ("core", "none"):
        cmd = _command(tmp_path / binding, 1, "checkpoint.at_exit=false")
        cmd[1:1] = ["--bind-to", binding]
        job = subprocess.run(cmd, cwd=REPO, env=app_env(), capture_output=True, text=True, timeout=180)
        logs[binding] = job.stdout + job.stderr
        assert job.returncode == 0, logs[binding]
    assert logs["core"].count("checkpoint.async: 2 rank(s) may run on no more cores than their torch threads") == 1
    assert "may run on no more cores" not in logs["none"], logs["none"]


def test_sigusr1_through_mpirun_waits_for_the_background_write_and_the_next_job_resumes(tmp_path):
    """Every step starts a background write; SIGUSR1 to mpirun stops the job after a step whose
    write committed (exit 0), and the next job resumes from it and logs each step once."""
    job = subprocess.Popen(
        _command(tmp_path, 10000, "checkpoint.every=1"), cwd=REPO, env=app_env(), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    output = []
    for line in job.stdout:  # wait for a background write to be logged
        output.append(line)
        if "written in the background" in line:
            break
    job.send_signal(signal.SIGUSR1)
    rest, _ = job.communicate(timeout=120)
    log = "".join(output) + rest
    assert job.returncode == 0, log
    assert "SIGUSR1 received: stopped after step" in log and "checkpoint.async needs" not in log
    stopped = read_latest(tmp_path / "checkpoints")
    step = int(stopped.stem.split("_")[1])
    assert f"stopped after step {step} of" in log
    again = subprocess.run(
        _command(tmp_path, step + 2), cwd=REPO, env=app_env(), capture_output=True, text=True, timeout=120
    )
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"resumed from {stopped} at step {step}" in again.stdout
    assert [r["step"] for r in read_metrics(tmp_path)] == list(range(1, step + 3))

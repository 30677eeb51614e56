"""The watchdog: a stopped or killed rank of an 8-rank job ends the job, named, in bounded time.

These tests launch `mpirun -n 8 python -m app` themselves (serial group), stop or kill one
rank mid-training and wait for the job to end. The bounds are the issue's: a stopped rank
ends the job within run.comm_timeout_s + 30 s, a killed one within 60 s.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, app_env

VICTIM = 5  # of 8 ranks: tp 2 x pp 2 x dp 2, so every axis has a group with it


def rank_pid(marker: str, rank: int) -> int:
    """The pid of `python -m app` rank `rank` of the job whose command line contains `marker`."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if marker in cmdline and "-m app" in cmdline and f"OMPI_COMM_WORLD_RANK={rank}".encode() in environ:
            return int(entry.name)
    raise AssertionError(f"no rank {rank} process of {marker}")


def start_job(run_dir: Path, timeout_s: float) -> subprocess.Popen:
    cmd = [
        "mpirun", "-n", "8", sys.executable, "-m", "app", "inputs/gpt_tiny.yaml",
        "--set", "parallel.tp=2", "--set", "parallel.pp=2", "--set", "train.steps=100000",
        "--set", "run.log_every=1", "--set", "checkpoint.at_exit=false", "--set", f"run.dir={run_dir}",
        "--set", f"run.comm_timeout_s={timeout_s}",
    ]  # fmt: skip
    out = open(run_dir.parent / "job.log", "w")
    return subprocess.Popen(cmd, cwd=REPO, env=app_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def wait_for_steps(proc: subprocess.Popen, run_dir: Path, steps: int, limit: float = 300) -> None:
    """Poll until metrics.jsonl has `steps` records (training is under way on every rank)."""
    deadline = time.monotonic() + limit
    metrics = run_dir / "metrics.jsonl"
    while time.monotonic() < deadline:
        assert proc.poll() is None, (run_dir.parent / "job.log").read_text()[-3000:]
        if metrics.exists() and len(metrics.read_text().splitlines()) >= steps:
            return
        time.sleep(0.2)
    raise AssertionError(f"no {steps} steps within {limit} s")


def stop_job(proc: subprocess.Popen, victim: int) -> None:
    for sig in (signal.SIGCONT, signal.SIGKILL):
        try:
            os.kill(victim, sig)
        except ProcessLookupError:
            pass
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.mark.timeout(600)
def test_stopped_rank_ends_the_job_within_timeout_and_is_named(tmp_path):
    timeout_s = 20.0
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    proc = start_job(run_dir, timeout_s)
    victim = 0
    try:
        wait_for_steps(proc, run_dir, 2)
        victim = rank_pid(str(run_dir), VICTIM)
        os.kill(victim, signal.SIGSTOP)
        stopped_at = time.monotonic()
        rc = proc.wait(timeout=timeout_s + 30)  # the bound; TimeoutExpired fails the test
        elapsed = time.monotonic() - stopped_at
    finally:
        stop_job(proc, victim)
    log = (tmp_path / "job.log").read_text()
    assert rc != 0, log[-3000:]
    lines = [line for line in log.splitlines() if "watchdog: no progress" in line]
    assert lines, log[-3000:]
    assert f"rank {VICTIM} (pid {victim}" in lines[0] and "stopped" in lines[0], lines[0]
    assert "Traceback" not in log, log[-3000:]
    print(f"stopped rank {VICTIM}: job ended {elapsed:.1f} s later, exit {rc}: {lines[0]}")


@pytest.mark.timeout(600)
def test_killed_rank_ends_the_job_and_is_named(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    proc = start_job(run_dir, 600.0)
    victim = 0
    try:
        wait_for_steps(proc, run_dir, 2)
        victim = rank_pid(str(run_dir), VICTIM)
        os.kill(victim, signal.SIGKILL)
        rc = proc.wait(timeout=60)
    finally:
        stop_job(proc, victim)
    log = (tmp_path / "job.log").read_text()
    assert rc != 0, log[-3000:]
    # The first line any rank prints about the failure names the dead rank.
    first = next((line for line in log.splitlines() if "gridlm: rank" in line), None)
    assert first is not None, log[-3000:]
    assert f"rank {VICTIM} (pid {victim}" in first and "died" in first, log[-3000:]
    assert "internal error" not in log, log[-3000:]

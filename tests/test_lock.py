"""One job per run.dir: the fcntl lock on <run.dir>/.gridlm.lock, with real processes.

fcntl locks do not conflict within one process, so the other job is always a subprocess
(plain python, no torch: a fraction of a second to start).
"""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest

from app.errors import GridlmError, RunDirInUse
from app.runtime import lock as lock_module
from app.runtime.lock import LOCK_NAME, acquire_run_lock
from conftest import REPO

HOLD = """
import sys, time
from pathlib import Path
from app.runtime.lock import acquire_run_lock
lock = acquire_run_lock(Path(sys.argv[1]))
print("locked", flush=True)
time.sleep(120)
"""
TRY = """
import sys
from pathlib import Path
from app.errors import RunDirInUse
from app.runtime.lock import acquire_run_lock
try:
    acquire_run_lock(Path(sys.argv[1]))
except RunDirInUse as err:
    print(err)
    sys.exit(3)
print("locked")
"""


def job_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("SLURM_JOB_ID", "PBS_JOBID")}
    return {**env, "PYTHONPATH": str(REPO), **extra}


@pytest.fixture
def holder(tmp_path):
    """Another job holding tmp_path/run's lock (Slurm job 4242), until the test ends or kills it."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(tmp_path / "run")],
        stdout=subprocess.PIPE,
        text=True,
        env=job_env(SLURM_JOB_ID="4242"),
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "locked"
    yield proc
    proc.kill()
    proc.wait()


def snapshot(run_dir: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under run_dir: its bytes and modification time."""
    return {str(p.relative_to(run_dir)): (p.read_bytes(), p.stat().st_mtime_ns) for p in run_dir.rglob("*")}


def test_second_job_is_refused_naming_the_holder_and_writes_nothing(tmp_path, holder):
    run_dir = tmp_path / "run"
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')  # the holder's outputs
    before = snapshot(run_dir)
    with pytest.raises(RunDirInUse) as e:
        acquire_run_lock(run_dir)
    assert str(e.value).startswith(f"run.dir = '{run_dir}' is in use by job 4242 since 20")  # the start time, ISO 8601
    assert f"(host {socket.gethostname()}, pid {holder.pid}); wait for it to finish" in str(e.value)
    assert str(e.value).endswith("or set run.dir to another directory")
    assert isinstance(e.value, GridlmError)  # exit status 2, one message, no traceback
    assert snapshot(run_dir) == before  # no new file, the lock file's bytes unchanged


def test_lock_of_a_killed_job_is_taken_over(tmp_path, holder):
    run_dir = tmp_path / "run"
    holder.send_signal(signal.SIGKILL)  # no clean-up: the stale lock file stays
    holder.wait()
    assert (run_dir / LOCK_NAME).exists()
    lock = acquire_run_lock(run_dir)
    assert lock.locked
    assert json.loads((run_dir / LOCK_NAME).read_text())["pid"] == os.getpid()
    lock.release()


def test_release_lets_the_next_job_take_the_lock(tmp_path):
    run_dir = tmp_path / "run"

    def other_job() -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-c", TRY, str(run_dir)]
        return subprocess.run(cmd, env=job_env(), capture_output=True, text=True, timeout=60, check=False)

    with acquire_run_lock(run_dir) as lock:
        refused = other_job()
        assert refused.returncode == 3, refused.stderr
        assert f"is in use by job pid {os.getpid()}" in refused.stdout
    assert not lock.locked
    lock.release()  # idempotent
    assert other_job().stdout.strip() == "locked"


def test_lock_file_records_the_holder_and_run_dir_is_created(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.setenv("PBS_JOBID", "77.pbs01")
    run_dir = tmp_path / "a" / "b" / "run"
    lock = acquire_run_lock(run_dir)
    info = json.loads((run_dir / LOCK_NAME).read_text())
    assert info == lock.holder
    assert (info["job"], info["host"], info["pid"]) == ("77.pbs01", socket.gethostname(), os.getpid())
    assert datetime.fromisoformat(info["since"]).tzinfo is not None
    lock.release()
    monkeypatch.delenv("PBS_JOBID")
    (run_dir / LOCK_NAME).write_text("x" * 5000)  # a longer stale record is replaced, not overlaid
    with acquire_run_lock(run_dir):
        assert json.loads((run_dir / LOCK_NAME).read_text())["job"] == f"pid {os.getpid()}"


@pytest.mark.parametrize("code", [errno.ENOSYS, errno.EINVAL], ids=["ENOSYS", "EINVAL"])
def test_file_system_without_lock_support_warns_once_and_runs_unlocked(tmp_path, monkeypatch, capsys, code):
    # Lustre mounted with -o noflock: every fcntl lock call fails.
    def no_locks(fd: int, cmd: int, *args: int) -> None:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(lock_module.fcntl, "lockf", no_locks)
    lock = acquire_run_lock(tmp_path / "run")
    out = capsys.readouterr().out
    assert out.count("gridlm: warning:") == 1
    assert "does not support fcntl locks" in out and "-o flock" in out and str(tmp_path / "run") in out
    assert not lock.locked and lock.warning is not None
    assert json.loads((tmp_path / "run" / LOCK_NAME).read_text())["pid"] == os.getpid()
    lock.release()  # does not call lockf again


def test_other_errors_name_run_dir(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    with pytest.raises(GridlmError, match="cannot write run directory run.dir = '.*file/run'"):
        acquire_run_lock(tmp_path / "file" / "run")

    def broken(fd: int, cmd: int, *args: int) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(lock_module.fcntl, "lockf", broken)
    with pytest.raises(GridlmError, match="Input/output error"):
        acquire_run_lock(tmp_path / "run")

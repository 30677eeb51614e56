"""gridlm under a real Slurm: `srun` of the app, and `sbatch --wait` of launch/submit.py's job scripts.

Run with `--with-slurm` against a running Slurm (launch/test.sh starts a one-node one with
launch/slurm_local.sh; by hand: `eval "$(launch/slurm_local.sh start)"`). Without the flag these
tests are skipped; with it, a Slurm that does not answer is a failure.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, app_env

pytestmark = pytest.mark.slurm

TINY = REPO / "inputs/gpt_tiny.yaml"
SHORT = ("--set", "train.steps=6", "--set", "run.log_every=1", "--set", "checkpoint.every=0")
DEFAULT_CONF = Path(os.environ.get("GRIDLM_SLURM_DIR", "/tmp/gridlm-slurm")) / "slurm.conf"
# One job name per pytest process: on a timeout only this run's jobs are cancelled.
JOB_NAME = f"gridlm-pytest-{os.getpid()}"


@pytest.fixture(scope="module")
def slurm_env() -> dict[str, str]:
    """app_env() for Slurm commands: our SLURM_CONF, no variables of a surrounding Slurm job."""
    env = app_env()
    for var in list(env):
        # Inside an allocation srun would start a step of *that* job (and sbatch inherit its options).
        if var.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_")) and var != "SLURM_CONF":
            del env[var]
    if "SLURM_CONF" not in env and DEFAULT_CONF.is_file():
        env["SLURM_CONF"] = str(DEFAULT_CONF)  # launch/slurm_local.sh's, when the caller did not eval it
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    for tool in ("srun", "sbatch", "sinfo", "scancel"):
        if shutil.which(tool, path=env["PATH"]) is None:
            pytest.fail(f"--with-slurm but no `{tool}` on PATH (launch/slurm_local.sh start installs Slurm)")
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail("--with-slurm but sinfo did not answer in 30 s")
    if out.returncode != 0 or not out.stdout.strip():
        pytest.fail(
            f"--with-slurm but Slurm does not answer (SLURM_CONF={env.get('SLURM_CONF')}): sinfo exit "
            f"{out.returncode}: {out.stdout.strip()} {out.stderr.strip()}; start it with launch/slurm_local.sh start"
        )
    return env


def slurm_run(cmd: list[str], env: dict[str, str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """Run a Slurm command (srun, sbatch --wait); on a timeout cancel this run's jobs and fail."""
    try:
        return subprocess.run(
            cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as err:
        # Killing srun or sbatch leaves the job itself running: cancel it by name.
        subprocess.run(["scancel", "--name", JOB_NAME], env=env, check=False, timeout=30)
        pytest.fail(
            f"{' '.join(cmd)} timed out after {timeout} s; cancelled job {JOB_NAME}\n{err.stdout}\n{err.stderr}"
        )


def job_logs(where: Path) -> str:
    """Every job log (*.out: slurm-%j.out, submit.py's job-%j.out) under `where`."""
    return "".join(f"--- {log}\n{log.read_text(errors='replace')}" for log in sorted(where.rglob("*.out")))


def report(out: subprocess.CompletedProcess, where: Path) -> str:
    return f"exit {out.returncode}\n--- stdout\n{out.stdout}\n--- stderr\n{out.stderr}\n{job_logs(where)}"


def submit(env: dict[str, str], script: Path, *sets: str) -> subprocess.CompletedProcess:
    """`python launch/submit.py DECK --machine local --nodes 1 --out SCRIPT ...`, run in the script's
    directory: the job's working directory is where submit.py ran, so nothing lands in the repository."""
    cmd = [sys.executable, str(REPO / "launch/submit.py"), str(TINY), "--machine", "local", "--nodes", "1",
           "--out", str(script), "--time", "00:05:00", *sets]  # fmt: skip
    return subprocess.run(cmd, cwd=script.parent, env=env, capture_output=True, text=True, timeout=120, check=False)


def test_srun_starts_four_ranks_as_one_world(slurm_env, tmp_path):
    run_dir = tmp_path / "run"
    cmd = ["srun", "-n", "4", "-J", JOB_NAME, "-t", "5", sys.executable, "-m", "app", str(TINY),
           *SHORT, "--set", f"run.dir={run_dir}"]  # fmt: skip
    out = slurm_run(cmd, slurm_env, REPO, timeout=300)
    assert out.returncode == 0, report(out, tmp_path)
    # The classic failure: srun with the wrong PMI plugin starts 4 independent 1-rank jobs that all
    # "succeed". Each prints its own start line ("world 1") and they race on one summary.json
    # (world_size 1), so one start line that says world 4, and world_size 4, prove one 4-rank world.
    starts = [line for line in out.stdout.splitlines() if line.startswith("gridlm:") and " | world " in line]
    assert len(starts) == 1, report(out, tmp_path)
    assert "| world 4 on 1 node(s) |" in starts[0], starts[0]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["world_size"], summary["nodes"], summary["steps"]) == (4, 1, 6)


def test_sbatch_runs_a_submit_py_job_script(slurm_env, tmp_path):
    run_dir, script = tmp_path / "run", tmp_path / "job.sh"
    made = submit(slurm_env, script, *SHORT, "--set", f"run.dir={run_dir}")
    assert made.returncode == 0, report(made, tmp_path)
    assert script.is_file(), report(made, tmp_path)
    # sbatch --wait returns the job's exit status.
    out = slurm_run(["sbatch", "--wait", "-J", JOB_NAME, str(script)], slurm_env, tmp_path, timeout=300)
    assert out.returncode == 0, report(out, tmp_path)
    assert (run_dir / "summary.json").is_file(), report(out, tmp_path)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["world_size"], summary["steps"]) == (4, 6), report(out, tmp_path)


def test_sbatch_reports_a_failing_job(slurm_env, tmp_path):
    # A deck that passes submit.py's checks but fails on the ranks: its data file does not exist.
    script = tmp_path / "job.sh"
    sets = ("--set", "data.kind=memmap", "--set", "data.path=/nonexistent/tokens",
            "--set", f"run.dir={tmp_path / 'run'}")  # fmt: skip
    made = submit(slurm_env, script, *sets)
    reason = "/nonexistent/tokens"
    if made.returncode != 0:
        # submit.py refuses it (it checks decks before writing): a hand-written job that fails the same way.
        script.write_text(
            "#!/bin/bash\n"
            f"#SBATCH -o {tmp_path}/slurm-%j.out\n"
            "#SBATCH -n 2\n"
            "#SBATCH -t 5\n"
            f"srun -n 2 {sys.executable} -m app /nonexistent.yaml\n"
        )
        reason = "/nonexistent.yaml"
    out = slurm_run(["sbatch", "--wait", "-J", JOB_NAME, str(script)], slurm_env, tmp_path, timeout=300)
    assert out.returncode != 0, report(out, tmp_path)
    logs = job_logs(tmp_path)
    # Rank 0 alone prints a user mistake as `gridlm: ...` (app/__main__.py); the user finds it in the job log.
    assert "gridlm:" in logs and reason in logs, report(out, tmp_path)

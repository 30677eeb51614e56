"""One job per run directory, end to end: a second `python -m app` on a run.dir that a running
job holds is refused at start (status 2, the holder named, nothing written), and the first
job finishes with a good checkpoint."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO, app_env, run_app


@pytest.mark.timeout(600)
def test_second_job_on_a_run_dir_is_refused_and_the_first_finishes_with_a_good_checkpoint(tmp_path):
    """The first job trains until the second has been refused, then is stopped by SIGUSR1 through
    mpirun (a checkpoint, exit 0): it needs no fixed number of steps to outlast the second."""
    run_dir = tmp_path / "run"
    sets = ["--set", f"run.dir={run_dir}", "--set", "run.log_every=1", "--set", "checkpoint.every=5"]
    first = subprocess.Popen(
        ["mpirun", "-n", "2", sys.executable, "-m", "app", "inputs/gpt_tiny.yaml", "--set", "train.steps=5000", *sets],
        cwd=REPO, env=app_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        metrics = run_dir / "metrics.jsonl"
        deadline = time.monotonic() + 300
        while not (metrics.exists() and metrics.read_text().strip()):  # the first job is training
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()[0][-3000:]
            time.sleep(0.2)
        before = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file() and p.name != "metrics.jsonl"}
        second = run_app(2, "inputs/gpt_tiny.yaml", "--set", "train.steps=3", *sets)
        after = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file() and p.name != "metrics.jsonl"}
        # Only while the first job still runs does `after` speak of the refused job alone (at its
        # end the first job writes summary.json).
        still_training = first.poll() is None
        first.send_signal(signal.SIGUSR1)  # checkpoint after the current step and exit 0
        out, _ = first.communicate(timeout=400)
    finally:
        if first.poll() is None:
            first.kill()
    assert second.returncode == 2, second.stdout + second.stderr
    assert "is in use by job" in second.stderr and "wait for it to finish" in second.stderr, second.stderr
    assert "Traceback" not in second.stdout + second.stderr
    assert still_training, "the first job ended before the second was refused: raise its train.steps"
    assert after == before  # deck.yaml and the lock file untouched by the refused job
    assert first.returncode == 0 and "SIGUSR1 received: stopped after step" in out, out[-3000:]
    latest = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
    check = subprocess.run(
        [sys.executable, "-m", "app.checkpoint", "inspect", str(latest)],
        cwd=REPO, env=app_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    stopped = int(latest.stem.split("_")[1])
    assert check.returncode == 0 and 1 <= stopped < 5000, check.stdout + check.stderr
    assert "mismatch" not in check.stdout and " ok" in check.stdout
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, stopped + 1))  # one job's records only, not interleaved with the refused one's


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=pytest.mark.full) for n in (".gridlm.lock", "deck.yaml")]
    + ["metrics.jsonl", "checkpoints/latest"],
)
def test_a_symlink_planted_where_gridlm_writes_is_refused_and_its_target_untouched(tmp_path, name):
    """Pre-planted symlinks named like gridlm's own files in run.dir and checkpoint.dir made a run
    overwrite their targets. Now the run refuses at start, naming the link (exit 2), and the
    target keeps its bytes; the run directory itself may be a link."""
    target = tmp_path / "precious.txt"
    target.write_text("keep me\n")
    real = tmp_path / "real"
    (real / "checkpoints").mkdir(parents=True)
    (real / name).symlink_to(target)
    run_dir = tmp_path / "linked_run"
    run_dir.symlink_to(real, target_is_directory=True)  # a link to the run directory is fine
    out = run_app(1, "inputs/gpt_tiny.yaml", "--set", f"run.dir={run_dir}", "--set", "train.steps=1")
    assert out.returncode == 2, out.stdout + out.stderr
    assert f"holds {run_dir / name}, a symbolic link to '{target}'" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
    assert target.read_text() == "keep me\n"

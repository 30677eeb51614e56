"""Every `python -m app.*` entry point treats bad input as `python -m app` does: a missing file, a
file of the wrong kind and an unknown flag each end in exit status 2 with one message naming the
file or the flag, and no traceback. Under mpirun (the MPI entry points), the message is printed
once, by rank 0, and every rank exits 2."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import REPO, app_env, run_mpi

MISSING = "/nonexistent/gridlm-test-input"
# Each entry point: the arguments for a missing file, for a wrong file (WRONG is replaced by the
# path of a file of junk bytes), and the arguments an unknown flag is added to. `mpi`: run the
# missing-file case under mpirun -n 2.
ENTRY_POINTS = {
    "app": dict(missing=[f"{MISSING}.yaml"], wrong=["WRONG.yaml", "--dry-run", "--world-size", "1"],
                flag=["inputs/gpt_tiny.yaml", "--dry-run"], mpi=True),
    "app.generate": dict(missing=[f"{MISSING}.h5", "--prompt", "hi"], wrong=["WRONG.h5", "--prompt", "hi"],
                         flag=[f"{MISSING}.h5", "--prompt", "hi"], mpi=True),
    "app.memorization": dict(missing=[f"{MISSING}.h5", "--data", "x"], wrong=["WRONG.h5", "--data", "x"],
                             flag=[f"{MISSING}.h5", "--data", "x"], mpi=True),
    "app.eval": dict(missing=["inputs/gpt_tiny.yaml", "--checkpoint", f"{MISSING}.h5"],
                     wrong=["inputs/gpt_tiny.yaml", "--checkpoint", "WRONG.h5"],
                     flag=["inputs/gpt_tiny.yaml", "--checkpoint", f"{MISSING}.h5"], mpi=True),
    "app.checkpoint": dict(missing=["inspect", f"{MISSING}.h5"], wrong=["inspect", "WRONG.h5"],
                           flag=["inspect", f"{MISSING}.h5"], mpi=False),
    "app.plan.calibrate": dict(missing=["--base", f"{MISSING}.yaml"], wrong=["--base", "WRONG.yaml"], flag=[],
                               mpi=True),
    "app.data.prepare": dict(missing=[f"{MISSING}.txt", "--out", "OUT"],
                             wrong=["README.md", "--out", "OUT", "--tokenizer", "WRONG.json"],
                             flag=["README.md", "--out", "OUT"], mpi=True),
}  # fmt: skip


def _args(args: list[str], tmp_path) -> list[str]:
    out = []
    for a in args:
        if a.startswith("WRONG"):
            path = tmp_path / a.replace("WRONG", "wrong")
            path.write_bytes(b"\x89not what you think\x00\xff\n" * 8)
            a = str(path)
        out.append(str(tmp_path / "out" / "t") if a == "OUT" else a)
    return out


def _one_line_exit_2(out: subprocess.CompletedProcess, names: str) -> None:
    text = out.stdout + out.stderr
    assert out.returncode == 2, text
    assert "Traceback" not in text, text
    lines = [line for line in out.stderr.splitlines() if line.startswith("gridlm: ")]
    assert len(lines) == 1 and names in lines[0], out.stderr


# The MPI entry points' missing-file case runs under mpirun below.
CASES = [
    (m, c) for m in sorted(ENTRY_POINTS) for c in ("missing", "wrong") if c == "wrong" or not ENTRY_POINTS[m]["mpi"]
]


@pytest.mark.parametrize("module, case", CASES)
def test_a_missing_or_wrong_file_is_one_line_and_exit_2(module, case, tmp_path):
    args = _args(ENTRY_POINTS[module][case], tmp_path)
    named = next(a for a in args if a.startswith((MISSING, str(tmp_path / "wrong"))))
    out = subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, env=app_env(), capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    _one_line_exit_2(out, named)


@pytest.mark.parametrize("module", sorted(ENTRY_POINTS))
def test_an_unknown_flag_is_a_usage_error_exit_2(module, tmp_path):
    args = _args(ENTRY_POINTS[module]["flag"], tmp_path)
    out = subprocess.run([sys.executable, "-m", module, *args, "--bogus-flag"], cwd=REPO, env=app_env(),
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 2 and "Traceback" not in out.stdout + out.stderr, out.stdout + out.stderr
    assert "unrecognized arguments: --bogus-flag" in out.stderr, out.stderr


@pytest.mark.parametrize("module", sorted(m for m, e in ENTRY_POINTS.items() if e["mpi"]))
def test_under_mpirun_a_missing_file_is_printed_once_and_every_rank_exits_2(module, tmp_path):
    args = _args(ENTRY_POINTS[module]["missing"], tmp_path)
    out = run_mpi(2, sys.executable, "-m", module, *args, timeout=300)
    _one_line_exit_2(out, MISSING)


EXIT_NOW = """
import atexit, sys, threading, time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from mpi4py import MPI
from app.runtime.process import exit_now, start_up

out = Path(sys.argv[1]) / f"rank{MPI.COMM_WORLD.Get_rank()}"
with start_up():
    import gc
    assert not gc.isenabled()
assert gc.isenabled() and gc.get_freeze_count() > 0
atexit.register(lambda: out.with_suffix(".atexit").write_text("ran"))
def late():  # a background writer still busy when the body returns
    time.sleep(0.5)
    out.with_suffix(".thread").write_text("done")
threading.Thread(target=late).start()
pool = ThreadPoolExecutor(1)  # an executor nobody shut down: its idle worker must not hold the exit
pool.submit(int).result()
MPI.COMM_WORLD.Barrier()
sys.stdout.write(f"unflushed {MPI.COMM_WORLD.Get_rank()}")  # no newline: still in the buffer
exit_now(int(sys.argv[2]))
"""


@pytest.mark.parametrize("code", [0, 3])
def test_exit_now_keeps_what_a_normal_exit_does_under_mpirun(code, tmp_path):
    """app.runtime.process.exit_now, every entry point's end: under mpirun -n 2 each rank waits for its
    non-daemon thread, runs its atexit handlers, flushes stdout and finalises MPI (without that
    mpirun reports an improper exit and fails the job), and the job's status is the code given; an
    executor left running does not hold the exit (its idle worker is told to stop, as at a normal
    exit)."""
    script = tmp_path / "exit_now.py"
    script.write_text(EXIT_NOW)
    out = run_mpi(2, sys.executable, str(script), str(tmp_path), str(code), timeout=60)
    assert out.returncode == code, out.stdout + out.stderr
    assert "exiting improperly" not in out.stdout + out.stderr
    assert "unflushed 0" in out.stdout and "unflushed 1" in out.stdout, out.stdout
    for rank in (0, 1):
        assert (tmp_path / f"rank{rank}.atexit").read_text() == "ran"
        assert (tmp_path / f"rank{rank}.thread").read_text() == "done"


def test_under_cprofile_the_entry_point_exits_normally_and_the_profile_is_written(tmp_path):
    """exit_now skips the interpreter's teardown, where cProfile (and coverage) write their results:
    under a profiler an entry point exits the normal way, so `python -m cProfile -o FILE -m app` works."""
    prof = tmp_path / "app.prof"
    cmd = [sys.executable, "-m", "cProfile", "-o", str(prof), "-m", "app", "inputs/gpt_tiny.yaml", "--dry-run"]
    out = subprocess.run(cmd, cwd=REPO, env=app_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert prof.is_file() and prof.stat().st_size > 0

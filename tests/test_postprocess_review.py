"""Review of postprocess.scaling and postprocess.compare: faults found, each with its test (serial, no MPI)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from test_postprocess import read_csv, run_scaling, weak_study, write_manifest, write_run

from conftest import REPO


def test_a_pending_point_s_old_summary_is_not_its_result(tmp_path, capsys):
    """--run-local writes every point "pending" (no `since`) before it runs the first: a study run
    again (and stopped, or read while it runs) still holds the earlier run's summary.json in a pending
    point's run dir. That point has not run in this attempt: it is a gap, not the old numbers."""
    root = tmp_path / "study"
    weak_study(root, (1, 2, 4))
    write_manifest(root, [(1, "ok"), (2, "interrupted"), (4, "pending")])
    out = tmp_path / "results"
    assert run_scaling(capsys, root, "--out", out)[0] == 0
    rows = read_csv(out / "scaling.csv")
    assert rows[2]["status"] == "missing (pending: not run yet); its summary.json is from an earlier attempt"
    assert rows[2]["tokens_per_s"] == "" and rows[2]["efficiency_pct"] == ""


def without_matplotlib(module: str, *args: object, cwd: Path) -> subprocess.CompletedProcess[str]:
    """`python -m postprocess.<module> ARGS` in a Python that cannot import matplotlib (None in
    sys.modules is Python's own way to make an import fail), as after a plain `pip install .`:
    setup.py does not require it."""
    code = (f"import sys; sys.modules['matplotlib'] = None; from postprocess import {module}; "
            f"sys.exit({module}.main(sys.argv[1:]))")  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], cwd=cwd, capture_output=True, text=True,
                          env=env)  # fmt: skip


def test_without_matplotlib_the_tables_are_written_and_the_missing_figures_said(tmp_path):
    """Found in review: without matplotlib (not in setup.py's requirements) scaling died in a traceback
    after scaling.csv and scaling.md, before summary.json, and compare before its errors.md."""
    dirs = weak_study(tmp_path / "runs", (1, 2))
    out = tmp_path / "results"
    done = without_matplotlib("scaling", *dirs, "--out", out, cwd=tmp_path)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith("scaling: warning: matplotlib is not installed") and done.stderr.count("\n") == 1
    assert "pip install matplotlib" in done.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["files"] == ["scaling.csv", "scaling.md", "summary.json"]
    assert any("matplotlib is not installed" in n for n in summary["notes"])
    assert "matplotlib is not installed" in (out / "scaling.md").read_text()
    assert not list(out.glob("*.png"))

    published = tmp_path / "paper.csv"
    published.write_text("gpus,tflops_per_gpu\n1,0.6\n2,0.6\n")
    cmp = tmp_path / "compare"
    done = without_matplotlib("compare", out, "--published", published, "--out", cmp, cwd=tmp_path)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith("compare: warning: matplotlib is not installed") and done.stderr.count("\n") == 1
    assert (cmp / "compare.csv").is_file() and (cmp / "errors.md").is_file() and not list(cmp.glob("*.png"))


def test_a_parent_of_runs_or_a_manifest_read_from_elsewhere_is_named_as_such(tmp_path, capsys):
    """Found in review: the directory holding a study's run directories (runs/<study>/), given instead of
    them, was read as one failed run, "none of the 1 run(s) ... has a summary.json"; and a manifest read
    from another working directory (its run_dir paths are relative to where launch.study ran) said that
    none of its runs has a summary.json, though none of their directories was found."""
    dirs = weak_study(tmp_path / "runs" / "s", (1, 2))
    rc, _, err = run_scaling(capsys, tmp_path / "runs" / "s", "--out", tmp_path / "o")
    assert rc == 2 and err.count("\n") == 1, err
    assert (
        f"{tmp_path / 'runs' / 's'} holds no summary.json or manifest.json itself, but 2 of its subdirectories" in err
    )
    assert f"pass those instead (run directories, or a study's directory): {dirs[0]} {dirs[1]}" in err

    jobs = tmp_path / "jobs"
    jobs.mkdir()
    points = [{"point": n, "nodes": 1, "ranks": n, "run_dir": f"runs/s/s_{n}", "status": "written"} for n in (1, 2)]
    (jobs / "manifest.json").write_text(json.dumps({"study": "s", "kind": "weak", "points": points}))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    cmd = [sys.executable, "-m", "postprocess.scaling", str(jobs), "--out", str(tmp_path / "o")]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(cmd, cwd=elsewhere, capture_output=True, text=True, env=env)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "none of the 2 run directories of study 's' exists" in done.stderr
    assert "relative to the directory launch.study ran in" in done.stderr
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, env=env)  # where it ran: found
    assert done.returncode == 0, done.stderr


def test_a_weak_study_whose_work_per_gpu_differs_says_so(tmp_path, capsys):
    """Found in review: strong scaling warns when its points do not share one problem, weak scaling said
    nothing when the same model's points do not share the work per GPU (a study file without
    scale.global_batch, or a point run again with another batch): its "efficiency" then compares a
    fixed batch spread over more GPUs, a strong study, and read as poor weak scaling."""
    fixed = [write_run(tmp_path, n, 100.0 * n**0.5, tokens_per_step=1000) for n in (1, 2, 4)]
    rc, stdout, _ = run_scaling(capsys, *fixed, "--out", tmp_path / "o")
    assert rc == 0
    warning = "warning: weak scaling keeps the work per GPU, but the tokens per step per GPU differ: 250, 500, 1000"
    assert warning in stdout and warning in (tmp_path / "o" / "scaling.md").read_text()
    # A proper weak study (the batch grows with the GPUs) has no such note.
    rc, stdout, _ = run_scaling(capsys, *weak_study(tmp_path / "w"), "--out", tmp_path / "w_o")
    assert rc == 0 and "warning" not in stdout

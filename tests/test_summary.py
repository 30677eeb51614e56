"""summary.json has one schema (app/metrics/summary.py): the trainer writes through it,
postprocess reads through it, and reading it needs no torch."""

from __future__ import annotations

import ast
import json
import subprocess
import sys

import pytest

from app.metrics.summary import REQUIRED_KEYS, Summary
from conftest import REPO, run_app

TINY = "inputs/gpt_tiny.yaml"
FAST = (
    "--set", "model.layers=2", "--set", "model.hidden=64", "--set", "model.seq_len=32",
    "--set", "train.steps=3", "--set", "train.global_batch=4", "--set", "train.micro_batch=2",
    "--set", "optim.warmup_steps=1", "--set", "checkpoint.at_exit=false",
)  # fmt: skip


def test_the_schema_has_exactly_the_keys_of_a_real_runs_summary_in_file_order(tmp_path):
    out = run_app(1, TINY, *FAST, "--set", f"run.dir={tmp_path}")
    assert out.returncode == 0, out.stdout + out.stderr
    written = json.loads((tmp_path / "summary.json").read_text())
    assert list(written) == Summary.file_keys()
    read = Summary.from_dict(written)
    assert read.to_dict() == written  # every key read back, none dropped or added
    assert read.world_size == 1 and read.steps == 3 and read.timers is not None
    assert set(REQUIRED_KEYS) <= set(Summary.file_keys())


def test_a_summary_without_a_required_key_is_refused_naming_it():
    assert Summary.missing_keys([1, 2]) == list(REQUIRED_KEYS)
    with pytest.raises(ValueError, match="lacks world_size, tokens_per_s$"):
        Summary.from_dict({k: 1 for k in REQUIRED_KEYS if k not in ("world_size", "tokens_per_s")})


def test_a_partial_summary_reads_with_none_for_what_it_lacks_and_keeps_nonfinite():
    data = {k: 1 for k in REQUIRED_KEYS} | {"future_key": 5, "final_loss": None, "nonfinite": ["final_loss"]}
    s = Summary.from_dict(data)
    assert s.deck is None and s.final_loss is None and s.nonfinite == ["final_loss"]
    assert "future_key" not in s.to_dict() and s.to_dict()["nonfinite"] == ["final_loss"]


def test_the_schema_and_postprocess_import_without_torch():
    code = (
        "import sys, app.metrics.summary, postprocess.scaling, postprocess.compare; "
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'mpi4py', 'h5py', 'numpy')); "
        "assert not heavy, heavy"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_postprocess_imports_nothing_from_app_but_the_schema():
    for path in sorted((REPO / "postprocess").glob("*.py")):
        tree = ast.parse(path.read_text())
        modules = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        modules |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        from_app = sorted(m for m in modules if m == "app" or m.startswith("app."))
        assert from_app in ([], ["app.metrics.summary"]), f"{path.name} imports {from_app}"


def test_a_run_dir_that_cannot_take_metrics_or_the_summary_ends_the_job_naming_it(tmp_path):
    """Found in review (2026-11-30): rank 0's write of metrics.jsonl or summary.json on a full (or
    otherwise failing) run.dir was an internal error with a traceback, exit 1, its peers left in a
    collective. It is this rank's fatal error (the job ends now, exit 2), naming the file and the
    fix. Real OSErrors: the files' names taken by directories."""
    from app.errors import RankFatal
    from app.metrics.report import MetricsWriter, write_summary

    writer = MetricsWriter(tmp_path, enabled=True)
    (tmp_path / "metrics.jsonl").unlink()
    (tmp_path / "metrics.jsonl").mkdir()
    with pytest.raises(RankFatal, match=r"cannot write .*metrics.jsonl: Is a directory; free space in") as err:
        writer.write({"step": 1, "loss": 1.0})
    assert err.value.exit_code == 2
    with pytest.raises(RankFatal, match=r"cannot write .*metrics.jsonl"):
        writer.truncate(None)
    (tmp_path / "summary.json.tmp").mkdir()
    with pytest.raises(RankFatal, match=r"cannot write .*summary.json: Is a directory.*run.resume: auto"):
        write_summary(tmp_path, {"steps": 1})


def test_a_fresh_run_in_a_used_run_dir_shows_only_its_own_tensorboard_curve(tmp_path):
    """Found in review (2026-11-30): metrics.jsonl starts afresh for a run that does not resume, but
    TensorBoard kept the earlier run's events in <run.dir>/tb and drew both curves."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from app.metrics.report import TensorBoardWriter

    for loss in (5.0, 3.0):  # two runs, the second not resumed
        writer = TensorBoardWriter(tmp_path, enabled=True)
        for step in (1, 2):
            writer.write({"step": step, "loss": loss + step})
        writer.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 4.0), (2, 5.0)]

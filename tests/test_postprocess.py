"""postprocess.scaling and postprocess.compare on synthetic run directories (serial, no MPI)."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

import pytest

from conftest import REPO, run_app
from postprocess import compare, scaling

PNG = b"\x89PNG\r\n\x1a\n"
MEGATRON = REPO / "inputs" / "published" / "megatron_sc21_table1.csv"
FLOPS_KIND = "model FLOPs (tflops_per_rank, mfu): Megatron SC21 count, full (not causally halved) attention"


def write_run(
    root: Path,
    gpus: int,
    tokens_per_s: float,
    *,
    tokens_per_step: int,
    study: Optional[str] = "s",
    kind: Optional[str] = "weak",
    peak: Optional[float] = None,
    flops_per_token: float = 6e9,
) -> Path:
    """A finished run: summary.json as app/train.py writes it, and a metrics.jsonl whose step 1
    is a slow warm-up step and steps 2-4 take 0.98, 1.02 and 1.0 x the mean step time."""
    run_dir = root / f"{study or 'run'}_{gpus}"
    run_dir.mkdir(parents=True)
    step_time = tokens_per_step / tokens_per_s
    flops = flops_per_token * tokens_per_step
    tflops = flops / step_time / gpus / 1e12
    summary = {
        "world_size": gpus, "nodes": (gpus + 3) // 4, "ranks_per_node": min(gpus, 4),
        "grid": {"tp": 1, "pp": 1, "dp": gpus, "order": "tp-pp-dp"}, "parameters": 125_000_000,
        "global_batch": tokens_per_step // 100, "tokens_per_step": tokens_per_step, "steps": 4,
        "start_step": 0, "step_time_s": step_time, "step_time_std_s": 0.02 * step_time, "timing_warmup_steps": 1,
        "tokens_per_s": tokens_per_s, "flops_per_step": flops, "hardware_flops_per_step": flops,
        "flops_kind": FLOPS_KIND, "tflops_per_rank": tflops, "hw_tflops_per_rank": tflops,
        "aggregate_tflops": tflops * gpus, "aggregate_pflops": tflops * gpus / 1e3,
        "device": "cpu" if peak is None else "NVIDIA A100-SXM4-80GB", "peak_tflops_per_rank": peak,
        "mfu": None if peak is None else tflops / peak, "precision": "bf16", "interrupted": None,
        "study": None if study is None else {"name": study, "kind": kind, "point": gpus},
    }  # fmt: skip
    (run_dir / "summary.json").write_text(json.dumps(summary))
    lines = [{"step": s, "step_time_s": f * step_time, "tokens_per_s": tokens_per_step / (f * step_time)}
             for s, f in ((1, 5.0), (2, 0.98), (3, 1.02), (4, 1.0))]  # fmt: skip
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return run_dir


def weak_study(root: Path, gpus: tuple[int, ...] = (1, 2, 4, 8)) -> list[Path]:
    """Per-GPU throughput 100, 95, 90, 80 tokens/s at 1, 2, 4, 8 GPUs; the batch grows with N."""
    per_gpu = {1: 100.0, 2: 95.0, 4: 90.0, 8: 80.0}
    return [write_run(root, n, per_gpu[n] * n, tokens_per_step=1000 * n) for n in gpus]


def strong_study(root: Path, peak: Optional[float] = None) -> list[Path]:
    """One problem (1000 tokens per step) at 1, 2, 4 GPUs: 100, 190, 340 tokens/s."""
    return [write_run(root, n, t, tokens_per_step=1000, study="st", kind="strong", peak=peak)
            for n, t in ((1, 100.0), (2, 190.0), (4, 340.0))]  # fmt: skip


def write_manifest(root: Path, points: list[tuple[int, str]], kind: str = "weak") -> Path:
    """manifest.json as launch/study.py writes it; run dirs are root/s_<gpus>."""
    manifest = {
        "study": "s", "kind": kind, "machine": "local", "base": "inputs/gpt_tiny.yaml", "devices_per_node": 4,
        "points": [{"point": n, "nodes": (n + 3) // 4, "ranks": n, "run_dir": str(root / f"s_{n}"), "script": None,
                    "status": status, "overrides": []} for n, status in points],
    }  # fmt: skip
    (root / "manifest.json").write_text(json.dumps(manifest))
    return root / "manifest.json"


def edit_summary(run_dir: Path, **values: Any) -> Path:
    """Set keys of a run's summary.json; its path."""
    path = run_dir / "summary.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **values}))
    return path


def read_csv(path: Path) -> list[dict[str, str]]:
    return list(csv.DictReader(path.read_text().splitlines()))


def column(rows: list[dict[str, str]], key: str) -> list[Optional[float]]:
    return [float(r[key]) if r[key] else None for r in rows]


def assert_close(got: list[Optional[float]], want: list[Optional[float]]) -> None:
    assert len(got) == len(want), (got, want)
    for g, w in zip(got, want):
        assert (g is None and w is None) or abs(g - w) < 1e-9, (got, want)


def assert_figures(out: Path, *stems: str) -> None:
    for stem in stems:
        png, pdf = out / f"{stem}.png", out / f"{stem}.pdf"
        assert png.read_bytes().startswith(PNG), png
        assert pdf.read_bytes().startswith(b"%PDF"), pdf


def run_scaling(capsys: Any, *args: Any) -> tuple[int, str, str]:
    rc = scaling.main([str(a) for a in args])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


# --- scaling: numbers, tables, figures ---------------------------------------------------------


def test_weak_efficiency_is_per_gpu_tokens_per_s_relative_to_the_smallest_point(tmp_path, capsys):
    dirs = weak_study(tmp_path / "runs")
    out = tmp_path / "results"
    rc, stdout, _ = run_scaling(capsys, *reversed(dirs), "--out", out)  # any order: sorted by GPUs
    assert rc == 0
    rows = read_csv(out / "scaling.csv")
    assert list(rows[0]) == scaling.COLUMNS
    assert [r["gpus"] for r in rows] == ["1", "2", "4", "8"]
    assert [r["nodes"] for r in rows] == ["1", "1", "1", "2"]
    assert [r["grid"] for r in rows] == ["tp1 x pp1 x dp1", "tp1 x pp1 x dp2", "tp1 x pp1 x dp4", "tp1 x pp1 x dp8"]
    assert_close(column(rows, "tokens_per_s_per_gpu"), [100, 95, 90, 80])
    assert_close(column(rows, "efficiency_pct"), [100, 95, 90, 80])
    assert [r["speedup"] for r in rows] == ["", "", "", ""]
    assert [r["mfu_pct"] for r in rows] == ["", "", "", ""]  # a CPU: peak unknown
    assert [r["status"] for r in rows] == ["ok"] * 4
    # The spread leaves out the warm-up step 1: min-max of 0.98, 1.02, 1.0 x the mean.
    step_times = [1000 / g for g in (100, 95, 90, 80)]  # tokens per step / tokens/s
    assert_close(column(rows, "step_time_s"), step_times)
    assert_close(column(rows, "step_time_lo_s"), [0.98 * t for t in step_times])
    assert_close(column(rows, "step_time_hi_s"), [1.02 * t for t in step_times])
    assert rows[0]["spread"] == "min-max of 3"

    md = (out / "scaling.md").read_text()
    assert "FLOP convention: model FLOPs (tflops_per_rank, mfu): Megatron SC21 count" in md
    assert "weak-scaling efficiency = per-GPU throughput at N GPUs / per-GPU throughput" in md
    assert "per-GPU throughput here is tokens/s per GPU" in md
    assert "Baseline: the 1-GPU point (the smallest with a result)." in md
    assert "| 8 | 2 | 8 | tp1 x pp1 x dp8 | 12.5 ± 0.25 | 12.25-12.75 (min-max of 3) | 640 |" in md
    assert md.count("| n/a |") == 4 and "| 80.0 | ok |" in md
    summary = json.loads((out / "summary.json").read_text())
    assert summary["kind"] == "weak" and summary["study"] == "s" and summary["baseline"]["gpus"] == 1
    assert summary["efficiency_basis"] == "tokens/s per GPU"
    assert_close([r["efficiency_pct"] for r in summary["rows"]], [100, 95, 90, 80])
    assert sorted(summary["files"]) == sorted(["scaling.csv", "scaling.md", "summary.json", "weak_efficiency.png",
                                               "weak_efficiency.pdf", "pflops.png", "pflops.pdf"])  # fmt: skip
    assert_figures(out, "weak_efficiency", "pflops")
    assert not (out / "strong_speedup.png").exists()
    assert "| point | nodes | GPUs | grid |" in stdout and "wrote " in stdout and "pflops.pdf" in stdout


def test_strong_speedup_is_the_tokens_per_s_ratio_and_efficiency_divides_by_the_gpu_ratio(tmp_path, capsys):
    dirs = strong_study(tmp_path / "runs", peak=312.0)
    out = tmp_path / "results"
    rc, stdout, _ = run_scaling(capsys, *dirs, "--out", out, "--title", "Strong scaling, 1000 tokens")
    assert rc == 0
    rows = read_csv(out / "scaling.csv")
    assert_close(column(rows, "speedup"), [1.0, 1.9, 3.4])
    assert_close(column(rows, "efficiency_pct"), [100, 95, 85])
    # Same problem: the speedup is also the step-time ratio.
    times = column(rows, "step_time_s")
    assert_close([times[0] / t for t in times], [1.0, 1.9, 3.4])
    tflops = column(rows, "tflops_per_gpu")
    assert_close(column(rows, "mfu_pct"), [100 * t / 312.0 for t in tflops])
    assert_close(column(rows, "aggregate_pflops"), [t * n / 1e3 for t, n in zip(tflops, (1, 2, 4))])
    md = (out / "scaling.md").read_text()
    assert md.startswith("# Strong scaling, 1000 tokens")
    assert "speedup = tokens/s at N GPUs / tokens/s at the baseline's N0 GPUs" in md
    assert "| speedup | efficiency (%) | status |" in md and "| 3.40 | 85.0 | ok |" in md
    assert "n/a" not in md
    assert_figures(out, "strong_speedup", "pflops")
    assert not (out / "weak_efficiency.png").exists()
    assert "Strong scaling, 1000 tokens" in stdout


def test_spread_is_p10_p90_from_ten_logged_steps_on():
    assert scaling.step_time_spread([3.0, 1.0, 2.0]) == (1.0, 3.0, "min-max of 3")
    lo, hi, which = scaling.step_time_spread([float(v) for v in range(11, 0, -1)])
    assert abs(lo - 2.0) < 1e-12 and abs(hi - 10.0) < 1e-12 and which == "p10-p90 of 11"
    assert scaling.step_time_spread([]) is None


def test_a_weak_study_whose_model_grows_compares_model_flops_per_gpu(tmp_path):
    # The same tokens/s per GPU, but the 2-GPU point's model does 1.5x the FLOPs per token.
    runs = [write_run(tmp_path, 1, 100.0, tokens_per_step=1000),
            write_run(tmp_path, 2, 200.0, tokens_per_step=2000, flops_per_token=9e9)]  # fmt: skip
    study = scaling.load_studies([str(d) for d in runs], None)[0]
    rows, baseline = scaling.scaling_rows(study.runs, study.kind)
    assert baseline["basis"].startswith("model TFLOP/s per GPU")
    assert_close([r["efficiency_pct"] for r in rows], [100.0, 150.0])


# --- scaling: missing and failed points ---------------------------------------------------------


def test_missing_and_failed_points_are_gaps_that_leave_the_other_efficiencies_alone(tmp_path, capsys):
    root = tmp_path / "study"
    weak_study(root, (1, 2, 4))
    failed = root / "s_8"  # started (deck.yaml written), died before summary.json
    failed.mkdir()
    (failed / "deck.yaml").write_text(
        "run: {study: s, study_kind: weak, study_point: 8}\nparallel: {tp: 2, pp: 1, dp: 4}\n"
    )
    write_manifest(root, [(1, "ok"), (2, "ok"), (4, "ok"), (8, "failed"), (16, "not run")])
    out = tmp_path / "results"
    rc, stdout, _ = run_scaling(capsys, root, "--out", out)  # the directory holding manifest.json
    assert rc == 0
    rows = read_csv(out / "scaling.csv")
    assert [r["gpus"] for r in rows] == ["1", "2", "4", "8", "16"]
    assert [r["status"] for r in rows] == ["ok", "ok", "ok", "failed (no summary.json)", "missing (not run)"]
    assert rows[3]["grid"] == "tp2 x pp1 x dp4" and rows[4]["nodes"] == "4"
    assert_close(column(rows, "efficiency_pct"), [100, 95, 90, None, None])
    assert rows[3]["tokens_per_s"] == "" and rows[4]["aggregate_pflops"] == ""
    md = (out / "scaling.md").read_text()
    assert "| 8 | 2 | 8 | tp2 x pp1 x dp4 | - | - | - | - | - | - | - | failed (no summary.json) |" in md
    assert "| 16 | 4 | 16 | - |" in md and "missing (not run) |" in md
    assert "- no result at point 16 (16 GPUs): missing (not run)" in md
    assert "no result at point 8 (8 GPUs): failed (no summary.json)" in stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["machine"] == "local" and len(summary["rows"]) == 5
    assert any("point 16" in n for n in summary["notes"])
    assert_figures(out, "weak_efficiency", "pflops")
    # The gaps break the lines: x holds every planned point, y is NaN at the gaps.
    x, y = scaling.series(summary["rows"], "efficiency_pct")
    assert x == [1, 2, 4, 8, 16] and y[:3] == pytest.approx([100, 95, 90]) and all(v != v for v in y[3:])


def test_an_earlier_attempt_s_summary_is_not_a_failed_point_s_result(tmp_path, capsys):
    """A point run again in its run dir that fails before writing summary.json (a deck or data
    error) leaves the earlier attempt's summary there: the manifest's `since` (when this attempt
    began) dates it, and the point is a gap, not the old numbers. Without `since` (an older
    manifest) a failed point's summary is not trusted either. A job point whose run wrote deck.yaml
    but no summary is incomplete, not "not run"; a fresh summary of a point whose job then failed
    is its result, marked so."""
    import os
    import time

    root = tmp_path / "study"
    weak_study(root, (1, 2, 4, 8))
    path = write_manifest(root, [(1, "ok"), (2, "failed"), (4, "failed"), (8, "ok")])
    manifest = json.loads(path.read_text())
    now = time.time()
    for p in manifest["points"]:
        os.utime(Path(p["run_dir"]) / "summary.json", (now, now))
        p["since"] = now - 60  # each attempt began a minute before its summary ...
    manifest["points"][1]["since"] = now + 3600  # ... but point 2's began an hour after: a stale summary
    del manifest["points"][2]["since"]  # point 4: an older manifest, failed, its summary undated
    path.write_text(json.dumps(manifest))
    out = tmp_path / "results"
    assert run_scaling(capsys, root, "--out", out)[0] == 0
    rows = read_csv(out / "scaling.csv")
    assert [r["status"] for r in rows] == [
        "ok", "failed (summary.json is from an earlier attempt)", "failed (summary.json is from an earlier attempt)", "ok"
    ]  # fmt: skip
    assert_close(column(rows, "efficiency_pct"), [100, None, None, 80])
    # Jobs: point 2's job started (deck.yaml after the script was written) and left no summary; point
    # 4's never ran; point 8 wrote its summary and then failed (an exit status in a run-local manifest).
    (root / "s_2" / "summary.json").unlink()
    (root / "s_4" / "summary.json").unlink()
    (root / "s_2" / "deck.yaml").write_text("parallel: {tp: 1, pp: 1, dp: 2}\n")
    manifest = json.loads(path.read_text())
    for p, status in zip(manifest["points"], ("ok", "written", "written", "failed")):
        p["status"], p["since"] = status, now - 60
    path.write_text(json.dumps(manifest))
    assert run_scaling(capsys, root, "--out", tmp_path / "jobs")[0] == 0
    rows = read_csv(tmp_path / "jobs" / "scaling.csv")
    assert [r["status"] for r in rows] == [
        "ok", "incomplete (the job started; no summary.json: failed or still running)",
        "missing (script written, not run)", "ok (then the job failed: see run.log)",
    ]  # fmt: skip
    assert rows[1]["grid"] == "tp1 x pp1 x dp2" and rows[3]["tokens_per_s"] != ""


def test_a_finished_point_launched_again_keeps_its_result(tmp_path, capsys):
    """Found in review: a finished point launched again resumes at its end, trains nothing and exits
    0 without a new summary.json, which was then older than the attempt and read as an earlier
    attempt's. The app marks the summary as this attempt's (its time), and a run-local point that
    exited 0 stands by its summary whatever its time. A summary stamped up to CLOCK_SKEW_S before the
    attempt (a file system's clock behind the launch host's) is the attempt's."""
    import os
    import time

    run_dir = tmp_path / "run"
    sets = (
        "--set",
        "train.steps=3",  # one more than run.timing_warmup: a step time without warm-up
        "--set",
        f"run.dir={run_dir}",
        "--set",
        "model.layers=1",
        "--set",
        "run.resume=auto",
    )
    first = run_app(1, "inputs/gpt_tiny.yaml", *sets)
    assert first.returncode == 0, first.stdout + first.stderr
    summary = run_dir / "summary.json"
    os.utime(summary, (time.time() - 3600, time.time() - 3600))  # written an hour before the next attempt
    since = time.time()
    again = run_app(1, "inputs/gpt_tiny.yaml", *sets)
    assert again.returncode == 0 and "nothing to train" in again.stdout + again.stderr, again.stdout + again.stderr
    assert summary.stat().st_mtime >= since - 1  # the app's mark: this attempt's result too
    for status in ("written", "ok"):
        if status == "ok":
            os.utime(summary, (since - 3600, since - 3600))  # an app from before the mark: the exit status says
        assert scaling.load_run(run_dir, status, since).status == "ok", status
    os.utime(summary, (since - 60, since - 60))  # a minute behind: clock skew, not an earlier attempt
    assert scaling.load_run(run_dir, "failed", since).status.startswith("ok")
    os.utime(summary, (since - 3600, since - 3600))
    assert scaling.load_run(run_dir, "failed", since).status == "failed (summary.json is from an earlier attempt)"


def test_a_study_whose_summaries_all_predate_its_attempts_says_so_and_how_to_use_them(tmp_path, capsys):
    """Found in review: when every point's summary.json is older than its attempt (`since`), scaling said
    "no summaries found ... has a summary.json", which was false; it says they are there, why they do
    not count, and the two ways on: run the points, or pass the run directories."""
    import time

    root = tmp_path / "study"
    dirs = weak_study(root, (1, 2))
    path = write_manifest(root, [(1, "written"), (2, "written")])
    manifest = json.loads(path.read_text())
    for p in manifest["points"]:
        p["since"] = time.time() + 3600  # the scripts were written after the summaries
    path.write_text(json.dumps(manifest))
    rc, _, err = run_scaling(capsys, root, "--out", tmp_path / "o")
    assert rc == 2 and err.count("\n") == 1, err
    assert "2 of the 2 run(s) of study 's' have a summary.json, but each is older than its point's attempt" in err
    assert (
        f"pass their run directories instead of the manifest: python -m postprocess.scaling {dirs[0]} {dirs[1]}" in err
    )
    assert "none of" not in err
    assert run_scaling(capsys, *dirs, "--out", tmp_path / "o")[0] == 0  # the way it names


def test_a_step_time_with_warm_up_in_it_is_shown_but_not_measured_against(tmp_path, capsys):
    """Found in review: the app leaves run.timing_warmup steps out of the mean only when the job timed
    more than that many, so a job resumed near its end (here: at step 8 of 9) or stopped after a step or
    two reported its warm-up as its step time, and the table called it "100.0 | ok". Such a row keeps
    its numbers but is marked, has no efficiency, is not the baseline nor in the figures, and a note
    says what to run. Rows that left their warm-up out (or whose deck asks for none) are unchanged."""
    root = tmp_path / "study"
    one, two, four = weak_study(root, (1, 2, 4))
    edit_summary(one, timing_warmup_steps=0, start_step=8, steps=9, deck={"run": {"timing_warmup": 2}})
    edit_summary(two, timing_warmup_steps=2, deck={"run": {"timing_warmup": 2}})  # left out: honest
    edit_summary(four, timing_warmup_steps=0, deck={"run": {"timing_warmup": 0}})  # none asked for: honest
    out = tmp_path / "results"
    rc, stdout, _ = run_scaling(capsys, one, two, four, "--out", out)
    assert rc == 0
    rows = read_csv(out / "scaling.csv")
    assert [r["status"] for r in rows] == ["warm-up in timing", "ok", "ok"]
    assert_close(column(rows, "efficiency_pct"), [None, 100, 100 * 90 / 95])
    assert rows[0]["tokens_per_s"] == "100.0"  # shown
    md = (out / "scaling.md").read_text()
    assert "| 1 | 1 | 1 | tp1 x pp1 x dp1 | 10 ± 0.2 |" in md and "| - | warm-up in timing |" in md
    assert (
        "Baseline: the 2-GPU point (the smallest with a result); the smallest planned point, 1 GPU, has no result" in md
    )
    note = ("- point 1 (1 GPU): its step time includes warm-up steps, so it has no efficiency and is not in the "
            "figures: the job timed 1 step(s), not more than run.timing_warmup = 2, so none was left out of the mean; "
            "train more than 2 steps in one job (here train.steps >= 11, as it starts at step 8)")  # fmt: skip
    assert note in md and note[2:] in stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["baseline"]["gpus"] == 2
    assert "no result: point 1 (1 GPU), warm-up in timing" in scaling.figure_gaps(summary["rows"])
    # Alone, no point can be measured against: said, not a table of warm-ups.
    rc, _, err = run_scaling(capsys, one, "--out", tmp_path / "alone")
    assert rc == 2 and err.startswith("scaling: no point has a step time without warm-up: ") and str(one) in err
    # compare sets nothing of it beside a published table.
    (row,) = compare.from_scaling_rows(summary["rows"][:1], "us", "x")
    assert row["tflops_per_gpu"] is None and row["pflops"] is None and row["status"] == "warm-up in timing"


def test_a_job_that_timed_only_its_warm_up_steps_says_so(tmp_path):
    """The same from a run of the app: 2 steps, with run.timing_warmup 2 (the default), as summary.json
    and deck.yaml write them."""
    run_dir = tmp_path / "run"
    done = run_app(1, "inputs/gpt_tiny.yaml", "--set", "train.steps=2", "--set", f"run.dir={run_dir}",
                   "--set", "model.layers=1", "--set", "checkpoint.every=0", "--set", "checkpoint.at_exit=false")  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    run = scaling.load_run(run_dir)
    assert run.status == "warm-up in timing"
    assert run.warmup.startswith("the job timed 2 step(s), not more than run.timing_warmup = 2")
    assert "train.steps >= 3" in run.warmup


def test_the_baseline_is_the_smallest_point_with_a_result_and_says_so(tmp_path, capsys):
    root = tmp_path / "study"
    weak_study(root, (2, 4, 8))
    write_manifest(root, [(1, "written"), (2, "ok"), (4, "ok"), (8, "ok")])
    out = tmp_path / "results"
    rc, stdout, _ = run_scaling(capsys, root / "manifest.json", "--out", out)
    assert rc == 0
    rows = read_csv(out / "scaling.csv")
    assert rows[0]["status"] == "missing (script written, not run)"
    assert_close(column(rows, "efficiency_pct"), [None, 100, 100 * 90 / 95, 100 * 80 / 95])
    note = "the 2-GPU point (the smallest with a result); the smallest planned point, 1 GPU, has no result"
    assert note in (out / "scaling.md").read_text() and note in stdout
    assert json.loads((out / "summary.json").read_text())["baseline"]["gpus"] == 2


def test_a_study_directory_copied_off_the_machine_is_found_next_to_its_manifest(tmp_path, capsys):
    root = tmp_path / "copied"
    weak_study(root, (1, 2))
    (root / "s_4").mkdir()  # killed by the user: launch/study.py says interrupted
    (tmp_path / "gone").mkdir()
    manifest = write_manifest(tmp_path / "gone", [(1, "ok"), (2, "ok"), (4, "interrupted"), (8, "pending")])
    manifest.rename(root / "manifest.json")  # run_dir paths point to tmp_path/gone/, which holds nothing now
    rc, _, _ = run_scaling(capsys, root / "manifest.json", "--out", tmp_path / "out")
    assert rc == 0
    rows = read_csv(tmp_path / "out" / "scaling.csv")
    assert [r["status"] for r in rows] == ["ok", "ok", "failed (interrupted, no summary.json)",
                                           "missing (pending: not run yet)"]  # fmt: skip
    assert_close(column(rows, "efficiency_pct"), [100, 95, None, None])


def test_a_run_dir_without_summary_given_alone_is_failed(tmp_path, capsys):
    dirs = weak_study(tmp_path, (1, 2))
    dead = tmp_path / "s_4"
    dead.mkdir()
    rc, _, _ = run_scaling(capsys, *dirs, dead, "--kind", "weak", "--out", tmp_path / "out")
    assert rc == 0
    rows = read_csv(tmp_path / "out" / "scaling.csv")
    assert rows[-1]["status"] == "failed (no summary.json)" and rows[-1]["gpus"] == ""


def test_several_studies_get_one_subdirectory_each(tmp_path, capsys):
    dirs = weak_study(tmp_path / "w") + strong_study(tmp_path / "st")
    rc, _, _ = run_scaling(capsys, *dirs, "--out", tmp_path / "out")
    assert rc == 0
    assert_figures(tmp_path / "out" / "s", "weak_efficiency", "pflops")
    assert_figures(tmp_path / "out" / "st", "strong_speedup", "pflops")


# --- scaling: errors ---------------------------------------------------------------------------


def test_errors_are_one_line_with_exit_status_2(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    rc, _, err = run_scaling(capsys, empty, "--out", tmp_path / "o")
    assert rc == 2 and err.startswith("scaling: no summaries found") and err.count("\n") == 1

    rc, _, err = run_scaling(capsys, tmp_path / "nowhere", "--out", tmp_path / "o")
    assert rc == 2 and "no such run directory or manifest" in err

    mixed = weak_study(tmp_path / "m", (1, 2)) + [write_run(tmp_path / "m", 4, 300.0, tokens_per_step=1000,
                                                            kind="strong")]  # fmt: skip
    rc, _, err = run_scaling(capsys, *mixed, "--out", tmp_path / "o")
    assert rc == 2 and "mixes weak and strong runs" in err and "s_4" in err

    bare = [write_run(tmp_path / "b", n, 100.0 * n, tokens_per_step=1000 * n, study=None) for n in (1, 2)]
    rc, _, err = run_scaling(capsys, *bare, "--out", tmp_path / "o")
    assert rc == 2 and "pass --kind weak or --kind strong" in err
    rc, _, _ = run_scaling(capsys, *bare, "--kind", "weak", "--out", tmp_path / "o")
    assert rc == 0 and (tmp_path / "o" / "scaling.csv").is_file()

    # --out an existing file (found in review: FileExistsError's traceback), for scaling and compare
    afile = tmp_path / "afile"
    afile.write_text("")
    rc, _, err = run_scaling(capsys, *bare, "--kind", "weak", "--out", afile)
    assert rc == 2 and err.startswith(f"scaling: cannot write --out {afile}: File exists") and err.count("\n") == 1
    published = tmp_path / "paper.csv"
    published.write_text("gpus,tflops_per_gpu\n1,90\n2,88\n")
    rc = compare.main([str(tmp_path / "o"), "--published", str(published), "--out", str(afile)])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith(f"compare: cannot write --out {afile}: File exists") and err.count("\n") == 1


def test_a_summary_that_is_not_json_is_named_without_a_traceback(tmp_path):
    run_dir = weak_study(tmp_path, (1,))[0]
    (run_dir / "summary.json").write_text('{"world_size": 1,')
    cmd = [sys.executable, "-m", "postprocess.scaling", str(run_dir), "--out", str(tmp_path / "o")]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 2
    assert done.stderr.startswith(f"scaling: {run_dir / 'summary.json'} is not valid JSON")
    assert "Traceback" not in done.stderr and done.stderr.count("\n") == 1


@pytest.mark.parametrize(
    "key, value, message",
    [("step_time_std_s", None, "step_time_std_s = None: expected a number >= 0"),
     ("world_size", "4", "world_size = '4': expected an integer >= 1"),
     ("tokens_per_s", 0, "tokens_per_s = 0: expected a number > 0"),
     ("grid", {"tp": 1, "pp": 1}, "grid = {'tp': 1, 'pp': 1}: expected {tp, pp, dp: integers >= 1}"),
     ("timing_warmup_steps", 1.5, "timing_warmup_steps = 1.5: expected an integer >= 0 or null"),
     ("deck", {"run": {"timing_warmup": "2"}}, "deck.run.timing_warmup = '2': expected an integer >= 0")],
)  # fmt: skip
def test_a_damaged_summary_value_is_named_without_a_traceback(tmp_path, capsys, key, value, message):
    """Found in review: scaling checked that summary.json's keys exist, not what they hold: a null
    std, a world size written as a string and a baseline of 0 tokens/s ended in tracebacks."""
    one, two = weak_study(tmp_path, (1, 2))
    path = edit_summary(one, **{key: value})
    rc, _, err = run_scaling(capsys, one, two, "--out", tmp_path / "o")
    assert rc == 2 and err.count("\n") == 1, err
    assert err.startswith(f"scaling: {path}: {message}"), err
    assert "mend the file" in err


# --- compare -----------------------------------------------------------------------------------


def test_compare_puts_our_hardware_flops_against_the_tables_which_count_recomputation():
    """Found in review (2026-11-30): the measured rows took model TFLOP/s and MFU, against Megatron SC21's
    table, which counts the recomputation's forward (hardware FLOPs): a full-recompute run read 25% low.
    Rows with hardware numbers use them; a results file from before keeps its model numbers."""
    row = {"gpus": 8, "parameters": 1e9, "tflops_per_gpu": 100.0, "hw_tflops_per_gpu": 133.0,
           "aggregate_pflops": 0.8, "mfu_pct": 30.0, "hfu_pct": 40.0, "efficiency_pct": 90.0, "status": "ok"}  # fmt: skip
    (new,) = compare.from_scaling_rows([row], "us", "x")
    assert (new["tflops_per_gpu"], new["pct_peak"]) == (133.0, 40.0) and new["pflops"] == pytest.approx(1.064)
    old = {k: v for k, v in row.items() if k not in ("hw_tflops_per_gpu", "hfu_pct")}
    (kept,) = compare.from_scaling_rows([old], "us", "x")
    assert (kept["tflops_per_gpu"], kept["pflops"], kept["pct_peak"]) == (100.0, 0.8, 30.0)
    # The axes say which (found in review the next session: hardware values were labelled model FLOPs / MFU).
    published = {"series": "paper", "status": "published"}
    assert compare.axis_label([new, published], "tflops_per_gpu") == "TFLOP/s per GPU (recompute counted)"
    assert compare.axis_label([new, published], "pct_peak") == "% of peak (HFU)"
    assert compare.axis_label([kept, published], "pflops") == "Aggregate PFLOP/s (model FLOPs)"
    assert compare.axis_label([kept, published], "pct_peak") == "% of peak (MFU)"
    assert "mixed" in compare.axis_label([new, kept], "tflops_per_gpu")
    # A failed point has no FLOPs either way: it does not make the label "mixed" (found in review)
    (gap,) = compare.from_scaling_rows([{"gpus": 16, "tflops_per_gpu": None, "aggregate_pflops": None, "mfu_pct": None,
                                         "efficiency_pct": None, "status": "failed (no summary.json)"}], "us", "x")  # fmt: skip
    assert compare.axis_label([new, gap], "tflops_per_gpu") == "TFLOP/s per GPU (recompute counted)"
    assert compare.axis_label([new], "efficiency_pct") == "Scaling efficiency (%)"


def test_compare_puts_a_study_next_to_megatron_sc21_table1(tmp_path, capsys):
    results = tmp_path / "results"
    assert scaling.main([*map(str, weak_study(tmp_path / "runs")), "--out", str(results)]) == 0
    out = tmp_path / "compare"
    rc = compare.main([str(results), "--published", str(MEGATRON), "--label", "gridlm CPU", "--out", str(out)])
    assert rc == 0
    rows = read_csv(out / "compare.csv")
    assert list(rows[0]) == compare.COLUMNS
    assert [r["series"] for r in rows] == ["gridlm CPU"] * 4 + ["Megatron-LM SC21 Table 1"] * 10
    published = rows[4:]
    assert [int(r["gpus"]) for r in published] == [32, 64, 128, 256, 512, 1024, 1536, 1920, 2520, 3072]
    assert column(published, "tflops_per_gpu") == [137, 138, 142, 135, 138, 140, 148, 155, 163, 163]
    assert column(published, "pflops")[-1] == 502.0 and column(published, "params_b")[-1] == 1008.0
    assert column(published, "pct_peak")[-1] == 52.0 and all(r["status"] == "published" for r in published)
    assert_close(column(rows[:4], "efficiency_pct"), [100, 95, 90, 80])
    assert_figures(out, "compare_tflops_per_gpu", "compare_pflops")
    # Megatron's table has no efficiency, and a CPU has no peak: nothing to put side by side.
    assert not (out / "compare_efficiency.png").exists() and not (out / "compare_pct_peak.png").exists()
    assert "compare_pflops.pdf" in capsys.readouterr().out


def test_compare_takes_run_dirs_and_plots_a_published_efficiency(tmp_path, capsys):
    published = tmp_path / "pub.csv"
    published.write_text("# made up\ngpus,efficiency,label\n1,100,paper\n2,97,paper\n4,,paper\n8,91,paper\n")
    dirs = weak_study(tmp_path / "runs")
    out = tmp_path / "compare"
    assert compare.main([*map(str, dirs), "--published", str(published), "--out", str(out)]) == 0
    rows = read_csv(out / "compare.csv")
    assert [r["series"] for r in rows] == ["s"] * 4 + ["paper"] * 4
    assert column(rows[4:], "efficiency_pct") == [100, 97, None, 91]
    assert_figures(out, "compare_efficiency")
    assert not (out / "compare_pflops.png").exists()

    published.write_text("gpus,speed\n1,2\n")
    assert compare.main([*map(str, dirs), "--published", str(published), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"compare: {published}: the header needs 'gpus' and any of") and err.count("\n") == 1


def test_compare_measures_against_each_published_series_and_names_it(tmp_path, capsys):
    """Found in review: the published rows were keyed by GPUs alone, so a CSV with two series measured
    ours against the last one only, and errors.md did not say which."""
    published = tmp_path / "pub.csv"
    published.write_text("gpus,tflops_per_gpu,label\n1,0.6,paper A\n2,0.6,paper A\n1,0.5,paper B\n2,0.5,paper B\n")
    dirs = weak_study(tmp_path / "runs", (1, 2))  # 0.6 and 0.57 TFLOP/s per GPU: 6e9 FLOPs x 100, 95 tokens/s
    out = tmp_path / "compare"
    assert compare.main([*map(str, dirs), "--published", str(published), "--out", str(out)]) == 0
    errors = (out / "errors.md").read_text()
    assert errors.startswith("| series | GPUs | metric | ours | published | error |\n")
    rows = [line.split(" | ") for line in errors.splitlines() if line.startswith("| paper")]
    assert [(r[0], r[1], r[4], r[5]) for r in rows] == [
        ("| paper A", "1", "0.6", "+0.0% |"), ("| paper A", "2", "0.6", "-5.0% |"),
        ("| paper B", "1", "0.5", "+20.0% |"), ("| paper B", "2", "0.5", "+14.0% |"),
    ]  # fmt: skip
    assert "paper A, tflops_per_gpu: mean absolute error" in errors
    assert "paper B, tflops_per_gpu: mean absolute error" in errors


def test_predicted_points_are_drawn_beside_the_measured_ones(tmp_path, capsys):
    """A predicted.json of the same study (launch.study --predict) adds predicted.md and a dashed
    line to the efficiency figure; the measured table and efficiencies are unchanged."""
    dirs = weak_study(tmp_path / "runs")
    points = [{"nodes": 1, "gpus": g, "grid": {"tp": 1, "pp": 1, "dp": g}, "step_time_s": 10.0 / e,
               "tflops_per_device": 50.0 * e, "mfu": 0.2 * e, "efficiency": e,
               "breakdown": {"gemm": 5.0, "dp_exposed": 1.0 / e, "recompute": 0.0}}
              for g, e in ((1, 1.0), (2, 0.97), (4, 0.93), (8, 0.85))]  # fmt: skip
    predicted = tmp_path / "predicted.json"
    predicted.write_text(json.dumps({"study": "s", "kind": "weak", "machine": "local", "points": points}))
    out = tmp_path / "results"
    rc, stdout, _ = run_scaling(capsys, *dirs, predicted, "--out", out)
    assert rc == 0
    assert_close(column(read_csv(out / "scaling.csv"), "efficiency_pct"), [100, 95, 90, 80])
    table = (out / "predicted.md").read_text()
    assert "| 8 | 1x1x8 |" in table and "| 85.0 | dp_exposed 1.18 s |" in table
    assert_figures(out, "weak_efficiency")


def test_the_predicted_curve_is_against_the_measured_baseline():
    """predicted.json's efficiencies and speedups are against its first point; the figure's axis is
    against the measured baseline (the smallest point with a result). When the smallest point
    failed, the predicted values are rescaled to the baseline's point: 100% (speedup 1) there."""
    weak = {"points": [{"gpus": 1, "efficiency": 1.0}, {"gpus": 2, "efficiency": 0.95}, {"gpus": 4, "efficiency": 0.9}]}
    x, y = scaling.predicted_series(weak, "weak", 2)
    assert x == [1, 2, 4] and y == pytest.approx([100 / 0.95, 100, 90 / 0.95])
    assert scaling.predicted_series(weak, "weak", 1)[1] == pytest.approx([100, 95, 90])
    assert scaling.predicted_series(weak, "weak", 8)[1] == pytest.approx([100, 95, 90])  # no predicted point there
    strong = {"points": [{"gpus": 1, "speedup": 1.0}, {"gpus": 2, "speedup": 1.9}, {"gpus": 4, "speedup": 3.4}]}
    assert scaling.predicted_series(strong, "strong", 2)[1] == pytest.approx([1 / 1.9, 1, 3.4 / 1.9])


def test_compare_puts_a_prediction_next_to_the_published_table(tmp_path, capsys):
    """launch.study --predict of selene_megatron (every row of Megatron SC21 Table 1) against the
    table: one point per row on each side, errors.md with the per-row error (the ±15% of
    tests/test_perf.py) and the mean."""
    from launch import study as study_cli

    out = tmp_path / "jobs"
    assert study_cli.main([str(REPO / "inputs/studies/selene_megatron.yaml"), "--predict", "--out", str(out)]) == 0
    rc = compare.main([str(out / "predicted.json"), "--published", str(MEGATRON), "--out", str(tmp_path / "cmp")])
    assert rc == 0
    rows = read_csv(tmp_path / "cmp" / "compare.csv")
    assert [r["gpus"] for r in rows if r["status"] == "predicted"] == [
        r["gpus"] for r in rows if r["status"] == "published"
    ]
    errors = (tmp_path / "cmp" / "errors.md").read_text()
    per_row = [float(line.split("|")[6].strip(" %+")) for line in errors.splitlines() if "| tflops_per_gpu |" in line]
    assert len(per_row) == 10 and max(abs(e) for e in per_row) <= 15.0
    assert "Megatron-LM SC21 Table 1, tflops_per_gpu: mean absolute error" in errors
    assert_figures(tmp_path / "cmp", "compare_tflops_per_gpu")


def test_a_failed_context_parallel_run_counts_its_cp_ranks(tmp_path):
    """Found in review (2026-11-30): a run without summary.json was placed at tp x pp x dp GPUs from its
    deck.yaml, leaving out cp (a tp1 cp2 pp1 dp2 run counted 2 GPUs, not 4), and grid labels omitted cp."""
    from postprocess.scaling import grid_label, load_run

    run_dir = tmp_path / "cpfail"
    run_dir.mkdir()
    (run_dir / "deck.yaml").write_text("parallel: {tp: 1, cp: 2, pp: 1, dp: 2}\nrun: {}\n")
    run = load_run(run_dir)
    assert run.gpus == 4 and run.grid == "tp1 x cp2 x pp1 x dp2", (run.gpus, run.grid)
    assert grid_label({"tp": 2, "pp": 1, "dp": 4}) == "tp2 x pp1 x dp4"  # cp 1 (and older files): as before

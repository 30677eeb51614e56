"""The benchmark scripts' own faults, serially and without real runs: a bad count, deck or --set
(and --device cuda without a GPU) is refused in one line with exit status 2 before any work; the
scripts that read a run's files find them whatever the caller's cwd; gpu_offload_check's `worst`
sees a NaN anywhere and a failed run fails its checks; medians and the alternation of the rounds."""

from __future__ import annotations

import csv
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from conftest import REPO

BENCH = REPO / "benchmarks"
sys.path.insert(0, str(BENCH))  # the scripts import grid_bench as their sibling

pytestmark = pytest.mark.timeout(120)


def script(name: str, *argv: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`python benchmarks/NAME.py ARGV` from `cwd` (not the repository: the scripts must not need it)."""
    return subprocess.run([sys.executable, str(BENCH / f"{name}.py"), *argv], cwd=cwd, capture_output=True,
                          text=True, timeout=110, env={**os.environ, **(env or {})}, check=False)  # fmt: skip


def complaint(done: subprocess.CompletedProcess) -> str:
    """The one line a refused run says, argparse's usage block left out; fails on a traceback, on
    another exit status than 2 or on more than one line."""
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == 2, (done.returncode, done.stdout[-2000:], done.stderr[-2000:])
    lines = [ln for ln in done.stderr.splitlines() if ln.strip() and not ln.startswith(("usage:", " "))]
    assert len(lines) == 1, done.stderr
    return lines[0]


def load(name: str) -> ModuleType:
    """benchmarks/NAME.py imported by path, as a module of its own."""
    spec = importlib.util.spec_from_file_location(f"{name}_under_test", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


BAD_COUNTS = [
    ("cp_bench", ["--ranks", "0"], "--ranks"),
    ("cp_bench", ["--kv-heads", "0"], "--kv-heads"),
    ("offload_bench", ["--rounds", "0"], "--rounds"),
    ("perf_model_bench", ["--rounds", "0"], "--rounds"),
    ("variant_bench", ["--rounds", "0", "--variant", "optim.zero=1"], "--rounds"),
    ("grid_bench", ["--rounds", "0"], "--rounds"),
    ("overlap_bench", ["--steps", "0"], "--steps"),
    ("tensor3d_bytes_bench", ["--rounds", "0"], "--rounds"),
    ("optimizer_bench", ["--rounds", "0"], "--rounds"),
    ("cp_memory_bench", ["--cp", "1", "0"], "--cp"),
    ("gpu_offload_check", ["--device", "cpu", "--steps", "0"], "--steps"),
]


@pytest.mark.parametrize("name, argv, flag", BAD_COUNTS, ids=[f"{n} {' '.join(a)}" for n, a, _ in BAD_COUNTS])
def test_a_count_below_one_is_refused_in_one_line_naming_the_flag(tmp_path, name, argv, flag):
    out = [] if name == "optimizer_bench" else ["--out", str(tmp_path / "out")]  # it writes no files
    line = complaint(script(name, *argv, *out, cwd=tmp_path))
    assert flag in line and "at least 1" in line, line
    assert not (tmp_path / "out").exists()  # refused before any work


BAD_DECKS = [
    ("tensor3d_bytes_bench", ["--set", "model.hidden=abc"], "model.hidden"),
    ("overlap_bench", ["--set", "model.hidden=abc"], "model.hidden"),
    ("overlap_bench", ["--deck", "inputs/no_such_deck.yaml"], "no_such_deck.yaml"),
    ("optimizer_bench", ["--set", "model.hidden=abc"], "model.hidden"),
    ("perf_model_bench", ["--set", "model.hidden=abc"], "model.hidden"),
    ("cp_memory_bench", ["--cp", "3", "--seq", "256"], "seq_len"),  # 256 is no multiple of 2 x 3
]


@pytest.mark.parametrize("name, argv, key", BAD_DECKS, ids=[f"{n} {' '.join(a)}" for n, a, _ in BAD_DECKS])
def test_a_bad_deck_or_set_is_refused_in_one_line_naming_the_key(tmp_path, name, argv, key):
    out = [] if name == "optimizer_bench" else ["--out", str(tmp_path / "out")]
    line = complaint(script(name, *argv, *out, cwd=tmp_path))
    assert key in line and line.startswith(f"{name}: "), line
    assert not (tmp_path / "out").exists()


def test_the_cp_benchmark_on_cuda_without_a_gpu_says_so_in_one_line(tmp_path):
    """Not one traceback per rank from mpirun: the check comes before launching (no GPU visible
    here, even on a machine with one)."""
    done = script("cp_bench", "--device", "cuda", "--out", str(tmp_path / "out"), cwd=tmp_path,
                  env={"CUDA_VISIBLE_DEVICES": ""})  # fmt: skip
    assert "CUDA" in complaint(done)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("where", range(3))
def test_worst_is_inf_for_a_value_that_is_not_finite_anywhere_in_either_curve(where):
    worst = load("gpu_offload_check").worst
    good = [5.0, 4.0, 3.0]
    assert worst(good, [5.0, 4.0, 3.3]) == pytest.approx(0.1 / 1.1)
    for bad in (math.nan, math.inf, -math.inf):
        curve = [bad if i == where else x for i, x in enumerate(good)]
        assert worst(curve, good) == math.inf and worst(good, curve) == math.inf, (where, bad)


def _fake_app(failing: dict[str, tuple[int, str]], losses: list[float]) -> Any:
    """A stand-in for `subprocess.run` of `python -m app`: writes what a run writes into run.dir,
    relative to its cwd as the app would, or fails as `failing[optim.offload]` says."""

    def run(cmd: list[str], cwd: Path, **_: Any) -> subprocess.CompletedProcess:
        sets = dict(cmd[i + 1].split("=", 1) for i, a in enumerate(cmd) if a == "--set")
        if sets["optim.offload"] in failing:
            code, message = failing[sets["optim.offload"]]
            return subprocess.CompletedProcess(cmd, code, "", f"some log\n{message}\n")
        run_dir = Path(cwd) / sets["run.dir"]
        run_dir.mkdir(parents=True, exist_ok=True)
        lines = [json.dumps({"step": i + 1, "loss": x}) for i, x in enumerate(losses)]
        (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
        (run_dir / "summary.json").write_text(json.dumps({"step_time_s": 0.25}))
        return subprocess.CompletedProcess(cmd, 0, "", "")

    return run


def test_the_offload_check_reads_its_runs_from_any_cwd_and_reports_a_failed_run_as_its_check_failed(
    tmp_path, monkeypatch, capsys
):
    """--out relative to the repository, as the runs' run.dir is (they run there), from another cwd;
    the nvme run exits 3 (a non-finite loss): its check FAILED in one line, the others ok, exit 1."""
    check = load("gpu_offload_check")
    fake = _fake_app({"nvme": (3, "gridlm: non-finite loss at step 2; train.nonfinite says stop")}, [5.0, 4.5])
    monkeypatch.setattr(check, "subprocess", SimpleNamespace(run=fake))
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    out = os.path.relpath(tmp_path / "out", REPO)
    assert check.main(["--device", "cpu", "--steps", "2", "--precisions", "fp32", "--out", out]) == 1
    table, err = capsys.readouterr()
    rows = [ln for ln in table.splitlines() if ln.startswith("| fp32 |")]
    assert len(rows) == 3 and "FAILED: run nvme exited 3" in rows[0] and "non-finite loss" in rows[0], table
    assert rows[1].endswith("| ok |") and rows[2].endswith("| ok |"), table
    failed = [ln for ln in err.splitlines() if "FAILED" in ln]
    assert len(failed) == 1 and "host = nvme" in failed[0], err
    assert "non-finite" in (tmp_path / "out" / "fp32_nvme.stderr").read_text()


def test_the_offload_benchmark_reads_its_runs_from_any_cwd(tmp_path, monkeypatch):
    """--out relative to the repository: the step runs' summary.json are read where the runs (whose
    cwd is the repository) wrote them, and the tables land there too."""
    bench = load("offload_bench")
    monkeypatch.setattr(bench, "subprocess", SimpleNamespace(run=_fake_app({}, [5.0])))
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    out = os.path.relpath(tmp_path / "out", REPO)
    argv = ["--elements", "4096", "--threads", "1", "--rounds", "1", "--decks", "tiny", "--offloads", "none,host",
            "--steps", "2", "--nvme-mb", "0", "--out", out]  # fmt: skip
    assert bench.main(argv) == 0
    rows = list(csv.DictReader((tmp_path / "out" / "table.csv").read_text().splitlines()))
    assert [r["value"] for r in rows if r["unit"] == "ms"] == ["250.0", "250.0"]


def test_the_predicted_median_of_an_even_count_of_rounds_is_the_mean_of_the_middle_two():
    median_prediction = load("perf_model_bench").median_prediction
    rounds = [{"predicted_ms": ms, "terms": f"compute {ms}"} for ms in (40.0, 10.0, 30.0, 20.0)]
    assert median_prediction(rounds) == {"predicted_ms": 25.0, "terms": "compute 20.0"}
    assert median_prediction(rounds[:3])["predicted_ms"] == 30.0


def test_rounds_alternate_reversing_the_order_every_other_round():
    round_order = load("grid_bench").round_order
    assert [round_order("abc", r) for r in range(4)] == [list("abc"), list("cba"), list("abc"), list("cba")]


def test_the_grid_benchmark_runs_each_grid_once_a_round_alternated_and_reports_medians(tmp_path, monkeypatch, capsys):
    grid_bench = load("grid_bench")
    calls: list[str] = []

    def run_grid(spec: str, args: Any) -> dict:
        calls.append(spec)
        step = {"1x1x2": 100.0, "2x1x1": 200.0}[spec] + 10 * len(calls)
        figures = dict.fromkeys(
            ("tokens_per_s", "tp_comm_ms", "pp_comm_ms", "dp_comm_ms", "cp_comm_ms", "peak_rss_gib"), 1.0
        )
        return {"grid": spec, "ranks": 2, "step_ms": step, "step_std_ms": 9.0, "final_loss": 6.5, **figures}

    monkeypatch.setattr(grid_bench, "run_grid", run_grid)
    assert grid_bench.main(["--grids", "1x1x2", "2x1x1", "--rounds", "3", "--out", str(tmp_path)]) == 0
    assert calls == ["1x1x2", "2x1x1", "2x1x1", "1x1x2", "1x1x2", "2x1x1"]
    rows = list(csv.DictReader((tmp_path / "table.csv").read_text().splitlines()))
    assert [(r["grid"], r["rounds"], r["step_ms"], r["step_min_ms"], r["step_max_ms"]) for r in rows] == [
        ("1x1x2", "3", "140.0", "110.0", "150.0"),
        ("2x1x1", "3", "230.0", "220.0", "260.0"),
    ]
    assert "| 1x1x2 | 2 | 140.0 (110.0-150.0) |" in capsys.readouterr().out


def test_the_overlap_benchmark_runs_each_configuration_once_a_round_alternated_and_reports_medians(
    tmp_path, monkeypatch, capsys
):
    overlap_bench = load("overlap_bench")
    calls: list[str] = []

    def run_config(name: str, dp: int, zero: int, overlap: bool, args: Any, batch: Any) -> dict:
        calls.append(name)
        if len(calls) == 9:  # dp2 overlap off, in the second round
            return {"config": name, "ranks": dp, "global_batch": 8, "error": "exit 1"}
        step = 100.0 * dp + len(calls)
        return {"config": name, "ranks": dp, "global_batch": 4 * dp, "step_ms": step, "dp_comm_ms": 1.0,
                "exposed_ms": 1.0, "exposed_pct": 1.0, "optimizer_state_mb": 1.0, "final_loss": 6.5}  # fmt: skip

    monkeypatch.setattr(overlap_bench, "run_config", run_config)
    assert overlap_bench.main(["--rounds", "3", "--out", str(tmp_path)]) == 1  # a failed round fails the run
    names = [c[0] for c in overlap_bench.CONFIGS]
    assert calls == [*names, *reversed(names), *names]
    rows = {r["config"]: r for r in csv.DictReader((tmp_path / "table.csv").read_text().splitlines())}
    assert (rows["dp1"]["step_ms"], rows["dp1"]["step_min_ms"], rows["dp1"]["step_max_ms"]) == (
        "110.0",
        "101.0",
        "111.0",
    )
    assert float(rows["dp2 overlap on"]["vs_dp1"]) == pytest.approx(208 / 110)  # medians: (203, 208, 213)
    assert rows["dp2 overlap off"]["error"] == "exit 1 in 1 of 3 rounds"
    assert "| dp1 | 1 | 4 | 110.0 (101.0-111.0) |" in capsys.readouterr().out

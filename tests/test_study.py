"""Scaling studies: inputs/studies/*.yaml expanded by launch/study.py into a deck per point, job
scripts (launch/submit.py's) with manifest.json and submit_all.sh, or runs here (--run-local).

Serial, except the Slurm test (`--with-slurm`: sbatch --test-only of every Slurm machine's script)
and the two --run-local tests, which start mpirun themselves (1 and 2 ranks, a few seconds each)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from test_slurm import slurm_env  # noqa: F401 (fixture: our SLURM_CONF, no surrounding job's variables)

from app.deck import load_deck, resolve_for_world
from app.plan.machine import load_machine, machine_names
from conftest import REPO, app_env
from launch import study as study_cli
from launch.study import STUDIES_DIR, expand, load_study, point_deck

STUDIES = sorted(p.stem for p in STUDIES_DIR.glob("*.yaml"))
TINY = REPO / "inputs" / "gpt_tiny.yaml"

# Per study, per point of the job scripts: (point, ranks, tp, pp, dp, global_batch).
JOB_POINTS = {
    "local_weak": [(1, 4, 1, 1, 4, 16), (2, 8, 1, 1, 8, 32), (4, 16, 1, 1, 16, 64)],  # 4 samples per rank
    "local_strong": [(1, 4, 1, 1, 4, 16), (2, 8, 1, 1, 8, 16), (4, 16, 1, 1, 16, 16)],
    "frontier_weak": [(64, 512, 8, 1, 64, 512), (128, 1024, 8, 1, 128, 1024), (256, 2048, 8, 1, 256, 2048),
                      (512, 4096, 8, 1, 512, 4096), (768, 6144, 8, 1, 768, 6144), (1024, 8192, 8, 2, 512, 4096),
                      (2048, 16384, 8, 4, 512, 8192), (4096, 32768, 8, 8, 512, 16384)],
    # The best 3D grid of each point (--search --tensor 3d, docs/PERFORMANCE_MODEL.md "3D tensor parallelism").
    "frontier_weak_3d": [(64, 512, 4, 1, 128, 512), (128, 1024, 8, 1, 128, 1024), (256, 2048, 8, 1, 256, 2048),
                         (512, 4096, 8, 1, 512, 4096), (768, 6144, 16, 1, 384, 6144), (1024, 8192, 32, 1, 256, 4096),
                         (2048, 16384, 32, 1, 512, 8192), (4096, 32768, 64, 1, 512, 16384)],
    "perlmutter_strong": [(16, 64, 4, 1, 16, 512), (32, 128, 4, 1, 32, 512), (64, 256, 4, 1, 64, 512),
                          (128, 512, 4, 1, 128, 512)],
    "polaris_weak": [(16, 64, 4, 1, 16, 256), (32, 128, 4, 1, 32, 512), (64, 256, 4, 1, 64, 1024),
                     (128, 512, 4, 1, 128, 2048)],
    "selene_megatron": [(4, 32, 1, 1, 32, 512), (8, 64, 2, 1, 32, 512), (16, 128, 4, 1, 32, 512),
                        (32, 256, 8, 1, 32, 1024), (64, 512, 8, 2, 32, 1536), (128, 1024, 8, 4, 32, 1792),
                        (192, 1536, 8, 8, 24, 2304), (240, 1920, 8, 16, 15, 2160), (315, 2520, 8, 35, 9, 2520),
                        (384, 3072, 8, 64, 6, 3072)],
}  # fmt: skip
# --run-local: points are ranks.
LOCAL_POINTS = {
    "local_weak": [(1, 1, 1, 1, 1, 4), (2, 2, 1, 1, 2, 8), (4, 4, 1, 1, 4, 16)],
    "local_strong": [(1, 1, 1, 1, 1, 16), (2, 2, 1, 1, 2, 16), (4, 4, 1, 1, 4, 16)],
}
# selene_megatron's points are the rows of Megatron-LM SC21's table, one deck each.
MEGATRON_ROWS = {4: "megatron/gpt_1.7b.yaml", 8: "megatron/gpt_3.6b.yaml", 16: "megatron/gpt_7.5b.yaml",
                 32: "megatron/gpt_18.4b.yaml", 64: "megatron/gpt_39.1b.yaml", 128: "megatron/gpt_76.1b.yaml",
                 192: "megatron/gpt_145.6b.yaml", 240: "megatron/gpt_310.1b.yaml", 315: "megatron/gpt_529.6b.yaml",
                 384: "gpt_1t.yaml"}  # fmt: skip


def write_study(tmp_path: Path, stem: str = "mini", **keys) -> Path:
    """tmp_path/<stem>.yaml: a 1-point strong study of gpt_tiny on `local`, with `keys` over it (None drops one)."""
    raw = {"name": stem, "kind": "strong", "base": str(TINY), "machine": "local", "points": [1],
           "scale": {}, "description": "a test study", **keys}  # fmt: skip
    path = tmp_path / f"{stem}.yaml"
    path.write_text(yaml.safe_dump({k: v for k, v in raw.items() if v is not None}))
    return path


def run_study(tmp_path: Path, monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    """study.main(args) in tmp_path: (status, stdout, stderr)."""
    monkeypatch.chdir(tmp_path)
    status = study_cli.main(list(args))
    out, err = capsys.readouterr()
    return status, out, err


@pytest.mark.parametrize("name", STUDIES)
def test_every_study_expands_to_the_decks_of_its_points(name):
    assert set(STUDIES) == set(JOB_POINTS)
    study = load_study(STUDIES_DIR / f"{name}.yaml")
    for mode, expected in ((False, JOB_POINTS[name]), (True, LOCAL_POINTS.get(name))):
        if expected is None:
            continue
        points = expand(study, run_local=mode, runs=Path("/scratch/runs"))
        assert [p.point for p in points] == [e[0] for e in expected]
        for pt, (point, ranks, tp, pp, dp, batch) in zip(points, expected):
            label = f"r{ranks}" if mode else f"n{point}"
            assert (pt.ranks, pt.nodes, pt.label) == (ranks, 1 if mode else point, label)
            assert pt.run_dir == Path("/scratch/runs") / name / label
            # The deck the app will run, loaded as the app loads it.
            deck = resolve_for_world(load_deck(study.base, pt.overrides), pt.ranks)
            assert (deck.parallel.tp, deck.parallel.pp, deck.dp, deck.train.global_batch) == (tp, pp, dp, batch)
            assert (deck.run.study, deck.run.study_kind, deck.run.study_point) == (name, study.kind, point)
            assert deck.run.dir == str(pt.run_dir)
            assert pt.overrides[-4:] == (f"run.study={name}", f"run.study_kind={study.kind}",
                                         f"run.study_point={point}", f"run.dir={pt.run_dir}")  # fmt: skip


def test_weak_studies_keep_the_work_per_device_and_strong_studies_the_deck():
    for name in STUDIES:
        study = load_study(STUDIES_DIR / f"{name}.yaml")
        decks = [point_deck(study, pt) for pt in expand(study)]
        per_dp_rank = {d.num_micro_batches * d.train.micro_batch for d in decks}
        models = {(d.model.layers, d.model.hidden) for d in decks}
        if study.kind == "strong":
            assert len({d.train.global_batch for d in decks}) == 1 and len(models) == 1, name
        elif len(models) == 1:  # weak by batch: every dp rank gets the same samples per step
            assert len(per_dp_rank) == 1, name


def test_selene_megatron_points_are_the_megatron_table_rows():
    study = load_study(STUDIES_DIR / "selene_megatron.yaml")
    for pt in expand(study):
        row = REPO / "inputs" / MEGATRON_ROWS[pt.point]
        want = resolve_for_world(load_deck(row), pt.ranks)
        got = point_deck(study, pt)
        assert got.model == want.model, row
        assert (got.parallel.tp, got.parallel.pp, got.dp) == (want.parallel.tp, want.parallel.pp, want.dp), row
        assert got.train.global_batch == want.train.global_batch, row


def test_per_point_settings_come_after_the_scaled_batch(tmp_path):
    path = write_study(tmp_path, kind="weak", points=[1, 2], scale={"global_batch": "per_point"},
                       per_point={2: ["train.global_batch=64"]})  # fmt: skip
    first, second = expand(load_study(path))
    assert "train.global_batch=16" in first.overrides
    assert second.overrides.index("train.global_batch=32") < second.overrides.index("train.global_batch=64")
    assert point_deck(load_study(path), second).train.global_batch == 64


@pytest.mark.parametrize("name", STUDIES)
def test_job_scripts_manifest_and_submit_all_for_every_study(tmp_path, monkeypatch, capsys, name):
    out = tmp_path / "jobs"
    status, stdout, err = run_study(tmp_path, monkeypatch, capsys, str(STUDIES_DIR / f"{name}.yaml"),
                                    "--out", str(out), "--account", "abc123")  # fmt: skip
    assert status == 0, err
    study = load_study(STUDIES_DIR / f"{name}.yaml")
    manifest = json.loads((out / "manifest.json").read_text())
    assert {k: manifest[k] for k in ("study", "kind", "machine", "mode", "base", "devices_per_node")} == {
        "study": name, "kind": study.kind, "machine": study.machine_name, "mode": "jobs",
        "base": str(study.base), "devices_per_node": load_machine(study.machine).devices_per_node,
    }  # fmt: skip
    assert manifest["description"] == study.description
    scheduler = load_machine(study.machine).scheduler
    scripts = []
    points = expand(study, runs=tmp_path / "runs")
    assert len(manifest["points"]) == len(points) == len(JOB_POINTS[name])
    for entry, (point, ranks, *_), pt in zip(manifest["points"], JOB_POINTS[name], points):
        script = out / f"{name}-n{point}.sh"
        # since: when the script was written (a summary.json older than that is an earlier attempt's)
        assert script.stat().st_mtime - 5 <= entry.pop("since") <= time.time()
        assert entry == {
            "point": point, "nodes": point, "ranks": ranks, "label": f"n{point}",
            "run_dir": str(tmp_path / "runs" / name / f"n{point}"), "script": str(script), "status": "written",
            "exit_status": None, "wall_s": None, "overrides": list(pt.overrides),
        }  # fmt: skip
        check = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, check=False)
        assert check.returncode == 0, check.stderr
        text = script.read_text()
        for key in (f"run.study={name}", f"run.study_kind={study.kind}", f"run.study_point={point}",
                    f"run.dir={entry['run_dir']}"):  # fmt: skip
            assert f"--set {key} " in text, key
        if scheduler == "pbs":
            assert f"#PBS -l select={point}:system=polaris\n" in text and "#PBS -A abc123\n" in text
        else:
            assert f"#SBATCH --nodes={point}\n" in text and "#SBATCH --account=abc123\n" in text
        scripts.append(str(script))
    assert len(list(out.glob("*.sh"))) == len(points) + 1  # and submit_all.sh
    submit_all = (out / "submit_all.sh").read_text()
    command = "qsub" if scheduler == "pbs" else "sbatch"
    assert [line for line in submit_all.splitlines() if not line.startswith(("#", "set "))] == [
        f'{command} "$@" {s}' for s in scripts
    ]
    assert subprocess.run(["bash", "-n", str(out / "submit_all.sh")], check=False).returncode == 0
    assert f"  {JOB_POINTS[name][0][0]}  " in stdout  # the table of points


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"nodes": [1]}, "unknown key 'nodes'; accepted: name, kind"),
        ({"kind": "medium"}, "kind = 'medium': accepted: weak, strong"),
        ({"base": None}, "missing key(s) base"),
        ({"base": "nowhere.yaml"}, "base = 'nowhere.yaml': no deck at"),
        ({"name": "other"}, "name = 'other' must equal the file stem 'mini'"),
        ({"points": [2, 1]}, "points = [2, 1]: expected increasing positive integers"),
        ({"points": [0, 1]}, "points = [0, 1]: expected increasing positive integers"),
        ({"points": []}, "points = []: expected increasing positive integers"),
        ({"machine": "summit"}, "machine 'summit': no file"),
        ({"overrides": "train.steps=3"}, "overrides = 'train.steps=3': expected list"),
        ({"overrides": ["train.stepz=3"]}, "deck error: train.stepz = 3: unknown key"),
        ({"per_point": {"8": ["model.layers=8"]}}, "per_point.8: not one of points [1]"),
        ({"time": 5400}, 'time = 5400: quote it, e.g. time: "01:30:00"'),
        ({"time": "30"}, "time = '30': expected HH:MM:SS"),
        ({"scale": {"global_batch": "per_point"}}, "a strong study keeps the global batch"),
        ({"per_point": {1: ["model.layers=8"]}}, "per_point.1: 'model.layers=8': a strong study keeps the model"),
        ({"kind": "weak", "scale": {"global_batch": "double"}}, "scale.global_batch = 'double': accepted: per_point"),
        ({"kind": "weak", "scale": {"micro_batch": "per_point"}}, "scale.micro_batch: only global_batch scales"),
        ({"kind": "weak", "scale": {}}, "a weak study must grow something"),
        ({"kind": "weak", "points": [3, 4], "scale": None}, "point 4: scale.global_batch per_point gives 16 x 4 / 3"),
    ],
)
def test_a_bad_study_file_is_one_line_naming_the_file_and_key(tmp_path, monkeypatch, capsys, keys, message):
    path = write_study(tmp_path, **keys)
    status, out, err = run_study(tmp_path, monkeypatch, capsys, str(path))
    assert status == 2
    assert err.startswith(f"study: study file {path}: ") and err.count("\n") == 1, err
    assert message in err, err
    assert "Traceback" not in err and not (tmp_path / "jobs").exists()


def test_a_point_whose_deck_cannot_run_stops_the_study_and_writes_nothing(tmp_path, monkeypatch, capsys):
    # global batch 16 with micro_batch 4 runs on 4 ranks (1 node) but not on 8 (2 nodes).
    path = write_study(tmp_path, points=[1, 2])
    status, _, err = run_study(tmp_path, monkeypatch, capsys, str(path), "--force")
    assert status == 2
    assert "point 2 (2 node(s), 8 rank(s)): deck error: train.global_batch = 16: must be a multiple of" in err, err
    assert not (tmp_path / "jobs").exists()


def test_plan_problems_stop_the_study_unless_force(tmp_path, monkeypatch, capsys):
    # tp 8 on Perlmutter's 4-GPU nodes: every tensor-parallel group spans 2 nodes.
    path = write_study(tmp_path, machine="perlmutter", points=[2], overrides=["parallel.tp=8"])
    status, _, err = run_study(tmp_path, monkeypatch, capsys, str(path))
    assert status == 2 and "point 2 (2 node(s), 8 rank(s)): the plan for 8 ranks on perlmutter has problems" in err
    assert not (tmp_path / "jobs").exists()
    status, _, err = run_study(tmp_path, monkeypatch, capsys, str(path), "--force")
    assert status == 0, err
    assert "study: warning: " in err and "(point(s) 2)" in err
    assert (tmp_path / "jobs" / "mini" / "mini-n2.sh").is_file()


def test_writing_a_study_again_keeps_the_attempts_of_unchanged_points(tmp_path, monkeypatch, capsys):
    """Found in review: every launch.study run stamped every point's `since` anew, so writing a study
    again (to mend one point, or with another --time) made every finished point's summary.json "from
    an earlier attempt". A point whose run is unchanged (base deck path and text, machine, nodes, ranks,
    --set list) keeps its `since`; a changed one's attempt begins now."""
    base = tmp_path / "tiny.yaml"
    base.write_text(TINY.read_text())
    path = write_study(tmp_path, base=str(base), points=[1, 2], overrides=["train.micro_batch=1"])
    manifest = tmp_path / "jobs" / "mini" / "manifest.json"

    def write(*args: str) -> dict[str, float]:
        status, out, err = run_study(tmp_path, monkeypatch, capsys, str(path), *args)
        assert status == 0, err
        return {p["point"]: p["since"] for p in json.loads(manifest.read_text())["points"]}

    write()
    data = json.loads(manifest.read_text())
    for p in data["points"]:
        p["since"] = 1000.0 * p["point"]  # the attempts began long ago (their summaries are older than now)
    manifest.write_text(json.dumps(data))
    assert write("--time", "00:20:00") == {1: 1000.0, 2: 2000.0}  # another time limit: the same runs
    path.write_text(path.read_text().replace("points:", "per_point: {2: [train.steps=7]}\npoints:"))
    before = time.time()
    since = write("--time", "00:20:00")
    assert since[1] == 1000.0 and since[2] >= before  # point 2 runs another deck now
    base.write_text(base.read_text() + "# edited\n")
    assert all(s >= before for s in write().values())  # the base deck's text changed: every point anew


def run_local(tmp_path: Path, study: Path, *args: str) -> subprocess.CompletedProcess:
    """`python -m launch.study STUDY --run-local --out out ARGS` in tmp_path, as a user runs it."""
    cmd = [sys.executable, "-m", "launch.study", str(study), "--run-local", "--out", str(tmp_path / "out"), *args]
    return subprocess.run(cmd, cwd=tmp_path, env=app_env(), capture_output=True, text=True, timeout=240, check=False)


TINY_MODEL = ["model.layers=1", "model.hidden=32", "model.heads=2", "model.vocab_size=64", "model.seq_len=16",
              "train.steps=3", "train.micro_batch=2", "run.log_every=1", "run.resume=none",
              "checkpoint.every=0", "checkpoint.at_exit=false"]  # fmt: skip


def test_run_local_runs_every_point_and_records_it(tmp_path):
    path = write_study(tmp_path, kind="weak", points=[1, 2], overrides=[*TINY_MODEL, "train.global_batch=2"],
                       scale={"global_batch": "per_rank"})  # fmt: skip
    out = run_local(tmp_path, path)
    assert out.returncode == 0, out.stdout + out.stderr
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert (manifest["mode"], manifest["study"], manifest["kind"]) == ("run-local", "mini", "weak")
    assert [(p["point"], p["ranks"], p["status"], p["exit_status"]) for p in manifest["points"]] == [
        (1, 1, "ok", 0), (2, 2, "ok", 0)
    ]  # fmt: skip
    for entry in manifest["points"]:
        run_dir = Path(entry["run_dir"])
        assert run_dir == tmp_path / "runs" / "mini" / f"r{entry['ranks']}"
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["study"] == {"name": "mini", "kind": "weak", "point": entry["point"]}
        assert (summary["world_size"], summary["steps"]) == (entry["ranks"], 3)
        assert "gridlm: done" in (run_dir / "run.log").read_text()  # the log holds what the terminal showed
    assert out.stdout.count("gridlm: done") == 2


def test_run_local_records_a_failing_point_and_goes_on(tmp_path):
    # global batch 2 = micro_batch 2 x dp 1: 1 rank runs, 2 ranks cannot (the app exits 2).
    path = write_study(tmp_path, points=[1, 2], overrides=[*TINY_MODEL, "train.global_batch=2"])
    out = run_local(tmp_path, path)  # checked before anything runs
    assert out.returncode == 2 and "point 2 (1 node(s), 2 rank(s)): deck error: train.global_batch" in out.stderr
    assert "(--force runs it anyway)" in out.stderr and not (tmp_path / "runs").exists()
    out = run_local(tmp_path, path, "--force")
    assert out.returncode == 1, out.stdout + out.stderr
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert [(p["point"], p["status"], p["exit_status"]) for p in manifest["points"]] == [(1, "ok", 0), (2, "failed", 2)]
    assert "deck error: train.global_batch" in (tmp_path / "runs" / "mini" / "r2" / "run.log").read_text()


@pytest.mark.slurm
def test_every_slurm_machines_job_script_is_accepted_by_sbatch_test_only(
    slurm_env,  # noqa: F811 (the fixture imported from test_slurm)
    tmp_path,
    monkeypatch,
    capsys,
):
    """Each Slurm machine's script at 1 node asks the local Slurm (launch/slurm_local.sh: partitions
    debug/batch/normal, feature gpu, 8 GPUs) for what the real machine offers; --test-only schedules
    nothing but says whether the request could run."""
    machines = [m for m in machine_names() if load_machine(m).scheduler == "slurm"]
    assert {"frontier", "perlmutter", "alps", "dgx_h100", "selene", "local"} <= set(machines)
    for machine in machines:
        batch = 4 * load_machine(machine).devices_per_node  # micro_batch 4 on every rank of 1 node
        path = write_study(tmp_path, f"at_{machine}", machine=machine, overrides=[f"train.global_batch={batch}"])
        status, _, err = run_study(tmp_path, monkeypatch, capsys, str(path), "--account", "gridlm_test")
        assert status == 0, err
        script = tmp_path / "jobs" / f"at_{machine}" / f"at_{machine}-n1.sh"
        out = subprocess.run(["sbatch", "--test-only", str(script)], env=slurm_env, capture_output=True, text=True,
                             timeout=60, check=False)  # fmt: skip
        assert out.returncode == 0 and " to start at " in out.stderr, f"{machine}: {out.stderr}\n{script.read_text()}"
        # The control: the same request on 2 nodes cannot be had on this one-node Slurm.
        more = subprocess.run(["sbatch", "--test-only", "--nodes=2", str(script)], env=slurm_env,
                              capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
        assert more.returncode != 0, f"{machine}: {more.stderr}"
    # submit_all.sh passes its arguments on to every sbatch.
    out = subprocess.run([str(tmp_path / "jobs" / "at_local" / "submit_all.sh"), "--test-only"], env=slurm_env,
                         capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert out.returncode == 0 and " to start at " in out.stderr, out.stderr


def test_predict_writes_every_points_prediction_and_runs_nothing(tmp_path, monkeypatch, capsys):
    """`--predict` plans and predicts each point of frontier_weak (the AxoNN decks to 32,768 GCDs) on
    Frontier's constants: no job script, no run; weak efficiency = TFLOP/s per GCD / the first point's."""
    status, out, err = run_study(tmp_path, monkeypatch, capsys, str(STUDIES_DIR / "frontier_weak.yaml"), "--predict")
    assert status == 0, err
    data = json.loads((tmp_path / "jobs" / "frontier_weak" / "predicted.json").read_text())
    points = data["points"]
    assert [p["gpus"] for p in points] == [512, 1024, 2048, 4096, 6144, 8192, 16384, 32768]
    assert points[0]["efficiency"] == 1.0
    for p in points:
        assert p["efficiency"] == pytest.approx(p["tflops_per_device"] / points[0]["tflops_per_device"])
        assert 0 < p["mfu"] < 1 and p["step_time_s"] > 0 and set(p["breakdown"]) >= {"gemm", "dp_exposed"}
    assert not list((tmp_path / "jobs" / "frontier_weak").glob("*.sh")) and not (tmp_path / "runs").exists()
    assert "32768" in out and "predicted weak scaling on frontier" in out
    # postprocess draws it (predicted only: a table and the efficiency figure).
    from postprocess import scaling

    assert (
        scaling.main([str(tmp_path / "jobs" / "frontier_weak" / "predicted.json"), "--out", str(tmp_path / "p")]) == 0
    )
    assert (tmp_path / "p" / "weak_efficiency.png").read_bytes().startswith(b"\x89PNG")
    assert "| 4096 | 32768 | 8x8x512 |" in (tmp_path / "p" / "predicted.md").read_text()

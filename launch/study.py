"""Scaling studies: one study file -> a deck per point -> job scripts (or runs here) + manifest.json.

    python -m launch.study inputs/studies/X.yaml [--out jobs/X/] [--force] [--account A] ...
    python -m launch.study inputs/studies/local_weak.yaml --run-local     (after: source launch/env.sh)

A study file (`inputs/studies/<name>.yaml`) names a base deck, a machine and a list of points:

    name: local_weak             # = the file stem; run directories go to runs/<name>/<label>
    kind: weak                   # weak | strong
    base: ../gpt_tiny.yaml       # the deck, relative to the study file
    machine: local               # inputs/machines/<machine>.yaml
    points: [1, 2, 4]            # nodes (job scripts, label n<nodes>); --run-local: ranks (label r<ranks>)
    overrides: [train.steps=30]  # --set for every point
    scale: {global_batch: per_point}   # weak only; see SCALE_RULES
    per_point: {4: [model.layers=8]}   # extra --set for one point (the model grows with the point)
    time: "00:30:00"             # job time limit (default: the machine's)
    description: one line

A point's --set list is: overrides, the scaled train.global_batch, per_point[point], then
run.study, run.study_kind, run.study_point and run.dir (the app copies the study_* keys into
summary.json). Weak studies grow the global batch with the point by default (dp grows, the work
per GPU stays), or grow the model through per_point with `scale: {}`; strong studies keep the
deck (model and global batch) and add nodes. `expand` is the pure expansion that tests check.

Job scripts are written with launch/submit.py's machinery, so every point's deck is checked
against its world size and planned on the machine (errors and plan problems stop the study,
naming the point; --force writes past plan problems). --run-local runs each point here instead,
one after another, with `mpirun -n <point>`. A user mistake prints one line `study: ...` and
exits with status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `python launch/study.py` puts launch/, not the repository, on sys.path
    sys.path.insert(0, str(REPO))

from app.deck import Deck, load_deck, resolve_for_world  # noqa: E402
from app.deck_yaml import read_yaml_file  # noqa: E402
from app.errors import GridlmError, InputError  # noqa: E402
from app.plan.machine import MACHINES_DIR, load_machine, machine_path  # noqa: E402
from app.schema import Key, Problem, check  # noqa: E402
from launch import submit  # noqa: E402

STUDIES_DIR = REPO / "inputs" / "studies"
EXAMPLE_STUDY = "inputs/studies/local_weak.yaml"
KINDS = ("weak", "strong")
# scale.global_batch: how a weak study's global batch follows the point.
SCALE_RULES = {
    "per_point": "the base deck's global_batch is the first point's; global_batch = base x point / points[0]",
    "per_rank": "the base deck's global_batch is one rank's; global_batch = base x ranks (jobs and --run-local alike)",
}
# The keys, declared for the schema engine (app/schema.py); null = left out.
FIELDS: dict[str, Key] = {
    "name": Key(str, help="the study's name, = the file stem; run directories go to runs/<name>/<label>"),
    "kind": Key(str, help="weak or strong", choices=KINDS),
    "base": Key(str, help="the deck, relative to the study file"),
    "machine": Key(str, help="inputs/machines/<machine>.yaml, or a machine file relative to the study file"),
    "points": Key(list, help="increasing positive node counts (--run-local: rank counts)"),
    "overrides": Key(list, None, "section.key=value settings for every point"),
    "scale": Key(dict, None, "weak: {global_batch: " + " | ".join(SCALE_RULES) + "} (default per_point), or {}"),
    "per_point": Key(dict, None, "{point: [section.key=value, ...]}: extra settings of one point, applied last"),
    "time": Key(
        str,
        None,
        'job time limit, e.g. "00:30:00" (default: the machine\'s)',
        fix='quote it, e.g. time: "01:30:00" (unquoted, YAML reads 1:30:00 as seconds)',
    ),
    "description": Key(str, help="one line: what the study measures"),
}
LABEL = re.compile(r"^[A-Za-z][A-Za-z0-9_.+-]*$")  # also a job name (submit.JOB_NAME)
SCHEDULER_FLAGS = tuple(submit.SCHEDULER_OPTIONS)  # passed through to every point's submit.py call


class StudyError(InputError):
    """A study file or a point of it is wrong; the message names the file, the key or point, and the fix."""


@dataclass(frozen=True)
class Study:
    name: str
    kind: str
    base: Path  # absolute
    machine: str  # as submit.py's --machine takes it: a name, or an absolute path
    machine_name: str
    scheduler: str
    devices_per_node: int
    points: tuple[int, ...]
    description: str
    path: Path
    base_global_batch: int  # of the base deck with `overrides`
    overrides: tuple[str, ...] = ()
    scale: dict[str, str] = field(default_factory=dict)
    per_point: dict[int, tuple[str, ...]] = field(default_factory=dict)
    time: Optional[str] = None


@dataclass(frozen=True)
class Point:
    """One run of a study: `point` nodes (job scripts) or ranks (--run-local)."""

    point: int
    nodes: int
    ranks: int
    label: str  # n<nodes> or r<ranks>: the run directory's and the job script's name
    run_dir: Path
    overrides: tuple[str, ...]  # every --set of the run, in order


def load_study(path: Path) -> Study:
    """Read and validate a study file; StudyError names the file, the key and what is accepted."""
    path = Path(os.path.abspath(path))
    where = f"study file {path}"
    if not path.exists():
        known = ", ".join(sorted(p.name for p in STUDIES_DIR.glob("*.yaml")))
        raise StudyError(f"{where}: no such file; the studies in {STUDIES_DIR}: {known}")
    # Bounded like a deck: a regular file, UTF-8, no aliases or merge keys, limited depth and size.
    raw = read_yaml_file(path, "study file", lambda message: StudyError(f"{where}: {message}"), EXAMPLE_STUDY)
    try:
        raw = check(raw, FIELDS, where, null_is_absent=True)
    except Problem as bad:
        raise StudyError(str(bad)) from None
    if raw["name"] != path.stem or not LABEL.match(raw["name"]):
        raise StudyError(
            f"{where}: name = {raw['name']!r} must equal the file stem {path.stem!r} (a letter, then letters, digits or _ . + -)"
        )
    if "\n" in raw["description"].strip():
        raise StudyError(f"{where}: description: one line, please (it heads tables and the manifest)")
    base = (path.parent / raw["base"]).resolve()
    if not base.is_file():
        raise StudyError(f"{where}: base = {raw['base']!r}: no deck at {base} (the path is relative to the study file)")
    points = raw["points"]
    if not points or any(type(p) is not int or p < 1 for p in points) or list(points) != sorted(set(points)):
        raise StudyError(f"{where}: points = {points!r}: expected increasing positive integers, e.g. [1, 2, 4]")
    overrides = _settings(where, "overrides", raw.get("overrides") or [])
    per_point: dict[int, tuple[str, ...]] = {}
    for point, sets in (raw.get("per_point") or {}).items():
        if point not in points:
            raise StudyError(f"{where}: per_point.{point}: not one of points {points}")
        per_point[point] = _settings(where, f"per_point.{point}", sets)
    scale = _scale(where, raw["kind"], raw.get("scale"), per_point)

    machine_ref = raw["machine"]
    if machine_path(machine_ref).parent != MACHINES_DIR:  # a path: relative to the study file
        machine_ref = str((path.parent / machine_ref).resolve())
    try:
        machine = load_machine(machine_ref)
        global_batch = load_deck(base, overrides).train.global_batch
    except GridlmError as err:
        raise StudyError(f"{where}: {err}") from None
    if raw.get("time") is not None:
        try:
            submit.parse_time(raw["time"], machine.scheduler)
        except GridlmError as err:
            raise StudyError(f"{where}: {err}".replace("--time ", "time = ", 1)) from None
    study = Study(
        name=raw["name"], kind=raw["kind"], base=base, machine=machine_ref, machine_name=machine.name,
        scheduler=machine.scheduler, devices_per_node=machine.devices_per_node, points=tuple(points),
        description=raw["description"], path=path, base_global_batch=global_batch, overrides=overrides,
        scale=scale, per_point=per_point, time=raw.get("time"),
    )  # fmt: skip
    expand(study)  # a global batch that does not scale to an integer is the file's mistake
    return study


def _settings(where: str, key: str, value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(s, str) and "=" in s for s in value):
        raise StudyError(f"{where}: {key} = {value!r}: expected a list of section.key=value, e.g. [train.steps=30]")
    return tuple(value)


def _scale(where: str, kind: str, scale: Optional[dict], per_point: dict[int, tuple[str, ...]]) -> dict[str, str]:
    """The scale rules in effect; a strong study changes neither the model nor the global batch."""
    if scale is None:
        scale = {"global_batch": "per_point"} if kind == "weak" else {}
    for key, rule in scale.items():
        if key != "global_batch":
            raise StudyError(f"{where}: scale.{key}: only global_batch scales; model sizes go in per_point")
        if rule not in SCALE_RULES:
            raise StudyError(
                f"{where}: scale.global_batch = {rule!r}: accepted: "
                + "; ".join(f"{k} ({v})" for k, v in SCALE_RULES.items())
            )
    if kind == "strong":
        if scale:
            raise StudyError(
                f"{where}: scale = {scale!r}: a strong study keeps the global batch; use scale: {{}} or kind: weak"
            )
        for point, sets in per_point.items():
            grows = [s for s in sets if s.split("=")[0].strip().startswith(("model.", "train.global_batch"))]
            if grows:
                raise StudyError(
                    f"{where}: per_point.{point}: {grows[0]!r}: a strong study keeps the model and the global batch (kind: weak grows them)"
                )
    elif not scale and not per_point:
        raise StudyError(
            f"{where}: scale = {{}} and no per_point: a weak study must grow something (per_point model sizes, or scale: {{global_batch: per_point}})"
        )
    return dict(scale)


def expand(study: Study, run_local: bool = False, runs: Path = Path("runs")) -> list[Point]:
    """The study's points in order, each with its nodes, ranks, run directory (runs/<name>/<label>)
    and the full --set list of its run. Pure: reads no file."""
    out = []
    for p in study.points:
        nodes, ranks, label = (1, p, f"r{p}") if run_local else (p, p * study.devices_per_node, f"n{p}")
        sets = list(study.overrides)
        rule = study.scale.get("global_batch")
        if rule == "per_point":
            batch, rest = divmod(study.base_global_batch * p, study.points[0])
            if rest:
                raise StudyError(
                    f"study file {study.path}: point {p}: scale.global_batch per_point gives {study.base_global_batch} "
                    f"x {p} / {study.points[0]}, not an integer; use points that are multiples of {study.points[0]}"
                )
            sets.append(f"train.global_batch={batch}")
        elif rule == "per_rank":
            sets.append(f"train.global_batch={study.base_global_batch * ranks}")
        sets += study.per_point.get(p, ())
        run_dir = runs / study.name / label
        sets += [
            f"run.study={study.name}",
            f"run.study_kind={study.kind}",
            f"run.study_point={p}",
            f"run.dir={run_dir}",
        ]
        out.append(Point(p, nodes, ranks, label, run_dir, tuple(sets)))
    return out


def point_deck(study: Study, point: Point) -> Deck:
    """The deck the point runs, resolved for its ranks (DeckError if it cannot run)."""
    return resolve_for_world(load_deck(study.base, point.overrides), point.ranks)


def _where(study: Study, pt: Point) -> str:
    return f"study file {study.path}: point {pt.point} ({pt.nodes} node(s), {pt.ranks} rank(s))"


def _stop(failures: list[str]) -> None:
    if failures:
        more = f" (and {len(failures) - 1} more point(s))" if len(failures) > 1 else ""
        raise StudyError(failures[0] + more)


def write_jobs(study: Study, points: list[Point], out: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    """A job script per point (all checked before any is written) and submit_all.sh; the manifest entries."""
    built, failures, messages = [], [], {}
    for pt in points:
        argv = [str(study.base), "--machine", study.machine, "--nodes", str(pt.nodes),
                "--out", str(out / f"{study.name}-{pt.label}.sh"), "--job-name", f"{study.name}-{pt.label}"]  # fmt: skip
        if args.time or study.time:
            argv += ["--time", args.time or study.time]
        argv += [x for key in SCHEDULER_FLAGS if getattr(args, key) for x in (f"--{key}", getattr(args, key))]
        argv += [x for s in pt.overrides for x in ("--set", s)] + (["--force"] if args.force else [])
        said = io.StringIO()
        try:
            with contextlib.redirect_stderr(said):  # submit.py's notes, once for the study below
                text, path, _, _ = submit.build_script(submit.parse_args(argv), Path.cwd())
        except GridlmError as err:
            failures.append(f"{_where(study, pt)}: {str(err).removeprefix('submit: ')}")
            continue
        for line in said.getvalue().splitlines():
            messages.setdefault(line.removeprefix("submit: "), []).append(str(pt.point))
        built.append((pt, path, text))
    _stop(failures)
    for message, at in messages.items():
        print(f"study: {message} (point(s) {', '.join(at)})", file=sys.stderr)
    earlier = unchanged_since(study, out)
    entries = []
    for pt, path, text in built:
        submit.write_script(path, text)
        since = earlier.get((pt.label, pt.nodes, pt.ranks, pt.overrides))
        entries.append(_entry(pt, script=path, status="written", since=time.time() if since is None else since))
    kept = [str(pt.point) for pt, _, _ in built if (pt.label, pt.nodes, pt.ranks, pt.overrides) in earlier]
    if kept:
        print(f"study: point(s) {', '.join(kept)} unchanged since {out / 'manifest.json'}: their attempts stand "
              "(a summary.json they wrote still counts)")  # fmt: skip
    command = submit.SUBMIT_COMMAND[study.scheduler][0]
    # singleton waits only for earlier jobs of the same name, and each script has its own (name-label):
    # --dependency=singleton alone started every point at once.
    example = {
        "sbatch": f"--test-only, or --job-name={study.name} --dependency=singleton to run one at a time",
        "qsub": "-W depend=...",
    }
    lines = [
        "#!/bin/bash",
        f"# Submits the {len(built)} job script(s) of study {study.name} ({study.kind}, {study.machine_name}) in order.",
        "# Written by launch/study.py (writing the study again overwrites it). Arguments go to every",
        f"# {command} call, e.g. {example[command]}.",
        "set -euo pipefail",
        *(f'{command} "$@" {shlex.quote(str(path))}' for _, path, _ in built),
    ]
    submit.write_script(out / "submit_all.sh", "\n".join(lines) + "\n")
    return entries


def deck_digest(path: Path) -> str:
    """sha256 of the base deck's text: an edited deck is another run, whatever its path."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def unchanged_since(study: Study, out: Path) -> dict[tuple[str, int, int, tuple[str, ...]], float]:
    """The `since` of each point of the previous manifest in `out` whose run is the one written now:
    the same base deck (path and text), machine, label, nodes, ranks and --set list, by (label, nodes,
    ranks, overrides). Writing a study again (to mend one point, or another --time) keeps their
    attempts, so the summary.json they wrote still counts; a changed point's attempt begins now.
    An unreadable or older manifest (without deck_sha256) keeps nothing."""
    try:
        old = json.loads((out / "manifest.json").read_text())
    except (OSError, ValueError):
        return {}
    same = {"base": str(study.base), "deck_sha256": deck_digest(study.base), "machine": study.machine_name}
    if not isinstance(old, dict) or any(old.get(k) != v for k, v in same.items()):
        return {}
    kept = {}
    for p in old.get("points") or []:
        if not isinstance(p, dict):
            continue
        since, sets = p.get("since"), p.get("overrides")
        if isinstance(since, (int, float)) and not isinstance(since, bool) and isinstance(sets, list):
            kept[(p.get("label"), p.get("nodes"), p.get("ranks"), tuple(sets))] = float(since)
    return kept


def _entry(pt: Point, script: Optional[Path], status: str, since: Optional[float] = None) -> dict[str, Any]:
    """A manifest point. `since`: when this attempt began (epoch seconds: the job script written, or
    the point launched here); postprocess/ takes a summary.json older than that for an earlier
    attempt's, not this point's result."""
    return {
        "point": pt.point, "nodes": pt.nodes, "ranks": pt.ranks, "label": pt.label, "run_dir": str(pt.run_dir),
        "script": None if script is None else str(script), "status": status, "exit_status": None, "wall_s": None,
        "since": since, "overrides": list(pt.overrides),
    }  # fmt: skip


def manifest(study: Study, mode: str, entries: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "study": study.name,
        "kind": study.kind,
        "machine": study.machine_name,
        "scheduler": study.scheduler,
        "mode": mode,
        "base": str(study.base),
        "deck_sha256": deck_digest(study.base),  # with base: the deck whose runs these are
        "study_file": str(study.path),
        "devices_per_node": study.devices_per_node,
        "description": study.description,
        "points": entries,
    }


def write_manifest(out: Path, data: dict[str, Any]) -> None:
    """manifest.json, replaced atomically: postprocess/ may read it while --run-local is running."""
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "manifest.json.tmp"
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(out / "manifest.json")


def stream(cmd: list[str], log: Path, env: dict[str, str]) -> int:
    """Run `cmd`, its output to the terminal and to `log`; its exit status. Ctrl-C stops it first."""
    with log.open("w") as f, subprocess.Popen(
        cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace"
    ) as proc:  # fmt: skip
        f.write(f"study: launch: {shlex.join(cmd)}\n")
        try:
            for line in proc.stdout:
                sys.stdout.write(line)
                sys.stdout.flush()
                f.write(line)
                f.flush()
            return proc.wait()
        except KeyboardInterrupt:
            proc.send_signal(signal.SIGINT)  # mpirun passes it on and ends the ranks
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
            raise


def run_local(study: Study, points: list[Point], out: Path, force: bool) -> list[dict[str, Any]]:
    """Run every point here with mpirun, in order; a failing point is recorded and the next runs.
    The manifest entries (status ok or failed), also in out/manifest.json after every point."""
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        raise StudyError("--run-local: mpirun not found on PATH; run `source launch/env.sh` first")
    failures = []
    for pt in points:
        try:
            point_deck(study, pt)
        except GridlmError as err:
            failures.append(f"{_where(study, pt)}: {err}")
    if not force:
        _stop([f + " (--force runs it anyway)" for f in failures])
    for failure in failures:
        print(f"study: warning: {failure}; running it anyway (--force)", file=sys.stderr)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    # `-m app` from any working directory; relative paths in the deck stay relative to it.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    entries = [_entry(pt, script=None, status="pending") for pt in points]
    write_manifest(out, manifest(study, "run-local", entries))
    for pt, entry in zip(points, entries):
        cmd = [mpirun, "-n", str(pt.ranks), sys.executable, "-m", "app", str(study.base)]
        cmd += [x for s in pt.overrides for x in ("--set", s)]
        pt.run_dir.mkdir(parents=True, exist_ok=True)
        print(f"study: point {pt.point} ({pt.ranks} rank(s)) -> {pt.run_dir}/run.log", flush=True)
        start = time.monotonic()
        entry.update(status="running", since=time.time())
        write_manifest(out, manifest(study, "run-local", entries))
        try:
            status = stream(cmd, pt.run_dir / "run.log", env)
        except KeyboardInterrupt:
            entry.update(status="interrupted", wall_s=round(time.monotonic() - start, 1))
            write_manifest(out, manifest(study, "run-local", entries))
            raise
        entry.update(
            status="ok" if status == 0 else "failed", exit_status=status, wall_s=round(time.monotonic() - start, 1)
        )
        write_manifest(out, manifest(study, "run-local", entries))
        print(f"study: point {pt.point}: {entry['status']} (exit status {status}) in {entry['wall_s']} s", flush=True)
    return entries


def predict_points(study: Study, points: list[Point]) -> list[dict[str, Any]]:
    """Each point's deck planned and predicted on the study's machine (app/plan/perf.py), no run.

    Weak studies: efficiency = model TFLOP/s per device / the first point's. Strong: speedup =
    tokens/s / the first point's, efficiency = speedup x first GPUs / GPUs."""
    from app.plan.dryrun import make_plan
    from app.plan.estimate import model_params
    from app.plan.machine import load_machine

    machine = load_machine(study.machine)
    rows: list[dict[str, Any]] = []
    for pt in points:
        deck = point_deck(study, pt)
        plan = make_plan(deck, pt.ranks, machine)
        if plan.predicted is None:
            raise StudyError(
                f"{_where(study, pt)}: no prediction: {plan.problems[0] if plan.problems else plan.unpredicted}"
            )
        q = plan.predicted
        m, par = deck.model, deck.parallel
        rows.append({
            "point": pt.point, "nodes": pt.nodes, "gpus": pt.ranks, "label": pt.label,
            "parameters": model_params(m), "grid": {"tp": par.tp, "pp": par.pp, "dp": deck.dp},
            "global_batch": deck.train.global_batch, **q.to_dict(),
        })  # fmt: skip
    base = rows[0]
    for row in rows:
        if study.kind == "weak":
            row["efficiency"] = row["tflops_per_device"] / base["tflops_per_device"]
        else:
            row["speedup"] = row["tokens_per_s"] / base["tokens_per_s"]
            row["efficiency"] = row["speedup"] * base["gpus"] / row["gpus"]
    return rows


def print_predicted(study: Study, rows: list[dict[str, Any]]) -> None:
    print(f"study {study.name}: predicted {study.kind} scaling on {study.machine_name} (app/plan/perf.py; no runs)")
    print("  nodes    GPUs  params  tp x pp x dp   step (s)  TFLOP/s/GPU   MFU  efficiency  largest loss")
    for r in rows:
        b = {k: v for k, v in r["breakdown"].items() if k not in ("gemm", "recompute")}
        worst = max(b, key=b.get)  # type: ignore[arg-type]
        g = r["grid"]
        print(
            f"  {r['nodes']:>5} {r['gpus']:>7} {r['parameters'] / 1e9:6.1f}B  {g['tp']} x {g['pp']} x {g['dp']:<6}"
            f" {r['step_time_s']:9.3g}  {r['tflops_per_device']:11.1f} {100 * r['mfu']:5.1f}%  {100 * r['efficiency']:9.1f}%"
            f"  {worst} {b[worst]:.3g} s"
        )


def print_table(study: Study, points: list[Point], entries: list[dict[str, Any]]) -> None:
    """One row per point: nodes, ranks, grid, global batch, status, run dir and script."""
    rows = [("point", "nodes", "ranks", "tp x pp x dp", "global_batch", "status", "run dir", "script")]
    for pt, entry in zip(points, entries):
        try:
            deck = point_deck(study, pt)
            grid, batch = f"{deck.parallel.tp} x {deck.parallel.pp} x {deck.dp}", str(deck.train.global_batch)
        except GridlmError:
            grid, batch = "(deck error)", "?"
        status = entry["status"] + ("" if entry["exit_status"] in (None, 0) else f" ({entry['exit_status']})")
        rows.append(
            (str(pt.point), str(pt.nodes), str(pt.ranks), grid, batch, status, str(pt.run_dir), entry["script"] or "-")
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    print(f"study {study.name}: {study.kind} scaling of {study.base} on {study.machine_name}: {study.description}")
    for row in rows:
        print("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m launch.study",
        description="Expand a scaling study (inputs/studies/NAME.yaml) into one run per point: a job script per "
        "point (launch/submit.py's checks, manifest.json, submit_all.sh), or with --run-local every point run here.",
        epilog="Examples: python -m launch.study inputs/studies/frontier_weak.yaml --account abc123 && "
        "jobs/frontier_weak/submit_all.sh;  source launch/env.sh && python -m launch.study "
        "inputs/studies/local_weak.yaml --run-local",
    )
    p.add_argument("study", help="study file (YAML); its keys are described in launch/study.py's docstring")
    p.add_argument("--out", help="where job scripts, submit_all.sh and manifest.json go (default: jobs/<name>/)")
    p.add_argument(
        "--run-local",
        action="store_true",
        help="run the points here, one after another, with `mpirun -n POINT python -m app` (points are ranks; "
        "run dirs runs/<name>/r<ranks>, each with run.log); uses this python and environment, so "
        "`source launch/env.sh` first. The study's machine is not used (no scheduler, no plan check). "
        "Exit status 1 if a point failed",
    )
    p.add_argument(
        "--predict",
        action="store_true",
        help="no runs: predict every point on the study's machine (app/plan/perf.py) and write predicted.json "
        "next to manifest.json (postprocess.scaling draws it beside measured points)",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="write scripts past plan problems (--run-local: run points whose deck check fails)",
    )
    p.add_argument("--time", help="job time limit for every point (default: the study's time, else the machine's)")
    for key in SCHEDULER_FLAGS:
        p.add_argument(f"--{key}", help=f"passed to launch/submit.py --{key} for every point")
    return p.parse_args(argv)


def check_modes(args: argparse.Namespace) -> None:
    """Options that cannot apply together are refused, not dropped: --predict with --run-local printed
    rows of neither (1 node of 128 GPUs), and --time or --account did nothing in those modes."""
    if args.predict and args.run_local:
        raise StudyError("--predict and --run-local: one at a time (--predict runs nothing; --run-local runs here)")
    mode = "--predict" if args.predict else "--run-local" if args.run_local else None
    if mode is not None:
        unused = [f"--{key.replace('_', '-')}" for key in ("time", *SCHEDULER_FLAGS) if getattr(args, key) is not None]
        if args.predict and args.force:
            unused.append("--force")
        if unused:
            does = "predicts and writes no job scripts" if args.predict else "runs here, with no scheduler"
            raise StudyError(
                f"{', '.join(unused)}: not used by {mode}, which {does}; drop {'them' if len(unused) > 1 else 'it'}"
            )
    if args.out is not None and not args.out.strip():
        raise StudyError(f"--out {args.out!r}: an empty path; pass --out DIR, or omit --out for jobs/<name>/")
    if args.time is not None and not args.time.strip():  # '' fell back to the study's time silently
        raise StudyError(f"--time {args.time!r}: empty; pass HH:MM:SS, or omit --time for the study's time")


def out_error(given: str, out: Path, err: OSError) -> str:
    """An OSError of the output directory in words, with the fix; another file's as it came."""
    named = Path(os.path.abspath(err.filename)) if err.filename else None
    if named is None or (named != out and out not in named.parents):
        return f"{err.filename or ''}{': ' if err.filename else ''}{err.strerror or err}"
    problem = submit.path_problem(out, True, err)
    return f"--out {given}: {problem}; pass --out a directory that can be created and written"


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    out = Path()
    try:
        check_modes(args)
        study = load_study(Path(args.study))
        out = Path(os.path.abspath(args.out or Path("jobs") / study.name))
        points = expand(study, run_local=args.run_local, runs=Path.cwd() / "runs")
        if args.predict:
            rows = predict_points(study, points)
            out.mkdir(parents=True, exist_ok=True)
            data = {"study": study.name, "kind": study.kind, "machine": study.machine_name, "points": rows,
                    "model": "app/plan/perf.py (docs/PERFORMANCE_MODEL.md)"}  # fmt: skip
            (out / "predicted.json").write_text(json.dumps(data, indent=2) + "\n")
            print_predicted(study, rows)
            print(f"study: wrote {out / 'predicted.json'}")
            return 0
        if args.run_local:
            print(
                f"study: note: --run-local: every point runs here (mpirun -n <point>); machine {study.machine_name} is not used"
            )
            try:
                entries = run_local(study, points, out, args.force)
            except KeyboardInterrupt:
                print(f"study: interrupted; {out / 'manifest.json'} records which points ran", file=sys.stderr)
                return 130
            print_table(study, points, entries)
            print(f"study: wrote {out / 'manifest.json'}")
            return 0 if all(e["status"] == "ok" for e in entries) else 1
        entries = write_jobs(study, points, out, args)
        write_manifest(out, manifest(study, "jobs", entries))
        print_table(study, points, entries)
        print(f"study: wrote {len(entries)} job script(s), {out / 'manifest.json'} and {out / 'submit_all.sh'}")
        print(f"study: submit them with: {out / 'submit_all.sh'}")
    except GridlmError as err:
        print(f"study: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        print(f"study: {out_error(args.out or str(out), out, err)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

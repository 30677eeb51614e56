"""Weak- and strong-scaling tables and figures from the reports of many runs.

    python -m postprocess.scaling RUN... --out results/NAME/ [--kind weak|strong] [--title T]

A RUN is a run directory (summary.json, metrics.jsonl, deck.yaml), a study manifest
(manifest.json, written by launch/study.py) or a directory holding one, or the predicted
points of a study (predicted.json, written by `launch.study --predict`; a directory with a
manifest and a predicted.json brings both). Predicted points are drawn beside the measured
ones (dashed) and get their own columns; a study with predictions only is reported alone. A manifest brings
in every point the study planned, so that points which failed or never ran show up as gaps
instead of silently vanishing. Runs are grouped by study (summary.json's study.name, else
the manifest's study, else deck.yaml's run.study): one study writes its files into --out,
several write one set each into --out/<study>/. The kind comes from --kind, else the
runs' study.kind, else the manifest; a study that mixes kinds is refused.

Definitions (N = GPUs = MPI ranks = world_size; N0 = the baseline's):
  weak efficiency   = per-GPU throughput at N / per-GPU throughput at N0, in tokens/s per
                      GPU when every point trains the same model. When the model grows with N
                      (FLOPs per token differ, as in Megatron SC21 Table 1) a token is more
                      work at larger N, so the throughput is model FLOP/s per GPU instead.
  strong speedup    = tokens/s at N / tokens/s at N0 (a fixed problem: the inverse step-time ratio)
  strong efficiency = speedup / (N / N0)
The baseline is the point with the fewest GPUs that has a result; when the smallest planned
point has none, the table, the figures' data and summary.json say so.

Step time: mean ± standard deviation after the warm-up steps (summary.json); spread: min-max
of the step times logged after the warm-up (metrics.jsonl), p10-p90 from 10 logged steps on.
A job that timed no more than run.timing_warmup steps left none out (summary.json's
timing_warmup_steps below the deck's): its row is shown as "warm-up in timing", without an
efficiency, and is neither the baseline nor in the figures; a note says how many steps to run.
FLOP/s are model FLOPs as summary.json's flops_kind says (Megatron SC21 count).

Files written into the output directory:
  scaling.csv   one row per point, the columns of COLUMNS (empty cell = no value)
  scaling.md    the same as a Markdown table, with the FLOP convention and the definitions
  summary.json  {study, kind, machine, title, flops_kind, definitions, efficiency_basis,
                 baseline, columns, rows, notes, files}
  weak_efficiency.{png,pdf} (weak) or strong_speedup.{png,pdf} (strong), and pflops.{png,pdf}
                (matplotlib; without it the rest is written and a warning and note say so)
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from app.metrics.summary import Summary

KINDS = ("weak", "strong")
COLUMNS = ["point", "nodes", "gpus", "grid", "parameters", "step_time_s", "step_time_std_s", "step_time_lo_s", "step_time_hi_s",
           "spread", "tokens_per_s", "tokens_per_s_per_gpu", "tflops_per_gpu", "hw_tflops_per_gpu", "aggregate_pflops",
           "peak_tflops_per_gpu", "mfu_pct", "hfu_pct", "speedup", "efficiency_pct", "status", "run_dir"]  # fmt: skip
DEFINITIONS = {
    "weak": "weak-scaling efficiency = per-GPU throughput at N GPUs / per-GPU throughput at the baseline's N0 GPUs",
    "strong": "strong-scaling efficiency = speedup / (N / N0), speedup = tokens/s at N GPUs / tokens/s at the "
    "baseline's N0 GPUs (same problem, so the inverse step-time ratio)",
    "baseline": "the point with the fewest GPUs that has a result",
    "step_time": "mean ± standard deviation of the step time after the warm-up steps (summary.json)",
    "spread": "min-max of the step times logged after the warm-up (metrics.jsonl); p10-p90 from 10 logged steps on",
}
# manifest statuses of points that never ran (launch/study.py), and how the table says so
MISSING = {"not run": "missing (not run)", "written": "missing (script written, not run)",
           "pending": "missing (pending: not run yet)",
           "running": "incomplete (running, or its study was stopped)"}  # fmt: skip
# Seconds a file system's clock may lag the launch host's: a summary.json stamped this much before a
# point's attempt began still counts as that attempt's (an earlier attempt's is older by far).
CLOCK_SKEW_S = 120.0
PERCENTILE_FROM = 10  # logged steps from which the spread is p10-p90 instead of min-max


class ScalingError(Exception):
    """A problem with the inputs; the CLI prints it as one line and exits 2."""


@dataclass
class Run:
    """One point of a study: what was planned and, when the run finished, its summary."""

    run_dir: Path
    status: str  # "ok", "failed (no summary.json)", "missing (not run)", ...
    study: Optional[str] = None
    kind: Optional[str] = None
    point: Optional[int] = None
    nodes: Optional[int] = None
    gpus: Optional[int] = None
    grid: str = "-"
    summary: Optional[Summary] = None
    step_times: list[float] = field(default_factory=list)  # logged step times after the warm-up
    machine: Optional[str] = None
    stale: bool = False  # a summary.json is there, but an earlier attempt's (`load_run`)
    warmup: Optional[str] = None  # why the step time includes warm-up steps (`warmup_in_timing`); None: it does not


@dataclass
class Study:
    name: Optional[str]
    runs: list[Run]
    kind: Optional[str] = None


# --- reading runs and manifests -------------------------------------------------------------


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ScalingError(f"{path} is not valid JSON ({err.msg}, line {err.lineno}); rerun or remove it") from None
    except OSError as err:
        raise ScalingError(f"cannot read {path}: {err.strerror}") from None


def grid_label(grid: Mapping[str, Any]) -> str:
    """tp2 x pp2 x dp4, with cp (context parallelism) where it is more than 1."""
    cp = grid.get("cp", 1)
    cp_part = f" x cp{cp}" if isinstance(cp, int) and cp > 1 else ""
    return f"tp{grid['tp']}{cp_part} x pp{grid['pp']} x dp{grid['dp']}"


def read_deck(run_dir: Path) -> dict[str, Any]:
    """The resolved deck a run wrote at its start ({} when absent or unreadable): what a run that
    died before summary.json still tells about itself."""
    try:
        deck = yaml.safe_load((run_dir / "deck.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return {}
    return deck if isinstance(deck, dict) else {}


def logged_step_times(run_dir: Path, summary: Summary) -> list[float]:
    """Step times of metrics.jsonl after this run's warm-up (a resumed run's older records are
    another process's and are left out, as summary.json's mean leaves them out)."""
    first = (summary.start_step or 0) + (summary.timing_warmup_steps or 0)
    times = []
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        try:
            record = json.loads(line)
            step, time = int(record["step"]), float(record["step_time_s"])
        except (ValueError, KeyError, TypeError):
            continue  # a torn last line of a killed run
        if step > first:
            times.append(time)
    return times


# summary.json's values that a row computes with: key -> (what is accepted, test); None passes where
# the key may be absent (older summaries). A damaged or hand-edited file is named, not a traceback.
def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _integer(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


SUMMARY_VALUES: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "world_size": ("an integer >= 1", lambda v: _integer(v) and v >= 1),
    "nodes": ("an integer >= 1", lambda v: _integer(v) and v >= 1),
    "grid": ("{tp, pp, dp: integers >= 1}",
             lambda v: isinstance(v, dict) and all(_integer(v.get(a)) and v[a] >= 1 for a in ("tp", "pp", "dp"))),
    "tokens_per_step": ("a number > 0", lambda v: _number(v) and v > 0),
    "step_time_s": ("a number > 0", lambda v: _number(v) and v > 0),
    "step_time_std_s": ("a number >= 0", lambda v: _number(v) and v >= 0),
    "tokens_per_s": ("a number > 0", lambda v: _number(v) and v > 0),
    "flops_per_step": ("a number > 0", lambda v: _number(v) and v > 0),
    "tflops_per_rank": ("a number > 0", lambda v: _number(v) and v > 0),
    "aggregate_tflops": ("a number >= 0", lambda v: _number(v) and v >= 0),
    "aggregate_pflops": ("a number >= 0 or null", lambda v: v is None or (_number(v) and v >= 0)),
    "hw_tflops_per_rank": ("a number >= 0 or null", lambda v: v is None or (_number(v) and v >= 0)),
    "peak_tflops_per_rank": ("a number > 0 or null", lambda v: v is None or (_number(v) and v > 0)),
    "mfu": ("a number >= 0 or null", lambda v: v is None or (_number(v) and v >= 0)),
    "hfu": ("a number >= 0 or null", lambda v: v is None or (_number(v) and v >= 0)),
    "parameters": ("an integer >= 0 or null", lambda v: v is None or (_integer(v) and v >= 0)),
    "steps": ("an integer >= 0 or null", lambda v: v is None or (_integer(v) and v >= 0)),
    "start_step": ("an integer >= 0 or null", lambda v: v is None or (_integer(v) and v >= 0)),
    "timing_warmup_steps": ("an integer >= 0 or null", lambda v: v is None or (_integer(v) and v >= 0)),
    "flops_kind": ("a string or null", lambda v: v is None or isinstance(v, str)),
    "deck": ("a mapping or null", lambda v: v is None or isinstance(v, dict)),
    "study": ("{name, kind, point} or null",
              lambda v: v is None or (isinstance(v, dict) and (v.get("point") is None or _integer(v["point"])))),
}  # fmt: skip


def check_values(data: dict[str, Any], path: Path) -> None:
    """ScalingError naming `path`, the key and its value where a value SUMMARY_VALUES lists is not
    what a row can compute with (step_time_std_s null, world_size "4", tokens_per_s 0)."""
    for key, (accepted, ok) in SUMMARY_VALUES.items():
        value = data.get(key)
        if not ok(value):
            why = " (written as null: it was not finite)" if key in (data.get("nonfinite") or ()) else ""
            raise ScalingError(f"{path}: {key} = {value!r}{why}: expected {accepted}; run the point again or "
                               "mend the file")  # fmt: skip


def deck_warmup(s: Summary, run_dir: Path, path: Path) -> Optional[int]:
    """The run's run.timing_warmup: summary.json's deck, else deck.yaml (None when neither says)."""
    if s.deck is not None:
        deck, where = s.deck, f"{path}: deck.run"
    else:
        deck, where = read_deck(run_dir), f"{run_dir / 'deck.yaml'}: run"
    run = deck.get("run")
    value = run.get("timing_warmup") if isinstance(run, dict) else None
    if value is not None and not (_integer(value) and value >= 0):
        raise ScalingError(f"{where}.timing_warmup = {value!r}: expected an integer >= 0; mend the file")
    return value


def warmup_in_timing(s: Summary, wanted: Optional[int]) -> Optional[str]:
    """Why the mean step time includes warm-up steps, or None when it does not (or cannot be told).
    The app leaves run.timing_warmup steps out only when the job timed more than that many
    (app/metrics/report.py mean_step_time): a job resumed near its end, or stopped by a signal after a
    step or two, means its first steps, with allocation and (on GPUs) torch.compile."""
    left_out = s.timing_warmup_steps
    if wanted is None or left_out is None or left_out >= wanted:
        return None
    start = s.start_step or 0
    timed = f"{s.steps - start} step(s)" if s.steps is not None and not s.interrupted else f"at most {wanted} step(s)"
    return (f"the job timed {timed}, not more than run.timing_warmup = {wanted}, so none was left out of the "
            f"mean; train more than {wanted} steps in one job (here train.steps >= {start + wanted + 1}, as it "
            f"starts at step {start}) and run postprocess.scaling again")  # fmt: skip


def finished_run(run_dir: Path, summary_path: Path) -> Run:
    data = read_json(summary_path)
    missing = Summary.missing_keys(data)
    if missing:
        raise ScalingError(f"{summary_path} lacks {', '.join(missing)}: not a gridlm summary.json")
    check_values(data, summary_path)
    s = Summary.from_dict(data)
    study = s.study or {}
    warmup = warmup_in_timing(s, deck_warmup(s, run_dir, summary_path))
    status = "ok" if warmup is None else "warm-up in timing"
    status += f" (stopped early by {s.interrupted})" if s.interrupted else ""
    run = Run(run_dir, status, study.get("name"), study.get("kind"), study.get("point"), s.nodes,
              s.world_size, grid_label(s.grid), s, logged_step_times(run_dir, s))  # fmt: skip
    run.warmup = warmup
    return run


def _newer(path: Path, since: Optional[float]) -> bool:
    """`path` exists and was written at or after `since` (epoch seconds; None: whenever), give or
    take CLOCK_SKEW_S: `since` is the launch host's clock, a file's time the file system's."""
    try:
        mtime = path.stat().st_mtime
    except OSError:
        return False
    return since is None or mtime >= since - CLOCK_SKEW_S


def unfinished_run(run_dir: Path, planned: str, since: Optional[float] = None, stale: bool = False) -> Run:
    """A run without a summary.json of its own; `planned` is the manifest's status ("" when none
    listed it), `since` when the manifest's attempt began, `stale`: the summary.json there is an
    earlier attempt's."""
    why = "summary.json is from an earlier attempt" if stale else "no summary.json"
    if planned == "written" and _newer(run_dir / "deck.yaml", since):
        # A job writes deck.yaml as it starts: it ran (and died) or is still running.
        status = f"incomplete (the job started; {why}: failed or still running)"
    elif planned in MISSING:
        status = MISSING[planned] + ("; its summary.json is from an earlier attempt" if stale else "")
    else:
        why = why if run_dir.is_dir() else "no run directory"
        status = f"failed (interrupted, {why})" if planned == "interrupted" else f"failed ({why})"
    deck = read_deck(run_dir)
    run, par = deck.get("run") or {}, deck.get("parallel") or {}
    out = Run(run_dir, status, run.get("study"), run.get("study_kind"), run.get("study_point"), stale=stale)
    if all(isinstance(par.get(a), int) for a in ("tp", "pp", "dp")):
        cp = par.get("cp", 1) if isinstance(par.get("cp", 1), int) else 1  # context parallelism's ranks too
        out.gpus, out.grid = par["tp"] * cp * par["pp"] * par["dp"], grid_label(par)
    return out


def load_run(run_dir: Path, planned: str = "", since: Optional[float] = None) -> Run:
    """A run's result from its summary.json, unless the manifest says the point failed and the file
    is older than the attempt (`since`: launch.study's, when the point was launched or its job
    script written; `_newer`) or cannot be dated (an older manifest), or a job's is older: a run that
    fails early (a deck or data error) leaves an earlier attempt's summary.json in place, whose
    numbers are not this point's. A point that exited 0 stands by the summary there (a finished run
    launched again resumes at its end and trains nothing; the app then marks the summary as this
    attempt's too, `Trainer.train`)."""
    summary = run_dir / "summary.json"
    if not summary.is_file():
        return unfinished_run(run_dir, planned, since)
    # A point still "pending" (--run-local writes every point so, with no `since`, before the first
    # runs) has not run in this attempt: a summary.json there is an earlier run's, whatever its time.
    never_ran = planned in ("pending", "not run")
    if planned != "ok" and (never_ran or not _newer(summary, since) or (since is None and planned == "failed")):
        return unfinished_run(run_dir, planned, since, stale=True)
    run = finished_run(run_dir, summary)
    if planned == "failed":  # it wrote its summary, then exited with an error
        run.status += " (then the job failed: see run.log)"
    return run


def manifest_run_dir(run_dir: Path, here: Path) -> Path:
    """A manifest's run_dir as found: as written (relative: to the working directory), else next
    to the manifest (a study directory copied off the machine)."""
    for candidate in (run_dir, here / run_dir, here / run_dir.name):
        if candidate.exists():
            return candidate
    return run_dir


def manifest_runs(path: Path) -> list[Run]:
    """The points of a study manifest, finished or not, with the manifest's facts filled in."""
    m = read_json(path)
    if not isinstance(m, dict) or not isinstance(m.get("points"), list):
        raise ScalingError(f"{path} is not a study manifest: it needs a 'points' list (see launch/study.py)")
    runs = []
    for p in m["points"]:
        if not isinstance(p, dict) or not p.get("run_dir"):
            raise ScalingError(f"{path}: a point without run_dir: {p!r}")
        run_dir = manifest_run_dir(Path(p["run_dir"]), path.parent)
        since = p.get("since")
        run = load_run(run_dir, str(p.get("status") or ""), float(since) if isinstance(since, (int, float)) else None)
        run.study = run.study or m.get("study")
        run.kind = run.kind or m.get("kind")
        run.point = run.point if run.point is not None else p.get("point")
        run.nodes = run.nodes if run.nodes is not None else p.get("nodes")
        run.gpus = run.gpus if run.gpus is not None else p.get("ranks")
        run.machine = m.get("machine")
        runs.append(run)
    return runs


def read_predicted(path: Path) -> dict[str, Any]:
    """A study's predicted.json (launch.study --predict), checked for its points."""
    data = read_json(path)
    if not isinstance(data, dict) or not isinstance(data.get("points"), list):
        raise ScalingError(f"{path} is not a prediction: it needs a 'points' list (launch.study --predict)")
    return data


def collect_predicted(paths: list[str]) -> dict[Optional[str], dict[str, Any]]:
    """The predicted.json files named on the command line (or beside a manifest), by study."""
    found: dict[Optional[str], dict[str, Any]] = {}
    for arg in paths:
        path = Path(arg)
        path = path / "predicted.json" if path.is_dir() else path
        if path.name == "predicted.json" and path.is_file():
            data = read_predicted(path)
            found[data.get("study")] = data
    return found


def predicted_only(paths: list[str]) -> list[str]:
    """The arguments that are predictions and nothing else (no manifest, no run)."""
    out = []
    for arg in paths:
        path = Path(arg)
        if (path.is_file() and path.name == "predicted.json") or (
            path.is_dir() and (path / "predicted.json").is_file() and not (path / "manifest.json").is_file()
        ):
            out.append(arg)
    return out


def collect(paths: list[str]) -> list[Run]:
    """Expand the command line into runs (manifests into their points), each run dir once."""
    runs: dict[Path, Run] = {}
    for arg in paths:
        path = Path(arg)
        if path.is_dir() and (path / "manifest.json").is_file():
            path = path / "manifest.json"
        if not path.exists():
            raise ScalingError(f"{arg}: no such run directory or manifest")
        if path.is_file() and path.name == "summary.json":
            found = [load_run(path.parent)]
        elif path.is_file():
            found = manifest_runs(path)
        else:
            check_not_a_parent(arg, path)
            found = [load_run(path)]
        for run in found:
            runs.setdefault(run.run_dir.resolve(), run)
    return list(runs.values())


def check_not_a_parent(arg: str, path: Path) -> None:
    """A directory without summary.json whose subdirectories hold run or study files (runs/<study>/,
    jobs/) is a parent of runs, not a run that failed: a ScalingError naming the ones to pass."""
    if (path / "summary.json").is_file():
        return
    below = sorted({p.parent for name in ("summary.json", "manifest.json") for p in path.glob(f"*/{name}")})
    if below:
        shown = " ".join(str(p) for p in below[:4]) + (" ..." if len(below) > 4 else "")
        raise ScalingError(f"{arg} holds no summary.json or manifest.json itself, but {len(below)} of its "
                           "subdirectories do: pass those instead (run directories, or a study's directory): "
                           f"{shown}")  # fmt: skip


def group_studies(runs: list[Run], kind: Optional[str], need_kind: bool = True) -> list[Study]:
    """One Study per study name, each with its kind settled (see the module docstring); with
    need_kind False a study whose kind nobody says gets kind None instead of an error."""
    if not runs:
        raise ScalingError("no summaries found: the manifest lists no points")
    names: dict[Optional[str], list[Run]] = {}
    for run in runs:
        names.setdefault(run.study, []).append(run)
    attach_strays(names)
    studies = []
    for name, members in names.items():
        label = f"study {name!r}" if name else "the runs"
        if not any(r.summary for r in members):
            stale = [str(r.run_dir) for r in members if r.stale]
            if stale:
                raise ScalingError(
                    f"no current summaries: {len(stale)} of the {len(members)} run(s) of {label} have a summary.json, "
                    "but each is older than its point's attempt in the manifest (`since`: its job script written, "
                    "or the point launched here), so it is taken for an earlier attempt's; run the points again, "
                    "or, if those summaries are the runs you mean, pass their run directories instead of the "
                    f"manifest: python -m postprocess.scaling {' '.join(stale)} --out DIR"
                )
            absent = [r.run_dir for r in members if not r.run_dir.exists()]
            if absent and len(absent) == len(members):  # a manifest's relative run_dir, read from elsewhere
                raise ScalingError(
                    f"no summaries found: none of the {len(members)} run directories of {label} exists (the "
                    f"manifest's run_dir, e.g. {absent[0]}, is relative to the directory launch.study ran in, and "
                    f"not next to the manifest either); run postprocess.scaling from that directory ({Path.cwd()} "
                    "is not it)"
                )
            raise ScalingError(f"no summaries found: none of the {len(members)} run(s) of {label} has a summary.json")
        kinds = {r.kind for r in members if r.kind}
        if kind is None and len(kinds) > 1:
            by_kind = "; ".join(
                f"{k}: {', '.join(r.run_dir.name for r in members if r.kind == k)}" for k in sorted(kinds)
            )
            raise ScalingError(f"{label} mixes weak and strong runs ({by_kind}); give runs of one kind")
        study_kind = kind or next(iter(kinds), None)
        if study_kind is None and need_kind:
            raise ScalingError(f"cannot tell whether {label} is weak or strong scaling: no summary.json has "
                               "study.kind and no manifest says; pass --kind weak or --kind strong")  # fmt: skip
        studies.append(Study(name, sorted(members, key=order_key), study_kind))
    return studies


def attach_strays(names: dict[Optional[str], list[Run]]) -> None:
    """A run that died before writing deck.yaml does not know its study: it joins the only one
    (with several, it is left out with a warning, as its study cannot be told)."""
    strays = [r for r in names.get(None, []) if r.summary is None]
    if not strays or len(names) == 1:
        return
    names[None] = [r for r in names[None] if r.summary is not None]
    if not names[None]:
        del names[None]
    if len(names) == 1:
        next(iter(names.values())).extend(strays)
        return
    for run in strays:
        print(f"scaling: warning: {run.run_dir} has no summary.json and no deck.yaml: its study is unknown, "
              "so it is in no table", file=sys.stderr)  # fmt: skip


def order_key(run: Run) -> tuple[float, float, str]:
    """By GPUs, then point; runs whose size is unknown go last."""
    inf = math.inf
    return (run.gpus if run.gpus is not None else inf, run.point if run.point is not None else inf, str(run.run_dir))


# --- computation (pure) ------------------------------------------------------------------------


def weak_efficiency(per_gpu: float, base_per_gpu: float) -> float:
    return per_gpu / base_per_gpu


def strong_speedup(tokens_per_s: float, base_tokens_per_s: float) -> float:
    return tokens_per_s / base_tokens_per_s


def strong_efficiency(speedup: float, gpus: int, base_gpus: int) -> float:
    return speedup / (gpus / base_gpus)


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated q-quantile (0 <= q <= 1), as numpy.percentile's default."""
    s = sorted(values)
    pos = q * (len(s) - 1)
    low = math.floor(pos)
    return s[low] + (s[min(low + 1, len(s) - 1)] - s[low]) * (pos - low)


def step_time_spread(times: list[float]) -> Optional[tuple[float, float, str]]:
    """(low, high, which) of the logged step times, or None when none were logged."""
    if not times:
        return None
    if len(times) >= PERCENTILE_FROM:
        return percentile(times, 0.1), percentile(times, 0.9), f"p10-p90 of {len(times)}"
    return min(times), max(times), f"min-max of {len(times)}"


def throughput_basis(runs: list[Run]) -> str:
    """'tokens' when every finished point does the same FLOPs per token, else 'flops' (see docstring)."""
    per_token = [r.summary.flops_per_step / r.summary.tokens_per_step for r in runs if r.summary]
    same = all(math.isclose(f, per_token[0], rel_tol=1e-9) for f in per_token)
    return "tokens" if same else "flops"


def point_row(run: Run) -> dict[str, Any]:
    """The measured columns of one point (None where it has no result)."""
    row: dict[str, Any] = dict.fromkeys(COLUMNS)
    row.update(point=run.point, nodes=run.nodes, gpus=run.gpus, grid=run.grid, status=run.status,
               run_dir=str(run.run_dir))  # fmt: skip
    s = run.summary
    if s is None:
        return row
    spread = step_time_spread(run.step_times)
    row.update(
        step_time_s=s.step_time_s,
        step_time_std_s=s.step_time_std_s,
        parameters=s.parameters,
        tokens_per_s=s.tokens_per_s,
        tokens_per_s_per_gpu=s.tokens_per_s / s.world_size,
        tflops_per_gpu=s.tflops_per_rank,
        hw_tflops_per_gpu=s.hw_tflops_per_rank,  # recomputation counted (None in older summaries)
        # summaries from before aggregate_pflops have aggregate_tflops
        aggregate_pflops=s.aggregate_tflops / 1e3 if s.aggregate_pflops is None else s.aggregate_pflops,
        peak_tflops_per_gpu=s.peak_tflops_per_rank,
        mfu_pct=None if s.mfu is None else 100 * s.mfu,
        hfu_pct=None if s.hfu is None else 100 * s.hfu,
    )
    if spread:
        row.update(step_time_lo_s=spread[0], step_time_hi_s=spread[1], spread=spread[2])
    return row


def scaling_rows(runs: list[Run], kind: Optional[str]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Rows in `runs`' order with speedup and efficiency against the baseline, and the baseline
    {point, gpus, run_dir, basis, note}. `kind` None leaves both empty (compare.py without a kind)."""
    rows = [point_row(r) for r in runs]
    # A point whose step time includes warm-up is shown but measured against nothing (`warmup_in_timing`).
    done = [(r, row) for r, row in zip(runs, rows) if r.summary and r.warmup is None]
    if not done:
        raise ScalingError(
            "no point has a step time without warm-up: "
            + "; ".join(f"{r.run_dir}: {r.warmup}" for r in runs if r.warmup)
        )
    base_run, base = min(done, key=lambda d: order_key(d[0]))
    basis = throughput_basis(runs) if kind == "weak" else "tokens"
    key = "tokens_per_s_per_gpu" if basis == "tokens" else "tflops_per_gpu"
    for run, row in done:
        if kind == "weak":
            row["efficiency_pct"] = 100 * weak_efficiency(row[key], base[key])
        elif kind == "strong":
            row["speedup"] = strong_speedup(row["tokens_per_s"], base["tokens_per_s"])
            row["efficiency_pct"] = 100 * strong_efficiency(row["speedup"], run.gpus, base_run.gpus)
    note = f"the {base_run.gpus}-GPU point (the smallest with a result)"
    smallest = runs[0]
    if smallest is not base_run and smallest.gpus is not None and smallest.gpus < base_run.gpus:
        note += f"; the smallest planned point, {n_gpus(smallest.gpus)}, has no result: {smallest.status}"
    baseline = {"point": base_run.point, "gpus": base_run.gpus, "run_dir": str(base_run.run_dir), "note": note,
                "basis": "tokens/s per GPU" if basis == "tokens" else "model TFLOP/s per GPU (the model grows with N)"}  # fmt: skip
    return rows, baseline


def problem_notes(runs: list[Run], kind: str) -> list[str]:
    """Warnings about a strong study whose points do not share one problem, or a weak study of one
    model whose points do not share the work per GPU."""
    done = [r.summary for r in runs if r.summary]
    notes = []
    if kind == "weak" and throughput_basis(runs) == "tokens":  # one model: the batch grows with the GPUs
        per_gpu = sorted({s.tokens_per_step / s.world_size for s in done})
        if not all(math.isclose(v, per_gpu[0], rel_tol=1e-9) for v in per_gpu):
            notes.append("warning: weak scaling keeps the work per GPU, but the tokens per step per GPU differ: "
                         f"{', '.join(f'{v:g}' for v in per_gpu)}; the efficiency compares unlike runs (a study "
                         "file's scale.global_batch: per_rank grows the batch with the GPUs)")  # fmt: skip
    if kind == "strong":
        shared = (
            ({s.tokens_per_step for s in done}, "tokens per step"),
            ({s.parameters for s in done}, "parameter count"),
        )
        for found, what in shared:
            values = sorted(found, key=str)
            if len(values) > 1:
                notes.append(f"warning: strong scaling needs one fixed problem, but the {what} differs: {values}")
    return notes


def gap_notes(rows: list[dict[str, Any]]) -> list[str]:
    return [f"no result at {gpus_text(r)}: {r['status']} ({r['run_dir']})" for r in rows if r["tokens_per_s"] is None]


def warmup_notes(runs: list[Run]) -> list[str]:
    """Why a point's numbers are shown but not measured against (no efficiency, not in the figures)."""
    notes = []
    for r in runs:
        if r.warmup:
            where = gpus_text({"point": r.point, "gpus": r.gpus})
            notes.append(f"{where}: its step time includes warm-up steps, so it has no efficiency and is not in the "
                         f"figures: {r.warmup} ({r.run_dir})")  # fmt: skip
    return notes


def counted(row: dict[str, Any]) -> bool:
    """A row with a result that the efficiency and the figures use: finished, timed after its warm-up."""
    return row["tokens_per_s"] is not None and str(row["status"]).startswith("ok")


def n_gpus(n: int) -> str:
    return f"{n} GPU" if n == 1 else f"{n} GPUs"


def gpus_text(row: dict[str, Any]) -> str:
    where = n_gpus(row["gpus"]) if row["gpus"] is not None else "unknown size"
    return f"point {row['point']} ({where})" if row["point"] is not None else where


def flops_kind(runs: list[Run]) -> str:
    kinds = sorted({r.summary.flops_kind or "model FLOPs" for r in runs if r.summary})
    return " | ".join(kinds)


# --- tables ------------------------------------------------------------------------------------


def fmt(value: Optional[float], spec: str, none: str = "-") -> str:
    return none if value is None else format(value, spec)


def markdown_table(rows: list[dict[str, Any]], kind: Optional[str]) -> str:
    head = ["point", "nodes", "GPUs", "grid", "step time (s)", "spread (s)", "tokens/s", "TFLOP/s per GPU",
            "PFLOP/s", "% of peak", *(["speedup"] if kind == "strong" else []), "efficiency (%)", "status"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        done = r["tokens_per_s"] is not None
        time = f"{r['step_time_s']:.4g} ± {r['step_time_std_s']:.2g}" if done else "-"
        spread = f"{r['step_time_lo_s']:.4g}-{r['step_time_hi_s']:.4g} ({r['spread']})" if r["spread"] else "-"
        cells = [fmt(r["point"], "d"), fmt(r["nodes"], "d"), fmt(r["gpus"], "d"), r["grid"], time, spread,
                 fmt(r["tokens_per_s"], ",.0f" if done and r["tokens_per_s"] >= 100 else ".3g"),
                 fmt(r["tflops_per_gpu"], ".3g"), fmt(r["aggregate_pflops"], ".3g"),
                 fmt(r["mfu_pct"], ".1f", "n/a" if done else "-"),
                 *([fmt(r["speedup"], ".2f")] if kind == "strong" else []), fmt(r["efficiency_pct"], ".1f"),
                 r["status"]]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def markdown(title: str, table: str, head: dict[str, Any]) -> str:
    kind = head["kind"]
    lines = [f"# {title}", "", f"FLOP convention: {head['flops_kind']}.", "",
             f"Scaling efficiency: {DEFINITIONS[kind]}; per-GPU throughput here is {head['baseline']['basis']}."
             if kind == "weak" else f"Scaling efficiency: {DEFINITIONS[kind]}.", "",
             f"Baseline: {head['baseline']['note']}.", "",
             f"Step time: {DEFINITIONS['step_time']}; spread: {DEFINITIONS['spread']}.", "", table, ""]  # fmt: skip
    if head["notes"]:
        lines += ["Notes:", "", *(f"- {n}" for n in head["notes"]), ""]
    return "\n".join(lines)


def write_csv(path: Path, rows: list[dict[str, Any]], columns: list[str]) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows({k: "" if v is None else v for k, v in r.items()} for r in rows)


# --- figures -----------------------------------------------------------------------------------

FIGSIZE = (3.5, 2.6)  # inches: one column of a two-column paper
RC = {"font.size": 8, "axes.titlesize": 8, "axes.labelsize": 8, "xtick.labelsize": 8, "ytick.labelsize": 8,
      "legend.fontsize": 7, "lines.linewidth": 1.2, "lines.markersize": 4}  # fmt: skip


def new_axes(title: Optional[str]) -> tuple[Any, Any]:
    """A paper-size figure on the Agg canvas (headless: no display, no pyplot state)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=FIGSIZE, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    if title:
        ax.set_title(title)
    ax.grid(True, which="major", linewidth=0.4, alpha=0.5)
    return fig, ax


def gpu_axis(ax: Any, gpus: list[int]) -> None:
    """log2 GPU axis with ticks at the points' GPU counts (powers of two when those crowd)."""
    from matplotlib.ticker import NullLocator

    ticks = sorted(set(gpus))
    if len(ticks) > 8:
        lo, hi = math.floor(math.log2(ticks[0])), math.ceil(math.log2(ticks[-1]))
        step = math.ceil((hi - lo + 1) / 8)
        ticks = [2**e for e in range(lo, hi + 1, step)]
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlim(min(gpus) / 1.3, max(gpus) * 1.3)
    ax.set_xlabel("GPUs (MPI ranks)")


def note_entries(ax: Any, notes: list[str]) -> None:
    """Text-only legend entries (gaps, 'peak unknown') so that the figure says it itself."""
    from matplotlib.lines import Line2D

    handles, labels = ax.get_legend_handles_labels()
    handles += [Line2D([], [], linestyle="none") for _ in notes]
    ax.legend(handles, labels + notes, loc="best", frameon=False, handlelength=1.5)


def save(fig: Any, out: Path, stem: str) -> list[Path]:
    paths = [out / f"{stem}.{ext}" for ext in ("png", "pdf")]
    for path in paths:
        fig.savefig(path, dpi=200)
    return paths


def series(rows: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """x (GPUs) and y with NaN where a point has no result: the line breaks there."""
    placed = [r for r in rows if r["gpus"] is not None]
    return [r["gpus"] for r in placed], [math.nan if r[key] is None else r[key] for r in placed]


def figure_gaps(rows: list[dict[str, Any]]) -> list[str]:
    return [f"no result: {gpus_text(r)}, {r['status'].split(' (')[0]}" for r in rows if not counted(r)]


def predicted_series(
    predicted: Optional[dict[str, Any]], kind: str, base_gpus: Optional[int] = None
) -> tuple[list[int], list[float]]:
    """The predicted efficiency (%) or speedup at each predicted point, against the measured
    baseline's GPU count `base_gpus` where the prediction has that point (predicted.json's own are
    against its first point, which is not the baseline when the smallest point has no result), so
    that both curves share the figure's axis."""
    if not predicted:
        return [], []
    points = predicted["points"]
    key = "efficiency" if kind == "weak" else "speedup"
    values = [float(p[key]) for p in points]
    at_base = [v for p, v in zip(points, values) if p["gpus"] == base_gpus]
    if at_base and at_base[0] > 0:
        values = [v / at_base[0] for v in values]
    return [p["gpus"] for p in points], [100 * v if kind == "weak" else v for v in values]


def plot_scaling(
    rows: list[dict[str, Any]], kind: str, baseline: dict[str, Any], title: Optional[str], out: Path,
    predicted: Optional[dict[str, Any]] = None,
) -> list[Path]:  # fmt: skip
    import matplotlib

    px, py = predicted_series(predicted, kind, baseline["gpus"])
    with matplotlib.rc_context(RC):
        fig, ax = new_axes(title)
        x, y = series(rows, "efficiency_pct" if kind == "weak" else "speedup")
        if px:
            ax.plot(px, py, marker="s", linestyle="--", label="predicted (app/plan/perf.py)")
        if kind == "weak":
            ax.axhline(100, color="0.4", linestyle="--", linewidth=0.8, label="ideal (100%)")
            if y:
                ax.plot(x, y, marker="o", label="measured")
            ax.set_ylim(0, max(110, *(v * 1.05 for v in [*y, *py] if not math.isnan(v))))
            ax.set_ylabel(f"Weak-scaling efficiency (%)\nvs {n_gpus(baseline['gpus'])}")
        else:
            from matplotlib.ticker import FuncFormatter

            every = sorted({*x, *px})
            ax.plot(every, [g / baseline["gpus"] for g in every], color="0.4", linestyle="--", linewidth=0.8,
                    label="ideal")  # fmt: skip
            if y:
                ax.plot(x, y, marker="o", label="measured")
            ax.set_yscale("log", base=2)
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            ax.set_ylabel(f"Speedup over {n_gpus(baseline['gpus'])}")
        gpu_axis(ax, [*x, *px])
        note_entries(ax, figure_gaps(rows))
        return save(fig, out, "weak_efficiency" if kind == "weak" else "strong_speedup")


def figures_unavailable(tool: str) -> Optional[str]:
    """Why no figure can be drawn, or None: matplotlib is not among setup.py's requirements (only
    launch/setup.sh installs it), so a plain `pip install .` lacks it; the tables are written anyway."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as err:
        return (f"warning: matplotlib is not installed ({err}), so {tool} wrote no figures; pip install matplotlib "
                "(launch/setup.sh installs it) and run it again")  # fmt: skip
    return None


def flops_label(kind_text: str) -> str:
    return "model FLOPs, Megatron SC21 count" if "Megatron SC21" in kind_text else "model FLOPs"


def plot_pflops(rows: list[dict[str, Any]], flops: str, title: Optional[str], out: Path) -> list[Path]:
    import matplotlib

    with matplotlib.rc_context(RC):
        fig, ax = new_axes(title)
        x, y = series([r if counted(r) else {**r, "aggregate_pflops": None} for r in rows], "aggregate_pflops")
        peaks = {r["peak_tflops_per_gpu"] for r in rows if r["peak_tflops_per_gpu"] is not None}
        notes = figure_gaps(rows)
        if len(peaks) == 1:
            peak = peaks.pop()
            ax.plot(x, [g * peak / 1e3 for g in x], color="0.4", linestyle="--", linewidth=0.8,
                    label=f"peak ({peak:g} TFLOP/s x GPUs)")  # fmt: skip
        elif peaks:  # devices differ between points: each point's own peak
            x_peak, tflops = series(rows, "peak_tflops_per_gpu")
            ax.plot(x_peak, [g * t / 1e3 for g, t in zip(x_peak, tflops)], color="0.4", linestyle="--",
                    linewidth=0.8, marker="_", label="peak of each point's device")  # fmt: skip
        else:
            notes.insert(0, "peak unknown")
        ax.plot(x, y, marker="o", label="sustained")
        ax.set_yscale("log")
        ax.set_ylabel(f"Sustained PFLOP/s\n({flops_label(flops)})")
        gpu_axis(ax, x)
        note_entries(ax, notes)
        return save(fig, out, "pflops")


# --- command line ------------------------------------------------------------------------------


def default_title(study: Study) -> str:
    name = f": {study.name}" if study.name else ""
    machine = next((r.machine for r in study.runs if r.machine), None)
    return f"{study.kind.capitalize()} scaling{name}" + (f" ({machine})" if machine else "")


def predicted_table(predicted: dict[str, Any], kind: str) -> str:
    head = ["nodes", "GPUs", "grid", "predicted step (s)", "TFLOP/s per GPU", "MFU (%)",
            *(["speedup"] if kind == "strong" else []), "efficiency (%)", "largest loss"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p in predicted["points"]:
        g = p["grid"]
        losses = {k: v for k, v in p["breakdown"].items() if k not in ("gemm", "recompute")}
        worst = max(losses, key=losses.get)  # type: ignore[arg-type]
        cells = [str(p["nodes"]), str(p["gpus"]), f"{g['tp']}x{g['pp']}x{g['dp']}", f"{p['step_time_s']:.4g}",
                 f"{p['tflops_per_device']:.3g}", f"{100 * p['mfu']:.1f}",
                 *([f"{p['speedup']:.2f}"] if kind == "strong" else []), f"{100 * p['efficiency']:.1f}",
                 f"{worst} {losses[worst]:.3g} s"]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def report_predicted(predicted: dict[str, Any], title: str, out: Path) -> list[Path]:
    """A study with predictions only: the predicted table and the scaling figure."""
    kind = predicted["kind"]
    out.mkdir(parents=True, exist_ok=True)
    table = predicted_table(predicted, kind)
    (out / "predicted.md").write_text(f"# {title} (predicted)\n\nModel: {predicted.get('model')}.\n\n{table}\n")
    first = predicted["points"][0]
    baseline = {"gpus": first["gpus"]}
    files = [out / "predicted.md"]
    unavailable = figures_unavailable("scaling")
    if unavailable is None:
        files += plot_scaling([], kind, baseline, title, out, predicted)
    print(f"{title} (predicted, no measured points)\n\n{table}\n\nwrote " + ", ".join(str(p) for p in files))
    if unavailable:
        print(f"scaling: {unavailable}", file=sys.stderr)
    return files


def report(study: Study, title: str, out: Path, predicted: Optional[dict[str, Any]] = None) -> list[Path]:
    """Compute, print and write the table, summary.json and the figures of one study."""
    rows, baseline = scaling_rows(study.runs, study.kind)
    notes = problem_notes(study.runs, study.kind) + gap_notes(rows) + warmup_notes(study.runs)
    unavailable = figures_unavailable("scaling")
    notes += [unavailable] if unavailable else []
    head = {"study": study.name, "kind": study.kind, "machine": next((r.machine for r in study.runs if r.machine), None),
            "title": title, "flops_kind": flops_kind(study.runs),
            "definitions": {k: DEFINITIONS[k] for k in (study.kind, "baseline", "step_time", "spread")},
            "efficiency_basis": baseline["basis"], "baseline": baseline, "notes": notes}  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    table = markdown_table(rows, study.kind)
    (out / "scaling.md").write_text(markdown(title, table, head))
    write_csv(out / "scaling.csv", rows, COLUMNS)
    files = [out / "scaling.csv", out / "scaling.md", out / "summary.json"]
    if predicted:
        (out / "predicted.md").write_text(f"# {title} (predicted)\n\n{predicted_table(predicted, study.kind)}\n")
        files.append(out / "predicted.md")
    if unavailable is None:
        files += plot_scaling(rows, study.kind, baseline, title, out, predicted)
        files += plot_pflops(rows, head["flops_kind"], title, out)
    summary = {**head, "columns": COLUMNS, "rows": rows, "files": [p.name for p in files]}
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"{title}\nbaseline: {baseline['note']}\n\n{table}\n")
    for note in notes:
        print(note)
    print("wrote " + ", ".join(str(p) for p in files))
    if unavailable:
        print(f"scaling: {unavailable}", file=sys.stderr)
    return files


def load_studies(paths: list[str], kind: Optional[str], need_kind: bool = True) -> list[Study]:
    return group_studies(collect(paths), kind, need_kind)


def subdir(name: Optional[str]) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name) if name else "unnamed"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m postprocess.scaling", description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", metavar="RUN", help="run directory, manifest.json, or a directory with one")
    parser.add_argument("--out", required=True, help="output directory (one subdirectory per study when several)")
    parser.add_argument("--kind", choices=KINDS, help="weak or strong (default: the runs' study.kind, the manifest)")
    parser.add_argument("--title", help="title of the table and figures (default: from the study and machine)")
    args = parser.parse_args(argv)
    try:
        check_out(args.out)
        predicted = collect_predicted(args.runs)
        measured = [a for a in args.runs if a not in predicted_only(args.runs)]
        studies = load_studies(measured, args.kind) if measured else []
        for study in studies:
            out = Path(args.out) if len(studies) == 1 else Path(args.out) / subdir(study.name)
            title = args.title if args.title and len(studies) == 1 else None
            title = title or (f"{args.title}: {study.name}" if args.title else default_title(study))
            report(study, title, out, predicted.pop(study.name, None))
        for name, alone in predicted.items():
            out = Path(args.out) if not studies and len(predicted) == 1 else Path(args.out) / subdir(name)
            title = args.title or f"{alone['kind'].capitalize()} scaling: {name} ({alone.get('machine')})"
            report_predicted(alone, title, out)
    except ScalingError as err:
        print(f"scaling: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # --out not a writable directory (a file, a read-only or missing parent)
        out = Path(args.out).absolute()
        named = Path(str(err.filename)).absolute() if err.filename else None
        if named is not None and named != out and out not in named.parents:  # a run's file, not the output
            print(f"scaling: cannot read {err.filename}: {err.strerror or err}", file=sys.stderr)
        else:
            print(f"scaling: cannot write --out {args.out}: {out_error(err)}", file=sys.stderr)
        return 2
    return 0


def check_out(out: str) -> None:
    """An empty --out is refused, not read as the working directory (where it wrote the files)."""
    if not out.strip():
        raise ScalingError(f"--out {out!r}: an empty path; pass --out DIR, e.g. --out results/NAME/")


def out_error(err: OSError) -> str:
    """An OSError on the output side in words: its reason and the path it names."""
    return f"{err.strerror or err} ({err.filename})" if err.filename else str(err.strerror or err)


if __name__ == "__main__":
    sys.exit(main())

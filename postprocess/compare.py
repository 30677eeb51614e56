"""Put a scaling study next to published numbers on the same axes.

    python -m postprocess.compare RESULTS... --published CSV [--label L] [--kind weak|strong] --out DIR

RESULTS is a results directory of postprocess.scaling (its summary.json), run directories / a
manifest as postprocess.scaling takes them (one study), or a study's predicted.json
(`launch.study --predict`): the predicted points, whose TFLOP/s count what the deck's
recomputation runs again (hardware FLOPs, the convention of Megatron SC21's table). The published CSV
has a header with `gpus` and any of `tflops_per_gpu`, `pflops` (aggregate), `efficiency`
and `pct_peak` (percent), and optionally `label` (rows of one label form one series; the
default series is the `source` column, else the file name), `params_b` and `source`; lines
starting with # are comments. inputs/published/megatron_sc21_table1.csv is Megatron-LM SC21
Table 1.

Every metric both sides have gets one figure, ours against each published series on a log2
GPU axis, as compare_<metric>.{png,pdf} (tflops_per_gpu, pflops, efficiency, pct_peak), and
compare.csv holds both sides' points in the columns of COLUMNS (one row per point and side).
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path
from typing import Any, Optional

from postprocess import scaling
from postprocess.scaling import ScalingError

# metric -> (column of the published CSV, y label, log y axis)
METRICS = {
    "tflops_per_gpu": ("tflops_per_gpu", "TFLOP/s per GPU", True),
    "pflops": ("pflops", "Aggregate PFLOP/s", True),
    "efficiency_pct": ("efficiency", "Scaling efficiency (%)", False),
    "pct_peak": ("pct_peak", "% of peak (MFU)", False),
}
COLUMNS = ["series", "gpus", "params_b", *METRICS, "status", "source"]
# scaling's columns that a point has only with a result scaling measures against (status "ok ...")
MEASURED = ("tflops_per_gpu", "hw_tflops_per_gpu", "aggregate_pflops", "mfu_pct", "hfu_pct")


def number(value: str, where: str) -> Optional[float]:
    if value is None or not value.strip():
        return None
    try:
        return float(value)
    except ValueError:
        raise ScalingError(f"{where} = {value!r} is not a number") from None


def read_published(path: Path) -> list[dict[str, Any]]:
    """The published points as rows of COLUMNS (status 'published')."""
    try:
        text = path.read_text()
    except OSError as err:
        raise ScalingError(f"cannot read the published CSV {path}: {err.strerror}") from None
    reader = csv.DictReader(line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#"))
    header = reader.fieldnames or []
    metrics = [m for m, (col, *_) in METRICS.items() if col in header]
    if "gpus" not in header or not metrics:
        raise ScalingError(f"{path}: the header needs 'gpus' and any of tflops_per_gpu, pflops, efficiency, "
                           f"pct_peak; it has {header}")  # fmt: skip
    rows = []
    for i, r in enumerate(reader, start=1):
        where = f"{path}: data row {i}"
        gpus = number(r["gpus"], f"{where}, gpus")
        if gpus is None:
            raise ScalingError(f"{where} has no gpus")
        row: dict[str, Any] = dict.fromkeys(COLUMNS)
        row.update(series=r.get("label") or r.get("source") or path.stem, gpus=int(gpus),
                   params_b=number(r.get("params_b", ""), f"{where}, params_b"), status="published",
                   source=r.get("source") or str(path))  # fmt: skip
        row.update({m: number(r[METRICS[m][0]], f"{where}, {METRICS[m][0]}") for m in metrics})
        rows.append(row)
    if not rows:
        raise ScalingError(f"{path} has a header but no rows")
    return rows


def from_scaling_rows(rows: list[dict[str, Any]], label: str, source: str) -> list[dict[str, Any]]:
    """Measured points as rows of COLUMNS, in hardware FLOPs (recomputation counted, as Megatron SC21's
    table and the predictions count them: a full-recompute run's model FLOPs read 25% low against
    them); model FLOPs from a results file written before scaling kept hardware ones."""
    out = []
    for r in rows:
        params = r.get("parameters")
        if not str(r["status"]).startswith("ok"):  # a gap, or warm-up in its step time: nothing to set beside
            r = {**r, **dict.fromkeys(MEASURED)}
        hw = r.get("hw_tflops_per_gpu")
        tflops = r["tflops_per_gpu"] if hw is None else hw
        pflops = r["aggregate_pflops"] if hw is None or r["gpus"] is None else hw * r["gpus"] / 1e3
        peak = r["mfu_pct"] if hw is None else r.get("hfu_pct")
        out.append({"series": label, "gpus": r["gpus"], "params_b": None if params is None else params / 1e9,
                    "tflops_per_gpu": tflops, "pflops": pflops, "efficiency_pct": r["efficiency_pct"],
                    "pct_peak": peak, "status": r["status"], "source": source,
                    "hardware": None if tflops is None else hw is not None})  # a gap has no FLOPs to count  # fmt: skip
    return out


def from_predicted(data: dict[str, Any], label: str, source: str) -> list[dict[str, Any]]:
    """Predicted points (launch.study --predict) as rows of COLUMNS, in hardware FLOPs."""
    out = []
    for p in data["points"]:
        hw = p["hardware_tflops_per_device"]
        out.append({"series": label, "gpus": p["gpus"], "params_b": p["parameters"] / 1e9, "tflops_per_gpu": hw,
                    "pflops": hw * p["gpus"] / 1e3, "efficiency_pct": 100 * p["efficiency"],
                    "pct_peak": 100 * p["mfu"] * hw / p["tflops_per_device"], "status": "predicted",
                    "source": source, "hardware": True})  # fmt: skip
    return out


def our_rows(paths: list[str], kind: Optional[str], label: Optional[str]) -> list[dict[str, Any]]:
    """Our points as rows of COLUMNS, from a scaling results directory, a prediction or runs."""
    if len(paths) == 1 and Path(paths[0]).name == "predicted.json":
        data = scaling.read_predicted(Path(paths[0]))
        return from_predicted(data, label or f"{data.get('study') or 'gridlm'} (predicted)", paths[0])
    if len(paths) == 1 and (Path(paths[0]) / "summary.json").is_file():
        # postprocess.scaling's results file (rows of its COLUMNS); a run's summary.json has no
        # "rows" and is read below, by scaling, as an app.metrics.summary.Summary
        results = scaling.read_json(Path(paths[0]) / "summary.json")
        if isinstance(results, dict) and "rows" in results:
            return from_scaling_rows(results["rows"], label or results.get("study") or "gridlm", paths[0])
    studies = scaling.load_studies(paths, kind, need_kind=False)
    if len(studies) > 1:
        names = ", ".join(str(s.name) for s in studies)
        raise ScalingError(f"the runs belong to {len(studies)} studies ({names}); compare one study at a time")
    rows, _ = scaling.scaling_rows(studies[0].runs, studies[0].kind)
    return from_scaling_rows(rows, label or studies[0].name or "gridlm", " ".join(paths))


def shared_metrics(ours: list[dict[str, Any]], published: list[dict[str, Any]]) -> list[str]:
    """Metrics with a value on both sides."""
    return [m for m in METRICS if any(r[m] is not None for r in ours) and any(r[m] is not None for r in published)]


def axis_label(rows: list[dict[str, Any]], metric: str) -> str:
    """The metric's y label with what our rows count: hardware FLOPs (recomputation counted) and HFU,
    or, from a results file written before scaling kept hardware FLOPs, model FLOPs and MFU."""
    _, label, _ = METRICS[metric]
    kinds = {r["hardware"] for r in rows if r.get("hardware") is not None}  # published rows: not ours
    hardware, model = kinds == {True}, kinds == {False}
    if "flops" in metric:
        return label + (
            " (recompute counted)"
            if hardware
            else " (model FLOPs)"
            if model
            else " (ours: model and hardware FLOPs mixed)"
        )
    if metric == "pct_peak":
        return "% of peak (HFU)" if hardware else label if model else "% of peak"
    return label


def plot_metric(rows: list[dict[str, Any]], metric: str, title: str, out: Path) -> list[Path]:
    import matplotlib

    _, ylabel, log = METRICS[metric]
    with matplotlib.rc_context(scaling.RC):
        fig, ax = scaling.new_axes(title)
        names = list(dict.fromkeys(r["series"] for r in rows))
        for i, name in enumerate(names):
            x, y = scaling.series([r for r in rows if r["series"] == name], metric)
            ax.plot(x, y, marker="os^vD"[i % 5], linestyle="-" if i == 0 else "--", label=name)
        if log:
            ax.set_yscale("log")
        else:
            ax.set_ylim(0, max(105, *(r[metric] * 1.05 for r in rows if r[metric] is not None)))
        ax.set_ylabel(axis_label(rows, metric))
        scaling.gpu_axis(ax, [r["gpus"] for r in rows if r["gpus"] is not None])
        gaps = [f"no result: {r['gpus']} GPUs, {r['status'].split(' (')[0]}" for r in rows
                if r["status"] not in ("published", "predicted") and not r["status"].startswith("ok")]  # fmt: skip
        scaling.note_entries(ax, gaps)
        return scaling.save(fig, out, f"compare_{METRICS[metric][0]}")


def relative_errors(
    ours: list[dict[str, Any]], published: list[dict[str, Any]], metrics: list[str]
) -> list[tuple[str, int, str, float, float, float]]:
    """(published series, gpus, metric, ours, published, ours / published - 1) for every published
    series that has the point: a CSV of several series (its label column) is measured against each,
    not against whichever came last."""
    theirs = {(r["series"], r["gpus"]): r for r in published}
    names = list(dict.fromkeys(r["series"] for r in published))
    out = []
    for name in names:
        for r in ours:
            other = theirs.get((name, r["gpus"]))
            for m in metrics:
                if other and r[m] is not None and other[m]:
                    out.append((name, r["gpus"], m, r[m], other[m], r[m] / other[m] - 1))
    return out


def errors_table(errors: list[tuple[str, int, str, float, float, float]]) -> str:
    lines = ["| series | GPUs | metric | ours | published | error |", "|---|---|---|---|---|---|"]
    lines += [f"| {s} | {g} | {m} | {a:.4g} | {b:.4g} | {100 * e:+.1f}% |" for s, g, m, a, b, e in errors]
    by_metric: dict[tuple[str, str], list[float]] = {}
    for s, _, m, _, _, e in errors:
        by_metric.setdefault((s, m), []).append(abs(e))
    lines += ["", *(f"{s}, {m}: mean absolute error {100 * sum(v) / len(v):.1f}%, worst {100 * max(v):.1f}%"
                    for (s, m), v in by_metric.items())]  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m postprocess.compare", description=__doc__.split("\n")[0])
    parser.add_argument("results", nargs="+", metavar="RESULTS", help="scaling results dir, or run dirs / manifest")
    parser.add_argument("--published", required=True, help="CSV of published numbers (gpus, tflops_per_gpu, ...)")
    parser.add_argument("--label", help="name of our series (default: the study name)")
    parser.add_argument("--kind", choices=scaling.KINDS, help="weak or strong, for the efficiency of run dirs")
    parser.add_argument("--title", help="figure title (default: ours vs the published series)")
    parser.add_argument("--out", required=True, help="output directory")
    args = parser.parse_args(argv)
    try:
        scaling.check_out(args.out)
        published = read_published(Path(args.published))
        ours = our_rows(args.results, args.kind, args.label)
        metrics = shared_metrics(ours, published)
        if not metrics:
            raise ScalingError(f"no metric with values on both sides (of {', '.join(METRICS)})")
    except ScalingError as err:
        print(f"compare: {err}", file=sys.stderr)
        return 2
    out = Path(args.out)
    rows = ours + published
    title = args.title or f"{ours[0]['series']} vs {published[0]['series']}"
    try:
        out.mkdir(parents=True, exist_ok=True)
        scaling.write_csv(out / "compare.csv", rows, COLUMNS)
        files = [out / "compare.csv"]
        unavailable = scaling.figures_unavailable("compare")
        for metric in metrics if unavailable is None else []:
            files += plot_metric(rows, metric, title, out)
    except OSError as err:  # --out not a writable directory
        print(f"compare: cannot write --out {args.out}: {scaling.out_error(err)}", file=sys.stderr)
        return 2
    print(" | ".join(["series", "gpus", *metrics, "status"]))
    for r in rows:
        cells = [r["series"], r["gpus"], *(("-" if r[m] is None else f"{r[m]:.4g}") for m in metrics), r["status"]]
        print(" | ".join(str(c) for c in cells))
    errors = relative_errors(ours, published, metrics)
    if errors:
        table = errors_table(errors)
        (out / "errors.md").write_text(table)
        files.append(out / "errors.md")
        print(table)
    print("wrote " + ", ".join(str(p) for p in files))
    if unavailable:
        print(f"compare: {unavailable}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The performance model against measured steps on this machine.

    .venv/bin/python benchmarks/perf_model_bench.py [--deck inputs/gpt_tiny.yaml] [--steps 20]
        [--grids 1x1x4 2x1x2 ...] [--rounds 3] [--calibrate-repeat 3] [--out runs/perf_model_bench]
        [--hosts gridlm-node1:4,gridlm-node2:4 [--shape 200mbit]] [--set model.seq_len=1024 ...]

Each of --rounds rounds first calibrates this machine at every world size among the grids
(`mpirun -n N python -m app.plan.calibrate`: primitives only), then runs every grid once (the
order reversed every other round) with
benchmarks/grid_bench.py's runner (step time after the warm-up, summary.json) and predicts the
same deck on that round's calibration (app/plan/perf.py). The table gives the medians over the
rounds of both, the error and the model's largest terms. A benchmark, not a test: it reports, it asserts
nothing about time.

Across simulated nodes (`eval "$(launch/cluster_local.sh start 2)"` first): --hosts passes mpirun's
`--host` to the calibrations and the runs, so the calibration measures the links between the nodes
too (its `network_collectives`), and --shape RATE limits every node's link for the whole benchmark
(launch/cluster_local.sh shape; unshaped at the end). Grids may name an order: 2x2x2@tp-pp-dp puts dp
across the nodes.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
import grid_bench  # noqa: E402

GRIDS = ["1x1x4", "2x1x2", "1x2x2", "2x2x1", "2x1x2+sp", "1x2x2+v2", "2x2x2", "1x2x4", "2x2x2+sp", "1x1x8"]
EXTRA = {"2x1x2": ("optim.zero=1",), "1x2x4": ("train.recompute=full",), "1x1x8": ("train.micro_batch=2",)}


def calibrate(ranks: int, out: Path, round_: int, hosts: str | None = None, repeat: int = 3) -> Path:
    path = out / f"local_{ranks}_round{round_}.yaml"
    cmd = ["mpirun", "-n", str(ranks), *grid_bench.host_args(hosts), sys.executable, "-m", "app.plan.calibrate",
           "--out", str(path), "--repeat", str(repeat)]  # fmt: skip
    print(f"perf_model_bench: {' '.join(cmd)}", file=sys.stderr, flush=True)
    subprocess.run(cmd, cwd=REPO, env=grid_bench.mpi_env(), check=True)
    return path


def ranks(spec: str) -> int:
    tp, pp, dp, _, _ = grid_bench.parse_grid(spec)
    return tp * grid_bench.context_ranks(spec) * pp * dp


def grid_deck(deck_path: str, spec: str, extra: tuple[str, ...]) -> Any:
    """The deck with the grid's parallel keys and `extra`, resolved for its ranks."""
    from app.deck import load_deck, resolve_for_world

    tp, pp, dp, sp, virtual = grid_bench.parse_grid(spec)
    sets = (f"parallel.tp={tp}", f"parallel.pp={pp}", f"parallel.dp={dp}",
            f"parallel.sequence_parallel={str(sp).lower()}", f"parallel.virtual_stages={virtual}",
            *grid_bench.grid_order(spec), *extra)  # fmt: skip
    return resolve_for_world(load_deck(REPO / deck_path, sets), ranks(spec))


def predicted(deck_path: str, spec: str, extra: tuple[str, ...], machine_path: Path) -> dict:
    from app.plan.machine import load_machine
    from app.plan.perf import predict

    p = predict(grid_deck(deck_path, spec, extra), load_machine(machine_path))
    worst = sorted(((v, k) for k, v in p.breakdown.items() if k != "recompute"), reverse=True)[:3]
    return {"predicted_ms": 1e3 * p.step_time_s, "terms": ", ".join(f"{k} {1e3 * v:.0f}" for v, k in worst)}


def median_prediction(predictions: list[dict]) -> dict:
    """The median of the rounds' predicted_ms (the mean of the middle two for an even count, as the
    measured median), with the terms of the lower middle prediction."""
    ranked = sorted(predictions, key=lambda p: p["predicted_ms"])
    mid = ranked[(len(ranked) - 1) // 2]
    return {"predicted_ms": statistics.median(p["predicted_ms"] for p in ranked), "terms": mid["terms"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--deck", default="inputs/gpt_tiny.yaml")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--grids", nargs="+", default=GRIDS)
    parser.add_argument("--rounds", type=int, default=3, help="runs of every grid, alternated; the median is reported")
    parser.add_argument("--out", default="runs/perf_model_bench")
    parser.add_argument("--calibrate-repeat", type=int, default=3, help="app.plan.calibrate --repeat (default 3)")
    parser.add_argument("--hosts", default=None, help="mpirun --host for every job (simulated nodes)")
    parser.add_argument("--shape", default=None, help="with --hosts: limit every node's link to RATE (e.g. 200mbit)")
    parser.add_argument("--set", action="append", default=[], help="a deck override for every grid (repeatable)")
    args = parser.parse_args(argv)
    grid_bench.check_counts(parser, args, "steps", "rounds", "calibrate_repeat")
    from app.errors import GridlmError

    try:  # a bad deck, --set or grid: said in one line before any calibration
        for spec in args.grids:
            grid_deck(args.deck, spec, (*args.set, *EXTRA.get(spec, ())))
    except GridlmError as err:
        print(f"perf_model_bench: {err}", file=sys.stderr)
        return 2
    if args.shape:
        subprocess.run([str(REPO / "launch/cluster_local.sh"), "shape", args.shape], check=True)
    try:
        return run(args)
    finally:
        if args.shape:
            subprocess.run([str(REPO / "launch/cluster_local.sh"), "unshape"], check=False)


def run(args: argparse.Namespace) -> int:
    out = REPO / args.out
    out.mkdir(parents=True, exist_ok=True)
    # Every round calibrates, then runs the grids once each (alternated): a load burst from another
    # tenant then hits calibrations and runs alike. Each grid's measured step is the median of its
    # rounds; its prediction the median of the predictions on each round's calibration.
    steps_ms: dict[str, list[float]] = {spec: [] for spec in args.grids}
    predictions: dict[str, list[dict]] = {spec: [] for spec in args.grids}
    errors: dict[str, str] = {}
    for round_ in range(args.rounds):
        machines = {
            n: calibrate(n, out, round_, args.hosts, args.calibrate_repeat)
            for n in sorted({ranks(s) for s in args.grids})
        }
        for spec in grid_bench.round_order(args.grids, round_):
            run_args = argparse.Namespace(
                out=str(Path(args.out) / "runs"),
                steps=args.steps,
                deck=args.deck,
                set=[*args.set, *EXTRA.get(spec, ())],
                hosts=args.hosts,
            )
            measured = grid_bench.run_grid(spec, run_args)
            if "error" in measured:
                errors[spec] = measured["error"]
                continue
            steps_ms[spec].append(measured["step_ms"])
            extra = (*args.set, *EXTRA.get(spec, ()))
            predictions[spec].append(predicted(args.deck, spec, extra, machines[ranks(spec)]))
    rows = []
    for spec in args.grids:
        extra = EXTRA.get(spec, ())
        row = {"grid": spec + "".join(f" {e}" for e in extra), "ranks": ranks(spec)}
        if spec in errors:
            rows.append({**row, "error": errors[spec]})
            continue
        row.update(median_prediction(predictions[spec]))
        row["measured_ms"] = statistics.median(steps_ms[spec])
        row["rounds_ms"] = " ".join(f"{t:.0f}" for t in steps_ms[spec])
        row["predicted_rounds_ms"] = " ".join(f"{p['predicted_ms']:.0f}" for p in predictions[spec])
        row["error_pct"] = 100 * (row["predicted_ms"] / row["measured_ms"] - 1)
        rows.append(row)
    lines = [
        "| grid | ranks | measured ms (median; rounds) | predicted ms (median; rounds) | error | model's largest terms (ms) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['grid']} | {r['ranks']} | failed ({r['error']}) | | | |")
        else:
            lines.append(f"| {r['grid']} | {r['ranks']} | {r['measured_ms']:.1f} ({r['rounds_ms']}) | {r['predicted_ms']:.1f} ({r['predicted_rounds_ms']}) | "
                         f"{r['error_pct']:+.0f}% | {r['terms']} |")  # fmt: skip
    within = [r for r in rows if "error_pct" in r and abs(r["error_pct"]) <= 25]
    lines.append(f"\n{len(within)} of {len(rows)} grids within ±25%.")
    if args.hosts:
        lines.append(f"Ranks on {args.hosts}; links {'shaped to ' + args.shape if args.shape else 'not shaped'}.")
    return grid_bench.write_tables(out, rows, ["grid", "ranks", "measured_ms", "rounds_ms", "predicted_ms", "predicted_rounds_ms", "error_pct", "terms"],
                                   "\n".join(lines))  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())

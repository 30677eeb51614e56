"""Benchmark data-parallel overlap and ZeRO-1 on this machine (weak scaling on one node).

    .venv/bin/python benchmarks/overlap_bench.py [--deck inputs/gpt_tiny.yaml] [--steps 30] [--rounds 3]
        [--out runs/overlap_bench] [--set section.key=value ...]

Runs the deck at dp = 1 and at dp = 2 with the same micro batch and accumulation per rank
(so dp = 2 trains a global batch twice as large: weak scaling), for dp = 2 with ZeRO-1
off and on, each with every overlap off (`parallel.overlap_*: false`) and on. Each run is
`mpirun -n DP python -m app DECK` with run.timers on and one torch thread per rank (so
that 1 and 2 ranks use the same compute per rank). Each of --rounds rounds runs every
configuration once, in turn (the order reversed every other round, so that none always runs
first). From the summary.json files the table (Markdown on stdout, table.md and table.csv in
--out) reports per configuration the medians over the rounds of:

  step ms         mean step time after the warm-up steps (the rounds' min-max in brackets)
  vs dp1          step time / the dp = 1 step time: 1.0 is perfect weak scaling
  dp comm ms      rank 0's time per step in dp collectives (launch to completion)
  exposed ms      rank 0's time per step blocked on communication (all axes)
  exposed %       exposed / step time
  opt. state MB   optimizer state per rank (Adam moments + separate fp32 master copy)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from grid_bench import FRESH, check_counts, mpi_env, round_order, write_tables

from app.errors import GridlmError
from app.metrics.summary import Summary

REPO = Path(__file__).resolve().parent.parent
OVERLAPS = ("grad_reduce", "param_gather", "tp_comm", "pp_comm")
# (name, dp, zero, overlap)
CONFIGS = (
    ("dp1", 1, 0, True),
    ("dp2 overlap off", 2, 0, False),
    ("dp2 overlap on", 2, 0, True),
    ("dp2 ZeRO-1 overlap off", 2, 1, False),
    ("dp2 ZeRO-1 overlap on", 2, 1, True),
)
COLUMNS = ["config", "ranks", "global_batch", "rounds", "step_ms", "step_min_ms", "step_max_ms", "rounds_ms", "vs_dp1",
           "dp_comm_ms", "exposed_ms", "exposed_pct", "optimizer_state_mb", "final_loss"]  # fmt: skip
MEDIANS = ("step_ms", "dp_comm_ms", "exposed_ms", "exposed_pct", "optimizer_state_mb", "final_loss")


def deck_batches(deck: str, sets: list[str]) -> tuple[int, int]:
    """(micro_batch, accumulation at dp = 1) of the deck with the overrides."""
    sys.path.insert(0, str(REPO))
    from app.deck import load_deck

    d = load_deck(REPO / deck, tuple(sets))
    return d.train.micro_batch, d.train.global_batch // d.train.micro_batch


def run_config(name: str, dp: int, zero: int, overlap: bool, args: argparse.Namespace, batch: tuple[int, int]) -> dict:
    micro, accumulation = batch
    global_batch = micro * accumulation * dp
    run_dir = Path(args.out) / name.replace(" ", "_")
    sets = [
        *args.set, f"parallel.dp={dp}", f"optim.zero={zero}", f"train.global_batch={global_batch}",
        *(f"parallel.overlap_{k}={str(overlap).lower()}" for k in OVERLAPS),
        f"train.steps={args.steps}", "run.timers=true", "run.threads=1", f"run.log_every={args.steps}",
        f"run.dir={run_dir}", *FRESH,
    ]  # fmt: skip
    cmd = ["mpirun", "-n", str(dp), sys.executable, "-m", "app", args.deck]
    cmd += [arg for s in sets for arg in ("--set", s)]
    print(f"overlap_bench: {name}: {' '.join(cmd)}", file=sys.stderr, flush=True)
    out = subprocess.run(cmd, cwd=REPO, env=mpi_env(), capture_output=True, text=True, check=False)
    row = {"config": name, "ranks": dp, "global_batch": global_batch}
    if out.returncode != 0:
        print(out.stdout[-2000:] + out.stderr[-4000:], file=sys.stderr)
        return {**row, "error": f"exit {out.returncode}"}
    s = Summary.from_dict(json.loads((REPO / run_dir / "summary.json").read_text()))
    t = s.timers
    assert t is not None and s.memory_bytes_rank0 is not None, "the runs set run.timers=true"
    return {
        **row,
        "step_ms": 1e3 * s.step_time_s,
        "dp_comm_ms": 1e3 * t["comm_s"]["dp"],
        "exposed_ms": 1e3 * sum(t["exposed_comm_s"].values()),
        "exposed_pct": 100 * (s.exposed_comm_fraction or 0.0),
        "optimizer_state_mb": s.memory_bytes_rank0["optimizer_state"] / 1e6,
        "final_loss": s.final_loss,
    }


def summarize(runs: list[dict]) -> dict:
    """One configuration's row from its rounds: the medians of MEDIANS, the step's min and max and
    each round's step; or the first failure, with how many rounds failed."""
    failed = [r for r in runs if "error" in r]
    if failed:
        return {**failed[0], "error": f"{failed[0]['error']} in {len(failed)} of {len(runs)} rounds"}
    steps = [r["step_ms"] for r in runs]
    row = {k: runs[0][k] for k in ("config", "ranks", "global_batch")}
    row.update({key: statistics.median(r[key] for r in runs) for key in MEDIANS})
    row.update(rounds=len(runs), step_min_ms=min(steps), step_max_ms=max(steps))
    row["rounds_ms"] = " ".join(f"{t:.1f}" for t in steps)
    return row


def markdown(rows: list[dict]) -> str:
    head = (
        "| config | ranks | global batch | step ms (median; min-max) | vs dp1 | dp comm ms | exposed ms | exposed % "
        "| opt. state MB/rank | final loss |"
    )
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['config']} | {r['ranks']} | {r['global_batch']} | failed ({r['error']}) |" + " |" * 6)
            continue
        lines.append(
            f"| {r['config']} | {r['ranks']} | {r['global_batch']} | {r['step_ms']:.1f} ({r['step_min_ms']:.1f}-{r['step_max_ms']:.1f}) "
            f"| {r['vs_dp1']:.3f} | {r['dp_comm_ms']:.1f} | {r['exposed_ms']:.1f} | {r['exposed_pct']:.1f} "
            f"| {r['optimizer_state_mb']:.2f} | {r['final_loss']:.4f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--deck", default="inputs/gpt_tiny.yaml")
    parser.add_argument(
        "--steps", type=int, default=30, help="optimizer steps per run (first run.timing_warmup skipped)"
    )
    parser.add_argument("--rounds", type=int, default=3, help="runs of every configuration, alternated; medians")
    parser.add_argument("--out", default="runs/overlap_bench")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="extra deck override")
    args = parser.parse_args(argv)
    check_counts(parser, args, "steps", "rounds")
    try:
        batch = deck_batches(args.deck, args.set)
    except GridlmError as err:  # a bad deck or --set: say it before launching anything
        print(f"overlap_bench: {err}", file=sys.stderr)
        return 2
    runs: dict[str, list[dict]] = {config[0]: [] for config in CONFIGS}
    for round_ in range(args.rounds):
        for config in round_order(CONFIGS, round_):
            runs[config[0]].append(run_config(*config, args, batch))
    rows = [summarize(runs[config[0]]) for config in CONFIGS]
    base = rows[0].get("step_ms")
    for r in rows:
        if "error" not in r:
            r["vs_dp1"] = r["step_ms"] / base if base else float("nan")
    return write_tables(REPO / args.out, rows, COLUMNS, markdown(rows))


if __name__ == "__main__":
    sys.exit(main())

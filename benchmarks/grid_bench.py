"""Benchmark one deck over a list of grids on this machine: step time, tokens/s, communication.

    .venv/bin/python benchmarks/grid_bench.py [--deck inputs/gpt_tiny.yaml] [--steps 20]
        [--grids 1x1x4 2x1x2 1x2x2 2x2x1 4x1x1 1x4x1 2x2x1+sp 1x2x2+v2] [--rounds 3] [--out runs/grid_bench]
        [--set section.key=value ...] [--hosts gridlm-node1:4,gridlm-node2:4]

A grid is TPxPPxDP, optionally followed by +sp (sequence parallelism), +vN (N virtual
stages, interleaved 1F1B), +epN (expert parallelism over N dp ranks, a mixture-of-experts deck),
+cpN (context parallelism over N more ranks: TP x PP x DP x N of them), +a2a (its all-to-all
attention instead of the ring) and @ORDER (parallel.order, e.g. 2x2x2@tp-pp-dp). --hosts H passes
`--host H` to mpirun (simulated nodes of launch/cluster_local.sh, with its exports). Each of
--rounds rounds runs every grid once, `mpirun -n TP*PP*DP(*CP) python -m app DECK` with run.timers on,
the grids in turn (the order reversed every other round, so that none always runs first). The
table (Markdown on stdout, plus table.md and table.csv in --out) reports per grid the medians over
the rounds of its summary.json's figures: the mean step time after the warm-up steps (with the
rounds' min-max), tokens/s, and the milliseconds per step rank 0 was blocked on tp, pp, dp and cp
communication (exposed; see app/runtime/timers.py), and rank 0's peak resident memory. Rank 0 is tp rank 0 of
the first pipeline stage: its pp time includes waiting for the pipeline to fill and
drain (the bubble), not only transfer time.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TypeVar

from app.metrics.summary import Summary

REPO = Path(__file__).resolve().parent.parent
GRID = re.compile(r"^(\d+)x(\d+)x(\d+)((?:\+sp|\+v\d+|\+ep\d+|\+cp\d+|\+a2a)*)(?:@([a-z]+(?:-[a-z]+){2,3}))?$")
COLUMNS = ["grid", "ranks", "rounds", "step_ms", "step_min_ms", "step_max_ms", "rounds_ms", "tokens_per_s",
           "tp_comm_ms", "pp_comm_ms", "dp_comm_ms", "cp_comm_ms", "final_loss", "peak_rss_gib"]  # fmt: skip
MEDIANS = ("step_ms", "tokens_per_s", "tp_comm_ms", "pp_comm_ms", "dp_comm_ms", "cp_comm_ms", "final_loss",
           "peak_rss_gib")  # fmt: skip
T = TypeVar("T")


def parse_grid(spec: str) -> tuple[int, int, int, bool, int]:
    """'2x2x1+sp+v2' -> (tp, pp, dp, sequence_parallel, virtual_stages)."""
    match = GRID.match(spec)
    if match is None:
        raise SystemExit(f"grid_bench: bad grid {spec!r}; expected TPxPPxDP[+sp][+vN][+epN][@ORDER], e.g. 2x2x1+sp")
    tp, pp, dp = (int(match.group(i)) for i in (1, 2, 3))
    flags = match.group(4)
    virtual = re.search(r"\+v(\d+)", flags)
    return tp, pp, dp, "+sp" in flags, int(virtual.group(1)) if virtual else 1


def grid_order(spec: str) -> tuple[str, ...]:
    """The deck overrides of a grid's @ORDER, +epN, +cpN and +a2a ('1x1x4+ep2@tp-pp-dp' ->
    ('parallel.ep=2', 'parallel.order=tp-pp-dp'))."""
    match = GRID.match(spec)
    if match is None:
        return ()
    ep = re.search(r"\+ep(\d+)", match.group(4))
    return (
        ((f"parallel.ep={ep.group(1)}",) if ep else ())
        + ((f"parallel.cp={context_ranks(spec)}",) if context_ranks(spec) > 1 else ())
        + (("parallel.cp_kind=all_to_all",) if "+a2a" in match.group(4) else ())
        + ((f"parallel.order={match.group(5)}",) if match.group(5) else ())
    )


def context_ranks(spec: str) -> int:
    """A grid's +cpN: the context-parallel degree (1 without)."""
    cp = re.search(r"\+cp(\d+)", spec)
    return int(cp.group(1)) if cp else 1


def host_args(hosts: str | None) -> list[str]:
    """mpirun's `--host H` for --hosts, else nothing."""
    return ["--host", hosts] if hosts else []


def mpi_env() -> dict[str, str]:
    """Open MPI settings for a one-node run as any user (see launch/env.sh)."""
    env = dict(os.environ)
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    env.setdefault("OMPI_MCA_rmaps_base_oversubscribe", "1")
    env.setdefault("OMPI_MCA_btl_vader_single_copy_mechanism", "none")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


# Every run trains from step 0 and writes no checkpoint (a rerun into the same --out would resume).
FRESH = ("run.resume=none", "checkpoint.at_exit=false")


def run_grid(spec: str, args: argparse.Namespace) -> dict:
    tp, pp, dp, sp, virtual = parse_grid(spec)
    ranks = tp * pp * dp * context_ranks(spec)
    run_dir = Path(args.out) / spec.replace("+", "_").replace("@", "_")
    sets = [
        f"parallel.tp={tp}", f"parallel.pp={pp}", f"parallel.dp={dp}", f"parallel.sequence_parallel={str(sp).lower()}",
        f"parallel.virtual_stages={virtual}", f"train.steps={args.steps}", "run.timers=true",
        f"run.log_every={args.steps}", f"run.dir={run_dir}", *FRESH, *grid_order(spec), *args.set,
    ]  # fmt: skip
    summary = run_deck(ranks, args.deck, sets, run_dir, f"grid_bench: {spec}", getattr(args, "hosts", None))
    if isinstance(summary, str):
        return {"grid": spec, "ranks": ranks, "error": summary}
    comm = summary.timers["exposed_comm_s"] if summary.timers else {}
    return {
        "grid": spec,
        "ranks": ranks,
        "step_ms": 1e3 * summary.step_time_s,
        "step_std_ms": 1e3 * summary.step_time_std_s,
        "tokens_per_s": summary.tokens_per_s,
        "tp_comm_ms": 1e3 * comm.get("tp", 0.0),
        "pp_comm_ms": 1e3 * comm.get("pp", 0.0),
        "dp_comm_ms": 1e3 * comm.get("dp", 0.0),
        "cp_comm_ms": 1e3 * comm.get("cp", 0.0),  # the ring's or the all-to-alls' (0 without cp)
        "final_loss": summary.final_loss,
        "peak_rss_gib": (summary.memory_bytes_rank0 or {}).get("peak_rss", 0) / 2**30,
    }


def run_deck(
    ranks: int, deck: str, sets: list[str], run_dir: Path, label: str, hosts: str | None = None
) -> Summary | str:
    """`mpirun -n RANKS [--host HOSTS] python -m app DECK --set ...` from the repository; its
    summary.json, or "exit N" (its output's tail on stderr) when it failed."""
    cmd = ["mpirun", "-n", str(ranks), *host_args(hosts), sys.executable, "-m", "app", deck]
    cmd += [arg for s in sets for arg in ("--set", s)]
    print(f"{label}: {' '.join(cmd)}", file=sys.stderr, flush=True)
    out = subprocess.run(cmd, cwd=REPO, env=mpi_env(), capture_output=True, text=True, check=False)
    if out.returncode != 0:
        print(out.stdout[-2000:] + out.stderr[-4000:], file=sys.stderr)
        return f"exit {out.returncode}"
    return Summary.from_dict(json.loads((REPO / run_dir / "summary.json").read_text()))


def round_order(items: Sequence[T], round_: int) -> list[T]:
    """The order of `items` in round `round_`: as given in even rounds, reversed in odd ones, so
    that no configuration always runs first (or last) beside a warming or noisy machine."""
    return list(items) if round_ % 2 == 0 else list(reversed(items))


def check_counts(parser: argparse.ArgumentParser, args: argparse.Namespace, *names: str) -> None:
    """`parser.error` (usage, one line, exit 2) if an option of `names` (dests; a list for nargs)
    is below 1: a zero count fails later as a division by zero or a median of nothing."""
    for name in names:
        value = getattr(args, name)
        if any(v < 1 for v in (value if isinstance(value, list) else [value])):
            parser.error(f"--{name.replace('_', '-')} must be at least 1, not {value}")


def summarize(runs: list[dict]) -> dict:
    """One grid's row from its rounds' runs: the medians of MEDIANS, the step's min and max, each
    round's step; or the first failure, with how many rounds failed."""
    failed = [r for r in runs if "error" in r]
    if failed:
        return {**failed[0], "error": f"{failed[0]['error']} in {len(failed)} of {len(runs)} rounds"}
    steps = [r["step_ms"] for r in runs]
    row = {"grid": runs[0]["grid"], "ranks": runs[0]["ranks"], "rounds": len(runs)}
    row.update({key: statistics.median(r[key] for r in runs) for key in MEDIANS})
    row.update(step_min_ms=min(steps), step_max_ms=max(steps), rounds_ms=" ".join(f"{t:.1f}" for t in steps))
    return row


def median_cell(rows: list[dict], key: str, fmt: str = ".0f") -> str:
    """A table cell: the median of `key` over the rows (rounds), then each round's value in brackets."""
    values = [r[key] for r in rows]
    return f"{statistics.median(values):{fmt}} ({' '.join(f'{v:{fmt}}' for v in values)})"


def markdown(rows: list[dict]) -> str:
    head = (
        "| grid (tp x pp x dp) | ranks | step ms (median; min-max) | tokens/s | exposed tp comm ms | exposed pp comm ms "
        "| exposed dp comm ms | exposed cp comm ms | final loss | peak RSS GiB |"
    )
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['grid']} | {r['ranks']} | failed ({r['error']}) | | | | | | | |")
            continue
        lines.append(
            f"| {r['grid']} | {r['ranks']} | {r['step_ms']:.1f} ({r['step_min_ms']:.1f}-{r['step_max_ms']:.1f}) | {r['tokens_per_s']:,.0f} | "
            f"{r['tp_comm_ms']:.1f} | {r['pp_comm_ms']:.1f} | {r['dp_comm_ms']:.1f} | {r['cp_comm_ms']:.1f} | {r['final_loss']:.4f} | "
            f"{r['peak_rss_gib']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--deck", default="inputs/gpt_tiny.yaml")
    parser.add_argument(
        "--steps", type=int, default=20, help="optimizer steps per grid (first run.timing_warmup skipped)"
    )
    parser.add_argument(
        "--grids", nargs="+", default=["1x1x4", "2x1x2", "1x2x2", "2x2x1", "4x1x1", "1x4x1", "2x2x1+sp", "1x2x2+v2"]
    )
    parser.add_argument("--rounds", type=int, default=3, help="runs of every grid, alternated; medians reported")
    parser.add_argument("--out", default="runs/grid_bench")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="extra deck override")
    parser.add_argument("--hosts", default=None, help="mpirun --host (simulated nodes: gridlm-node1:4,gridlm-node2:4)")
    args = parser.parse_args(argv)
    check_counts(parser, args, "steps", "rounds")
    grids = list(dict.fromkeys(args.grids))  # a grid named twice runs once a round
    for spec in grids:
        parse_grid(spec)  # fail before running anything
    runs: dict[str, list[dict]] = {spec: [] for spec in grids}
    for round_ in range(args.rounds):
        for spec in round_order(grids, round_):
            runs[spec].append(run_grid(spec, args))
    rows = [summarize(runs[spec]) for spec in grids]
    return write_tables(REPO / args.out, rows, COLUMNS, markdown(rows))


def write_tables(out: Path, rows: list[dict], columns: list[str], table: str) -> int:
    """Write table.md and table.csv into `out`, print the Markdown; exit status 1 if a run failed."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.md").write_text(table + "\n")
    with open(out / "table.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[*columns, "error"], extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    print(table)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())

"""Compare variants of one deck on this machine: step time, exposed communication and peak
memory, measured against the dry run's plan.

    .venv/bin/python benchmarks/variant_bench.py --deck inputs/gpt_tiny.yaml --ranks 4 \\
        --variant optim.zero=1 --variant optim.zero=3 [--rounds 3] [--steps 12] [--set k=v ...]
    .venv/bin/python benchmarks/variant_bench.py --deck inputs/gpt_823m_zero3.yaml --ranks 4 \\
        --variant optim.offload=none --variant optim.offload=nvme --steps 4

A variant is one or more space-separated `section.key=value` overrides. Each round runs every
variant once, in turn (the variants alternate, so a noisy neighbour hurts all of them alike):
`mpirun -n RANKS python -m app DECK` with run.timers on, no checkpoint, from step 0. The table
(Markdown on stdout, table.md and table.csv in --out) gives per variant the medians over the
rounds (each round's figure in brackets) of:

- the mean step time after `run.timing_warmup` steps, and the milliseconds per step rank 0 was
  blocked on dp and tp communication (exposed; app/runtime/timers.py);
- rank 0's peak resident memory (summary.json `memory_bytes_rank0.peak_rss`: the whole process,
  its Python, torch and MPI libraries included, over the whole run, start-up included);
- the dry run's peak per rank for the same deck (`--dry-run --json`, `memory.peak_gib`: on a
  CPU machine host-offloaded state counts in it) and the measured peak's difference from it.

A benchmark, not a test: its numbers go to docs/, with the machine and command.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
import grid_bench  # noqa: E402

GiB = float(1 << 30)
COLUMNS = ["variant", "round", "step_ms", "dp_comm_ms", "tp_comm_ms", "peak_rss_gib", "planned_gib", "final_loss"]


def planned_gib(deck: str, ranks: int, sets: list[str]) -> float:
    """The dry run's peak memory per rank (GiB) for the deck with `sets`."""
    cmd = [sys.executable, "-m", "app", deck, "--dry-run", "--json", "--world-size", str(ranks)]
    cmd += [arg for s in sets for arg in ("--set", s)]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False)
    try:
        return float(json.loads(out.stdout)["memory"]["peak_gib"])
    except (ValueError, KeyError) as e:
        raise SystemExit(
            f"variant_bench: the dry run of {' '.join(sets)} failed ({e}):\n{out.stderr[-2000:]}"
        ) from None


def run_once(args: argparse.Namespace, variant: str, index: int, round_: int) -> dict:
    run_dir = Path(args.out) / f"v{index}_r{round_}"
    sets = [*variant.split(), *args.set, f"train.steps={args.steps}", "run.timers=true", f"run.log_every={args.steps}",
            f"run.dir={run_dir}", *grid_bench.FRESH]  # fmt: skip
    summary = grid_bench.run_deck(args.ranks, args.deck, sets, run_dir, f"variant_bench: round {round_}: {variant}")
    if isinstance(summary, str):
        return {"variant": variant, "round": round_, "error": summary}
    comm = summary.timers["exposed_comm_s"] if summary.timers else {}
    return {
        "variant": variant,
        "round": round_,
        "step_ms": 1e3 * summary.step_time_s,
        "dp_comm_ms": 1e3 * comm.get("dp", 0.0),
        "tp_comm_ms": 1e3 * comm.get("tp", 0.0),
        "peak_rss_gib": summary.memory_bytes_rank0["peak_rss"] / GiB,
        "final_loss": summary.final_loss,
    }


def markdown(variants: list[str], rows: list[dict], planned: dict[str, float]) -> str:
    lines = [
        "| variant | step ms (median; rounds) | exposed dp ms | exposed tp ms | peak RSS GiB, rank 0 | planned GiB "
        "| RSS vs plan |",
        "|" + "---|" * 7,
    ]
    for v in variants:
        ok = [r for r in rows if r["variant"] == v and "error" not in r]
        if not ok:
            lines.append(f"| {v} | failed | | | | {planned[v]:.2f} | |")
            continue
        rss = statistics.median(r["peak_rss_gib"] for r in ok)
        cells = [grid_bench.median_cell(ok, key) for key in ("step_ms", "dp_comm_ms", "tp_comm_ms")]
        cells.append(grid_bench.median_cell(ok, "peak_rss_gib", ".2f"))
        lines.append(f"| {v} | {' | '.join(cells)} | {planned[v]:.2f} | {100 * (rss / planned[v] - 1):+.0f}% |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--deck", default="inputs/gpt_tiny.yaml")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--variant", action="append", required=True, metavar="'K=V [K=V ...]'")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--steps", type=int, default=12, help="optimizer steps per run (first run.timing_warmup skipped)"
    )
    parser.add_argument("--out", default="runs/variant_bench")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="for every variant")
    args = parser.parse_args(argv)
    grid_bench.check_counts(parser, args, "ranks", "rounds", "steps")
    planned = {v: planned_gib(args.deck, args.ranks, [*v.split(), *args.set]) for v in args.variant}
    rows = [run_once(args, v, i, r) for r in range(args.rounds) for i, v in enumerate(args.variant)]
    for r in rows:
        r["planned_gib"] = planned[r["variant"]]
    return grid_bench.write_tables(REPO / args.out, rows, COLUMNS, markdown(args.variant, rows, planned))


if __name__ == "__main__":
    sys.exit(main())

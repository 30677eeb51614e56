"""Bytes per rank of parameters, gradients and optimizer state by ZeRO stage and dp, measured
against the dry run's prediction.

    .venv/bin/python benchmarks/zero_memory_bench.py [--deck inputs/gpt_tiny.yaml] [--zero 0 1 2 3]
        [--dp 1 2 4 8] [--steps 2] [--out runs/zero_memory_bench]

Each (zero, dp) runs `mpirun -n DP python -m app DECK` (global batch 32, so that dp = 8 divides it)
for --steps steps and reads rank 0's
`memory_bytes_rank0` from summary.json: the parameter buffer (ZeRO-3: the shard plus the most
units gathered at once), the whole gradient buffer, the ZeRO gradient shard, the most ZeRO-2/3
bucket buffers held at once, and the optimizer state (moments and any separate fp32 master). The
dry run's figures come from app/plan/estimate.py on the same deck and grid: weights (ZeRO-3: its
bound on the gathered units), gradients (ZeRO-2/3: its bound on the bucket buffers) and the
optimizer line (ZeRO >= 1 with the gradient shard). Parameters and optimizer state are exact
(the same ParamLayout) up to those bounds. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
import grid_bench  # noqa: E402

from app.deck import load_deck, resolve_for_world  # noqa: E402
from app.metrics.summary import Summary  # noqa: E402
from app.plan.estimate import estimate_stages  # noqa: E402

COLUMNS = ["zero", "dp", "parameters", "planned_parameters", "gradients", "planned_gradients", "optimizer",
           "planned_optimizer"]  # fmt: skip


def measure(deck_path: str, zero: int, dp: int, steps: int, out: Path) -> dict:
    sets = [f"optim.zero={zero}", "parallel.tp=1", "parallel.pp=1", f"parallel.dp={dp}", f"train.steps={steps}",
            "train.global_batch=32", f"run.log_every={steps}", f"run.dir={out / f'zero{zero}_dp{dp}'}",
            *grid_bench.FRESH]  # fmt: skip
    cmd = ["mpirun", "-n", str(dp), sys.executable, "-m", "app", deck_path]
    cmd += [arg for s in sets for arg in ("--set", s)]
    print(f"zero_memory_bench: {' '.join(cmd)}", file=sys.stderr, flush=True)
    run = subprocess.run(cmd, cwd=REPO, env=grid_bench.mpi_env(), capture_output=True, text=True, check=False)
    row: dict = {"zero": zero, "dp": dp}
    if run.returncode != 0:
        print(run.stdout[-2000:] + run.stderr[-4000:], file=sys.stderr)
        return {**row, "error": f"exit {run.returncode}"}
    summary = Summary.from_dict(json.loads((REPO / out / f"zero{zero}_dp{dp}" / "summary.json").read_text()))
    got = summary.memory_bytes_rank0 or {}
    stage = estimate_stages(resolve_for_world(load_deck(REPO / deck_path, sets), dp))[0]
    return {
        **row,
        # ZeRO-3: the kept shard plus the most units gathered at once, against the plan's bound.
        "parameters": got["parameters"] + got.get("parameters_gathered_peak", 0),
        "planned_parameters": stage.weights_for(zero),
        # ZeRO-2 keeps no whole buffer: its bucket buffers at their most, against the plan's bound.
        "gradients": got["gradients"] + got.get("gradient_buckets_peak", 0),
        "planned_gradients": stage.grads(zero),
        "optimizer": got["optimizer_state"] + got.get("gradient_shard", 0),
        "planned_optimizer": stage.optimizer[f"zero{zero}"],
    }


def markdown(rows: list[dict]) -> str:
    mb = 1e6
    lines = ["| zero | dp | parameters MB (plan) | gradients MB (plan) | optimizer state + gradient shard MB (plan) |",
             "|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['zero']} | {r['dp']} | failed ({r['error']}) | | |")
            continue
        cells = [f"{r[k] / mb:.3f} ({r['planned_' + k] / mb:.3f})" for k in ("parameters", "gradients", "optimizer")]
        lines.append(f"| {r['zero']} | {r['dp']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--deck", default="inputs/gpt_tiny.yaml")
    parser.add_argument("--zero", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--dp", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--out", default="runs/zero_memory_bench")
    args = parser.parse_args(argv)
    rows = [measure(args.deck, zero, dp, args.steps, Path(args.out)) for zero in args.zero for dp in args.dp]
    return grid_bench.write_tables(REPO / args.out, rows, COLUMNS, markdown(rows))


if __name__ == "__main__":
    sys.exit(main())

"""3D against 1D tensor parallelism at the same tensor degree on this machine: bytes and time.

    .venv/bin/python benchmarks/tensor3d_bytes_bench.py [--deck inputs/gpt_tiny.yaml] [--steps 8]
        [--rounds 3] [--variants 1d:4 3d:2x2x1 3d:1x2x2 3d:2x1x2 1d:8 3d:2x2x2 3d:1x2x4 1d:4/dp2 3d:2x2x1/dp2]
        [--out runs/tensor3d_bytes_bench] [--calibrated DIR] [--set section.key=value ...]

A variant is `1d:T` (parallel.tp = T, Megatron's 1D tensor parallelism) or `3d:XxYxZ`
(parallel.tensor = [X, Y, Z], tp = X Y Z, AxoNN's 3D), optionally `/dpD` (dp = D; 1 otherwise);
it runs on T x D ranks. Each round runs every variant once, in turn (a noisy neighbour hurts them
alike): `mpirun -n RANKS python benchmarks/count_collectives.py ... DECK` with run.timers on, one
torch thread per rank, no checkpoint, from step 0. The counted window is the steps after
run.timing_warmup, the same steps the step time averages. Two tables (Markdown on stdout,
table.md and table.csv in --out):

- bytes: per grid axis, the bytes one rank sends per step (every rank's; "a-b" where ranks
  differ), counted from the torch.distributed calls of the run, next to the model's: the ring
  volumes (`app.plan.perf.ring_terms`, NCCL's: all-reduce 2 (n-1)/n, all-gather and
  reduce-scatter (n-1)/n of the full size, a send its payload) of `perf.step_messages` (the
  collectives of `tp_collectives` / `tp3d_collectives` times the micro-batches, dp, pp) and the
  sum over Z of the gradients replicated over Z (`perf.stage_params3d`, charged by `predict`).
  Scalar all-reduces (norm, non-finite check: <= 64 bytes each), which the model leaves out, are
  a column of their own. "on the wire": what the rank wrote to its sockets (/proc/self/io wchar,
  see count_collectives.py) next to the counted calls at gloo's volumes (its reduce-scatter
  sends what an all-reduce does: `Link.gloo`);
- time: the median over the rounds of rank 0's mean step time and of its exposed communication
  per axis and 3D sub-axis (summary.json `timers.exposed_comm_s`; in 3D the `tp` timer holds the
  sum over Z of the replicated gradients, charged to tp by `finish_grad_reduce`). With
  --calibrated DIR, next to each the model's (`perf.predict` on this machine calibrated at the
  variant's rank count, DIR/local_RANKS.yaml, `python -m app.plan.calibrate` first where it is
  missing), and the part of the predicted step the bytes cost: the step less the step predicted
  with every link and collective of infinite bandwidth (latencies and busy waits kept).

A benchmark, not a test: it reports; the exit status is 1 only if a run failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
import grid_bench  # noqa: E402

from app.deck import Deck, load_deck, resolve_for_world  # noqa: E402
from app.errors import GridlmError  # noqa: E402
from app.names import BYTES, reduce_precision  # noqa: E402
from app.plan.machine import Machine, load_machine  # noqa: E402
from app.plan.perf import predict, ring_terms, stage_params3d, step_messages, tensor_shape  # noqa: E402

VARIANT = re.compile(r"^(1d:(\d+)|3d:(\d+)x(\d+)x(\d+))(?:/dp(\d+))?$")
VARIANTS = ["1d:4", "3d:2x2x1", "3d:1x2x2", "3d:2x1x2", "1d:8", "3d:2x2x2", "3d:1x2x4", "1d:4/dp2", "3d:2x2x1/dp2"]
# The columns of the bytes table: grid axes and 3D sub-axes, the Z sum of the replicated gradients,
# and the scalar all-reduces the model leaves out.
COLUMNS = ["tp", "tp_x", "tp_y", "tp_z", "tp_z_sum", "dp", "pp", "scalars"]
SCALAR_BYTES = 64  # an all-reduce this small is a scalar's (norm, non-finite flags, loss)
SUB_AXES = ("tp_x", "tp_y", "tp_z")


def parse_variant(spec: str) -> tuple[int, Optional[tuple[int, int, int]], int]:
    """'3d:2x2x1/dp2' -> (tp, (x, y, z) or None for 1D, dp)."""
    match = VARIANT.match(spec)
    if match is None:
        raise SystemExit(f"tensor3d_bytes_bench: bad variant {spec!r}; expected 1d:T or 3d:XxYxZ, then /dpD or nothing")
    dp = int(match.group(6) or 1)
    if match.group(2) is not None:
        return int(match.group(2)), None, dp
    shape = (int(match.group(3)), int(match.group(4)), int(match.group(5)))
    return shape[0] * shape[1] * shape[2], shape, dp


def variant_sets(spec: str) -> list[str]:
    tp, shape, dp = parse_variant(spec)
    tensor = "null" if shape is None else "[" + ",".join(map(str, shape)) + "]"
    return [f"parallel.tp={tp}", f"parallel.tensor={tensor}", f"parallel.dp={dp}"]


def sent(op: str, n: int, nbytes: float, gloo: bool = False) -> float:
    """Bytes one rank sends for one message of full size `nbytes` over a group of `n` ranks: a ring's
    (`perf.ring_terms`: all-reduce 2 (n-1)/n, all-gather and reduce-scatter (n-1)/n, or under `gloo`
    a reduce-scatter as an all-reduce), a send's payload; nothing for a receive."""
    if op == "send":
        return float(nbytes)
    if op in ("recv", "barrier") or n <= 1:
        return 0.0
    if op in ("broadcast", "all_to_all"):  # not in a training step; counted should one appear
        return (n - 1) / n * nbytes
    return ring_terms(op, n, gloo)[0] * nbytes


def column_of(axis: str, phase: str, op: str, nbytes: int) -> str:
    """The bytes table's column of a counted call (`count_collectives.py` record)."""
    if op == "all_reduce" and nbytes <= SCALAR_BYTES:
        return "scalars"
    if axis == "tp_z" and phase == "update" and op == "all_reduce":
        return "tp_z_sum"  # finish_grad_reduce: the Z sum of the replicated parameters' gradients
    return axis


def counted_bytes(records: list[dict[str, Any]], steps: int, gloo: bool = False) -> dict[str, float]:
    """Bytes one rank sent per step by column, from its counted calls over `steps` steps."""
    out: dict[str, float] = {}
    for r in records:
        column = column_of(r["axis"], r["phase"], r["op"], r["bytes"])
        out[column] = out.get(column, 0.0) + r["calls"] * sent(r["op"], r["n"], r["bytes"], gloo) / steps
    return out


def axis_sizes(deck: Deck) -> dict[str, int]:
    par = deck.parallel
    sizes = {"tp": par.tp, "pp": par.pp, "dp": deck.dp}
    return {**sizes, **dict(zip(SUB_AXES, tensor_shape(deck) or (1, 1, 1)))}


def predicted_bytes(deck: Deck, stage: int = 0, gloo: bool = False) -> dict[str, float]:
    """Bytes one rank of pipeline `stage` sends per step by column, by the model: the ring volumes of
    `perf.step_messages` and, under 3D with Z > 1, of the Z sum of the replicated gradients (as
    `perf.predict` charges it in dp_exposed: one all-reduce of this rank's share of them)."""
    m, par, tr = deck.model, deck.parallel, deck.train
    sizes = axis_sizes(deck)
    out: dict[str, float] = {}
    for (axis, op), nbytes in step_messages(deck, stage).items():
        n = 2 if axis == "pp" and op == "all_reduce" else sizes[axis]  # pp's all-reduce: the tied pair
        out[axis] = out.get(axis, 0.0) + sent(op, n, nbytes, gloo)
    shape = tensor_shape(deck)
    if shape is not None and shape[2] > 1:
        chunks = deck.chunks
        layers = sum(len(chunks[c]) for c in range(stage, par.pp * par.virtual_stages, par.pp))
        _, replicated = stage_params3d(m, shape, layers, stage == 0, stage == par.pp - 1)
        g = BYTES[reduce_precision(tr.precision, tr.grad_reduce_dtype)]
        share = 1 / deck.dp if deck.optim.zero and deck.dp > 1 else 1  # under ZeRO, this rank's shard of them
        out["tp_z_sum"] = sent("all_reduce", shape[2], replicated * g * share, gloo)
    return out


def resolve(deck_path: str, spec: str, sets: list[str]) -> Deck:
    tp, _, dp = parse_variant(spec)
    return resolve_for_world(load_deck(REPO / deck_path, (*sets, *variant_sets(spec))), tp * dp)


def calibration(directory: Path, ranks: int) -> Machine:
    """This machine calibrated on `ranks` ranks (`app.plan.calibrate`): directory/local_RANKS.yaml,
    measured into it first if it is not there."""
    path = directory / f"local_{ranks}.yaml"
    if not path.exists():
        directory.mkdir(parents=True, exist_ok=True)
        cmd = ["mpirun", "-n", str(ranks), sys.executable, "-m", "app.plan.calibrate", "--out", str(path)]
        print(f"tensor3d_bytes_bench: {' '.join(cmd)}", file=sys.stderr, flush=True)
        subprocess.run(cmd, cwd=REPO, env=grid_bench.mpi_env(), check=True)
    return load_machine(path)


def free_bytes(machine: Machine) -> Machine:
    """`machine` with every link and measured collective of infinite bandwidth (latencies and busy
    waits kept): the step the model predicts if the bytes cost nothing."""
    links = [{**level, "gbs": math.inf} for level in machine.links or []]
    fits = {op: {n: {**fit, "gbs": math.inf} for n, fit in by_size.items()}
            for op, by_size in (machine.collectives or {}).items()}  # fmt: skip
    return dataclasses.replace(machine, links=links, collectives=fits)


def predicted_time(deck: Deck, machine: Machine) -> dict[str, float]:
    """The model's step and exposed communication (ms): tp_x, tp_y, tp_z; tp (1D's, or 3D's Z sum of
    the replicated gradients, which `predict` counts in dp_exposed); dp; and `bytes`, the part of the
    step the bytes cost (the step less the step with free bandwidth)."""
    p, free = predict(deck, machine), predict(deck, free_bytes(machine))
    z_sum = p.tensor3d.get("tp_z_grad_sum", 0.0)
    out = {"step": p.step_time_s, "bytes": p.step_time_s - free.step_time_s, "dp": p.breakdown["dp_exposed"] - z_sum}
    out.update({a: p.tensor3d.get(a, 0.0) for a in SUB_AXES})
    out["tp"] = z_sum if p.tensor3d else p.breakdown["tp_exposed"]
    return {k: 1e3 * v for k, v in out.items()}


def run_once(spec: str, round_: int, args: argparse.Namespace) -> dict[str, Any]:
    """One run of a variant: its summary's times, each rank's counted bytes, the machine's load."""
    tp, _, dp = parse_variant(spec)
    name = spec.replace(":", "").replace("/", "_")
    run_dir = Path(args.out) / f"{name}_r{round_}"
    sets = [*args.set, *variant_sets(spec), f"train.steps={args.steps}", "run.timers=true", "run.threads=1",
            f"run.log_every={args.steps}", f"run.dir={run_dir}", *grid_bench.FRESH]  # fmt: skip
    skip = resolve(args.deck, spec, args.set).run.timing_warmup
    counts = str(run_dir / "counts")
    cmd = ["mpirun", "-n", str(tp * dp), sys.executable, "benchmarks/count_collectives.py", counts, str(skip)]
    cmd += [args.deck, *(a for s in sets for a in ("--set", s))]
    print(f"tensor3d_bytes_bench: round {round_}: {spec}: {' '.join(cmd)}", file=sys.stderr, flush=True)
    load_before = os.getloadavg()[0]
    out = subprocess.run(cmd, cwd=REPO, env=grid_bench.mpi_env(), capture_output=True, text=True, check=False)
    row: dict[str, Any] = {"variant": spec, "round": round_, "ranks": tp * dp, "load_before": load_before,
                           "load_after": os.getloadavg()[0]}  # fmt: skip
    if out.returncode != 0:
        print(out.stdout[-2000:] + out.stderr[-4000:], file=sys.stderr)
        return {**row, "error": f"exit {out.returncode}"}
    return {**row, **read_run(REPO / run_dir, tp * dp)}


def read_run(run_dir: Path, ranks: int) -> dict[str, Any]:
    """A finished run's figures: rank 0's times (summary.json) and every rank's counted bytes per
    step by column (`counted_bytes`), socket bytes (`wire`) and counted calls at gloo's volumes."""
    summary = json.loads((run_dir / "summary.json").read_text())
    exposed = summary["timers"]["exposed_comm_s"]
    row = {"step_ms": 1e3 * summary["step_time_s"], "exposed_pct": 100 * (summary["exposed_comm_fraction"] or 0.0),
           "micro_batches": summary["pipeline"]["micro_batches"]}  # fmt: skip
    row.update({f"exposed_{a}_ms": 1e3 * exposed.get(a, 0.0) for a in ("tp", *SUB_AXES, "dp", "pp")})
    counts = [json.loads(p.read_text()) for p in sorted((run_dir / "counts").glob("rank*.json"))]
    assert len(counts) == ranks, f"{len(counts)} count files for {ranks} ranks in {run_dir}"
    row["per_rank"] = [counted_bytes(r["records"], r["steps"]) for r in counts]
    row["wire"] = [r["wchar"] / r["steps"] for r in counts]
    row["gloo"] = [sum(counted_bytes(r["records"], r["steps"], gloo=True).values()) for r in counts]
    row["unknown"] = sorted({x["axis"] for r in counts for x in r["records"] if x["axis"] in ("unknown", "world")})
    return row


def _span(values: list[float], unit: float = 1e3, digits: int = 1) -> str:
    lo, hi = min(values) / unit, max(values) / unit
    text = [f"{v:,.{digits}f}" for v in (lo, hi)]
    return text[0] if text[0] == text[1] else f"{text[0]}-{text[1]}"


def bytes_table(specs: list[str], rows: list[dict], predicted: dict[str, dict[str, float]]) -> str:
    """Per variant and column: counted / model, kB per rank per step (the scalars in bytes)."""
    lines = [
        "| variant | ranks | micro-batches per rank | "
        + " | ".join(COLUMNS)
        + " | total | vs 1D | on the wire (gloo volume) |",
        "|" + "---|" * (len(COLUMNS) + 6),
    ]
    totals: dict[str, float] = {}
    for spec in specs:
        ok = [r for r in rows if r["variant"] == spec and "error" not in r]
        if not ok:
            lines.append(f"| {spec} | failed |" + " |" * (len(COLUMNS) + 4))
            continue
        r, model = ok[0], predicted[spec]
        cells = []
        for c in [*COLUMNS, "total"]:
            counted = [sum(v for k, v in b.items() if k != "scalars") if c == "total" else b.get(c, 0.0)
                       for b in r["per_rank"]]  # fmt: skip
            expect = sum(model.values()) if c == "total" else model.get(c)
            if c == "scalars":  # left out by the model
                cells.append(f"{_span(counted, 1.0, 0)} B" if any(counted) else "")
            elif not any(counted) and not expect:
                cells.append("")
            else:
                cells.append(_span(counted) + f" / {(expect or 0.0) / 1e3:,.1f}")
        totals[spec] = max(sum(v for k, v in b.items() if k != "scalars") for b in r["per_rank"])
        tp, shape, dp = parse_variant(spec)
        base = totals.get(f"1d:{tp}" + (f"/dp{dp}" if dp > 1 else ""))
        cells.append(f"{totals[spec] / base:.2f}" if base and shape is not None else "")
        wire = f"{_span(r['wire'])} ({_span(r['gloo'])})"
        lines.append(f"| {spec} | {r['ranks']} | {r['micro_batches']} | " + " | ".join(cells) + f" | {wire} |")
    return "\n".join(lines)


def time_table(specs: list[str], rows: list[dict], model: dict[str, dict[str, float]]) -> str:
    """Medians over the rounds (each round's in brackets), then the model's where it was asked for."""
    axes = ("tp_x", "tp_y", "tp_z", "tp", "dp")
    lines = [
        "| variant | ranks | step ms (median; rounds) | exposed ms: tp_x | tp_y | tp_z | tp (1D; 3D: Z grad sum) | dp "
        "| exposed % of step | model: bytes' share of the step | load (1 min) |",
        "|" + "---|" * 11,
    ]
    for spec in specs:
        ok = [r for r in rows if r["variant"] == spec and "error" not in r]
        if not ok:
            lines.append(f"| {spec} | failed |" + " |" * 9)
            continue
        for r in ok:  # the tp timer holds its sub-axes too (StepTimers.pop): keep tp's own part
            r["exposed_tp_own_ms"] = max(0.0, r["exposed_tp_ms"] - sum(r[f"exposed_{a}_ms"] for a in SUB_AXES))
        mine = model.get(spec, {})
        cells = [grid_bench.median_cell(ok, "step_ms") + (f" / {mine['step']:.0f}" if mine else "")]
        for a in axes:
            key = f"exposed_{a}_ms" if a != "tp" else "exposed_tp_own_ms"
            cells.append(grid_bench.median_cell(ok, key) + (f" / {mine[a]:.0f}" if mine else ""))
        cells.append(f"{statistics.median(r['exposed_pct'] for r in ok):.0f}")
        cells.append(f"{mine['bytes']:.0f} ms ({100 * mine['bytes'] / mine['step']:.0f}%)" if mine else "")
        loads = [x for r in ok for x in (r["load_before"], r["load_after"])]
        cells.append(f"{min(loads):.1f}-{max(loads):.1f}")
        lines.append(f"| {spec} | {ok[0]['ranks']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--deck", default="inputs/gpt_tiny.yaml")
    parser.add_argument(
        "--steps", type=int, default=8, help="optimizer steps per run (first run.timing_warmup skipped)"
    )
    parser.add_argument("--rounds", type=int, default=3, help="runs of every variant, alternated; medians reported")
    parser.add_argument("--variants", nargs="+", default=VARIANTS)
    parser.add_argument("--out", default="runs/tensor3d_bytes_bench")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="for every variant")
    parser.add_argument(
        "--calibrated",
        metavar="DIR",
        help="also predict each step on this machine's calibration, DIR/local_RANKS.yaml (calibrated first if absent)",
    )
    args = parser.parse_args(argv)
    grid_bench.check_counts(parser, args, "steps", "rounds")
    try:  # a bad variant, deck or --set fails here, in one line, before any run
        decks = {spec: resolve(args.deck, spec, args.set) for spec in args.variants}
    except GridlmError as err:
        print(f"tensor3d_bytes_bench: {err}", file=sys.stderr)
        return 2
    predicted = {spec: predicted_bytes(deck) for spec, deck in decks.items()}
    model: dict[str, dict[str, float]] = {}
    if args.calibrated:
        machines = {
            n: calibration(REPO / args.calibrated, n) for n in sorted({d.parallel.tp * d.dp for d in decks.values()})
        }
        model = {spec: predicted_time(deck, machines[deck.parallel.tp * deck.dp]) for spec, deck in decks.items()}
    rows = [run_once(spec, round_, args) for round_ in range(args.rounds) for spec in args.variants]
    problems = []
    for spec in args.variants:
        ok = [r for r in rows if r["variant"] == spec and "error" not in r]
        if any(r["per_rank"] != ok[0]["per_rank"] for r in ok):
            problems.append(f"{spec}: the counted bytes differ between rounds")
        if ok and ok[0]["unknown"]:
            problems.append(f"{spec}: calls on groups that are no grid axis: {ok[0]['unknown']}")
    flat = []
    for r in rows:
        base = {k: v for k, v in r.items() if k not in ("per_rank", "wire", "gloo", "unknown")}
        if "error" not in r:
            base.update({f"{c}_bytes": max(b.get(c, 0.0) for b in r["per_rank"]) for c in COLUMNS})
            base.update({f"{c}_predicted": predicted[r["variant"]].get(c, 0.0) for c in COLUMNS if c != "scalars"})
            base.update(wire_bytes=max(r["wire"]), gloo_bytes=max(r["gloo"]))
            base.update({f"model_{k}_ms": v for k, v in model.get(r["variant"], {}).items()})
        flat.append(base)
    text = (
        "Bytes one rank sends per step, kB (1e3 B): counted / model (ring volumes; the scalars are not "
        "in the model). On the wire: the rank's socket writes (the counted calls at gloo's volumes).\n\n"
        + bytes_table(args.variants, rows, predicted)
        + "\n\nStep time and exposed communication, rank 0, ms per step (median of the rounds; each round)"
        + (" / the model's on this machine's calibration" if model else "")
        + ":\n\n"
        + time_table(args.variants, rows, model)
        + "".join(f"\n\nproblem: {p}" for p in problems)
    )
    columns = [*{k: None for r in flat for k in r if k != "error"}]
    return grid_bench.write_tables(REPO / args.out, flat, columns, text)


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark asynchronous checkpoints: what the step loop loses to a save, sync against async.

    .venv/bin/python benchmarks/checkpoint_async_bench.py [--ranks 4] [--rounds 3] [--steps 3]
        [--deck inputs/gpt_tiny.yaml] [--out runs/checkpoint_async_bench] [--set section.key=value ...]

One `mpirun -n RANKS` job builds the `Trainer` of checkpoint_bench.py's model (gpt_tiny enlarged
to ~35M parameters: 0.42 GB of fp32 parameters + Adam moments, tp = 2 x dp = 2, ZeRO-1) and
trains it. Every round runs, in alternating order (even rounds in the order below, odd rounds
reversed, so that neither variant always follows the other):

  steps            --steps training steps with no checkpoint: the baseline step time
  sync             a synchronous save (`io.save`, checkpoint.async false): the step loop is
                   blocked for all of it
  async            a background save (`BackgroundWriter`, the checkpoint.async path): the loop
                   is blocked while `start` copies the state and, should the write outlast
                   the steps that follow, while `wait` waits for it; training steps run during
                   the write until every rank's write is done (as the train loop polls it)
  async nice 10    the same with the writer thread at nice 10 (the default, background.NICE,
                   is the training threads' priority): the write spreads over more steps

Times are rank 0's; a step's time is set by its collectives, so by the slowest rank. Blocked
times are the maximum over ranks of each rank's blocked time. The table (table.md and
table.csv in --out) gives medians over the rounds: blocked seconds, the whole save (from the
copy to the commit), blocked / the sync save, the baseline step time and the step time
during the write (the mean of the steps run while it was in flight), their ratio, the
steps run during the write, and the extra step time those steps took in all (the CPU the
writer took from training: on a machine with idle cores it is ~0).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this checkout's app, before grid_bench imports it

from checkpoint_bench import SIZE, build_trainer  # noqa: E402
from grid_bench import mpi_env, write_tables  # noqa: E402

VARIANTS = ("sync", "async", "async nice 10")
COLUMNS = ["variant", "ranks", "GB", "blocked_s", "save_s", "blocked_vs_sync", "step_s", "step_during_write_s",
           "step_slowdown", "steps_during_write", "extra_step_s", "rounds"]  # fmt: skip


# ---- worker (one per MPI rank) ---------------------------------------------------------


def worker(args: argparse.Namespace) -> int:
    from app.runtime.mpi import abort, init_mpi

    rt = init_mpi()
    try:
        return _measure(rt, args)
    except BaseException:
        print(f"checkpoint_async_bench: rank {rt.rank}: error, aborting the job", file=sys.stderr, flush=True)
        traceback.print_exc()
        abort(rt, 1)
    return 1


def _measure(rt: Any, args: argparse.Namespace) -> int:
    from mpi4py import MPI

    from app.checkpoint import io
    from app.checkpoint.background import BackgroundWriter
    from app.runtime.mpi import shutdown

    comm = rt.comm
    trainer, threads = build_trainer(rt, args.deck, args.set)
    grid = trainer.grid
    writers = {"async": BackgroundWriter(rt), "async nice 10": BackgroundWriter(rt, nice=10)}
    directory = Path(args.dir)
    trainer.model.train()

    def step() -> float:
        t0 = time.perf_counter()
        trainer.step()
        return time.perf_counter() - t0

    def most(seconds: float) -> float:
        return comm.allreduce(seconds, op=MPI.MAX)

    def clear() -> None:
        if rt.rank == 0:
            shutil.rmtree(directory, ignore_errors=True)
        comm.Barrier()

    results: dict[str, list[dict[str, Any]]] = {"steps": [], **{v: [] for v in VARIANTS}}
    nbytes = 0
    for _ in range(2):  # warm-up: allocations, first collectives
        step()
    for round_ in range(args.rounds):
        order = ["steps", *VARIANTS] if round_ % 2 == 0 else [*reversed(VARIANTS), "steps"]
        for variant in order:
            clear()
            if variant == "steps":
                results["steps"].append({"steps": [step() for _ in range(args.steps)]})
            elif variant == "sync":
                comm.Barrier()
                t0 = time.perf_counter()
                saved = io.save(trainer, directory)
                seconds = most(time.perf_counter() - t0)
                nbytes = saved.bytes
                results["sync"].append({"blocked_s": seconds, "save_s": seconds})
            else:
                writer = writers[variant]
                comm.Barrier()
                blocked = writer.start(trainer, directory, "benchmark")
                during = []
                while not writer.done_everywhere() and len(during) < args.max_steps:
                    during.append(step())
                t0 = time.perf_counter()
                saved = writer.wait()
                waited = time.perf_counter() - t0
                results[variant].append({
                    "blocked_s": most(blocked + waited), "copy_s": most(blocked), "save_s": most(saved.seconds),
                    "steps": during,
                })  # fmt: skip
        rt.log(f"checkpoint_async_bench: round {round_ + 1}/{args.rounds} done")
    clear()
    for writer in writers.values():
        writer.close()
    if rt.rank == 0:
        result = {
            "ranks": rt.world_size,
            "parameters": trainer.model.num_parameters(),
            "grid": {"tp": grid.size("tp"), "pp": grid.size("pp"), "dp": grid.size("dp"), "zero": int(trainer.dp.zero)},
            "torch_threads": threads,
            "bytes": nbytes,
            "results": results,
        }
        Path(args.result).write_text(json.dumps(result, indent=1))
    shutdown(rt)
    return 0


# ---- driver ----------------------------------------------------------------------------


def rows_of(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The table's rows from the worker's measurements (medians over the rounds)."""
    res, gb = result["results"], result["bytes"] / 1e9
    step_s = statistics.median(s for r in res["steps"] for s in r["steps"])
    sync_s = statistics.median(r["save_s"] for r in res["sync"])
    rows = []
    for variant in VARIANTS:
        runs = res[variant]
        blocked = statistics.median(r["blocked_s"] for r in runs)
        during = [s for r in runs for s in r.get("steps", [])]
        mean_during = statistics.fmean(during) if during else None
        rows.append({
            "variant": variant, "ranks": result["ranks"], "GB": gb, "blocked_s": blocked,
            "save_s": statistics.median(r["save_s"] for r in runs), "blocked_vs_sync": blocked / sync_s,
            "step_s": step_s, "step_during_write_s": mean_during,
            "step_slowdown": None if mean_during is None else mean_during / step_s - 1,
            "steps_during_write": statistics.fmean(len(r.get("steps", [])) for r in runs),
            "extra_step_s": statistics.median(sum(s - step_s for s in r.get("steps", [])) for r in runs),
            "rounds": len(runs),
        })  # fmt: skip
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    def num(value: Optional[float], fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    lines = [
        "| variant | blocked s | whole save s | blocked / sync save | step s (no save) | step s during the write "
        "| slowdown | steps during the write | extra step time s |",
        "|" + "---|" * 9,
    ]
    for r in rows:
        lines.append(
            f"| {r['variant']} | {r['blocked_s']:.3f} | {r['save_s']:.3f} | {100 * r['blocked_vs_sync']:.1f}% "
            f"| {r['step_s']:.3f} | {num(r['step_during_write_s'], '.3f')} "
            f"| {num(None if r['step_slowdown'] is None else 100 * r['step_slowdown'], '+.1f')}% "
            f"| {r['steps_during_write']:.1f} | {r['extra_step_s']:.3f} |"
        )
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every variant (medians over them)")
    parser.add_argument("--steps", type=int, default=3, help="baseline steps per round")
    parser.add_argument("--max-steps", type=int, default=20, help="at most this many steps during one write")
    parser.add_argument("--deck", default="inputs/gpt_tiny.yaml")
    parser.add_argument("--out", default="runs/checkpoint_async_bench")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="extra deck override")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)
    out = (REPO / args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    result_path = out / "worker.json"
    result_path.unlink(missing_ok=True)
    sets = [*SIZE, f"run.dir={out / 'run'}", "run.resume=none", "checkpoint.at_exit=false", *args.set]
    cmd = ["mpirun", "-n", str(args.ranks), sys.executable, str(Path(__file__).resolve()), "--worker",
           "--deck", args.deck, "--dir", str(out / "files"), "--rounds", str(args.rounds), "--steps", str(args.steps),
           "--max-steps", str(args.max_steps), "--result", str(result_path),
           *(a for s in sets for a in ("--set", s))]  # fmt: skip
    print(f"checkpoint_async_bench: {' '.join(cmd)}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=mpi_env(), capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    if proc.returncode != 0 or not result_path.is_file():
        print(proc.stdout[-2000:] + proc.stderr[-4000:], file=sys.stderr)
        rows = [{"variant": v, "ranks": args.ranks, "error": f"exit {proc.returncode}"} for v in VARIANTS]
        return write_tables(out, rows, COLUMNS, f"checkpoint_async_bench: the MPI job failed (exit {proc.returncode})")
    result = json.loads(result_path.read_text())
    rows = rows_of(result)
    g = result["grid"]
    head = (
        f"checkpoint_async_bench: {os.cpu_count()} cores, {result['ranks']} ranks, {result['parameters']:,} "
        f"parameters, grid tp={g['tp']} pp={g['pp']} dp={g['dp']} zero={g['zero']}, torch threads per rank "
        f"{result['torch_threads']}, {result['bytes'] / 1e9:.3f} GB of tensors per checkpoint, {args.rounds} round(s)"
    )
    by = {r["variant"]: r for r in rows}
    verdict = (
        f"checkpoint_async_bench: async blocked {100 * by['async']['blocked_vs_sync']:.1f}% of the sync save "
        f"(goal <= 10%); steps during the write "
        + ("-" if by["async"]["step_slowdown"] is None else f"{100 * by['async']['step_slowdown']:+.1f}%")
        + f" (goal <= +20%); wall time {wall:.1f} s"
    )
    return write_tables(out, rows, COLUMNS, head + "\n\n" + markdown(rows) + "\n\n" + verdict)


if __name__ == "__main__":
    sys.exit(main())

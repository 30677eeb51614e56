"""Context parallelism's memory: at a sequence one rank cannot hold within a budget, cp ranks train
it, each with a fraction of the activations; the dry run's activation bytes against the measured
ones (issue 43).

    .venv/bin/python benchmarks/cp_memory_bench.py [--cp 1 4] [--seq 16384] [--micro-batch 2]
        [--budget-gib 2.5] [--steps 2] [--out runs/cp_memory_bench]

Per cp: one `mpirun -n CP python benchmarks/cp_memory_bench.py --worker` job trains gpt_tiny (4 layers,
hidden 256) at `--seq` on a tp1 cp pp1 dp1 grid. Each rank measures:

- `activation_bytes`: the bytes autograd keeps for backward during the first step's one micro-batch
  (every saved tensor's storage counted once, parameters left out;
  `torch.autograd.graph.saved_tensors_hooks`): what the dry
  run's `activations` estimate per stage at recompute none (one micro-batch in flight at pp 1);
- `peak_rss`: the process's peak resident memory (ru_maxrss) after `--steps` training steps,
  Python, torch and the model included.

Rank 0 prints, per cp, the slowest rank's numbers beside the dry run's total per rank and its
activations, and the ratio of cp's peak RSS to the cp = 1 estimate (the issue's bound: <= 0.35 at
cp 4). `--budget-gib`: the memory a rank may use; the table says which cp fit it by the estimate
(cp = 1 at seq 16k does not). Writes `results.jsonl` and `table.md` to --out. A benchmark, not a
test.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this checkout's app
sys.path.insert(0, str(REPO / "benchmarks"))
from grid_bench import check_counts, mpi_env  # noqa: E402

GIB = 2**30


def _overrides(args: argparse.Namespace, cp: int, run_dir: str) -> list[str]:
    return [f"parallel.cp={cp}", f"model.seq_len={args.seq}", f"train.micro_batch={args.micro_batch}",
            f"train.global_batch={args.micro_batch}", f"train.steps={args.steps}", "run.resume=none",
            "checkpoint.at_exit=false", "checkpoint.every=0", f"run.dir={run_dir}", f"run.log_every={args.steps}"]  # fmt: skip


def worker(args: argparse.Namespace) -> int:
    import torch

    from app.deck import load_deck, resolve_for_world
    from app.runtime.grid import ProcessGrid
    from app.runtime.mpi import bind_device, init_mpi, init_torch_distributed, set_malloc_mmap_threshold, set_threads
    from app.train import Trainer

    rt = init_mpi()
    bind_device(rt, "cpu")
    set_threads(rt, None)
    init_torch_distributed(rt)
    cp = rt.world_size
    deck = resolve_for_world(load_deck(REPO / "inputs/gpt_tiny.yaml", _overrides(args, cp, args.run_dir)), cp)
    set_malloc_mmap_threshold(deck.run.malloc_mmap_threshold_kb)  # as a job does (app/job.py)
    trainer = Trainer(deck, rt, ProcessGrid(rt, 1, 1, 1, deck.parallel.order, cp))
    # One micro-batch's forward under hooks that count each saved storage once: the activations.
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        seen.setdefault(storage.data_ptr(), storage.nbytes())
        return t

    # The first step under the hooks: its one micro-batch's forward saves every activation before
    # its backward frees them (global batch = micro batch, pp 1).
    params = {p.untyped_storage().data_ptr() for p in trainer.model.parameters()}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        trainer.step()
    activation = sum(n for ptr, n in seen.items() if ptr not in params)  # weights are not activations
    for _ in range(args.steps - 1):
        trainer.step()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    rows = rt.comm.gather({"activation_bytes": activation, "peak_rss": rss}, root=0)
    if rt.is_root:
        print(json.dumps({"cp": cp, "ranks": rows}), flush=True)
    return 0


def planned(args: argparse.Namespace, cp: int) -> dict[str, float]:
    from app.deck import load_deck, resolve_for_world
    from app.plan.estimate import estimate_stages

    deck = resolve_for_world(load_deck(REPO / "inputs/gpt_tiny.yaml", _overrides(args, cp, "runs/unused")), cp)
    stage = estimate_stages(deck)[0]
    total = stage.weights + stage.gradients + stage.optimizer["zero0"] + stage.activations["none"]
    return {"planned_total": total, "planned_activations": stage.activations["none"]}


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--seq", type=int, default=16384)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--budget-gib", type=float, default=2.5)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--out", default="runs/cp_memory_bench")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    check_counts(parser, args, "cp", "seq", "micro_batch", "steps")
    if args.worker:
        return worker(args)
    from app.errors import GridlmError

    try:  # every cp's plan before launching anything: a bad --seq for a cp is said in one line
        base, plans = planned(args, 1), {cp: planned(args, cp) for cp in args.cp}
    except GridlmError as err:
        print(f"cp_memory_bench: {err}", file=sys.stderr)
        return 2
    out = REPO / args.out
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for cp in args.cp:
        plan = plans[cp]
        cmd = ["mpirun", "-n", str(cp), sys.executable, str(Path(__file__).resolve()), "--worker",
               "--seq", str(args.seq), "--micro-batch", str(args.micro_batch), "--steps", str(args.steps),
               "--run-dir", str(out / f"cp{cp}")]  # fmt: skip
        print(f"cp_memory_bench: {' '.join(cmd)}", file=sys.stderr, flush=True)
        run = subprocess.run(cmd, cwd=REPO, env=mpi_env(), capture_output=True, text=True, check=False)
        lines = [line for line in run.stdout.splitlines() if line.startswith('{"cp"')]
        if run.returncode != 0 or not lines:
            print(run.stdout[-2000:] + run.stderr[-4000:], file=sys.stderr)
            rows.append({"cp": cp, **plan, "error": f"exit {run.returncode}"})
            continue
        ranks = json.loads(lines[-1])["ranks"]
        measured = max(r["activation_bytes"] for r in ranks)
        rss = max(r["peak_rss"] for r in ranks)
        rows.append({
            "cp": cp, "seq": args.seq, "micro_batch": args.micro_batch, **plan,
            "activation_bytes": measured, "activation_error": plan["planned_activations"] / measured - 1,
            "peak_rss": rss, "rss_over_cp1_estimate": rss / base["planned_total"],
            "fits_budget_by_estimate": plan["planned_total"] <= args.budget_gib * GIB,
        })  # fmt: skip
    with open(out / "results.jsonl", "w") as f:  # this invocation's rows only, as table.md (and cp_bench)
        for row in rows:
            f.write(json.dumps(row) + "\n")
    head = "| cp | planned GiB/rank | fits budget | planned activations GiB | measured GiB | plan error | peak RSS GiB | RSS / cp1 estimate |"
    text = [head, "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            text.append(f"| {r['cp']} | {r['planned_total'] / GIB:.2f} | | | {r['error']} | | | |")
            continue
        text.append(
            f"| {r['cp']} | {r['planned_total'] / GIB:.2f} | {'yes' if r['fits_budget_by_estimate'] else 'no'} | "
            f"{r['planned_activations'] / GIB:.3f} | {r['activation_bytes'] / GIB:.3f} | {r['activation_error']:+.1%} | "
            f"{r['peak_rss'] / GIB:.2f} | {r['rss_over_cp1_estimate']:.2f} |"
        )
    facts = (f"gpt_tiny (4 layers, hidden 256), seq {args.seq}, micro batch {args.micro_batch}, fp32, budget "
             f"{args.budget_gib} GiB; the cp = 1 estimate: {base['planned_total'] / GIB:.2f} GiB per rank "
             f"({'fits' if base['planned_total'] <= args.budget_gib * GIB else 'does not fit'})")  # fmt: skip
    table = facts + "\n\n" + "\n".join(text) + "\n"
    (out / "table.md").write_text(table)
    print(table)
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

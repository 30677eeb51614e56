"""The offloaded update's CUDA paths (`app/optim/transfer.py`: gradients copied out on their own
stream behind each bucket's reduction, parameters back through two pinned buffers, the delayed
update's staged parameters) checked on a GPU against runs whose outcome is known. A check for the
first session with a GPU, not a benchmark of speed (`gpu_bench.py` times the offloaded cases).

    python benchmarks/gpu_offload_check.py [--steps 8] [--precisions fp32 bf16] [--out runs/gpu_offload_check]
    python benchmarks/gpu_offload_check.py --device cpu --steps 2 --precisions fp32   (the flow on CPU ranks)

For each precision, one rank trains gpt_tiny (2 layers, hidden 64) for --steps steps with
optim.offload none, host and nvme (a 0.05 MB buffer: many chunks) and host with
optim.offload_delay 1 on the device, and host with the delay on CPU ranks (run.device cpu). The
checks, each printed with its numbers:

- host and nvme log the same losses to the bit: the same host kernel on the same gradients, only
  the chunks differ (tests/test_offload.py holds this on CPU ranks);
- host against none within RTOL[precision]: the host AdamW against the device's fused AdamW, about
  an ulp per element and step (fp32; bf16 rounds the parameters, where an ulp can flip one);
- the delayed update on the device against the delayed update on CPU ranks within
  RTOL_DEVICE[precision]: the same update, the forward and backward kernels of two devices.

A gradient read before its copy landed, a parameter buffer reused before its copy left, or staged
parameters published before the update wrote them move a loss by far more (or make it NaN).
Exit 0 when every check passes, 1 when one fails, 2 without a CUDA device (unless --device cpu,
where the device runs are CPU runs: the flow, not the CUDA paths).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from grid_bench import FRESH, check_counts, mpi_env  # noqa: E402

SETS = ("model.layers=2", "model.hidden=64", "model.heads=4", "model.seq_len=32", "train.global_batch=4",
        "train.micro_batch=2", "parallel.dp_bucket_mb=0.05", "checkpoint.at_exit=false", "checkpoint.every=0")  # fmt: skip
RUNS = {  # name -> (run.device is the checked device?, deck keys)
    "none": (True, ("optim.offload=none",)),
    "host": (True, ("optim.offload=host",)),
    "nvme": (True, ("optim.offload=nvme", "optim.offload_buffer_mb=0.05")),
    "host-delay": (True, ("optim.offload=host", "optim.offload_delay=1")),
    "host-delay-cpu": (False, ("optim.offload=host", "optim.offload_delay=1")),
}
RTOL = {"fp32": 1e-5, "bf16": 1e-3}
RTOL_DEVICE = {"fp32": 1e-4, "bf16": 5e-3}


def run(name: str, device: str, precision: str, steps: int, out: Path) -> list[float] | str:
    """The losses of one `python -m app` run of gpt_tiny on one rank, or why it failed (its exit
    status and last line; its whole stderr in OUT/PRECISION_NAME.stderr): a failed run fails its
    checks, the others still run."""
    on_device, keys = RUNS[name]
    run_dir = out / f"{precision}_{name}"
    sets = [*SETS, *keys, f"run.device={device if on_device else 'cpu'}", f"train.precision={precision}",
            f"train.steps={steps}", "run.log_every=1", f"run.dir={run_dir}", *FRESH]  # fmt: skip
    cmd = [sys.executable, "-m", "app", "inputs/gpt_tiny.yaml", *(a for s in sets for a in ("--set", s))]
    print(f"gpu_offload_check: {' '.join(cmd)}", file=sys.stderr, flush=True)
    done = subprocess.run(cmd, cwd=REPO, env=mpi_env(), capture_output=True, text=True, check=False)
    if done.returncode != 0:
        log = out / f"{precision}_{name}.stderr"
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(done.stderr)
        last = (done.stderr.strip().splitlines() or [""])[-1][:200]
        return f"run {name} exited {done.returncode} ({last}; {log})"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if "loss" in r]


def worst(a: list[float], b: list[float]) -> float:
    """The largest relative difference between two loss curves (inf where one is not finite)."""
    if not all(math.isfinite(x) for x in (*a, *b)):  # max() drops a NaN unless it comes first
        return math.inf
    return max((abs(x - y) / abs(y) if abs(y) > 0 else abs(x - y)) for x, y in zip(a, b))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=sorted(RTOL))
    parser.add_argument("--out", default="runs/gpu_offload_check")
    args = parser.parse_args(argv)
    check_counts(parser, args, "steps")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("gpu_offload_check: no CUDA device visible; nothing to check (--device cpu runs the flow)",
                  file=sys.stderr)  # fmt: skip
            return 2
    out, failed = (REPO / args.out).resolve(), []  # the runs' run.dir is against REPO, their cwd
    print("| precision | check | worst relative difference | bound | result |\n|---|---|---|---|---|")
    for precision in args.precisions:
        losses = {name: run(name, args.device, precision, args.steps, out) for name in RUNS}
        checks = [
            ("host = nvme, to the bit", ("host", "nvme"), 0.0),
            ("host against none", ("host", "none"), RTOL[precision]),
            ("delayed: device against CPU ranks", ("host-delay", "host-delay-cpu"), RTOL_DEVICE[precision]),
        ]  # fmt: skip
        for what, (a, b), bound in checks:
            broken = next((x for x in (losses[a], losses[b]) if isinstance(x, str)), None)
            if broken is not None:
                print(f"| {precision} | {what} | | {bound:.0e} | FAILED: {broken} |")
                failed.append(f"{precision}: {what}: {broken}")
                continue
            diff = worst(losses[a], losses[b])
            ok = diff <= bound
            print(f"| {precision} | {what} | {diff:.2e} | {bound:.0e} | {'ok' if ok else 'FAILED'} |")
            if not ok:
                failed.append(f"{precision}: {what}: {diff:.2e} > {bound:.0e}")
        shown = {k: [round(x, 6) for x in v] if isinstance(v, list) else v for k, v in losses.items()}
        print(f"\n{precision} losses: " + json.dumps(shown))
    for line in failed:
        print(f"gpu_offload_check: FAILED {line}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

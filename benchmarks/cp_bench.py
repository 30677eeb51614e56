"""Context-parallel attention: forward + backward time of the ring with its overlap on and off, the
all-to-all, and the ring's messages alone, on a cp group of --ranks ranks (issue 43).

    .venv/bin/python benchmarks/cp_bench.py [--ranks 4] [--seq 4096] [--heads 8] [--kv-heads 8]
        [--head-dim 64] [--batch 1] [--dtype fp32|bf16] [--steps 5] [--rounds 3] [--out runs/cp_bench]

One `mpirun -n RANKS python benchmarks/cp_bench.py --worker` job; each rank holds its two chunks of
the sequence (app/tensor_parallel/context.py). Per round, the variants run in turn (the order
reversed every other round, so that none always runs first), each `--steps` forward + backward passes
after one untimed one; rank 0 prints the medians over the rounds of each variant's slowest rank:

- `ring`: `ring_attention`, each block sent while the one before is computed (the default), each
  block by torch's fused kernel where there is one (CPUs);
- `ring_explicit`: the same with each block as explicit matmuls (what GPUs run until checked);
- `ring_overlap_off`: the same, waiting for each block before computing it;
- `all_to_all`: `all_to_all_attention` (needs cp to divide the heads; else skipped, said so);
- `ring_messages`: only the ring's messages (cp - 1 key/value exchanges forward; backward cp - 1 again
  and cp of the fp32 gradients), no arithmetic: what the ring sends, unhidden.

From these: `hidden_ms` = overlap off - overlap on (communication the overlap hides) and `exposed_ms`
= on - (off - messages) (communication still in the way with the overlap on, clamped at 0). On a CPU
the ranks' compute and gloo's messages share the cores, so little can hide; on GPUs the messages run
beside the kernels. Writes `results.jsonl` and `table.md` to --out. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this checkout's app
sys.path.insert(0, str(REPO / "benchmarks"))
from grid_bench import check_counts, mpi_env  # noqa: E402

VARIANTS = ("ring", "ring_explicit", "ring_overlap_off", "all_to_all", "ring_messages")


def _messages(ring: Any, k: Any, v: Any) -> None:
    """The ring's messages of one forward + backward, without the attention."""
    import torch

    from app.tensor_parallel.context import GRAD_TAG, KV_TAG, _exchange, _wait

    for _ in range(2 * (ring.size - 1)):  # forward's and backward's key/value hops
        _, works = _exchange(ring, [k, v], KV_TAG)
        _wait(ring, works)
    grads = [torch.zeros(k.shape, device=k.device), torch.zeros(v.shape, device=v.device)]
    for _ in range(ring.size):  # backward's fp32 gradients, back to their owners
        grads, works = _exchange(ring, grads, GRAD_TAG)
        _wait(ring, works)


def worker(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    from app.runtime.mpi import bind_device, init_mpi, init_torch_distributed
    from app.tensor_parallel.context import Ring, all_to_all_attention, ring_attention, split_sequence

    rt = init_mpi()
    bind_device(rt, args.device)
    init_torch_distributed(rt, "auto")
    ring = Ring.of_group(dist.group.WORLD) if rt.world_size > 1 else Ring()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    dev = rt.device
    g = torch.Generator().manual_seed(0)
    shape = (args.batch, args.heads, args.seq, args.head_dim)
    kv_shape = (args.batch, args.kv_heads, args.seq, args.head_dim)
    q, grad = (split_sequence(torch.randn(shape, generator=g), ring, 2).to(dev, dtype) for _ in range(2))
    k, v = (split_sequence(torch.randn(kv_shape, generator=g), ring, 2).to(dev, dtype) for _ in range(2))

    def attention(fn: Callable[..., Any]) -> Callable[[], None]:
        def run() -> None:
            qs, ks, vs = (t.detach().requires_grad_() for t in (q, k, v))
            fn(qs, ks, vs, ring).backward(grad)

        return run

    runs: dict[str, Callable[[], None]] = {
        "ring": attention(ring_attention),
        "ring_explicit": attention(lambda *a: ring_attention(*a, fused=False)),
        "ring_overlap_off": attention(lambda *a: ring_attention(*a, overlap=False)),
        "ring_messages": lambda: _messages(ring, k, v),
    }
    skipped: dict[str, str] = {}
    if args.heads % ring.size:
        skipped["all_to_all"] = f"cp = {ring.size} does not divide {args.heads} heads"
    else:
        runs["all_to_all"] = attention(all_to_all_attention)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for rnd in range(args.rounds):
        order = list(runs) if rnd % 2 == 0 else list(reversed(runs))
        for name in order:
            runs[name]()  # untimed: first-call costs
            dist.barrier()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            for _ in range(args.steps):
                runs[name]()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            mine = (time.perf_counter() - t0) / args.steps
            times[name].append(rt.comm.allreduce(mine, op=_max()))  # the slowest rank's
    if rt.rank == 0:
        result = {"times": times, "skipped": skipped, "cp": ring.size, "device": str(dev)}
        Path(args.result).write_text(json.dumps(result))
    dist.destroy_process_group()
    return 0


def _max() -> Any:
    from mpi4py import MPI

    return MPI.MAX


def table(rows: list[dict[str, Any]], facts: str) -> str:
    lines = [facts, "", "| variant | ms (median) | min | max |", "|---|---|---|---|"]
    for r in rows:
        if "ms" in r:
            lines.append(f"| {r['variant']} | {r['ms']:.1f} | {r['min_ms']:.1f} | {r['max_ms']:.1f} |")
        else:
            lines.append(f"| {r['variant']} | {r.get('skipped', r.get('error'))} | | |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4, help="cp: ranks in the ring (default 4)")
    parser.add_argument("--seq", type=int, default=4096, help="whole sequence length (default 4096)")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="cpu")
    parser.add_argument("--steps", type=int, default=5, help="timed forward + backward passes per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="runs/cp_bench")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    check_counts(parser, args, "ranks", "seq", "heads", "kv_heads", "head_dim", "batch", "steps", "rounds")
    if args.seq % (2 * args.ranks):
        parser.error(f"--seq {args.seq} must be a multiple of 2 x ranks = {2 * args.ranks}")
    if args.heads % args.kv_heads:
        parser.error(f"--kv-heads {args.kv_heads} must divide --heads {args.heads}")
    if args.worker:
        return worker(args)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():  # else every rank fails in bind_device with its traceback
            print("cp_bench: --device cuda but torch sees no CUDA device on this machine", file=sys.stderr)
            return 2
    out = (REPO / args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    result_path = out / "worker.json"
    result_path.unlink(missing_ok=True)
    passed = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--worker"]
    cmd = ["mpirun", "-n", str(args.ranks), sys.executable, str(Path(__file__).resolve()), *passed, "--worker",
           "--result", str(result_path)]  # fmt: skip
    print(f"cp_bench: {' '.join(cmd)}", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, cwd=REPO, env=mpi_env(), capture_output=True, text=True, check=False)
    if proc.returncode != 0 or not result_path.is_file():
        print(proc.stdout[-2000:] + proc.stderr[-4000:], file=sys.stderr)
        print(f"cp_bench: the mpirun job failed (exit {proc.returncode})", file=sys.stderr)
        return 1
    result = json.loads(result_path.read_text())
    rows: list[dict[str, Any]] = []
    for name in VARIANTS:
        if name in result["skipped"]:
            rows.append({"variant": name, "skipped": result["skipped"][name]})
            continue
        t = [1e3 * s for s in result["times"][name]]
        rows.append({"variant": name, "ms": statistics.median(t), "min_ms": min(t), "max_ms": max(t), "rounds": t})
    ms = {r["variant"]: r["ms"] for r in rows if "ms" in r}
    hidden = ms["ring_overlap_off"] - ms["ring"]
    exposed = max(0.0, ms["ring"] - (ms["ring_overlap_off"] - ms["ring_messages"]))
    rows.append({"variant": "ring_overlap", "hidden_ms": hidden, "exposed_ms": exposed})
    facts = (f"cp {result['cp']} on {result['device']}, {args.dtype}, batch {args.batch}, sequence {args.seq} "
             f"({args.seq // args.ranks} tokens a rank), {args.heads} heads ({args.kv_heads} key/value) of "
             f"{args.head_dim}; {args.rounds} rounds of {args.steps} forward + backward passes; medians of the "
             f"slowest rank")  # fmt: skip
    text = table([r for r in rows if "variant" in r and r["variant"] != "ring_overlap"], facts)
    text += f"\n\nring overlap: hides {hidden:.1f} ms of the messages, {exposed:.1f} ms still exposed\n"
    with (out / "results.jsonl").open("w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    (out / "table.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

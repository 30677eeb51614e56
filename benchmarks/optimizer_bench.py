"""The optimizer step alone: time, bytes moved against memory bandwidth, and operations dispatched.

    .venv/bin/python benchmarks/optimizer_bench.py [--deck inputs/gpt_tiny.yaml] [--set key=value ...]
        [--device cpu|cuda] [--steps 20] [--rounds 3] [--json]

One rank, in this process. The deck's model is built by the trainer, one forward + backward fills
the gradient buckets, and then `Trainer.update` (the gradient norm, the grid-wide non-finite verdict,
clipping, the AdamW or LAMB update and publishing the compute-dtype parameters) is timed --steps
times per round (after one untimed call), the rounds alternating with a STREAM-style triad over the
same number of bytes so that both see the same machine. It prints, per round and as medians:

- `update_ms`: one optimizer step; `triad_GBps`: `a = b + s * c` over fp32 buffers as large as the
  master shards, the memory bandwidth this process gets now;
- `bytes_GB`: what an ideal step moves (AdamW: read master, gradient, both moments, write master
  and both moments; plus the parameter copy-out when the compute dtype is not fp32; plus reading
  the gradient once for the norm), and `update_GBps` = bytes / time, `of_triad` the ratio;
- `ops`: the aten operations one step dispatches (a TorchDispatchMode; collectives included), which
  must not grow with the number of elements (tests/test_optim.py checks that for 4 and 24 layers);
- on CUDA, `fused_adamw_ms`: torch.optim.AdamW(fused=True) over fp32 tensors of the same sizes (the
  roofline the issue measures against), and `vs_fused` the ratio.

The same command works on older trees (it uses only `Trainer`), so a before/after pair is this
script run in two checkouts, e.g. `farm-bench` alternating them. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this checkout's app, not the one installed (before/after pairs)


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def count_ops(fn) -> Counter:
    """The aten operations `fn()` dispatches, by name (a TorchDispatchMode sees each once)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: Counter = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[str(func.overloadpacket.__name__)] += 1
            return func(*args, **(kwargs or {}))

    mode = Count()
    with mode:
        fn()
    return mode.ops


def build(deck_path: str, sets: list[str], device: str):
    """(trainer, runtime) for one rank with the gradients of one forward + backward in its buckets."""
    from mpi4py import MPI

    from app.deck import load_deck, resolve_for_world
    from app.runtime.grid import ProcessGrid
    from app.runtime.mpi import bind_device, init_mpi, init_torch_distributed, set_threads
    from app.train import Trainer

    runtime = init_mpi(MPI.COMM_SELF)
    bind_device(runtime, device)
    set_threads(runtime, None)
    init_torch_distributed(runtime)
    overrides = ["run.resume=none", "checkpoint.every=0", "checkpoint.at_exit=false", "train.steps=1000",
                 "run.dir=/tmp/gridlm_optimizer_bench", f"run.device={device}", *sets]  # fmt: skip
    deck = resolve_for_world(load_deck(REPO / deck_path, overrides), 1)
    trainer = Trainer(deck, runtime, ProcessGrid(runtime, 1, 1, 1))
    trainer.forward_backward()
    return trainer


def ideal_bytes(trainer) -> float:
    """Bytes an ideal optimizer step moves on this rank (see the module docstring)."""
    import torch

    dp = trainer.dp
    n = dp.layout.shard_elements()
    grad = torch.empty((), dtype=dp.reduce_dtype).element_size()
    moved = n * (4 + grad + 4 + 4) + n * (4 + 4 + 4)  # read master, grad, m, v; write master, m, v
    moved += n * grad  # the norm reads the gradient once
    if not dp.master_is_param:
        moved += n * (4 + dp.param_buffer.element_size())  # copy-out into the compute dtype
    return float(moved)


def triad_ms(n: int, device) -> float:
    import torch

    b = torch.rand(n, device=device)
    c = torch.rand(n, device=device)
    a = torch.empty(n, device=device)
    torch.add(b, c, alpha=1.5, out=a)
    _sync(device)
    t = time.perf_counter()
    for _ in range(5):
        torch.add(b, c, alpha=1.5, out=a)
    _sync(device)
    return (time.perf_counter() - t) / 5 * 1e3


def fused_adamw_ms(trainer, steps: int) -> float:
    """torch.optim.AdamW(fused=True) over fp32 tensors shaped like this rank's parameters."""
    import torch

    device = trainer.dp.device
    params = [torch.zeros(p.numel(), device=device, requires_grad=True) for p in trainer.dp.params]
    for p in params:
        p.grad = torch.rand_like(p)
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
    opt.step()
    _sync(device)
    t = time.perf_counter()
    for _ in range(steps):
        opt.step()
    _sync(device)
    return (time.perf_counter() - t) / steps * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--deck", default="inputs/gpt_tiny.yaml")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="one JSON line instead of the table")
    args = ap.parse_args(argv)
    for name in ("steps", "rounds"):  # no grid_bench here: this script also runs in older trees
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be at least 1, not {getattr(args, name)}")
    import torch

    from app.errors import GridlmError

    if args.device == "cuda" and not torch.cuda.is_available():
        print("optimizer_bench: --device cuda but torch sees no GPU on this machine", file=sys.stderr)
        return 2
    try:
        trainer = build(args.deck, args.set, args.device)
    except GridlmError as err:  # a bad deck or --set: its one line, not a traceback
        print(f"optimizer_bench: {err}", file=sys.stderr)
        return 2
    device = trainer.dp.device
    lr = trainer.deck.optim.lr
    trainer.update(lr)  # warm-up: scratch buffers, lists, first-call costs
    ops = count_ops(lambda: trainer.update(lr))
    moved = ideal_bytes(trainer)
    n = trainer.dp.layout.shard_elements()
    rows = []
    for r in range(args.rounds):
        triad = triad_ms(n, device)
        _sync(device)
        t = time.perf_counter()
        for _ in range(args.steps):
            trainer.update(lr)
        _sync(device)
        update = (time.perf_counter() - t) / args.steps * 1e3
        row = {"round": r + 1, "update_ms": update, "triad_GBps": 3 * 4 * n / triad / 1e6}
        if device.type == "cuda":
            row["fused_adamw_ms"] = fused_adamw_ms(trainer, args.steps)
        rows.append(row)
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k != "round"}
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "optimizer": trainer.deck.optim.name,
        "precision": trainer.deck.train.precision,
        "elements": n,
        "buckets": len(trainer.dp.buckets),
        "ops": sum(ops.values()),
        "bytes_GB": moved / 1e9,
        **med,
        "update_GBps": moved / med["update_ms"] / 1e6,
    }
    result["of_triad"] = result["update_GBps"] / med["triad_GBps"]
    if "fused_adamw_ms" in med:
        result["vs_fused"] = med["update_ms"] / med["fused_adamw_ms"]
    if args.json:
        print(json.dumps(result))
    else:
        for row in rows:
            print("  ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))
        print("median: " + "  ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                      for k, v in result.items()))  # fmt: skip
        print("ops: " + ", ".join(f"{k} {v}" for k, v in ops.most_common()))
    trainer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Optimizer offload on this machine: the host update against memory bandwidth, and the step with
the optimizer offloaded against the step without.

    .venv/bin/python benchmarks/offload_bench.py [--elements 33554432] [--threads N] [--rounds 3]
        [--decks tiny,100m] [--steps 6] [--offloads none,host] [--out runs/offload_bench]

1. The host update (`app.optim.host_adamw.HostAdamW`, what `optim.offload` runs for AdamW) over
   --elements fp32 elements (master, gradient, both moments, weight decay on most of them, as a
   model's matrices), against a STREAM triad (`a = b + s c` over three fp32 buffers of the same
   size) and against the eager passes of the device path on CPU ranks (`ShardedOptimizer._update`),
   in alternating rounds on the same --threads (default: every core this process may use), the
   medians reported (the triad is optimizer_bench.py's: the mean of 5 calls). The update's bytes are what it must move: the master, gradient and moments
   read, the master and moments written, 28 bytes an element; the triad's 12 (STREAM's count).
2. The step: `python -m app` on one rank for each deck and each optim.offload (host-delay: host
   with optim.offload_delay 1), --steps steps (the first run.timing_warmup not timed), alternating
   the offload settings round by round; the median step time from summary.json and the ratio to
   optim.offload: none. Decks: `tiny` is
   inputs/gpt_tiny.yaml; `100m` is gpt_tiny at 12 layers of hidden 768 (GPT-2 small, 124M
   parameters with its 50,257-token vocabulary; seq 128, one sequence a step).

3. NVMe (`NvmeStore`, what `optim.offload: nvme` streams through): --nvme-mb MB of state (master
   and moments) in a file under --nvme-dir, streamed through 64 MB of buffers with nothing to
   update (each pass reads and writes all of it, read-ahead and write-behind at once), against
   `dd oflag=direct` writing and `dd iflag=direct` reading as many bytes in the same directory
   (GB/s = bytes read + written over the time; dd's two are one after the other).

Markdown on stdout; table.md and table.csv in --out. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from grid_bench import FRESH, check_counts, mpi_env, write_tables  # noqa: E402
from optimizer_bench import triad_ms  # noqa: E402

DECKS = {
    "tiny": (),
    "100m": ("model.layers=12", "model.hidden=768", "model.heads=12", "model.vocab_size=50257", "model.seq_len=128",
             "train.global_batch=1", "train.micro_batch=1"),
}  # fmt: skip
COLUMNS = ["part", "case", "value", "unit", "of", "ratio", "rounds"]
DELAYED = "-delay"  # an --offloads value host-delay or nvme-delay: optim.offload_delay = 1
UPDATE_BYTES, TRIAD_BYTES = 28, 12  # per element (module docstring)


def _median_time(fn, repeat: int = 3) -> float:
    fn()  # warm: pages touched, buffers sized
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def host_update(n: int, threads: int, rounds: int) -> list[dict]:
    """Part 1: GB/s of HostAdamW, the eager passes and the triad, alternating, medians over rounds."""
    import torch

    from app.deck import OptimConfig
    from app.optim.host_adamw import HostAdamW

    torch.set_num_threads(threads)
    cfg = OptimConfig(lr=1e-3, weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8)
    gen = torch.Generator().manual_seed(0)
    p, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    m, v, denom = torch.zeros(n), torch.zeros(n), torch.empty(n)
    # Matrices of 4096 x 4096 elements decayed, with a vector between them not (a bias, a norm).
    runs = [(lo, min(lo + 4096 * 4096, n)) for lo in range(0, n, 4096 * 4096 + 4096)]
    update, step = HostAdamW((p, m, v), runs), torch.tensor(1.0)

    def eager() -> None:  # ShardedOptimizer._update's passes (AdamW)
        m.lerp_(g, 1 - cfg.beta1)
        v.mul_(cfg.beta2).addcmul_(g, g, value=1 - cfg.beta2)
        torch.sqrt(v, out=denom).div_(math.sqrt(1 - cfg.beta2)).add_(cfg.eps)
        torch._foreach_mul_([p[lo:hi] for lo, hi in runs], 1 - cfg.lr * cfg.weight_decay)
        p.addcdiv_(m, denom, value=-cfg.lr / (1 - cfg.beta1))

    kinds = {
        "host update (HostAdamW)": lambda: update.step(cfg, cfg.lr, step, g),
        "eager passes (device path on CPU ranks)": eager,
    }
    rates: dict[str, list[float]] = {"triad": [], **{k: [] for k in kinds}}
    for _ in range(rounds):
        rates["triad"].append(n * TRIAD_BYTES / triad_ms(n, torch.device("cpu")) / 1e6)
        for kind, fn in kinds.items():
            rates[kind].append(n * UPDATE_BYTES / _median_time(fn) / 1e9)
    triad = statistics.median(rates["triad"])
    rows = []
    for kind, values in rates.items():
        gbs = statistics.median(values)
        rows.append({"part": f"host update, {n:,} elements, {threads} threads", "case": kind, "value": round(gbs, 2),
                     "unit": "GB/s", "of": "triad", "ratio": round(gbs / triad, 3),
                     "rounds": " ".join(f"{x:.1f}" for x in values)})  # fmt: skip
    return rows


def nvme(mb: int, directory: Path, rounds: int) -> list[dict]:
    """Part 3: GB/s of a pass of NvmeStore.stream against dd oflag/iflag=direct, alternating."""
    import torch

    from app.optim.offload import NvmeStore

    directory.mkdir(parents=True, exist_ok=True)
    n = mb * 10**6 // 12  # elements: master and two moments, 4 bytes each
    masters = [torch.zeros(n // 4) for _ in range(4)]  # four buckets
    store = NvmeStore(masters, directory / "offload_bench.bin", 64 * 10**6)
    moved = 2 * 12 * sum(m.numel() for m in masters)  # each pass reads and writes the state

    def stream() -> None:
        for _ in store.stream(range(len(masters))):
            pass

    def dd() -> None:
        target, count = directory / "offload_bench_dd.bin", -(-moved // 2 // (4 << 20))
        for cmd in (["dd", "if=/dev/zero", f"of={target}", "bs=4M", f"count={count}", "oflag=direct"],
                    ["dd", f"if={target}", "of=/dev/null", "bs=4M", "iflag=direct"]):  # fmt: skip
            subprocess.run(cmd, check=True, capture_output=True)
        target.unlink()

    rates: dict[str, list[float]] = {"dd oflag=direct + iflag=direct": [], "NvmeStore stream": []}
    try:
        for _ in range(rounds):
            rates["dd oflag=direct + iflag=direct"].append(moved / _median_time(dd, 1) / 1e9)
            rates["NvmeStore stream"].append(moved / _median_time(stream, 1) / 1e9)
    finally:
        store.close()
    base = statistics.median(rates["dd oflag=direct + iflag=direct"])
    direct = "O_DIRECT" if getattr(store, "direct", False) else "page cache"  # older trees: no O_DIRECT
    return [{"part": f"nvme, {mb} MB of state in {directory}, {direct}", "case": kind,
             "value": round(statistics.median(v), 2), "unit": "GB/s", "of": "dd",
             "ratio": round(statistics.median(v) / base, 3), "rounds": " ".join(f"{x:.2f}" for x in v)}
            for kind, v in rates.items()]  # fmt: skip


def run_step(deck: str, offload: str, steps: int, out: Path) -> float:
    """Median step seconds of one `python -m app` run on one rank."""
    run_dir = out / f"{deck}_{offload}"
    store, delayed = offload.removesuffix(DELAYED), offload.endswith(DELAYED)
    sets = [*DECKS[deck], f"optim.offload={store}", f"optim.offload_delay={int(delayed)}", f"train.steps={steps}",
            f"run.log_every={steps}", f"run.dir={run_dir}", *FRESH]  # fmt: skip
    cmd = [sys.executable, "-m", "app", "inputs/gpt_tiny.yaml", *(a for s in sets for a in ("--set", s))]
    print(f"offload_bench: {' '.join(cmd)}", file=sys.stderr, flush=True)
    done = subprocess.run(cmd, cwd=REPO, env=mpi_env(), capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{deck} offload={offload}: exit {done.returncode}\n{done.stderr[-3000:]}")
    return json.loads((run_dir / "summary.json").read_text())["step_time_s"]


def steps_table(decks: list[str], offloads: list[str], steps: int, rounds: int, out: Path) -> list[dict]:
    """Part 2: the step with each optim.offload, alternating round by round; medians and ratios."""
    rows = []
    for deck in decks:
        times: dict[str, list[float]] = {o: [] for o in offloads}
        for _ in range(rounds):
            for offload in offloads:
                times[offload].append(run_step(deck, offload, steps, out))
        base = statistics.median(times[offloads[0]])
        for offload, values in times.items():
            ms = 1e3 * statistics.median(values)
            rows.append({"part": f"step, deck {deck}, 1 rank", "case": f"optim.offload={offload}", "value": round(ms, 1),
                         "unit": "ms", "of": f"optim.offload={offloads[0]}", "ratio": round(ms / 1e3 / base, 3),
                         "rounds": " ".join(f"{1e3 * x:.0f}" for x in values)})  # fmt: skip
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| part | case | value | ratio | rounds |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['part']} | {r['case']} | {r['value']} {r['unit']} | {r['ratio']} of {r['of']} "
                     f"| {r['rounds']} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--elements", type=int, default=1 << 25, help="fp32 elements of the host update's state")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="torch threads (part 1)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--decks", default="tiny,100m", help=f"comma-separated, of {sorted(DECKS)}; empty: none")
    parser.add_argument("--offloads", default="none,host,host-delay",
                        help="optim.offload values (with -delay: optim.offload_delay 1), the first the baseline")  # fmt: skip
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--nvme-mb", type=int, default=1024, help="MB of state streamed from the file (0: no part 3)")
    parser.add_argument(
        "--nvme-dir", default=None, help="directory of the file (default: --out; relative: to the repo)"
    )
    parser.add_argument("--out", default="runs/offload_bench")
    args = parser.parse_args(argv)
    check_counts(parser, args, "elements", "threads", "rounds", "steps")
    decks = [d for d in args.decks.split(",") if d]
    if unknown := [d for d in decks if d not in DECKS]:
        parser.error(f"unknown deck(s) {unknown}: choose from {sorted(DECKS)}")
    # The runs' run.dir is read back from here, and `python -m app` runs in REPO: both against REPO.
    out = (REPO / args.out).resolve()
    rows = host_update(args.elements, args.threads, args.rounds)
    rows += steps_table(decks, args.offloads.split(","), args.steps, args.rounds, out)
    if args.nvme_mb > 0:
        rows += nvme(args.nvme_mb, (REPO / args.nvme_dir).resolve() if args.nvme_dir else out, args.rounds)
    return write_tables(out, rows, COLUMNS, markdown(rows))


if __name__ == "__main__":
    sys.exit(main())

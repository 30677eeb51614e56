"""Benchmark checkpoint I/O on this machine: parallel HDF5 vs torch.save per rank vs dd.

    .venv/bin/python benchmarks/checkpoint_bench.py [--ranks 4] [--case small|large] [--repeats 3] [--warmup 1] [--deck inputs/gpt_tiny.yaml]
        [--out runs/checkpoint_bench] [--dir DIR] [--drop-caches] [--set section.key=value ...]

One invocation measures, on the same file system (DIR, default <out>/files):

  dd conv=fsync        `dd if=/dev/zero of=DIR/dd.bin bs=4M count=<checkpoint bytes / 4 MiB> conv=fsync`
                       (sequential write, fsync'ed), and reading the file back with dd; run
                       --repeats times before and --repeats times after the MPI part, the
                       table gives the mean of all of them
  HDF5 posix           `app.checkpoint.io.save` / `load` with checkpoint.io = posix (the default:
                       rank 0 makes the file with serial HDF5, each rank pwrites / preads its
                       slabs at the offsets HDF5 allocated)
  HDF5 independent     the same with checkpoint.io = independent (parallel HDF5, MPI-IO)
  HDF5 collective      the same with checkpoint.io = collective (two-phase MPI-IO)
  torch.save per rank  every rank `torch.save`s the same tensor bytes it writes into the HDF5
                       file (its dp slice of every parameter it owns: parameters, fp32 masters
                       when separate, both Adam moments; flat, one tensor per kind) into
                       DIR/torch_rank<r>.pt, then fsyncs it; and `torch.load`s it back

The MPI part is one `mpirun -n RANKS python benchmarks/checkpoint_bench.py --worker` job
that builds the `Trainer` of the deck (inputs/gpt_tiny.yaml, enlarged by --case small to a
~35M-parameter model, ~0.42 GB of fp32 parameters + Adam moments, or by --case large to ~183M
parameters, 2.2 GB; on tp = 2 x dp = 2 (4 ranks) with
ZeRO-1, so the four ranks write different slices; --set overrides any key) without
training it, and then, for every repeat, saves and loads with each method in turn, the order
rotated and reversed between repeats (a method's place in the order, and which method ran
before it, measured up to 40% and 3x on a save). With --drop-caches, every save and every
load starts after `sync` and a dropped page cache. One untimed round of every method comes
first (--warmup; a process's first save measured 2-3x its later ones). Each
save and load is timed on rank 0 from a barrier to a barrier (the slowest rank); the
files of the previous repeat are deleted before every save, outside the timing. GB/s is
the tensor bytes (`Saved.bytes`; the HDF5 metadata, RNG rows and header attributes and the
torch pickle framing are not counted) over that time, 1 GB = 1e9 bytes. The table
(Markdown on stdout, table.md and table.csv in --out) reports mean ± standard deviation
over the repeats, GB/s of the mean time, save (load) GB/s relative to dd's write (read)
GB/s, and the best (fastest) repeat's GB/s, which is steadier on a noisy machine.

Caveats:
  * Loads come from the page cache: every file was just written and fits in memory. Load
    numbers are therefore an upper bound on reading from the disk, unless --drop-caches
    (root only: `sync` and `echo 3 > /proc/sys/vm/drop_caches` before every load and dd
    read) is given.
  * The HDF5 save includes everything `save` does: the checksums, creating the datasets,
    the H5Dwrite calls, MPI_File_sync, the fsync + rename + `latest` commit. The HDF5 load
    includes reading the header, verifying the checksums and copying into the model. The
    torch.save time includes pickling and fsync but not gathering the slices into the
    flat tensors (done once, before timing).
  * On a shared machine (or a VM with CPU steal) other jobs' I/O and CPU show up in the
    numbers: compare rows of one invocation (dd runs in the same one for that reason), look
    at the ± columns, and raise --repeats when they are large.
  * With more ranks than cores (4 ranks on 2 cores) the ranks compete for CPU in the
    checksums and in MPI's busy-polling collectives: the HDF5 rows pay for that, the
    torch.save and dd rows hardly (no collectives).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

from grid_bench import mpi_env, write_tables

REPO = Path(__file__).resolve().parent.parent
# --case: small, ~35M parameters: 0.42 GB of fp32 parameters + two Adam moments; large, ~183M
# parameters: 2.2 GB. Both on tp = 2, dp = auto (2 on 4 ranks, 4 on 8), ZeRO-1.
CASES = {
    "small": ["model.hidden=768", "model.layers=4", "model.heads=12"],
    "large": ["model.hidden=1536", "model.layers=6", "model.heads=16"],
}
SIZE = ["model.vocab_size=8192", "model.seq_len=128", "parallel.tp=2", "optim.zero=1", "run.device=cpu",
        "checkpoint.keep=1"]  # fmt: skip
HDF5 = {"posix": "HDF5 posix", "independent": "HDF5 independent", "collective": "HDF5 collective"}
TORCH, DD = "torch.save per rank", "dd conv=fsync"
COLUMNS = ["method", "ranks", "GB", "save_s", "save_std_s", "save_GBps", "load_s", "load_std_s", "load_GBps",
           "save_vs_dd", "load_vs_dd", "save_best_GBps", "load_best_GBps"]  # fmt: skip
DROP_CACHES = Path("/proc/sys/vm/drop_caches")
DD_BLOCK = 4 * 1024 * 1024


def drop_caches() -> None:
    """Write back dirty pages and drop the page cache (root only)."""
    os.sync()
    DROP_CACHES.write_text("3\n")


def can_drop_caches() -> bool:
    return os.geteuid() == 0 and os.access(DROP_CACHES, os.W_OK)


# ---- worker (one per MPI rank) ---------------------------------------------------------


def _timed(comm: Any, fn: Callable[[], Any]) -> tuple[float, Any]:
    """Seconds from a barrier before `fn` to a barrier after it on every rank: the slowest rank."""
    comm.Barrier()
    t0 = time.perf_counter()
    out = fn()
    comm.Barrier()
    return time.perf_counter() - t0, out


def _rank_tensors(trainer: Any) -> dict[str, Any]:
    """What this rank writes into the HDF5 file, as one flat tensor per kind (contiguous copies:
    torch.save of a view would write the view's whole storage)."""
    import torch

    shards = sorted((*trainer.dp.shard_states(), *trainer.optimizer.shard_states()), key=lambda s: (s.group, s.name))
    out = {}
    for group in dict.fromkeys(s.group for s in shards):  # the groups this run has, in order
        mine = [s for s in shards if s.group == group]
        slices = [s.view(*s.write) for s in mine if s.writes]
        out[group] = torch.cat(slices).cpu() if slices else torch.empty(0, dtype=mine[0].dtype)
    return out


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def worker(args: argparse.Namespace) -> int:
    """One MPI rank: build the Trainer, save and load with every method; rank 0 writes --result."""
    sys.path.insert(0, str(REPO))
    from app.errors import GridlmError
    from app.runtime.mpi import abort, init_mpi

    rt = init_mpi()
    try:
        return _measure(rt, args)
    except GridlmError as err:  # raised on every rank alike (see `agree`)
        if rt.is_root:
            print(f"checkpoint_bench: {err}", file=sys.stderr, flush=True)
        return 2
    except BaseException:
        print(f"checkpoint_bench: rank {rt.rank}: error, aborting the job", file=sys.stderr, flush=True)
        traceback.print_exc()
        abort(rt, 1)
    return 1


def build_trainer(rt: Any, deck_path: str, sets: list[str]) -> tuple[Any, int]:
    """A `Trainer` of the deck with `sets` on every rank (device, threads, torch.distributed and
    the grid as `python -m app` makes them), and the torch threads per rank."""
    from app.deck import load_deck, resolve_for_world
    from app.runtime.grid import ProcessGrid
    from app.runtime.mpi import agree, bind_device, init_torch_distributed, set_malloc_mmap_threshold, set_threads
    from app.train import Trainer

    deck = agree(rt, lambda: resolve_for_world(load_deck(REPO / deck_path, tuple(sets)), rt.world_size))
    agree(rt, lambda: bind_device(rt, deck.run.device))
    threads = set_threads(rt, deck.run.threads)
    set_malloc_mmap_threshold(deck.run.malloc_mmap_threshold_kb)
    agree(rt, lambda: init_torch_distributed(rt, deck.parallel.backend))
    par = deck.parallel
    return Trainer(deck, rt, ProcessGrid(rt, par.tp, par.pp, deck.dp, par.order)), threads


def _measure(rt: Any, args: argparse.Namespace) -> int:
    import torch
    from mpi4py import MPI

    from app.checkpoint import io
    from app.runtime.mpi import shutdown

    comm = rt.comm
    trainer, threads = build_trainer(rt, args.deck, args.set)
    deck, grid = trainer.deck, trainer.grid
    directory = Path(args.dir)
    h5dir = directory / "hdf5"
    torch_file = directory / f"torch_rank{rt.rank}.pt"

    tensors = _rank_tensors(trainer)
    mine = sum(t.numel() * t.element_size() for t in tensors.values())
    torch_bytes = comm.allreduce(mine, op=MPI.SUM)

    def before_save() -> None:
        """With --drop-caches every save starts alike too: the previous step's dirty pages written
        back and its cached pages dropped (a save right after torch.load's 2.2 GB measured 2-3x
        slower, whichever method it was)."""
        before_load()

    def before_load() -> None:
        if args.drop_caches and rt.local_rank == 0:
            drop_caches()
        comm.Barrier()

    def clear(path: Path) -> None:
        if rt.rank == 0 or path == torch_file:
            _remove(path)
        comm.Barrier()

    def torch_save() -> None:
        with open(torch_file, "wb") as f:
            torch.save(tensors, f)
            f.flush()
            os.fsync(f.fileno())

    def torch_load() -> dict:
        return torch.load(torch_file, map_location="cpu", weights_only=True)

    modes = {mode: HDF5[mode] for mode in args.modes.split(",")}
    times: dict[str, dict[str, list[float]]] = {m: {"save_s": [], "load_s": []} for m in [*modes.values(), TORCH]}
    # Per HDF5 method and phase of the save (`Saved.phases`) and of the load (`load`'s "phases"):
    # each repeat's slowest rank.
    phases: dict[str, dict[str, list[float]]] = {m: {} for m in modes.values()}
    load_phases: dict[str, dict[str, list[float]]] = {m: {} for m in modes.values()}

    def slowest(into: dict[str, list[float]], mine: dict[str, float]) -> None:
        every = comm.gather(mine, root=0)  # each rank's (a rank-0-only phase is 0 elsewhere)
        for phase in dict.fromkeys(p for ranks in every or [] for p in ranks):
            into.setdefault(phase, []).append(max(ranks.get(phase, 0.0) for ranks in every))

    def hdf5_round(mode: str, method: str) -> None:
        nonlocal h5_bytes
        checkpoint = dataclasses.replace(deck.checkpoint, io=mode)
        trainer.deck = dataclasses.replace(deck, checkpoint=checkpoint)  # save / load read checkpoint.io
        clear(h5dir)
        before_save()
        seconds, saved = _timed(comm, lambda: io.save(trainer, h5dir))
        times[method]["save_s"].append(seconds)
        h5_bytes = saved.bytes
        slowest(phases[method], saved.phases)
        before_load()
        seconds, loaded = _timed(comm, lambda path=saved.path: io.load(trainer, path))
        times[method]["load_s"].append(seconds)
        slowest(load_phases[method], loaded["phases"])
        read_bytes[method] = comm.allreduce(loaded["read_bytes"])  # the same every repeat

    def torch_round(first: bool) -> None:
        clear(torch_file)
        before_save()
        seconds, _ = _timed(comm, torch_save)
        times[TORCH]["save_s"].append(seconds)
        before_load()
        seconds, back = _timed(comm, torch_load)
        times[TORCH]["load_s"].append(seconds)
        if first and not all(torch.equal(back[k], t) for k, t in tensors.items()):
            raise RuntimeError(f"rank {rt.rank}: torch.load returned other values than were saved")

    h5_bytes = 0
    read_bytes: dict[str, int] = {}  # per HDF5 method: tensor bytes every rank read from the file, summed
    rounds = [*modes.items(), (None, TORCH)]
    for _ in range(args.warmup):  # untimed: a process's first save measured 2-3x its later ones, whatever the method
        for mode, method in rounds:
            if mode is None:
                torch_round(first=True)
            else:
                hdf5_round(mode, method)
    for method in times:  # what the warm-up measured is dropped
        times[method] = {"save_s": [], "load_s": []}
    for per_phase in (*phases.values(), *load_phases.values()):
        per_phase.clear()
    for repeat in range(args.repeats):
        # Each repeat starts with the next method, and every other repeat runs them backwards: a
        # save measured 0.54 s in one place of the order and 0.76 s in another (the same code), so
        # no method keeps its place or its predecessor.
        order = rounds if repeat % 2 == 0 else rounds[::-1]
        shift = (repeat // 2) % len(rounds)
        for mode, method in order[shift:] + order[:shift]:
            if mode is None:
                torch_round(first=repeat == 0)
            else:
                hdf5_round(mode, method)
        rt.log(f"checkpoint_bench: repeat {repeat + 1}/{args.repeats} done")
    clear(h5dir)
    clear(torch_file)
    if rt.rank == 0:
        result = {
            "ranks": rt.world_size,
            "parameters": trainer.model.num_parameters(),
            "precision": deck.train.precision,
            "grid": {"tp": grid.size("tp"), "pp": grid.size("pp"), "dp": grid.size("dp"), "zero": int(trainer.dp.zero)},
            "torch_threads": threads,
            "hdf5_bytes": h5_bytes,
            "torch_bytes": torch_bytes,
            "times": times,
            "phases": phases,
            "load_phases": load_phases,
            "read_bytes": read_bytes,
        }
        Path(args.result).write_text(json.dumps(result, indent=1, default=str))
    shutdown(rt)
    return 0


# ---- driver ----------------------------------------------------------------------------


def checkpoint_bytes(deck_path: str, sets: list[str]) -> int:
    """Tensor bytes of a checkpoint of the deck's model (what `save` reports as Saved.bytes)."""
    sys.path.insert(0, str(REPO))
    from app.deck import load_deck
    from app.plan.estimate import checkpoint_bytes as planned

    return planned(load_deck(REPO / deck_path, tuple(sets)))


DD_LINE = re.compile(r"^(\d+) bytes .* copied, ([0-9.eE+-]+) s", re.MULTILINE)


def _dd(args: list[str]) -> tuple[int, float]:
    """Run dd; (bytes, seconds) from its summary line (else measured here)."""
    t0 = time.perf_counter()
    out = subprocess.run(["dd", *args], env={**os.environ, "LC_ALL": "C"}, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if out.returncode != 0:
        raise RuntimeError(f"dd {' '.join(args)} failed: {out.stderr.strip()}")
    match = DD_LINE.search(out.stderr)
    if match is None:
        raise RuntimeError(f"cannot parse dd's output: {out.stderr.strip()!r}")
    seconds = float(match.group(2))
    return int(match.group(1)), seconds if seconds > 0 else wall


def dd_run(directory: Path, nbytes: int, drop: bool) -> dict[str, float]:
    """Write `nbytes` (rounded up to 4 MiB blocks) with conv=fsync, read it back, delete it."""
    path = directory / "dd.bin"
    count = max(1, math.ceil(nbytes / DD_BLOCK))
    try:
        if drop:  # as before every save of the MPI part
            drop_caches()
        written, save_s = _dd(["if=/dev/zero", f"of={path}", "bs=4M", f"count={count}", "conv=fsync"])
        if drop:
            drop_caches()
        read, load_s = _dd([f"if={path}", "of=/dev/null", "bs=4M"])
    finally:
        path.unlink(missing_ok=True)
    return {"bytes": written, "save_s": save_s, "load_s": load_s}


def _stats(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def _row(method: str, ranks: int, nbytes: int, saves: list[float], loads: list[float]) -> dict[str, Any]:
    save_s, save_std = _stats(saves)
    load_s, load_std = _stats(loads)
    return {
        "method": method, "ranks": ranks, "GB": nbytes / 1e9, "save_s": save_s, "save_std_s": save_std,
        "save_GBps": nbytes / 1e9 / save_s, "load_s": load_s, "load_std_s": load_std,
        "load_GBps": nbytes / 1e9 / load_s, "save_best_GBps": nbytes / 1e9 / min(saves),
        "load_best_GBps": nbytes / 1e9 / min(loads),
    }  # fmt: skip


def markdown(rows: list[dict]) -> str:
    head = (
        "| method | ranks | GB | save s (± std) | save GB/s | load s (± std) | load GB/s | save / dd | load / dd "
        "| best save GB/s | best load GB/s |"
    )
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['method']} | {r['ranks']} | failed ({r['error']}) |" + " |" * 8)
            continue
        lines.append(
            f"| {r['method']} | {r['ranks']} | {r['GB']:.3f} | {r['save_s']:.3f} ± {r['save_std_s']:.3f} "
            f"| {r['save_GBps']:.2f} | {r['load_s']:.3f} ± {r['load_std_s']:.3f} | {r['load_GBps']:.2f} "
            f"| {r['save_vs_dd']:.2f} | {r['load_vs_dd']:.2f} | {r['save_best_GBps']:.2f} | {r['load_best_GBps']:.2f} |"
        )
    return "\n".join(lines)


def file_system(directory: Path) -> str:
    out = subprocess.run(["df", "-T", str(directory)], capture_output=True, text=True)
    lines = out.stdout.split("\n")
    if out.returncode != 0 or len(lines) < 2 or len(lines[1].split()) < 2:
        return "unknown"
    device, kind = lines[1].split()[:2]
    return f"{kind} ({device})"


def facts(args: argparse.Namespace, directory: Path, fs: str, result: Optional[dict], dd: list[dict]) -> str:
    lines = [
        f"checkpoint_bench: {os.cpu_count()} cores (nproc {len(os.sched_getaffinity(0))}), "
        f"{args.ranks} ranks, files in {directory}: {fs}, "
        f"page cache {'dropped before every load' if args.drop_caches else 'NOT dropped: load GB/s is an upper bound'}",
    ]
    if result is not None:
        g = result["grid"]
        lines.append(
            f"checkpoint_bench: {result['parameters']:,} parameters, {result['precision']}, grid tp={g['tp']} "
            f"pp={g['pp']} dp={g['dp']} zero={g['zero']}, torch threads per rank {result['torch_threads']} | "
            f"tensor bytes: HDF5 {result['hdf5_bytes']:,}, torch.save {result['torch_bytes']:,} "
            f"({100 * (result['torch_bytes'] / result['hdf5_bytes'] - 1):+.2f}%), dd {dd[0]['bytes']:,} | "
            f"{args.repeats} repeat(s), dd runs {len(dd)} (half before, half after)"
        )
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument(
        "--case", choices=sorted(CASES), default="small", help="model size: small 0.42 GB, large 2.2 GB"
    )
    parser.add_argument("--repeats", type=int, default=3, help="saves and loads per method")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds of every method first")
    parser.add_argument("--deck", default="inputs/gpt_tiny.yaml")
    parser.add_argument("--out", default="runs/checkpoint_bench")
    parser.add_argument("--dir", default=None, help="where the checkpoint files go (default <out>/files)")
    parser.add_argument(
        "--drop-caches", action="store_true", help="root: drop the page cache before every load (sync; echo 3)"
    )
    parser.add_argument(
        "--modes",
        default=",".join(HDF5),
        help=f"the checkpoint.io modes measured, comma-separated (default {','.join(HDF5)})",
    )
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="extra deck override")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    unknown = [m for m in args.modes.split(",") if m not in HDF5]
    if unknown or not args.modes:
        raise SystemExit(f"checkpoint_bench: --modes {args.modes}: each of them one of {', '.join(HDF5)}")
    if args.worker:
        return worker(args)
    if args.drop_caches and not can_drop_caches():
        raise SystemExit(f"checkpoint_bench: --drop-caches needs root and a writable {DROP_CACHES}")
    out = (REPO / args.out).resolve()
    directory = (REPO / args.dir).resolve() if args.dir else out / "files"
    sets = [*CASES[args.case], *SIZE, f"run.dir={out / 'run'}", *args.set]
    try:
        nbytes = checkpoint_bytes(args.deck, sets)
    except Exception as err:  # a deck error: say it before launching anything
        raise SystemExit(f"checkpoint_bench: {err}") from None
    directory.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    fs = file_system(directory)
    result_path = out / "worker.json"
    result_path.unlink(missing_ok=True)

    t0 = time.perf_counter()
    dd = [dd_run(directory, nbytes, args.drop_caches) for _ in range(args.repeats)]
    cmd = ["mpirun", "-n", str(args.ranks), sys.executable, str(Path(__file__).resolve()), "--worker",
           "--deck", args.deck, "--dir", str(directory), "--repeats", str(args.repeats), "--warmup", str(args.warmup), "--result", str(result_path), "--modes", args.modes,
           *(["--drop-caches"] if args.drop_caches else []), *(a for s in sets for a in ("--set", s))]  # fmt: skip
    print(f"checkpoint_bench: {' '.join(cmd)}", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, cwd=REPO, env=mpi_env(), capture_output=True, text=True, check=False)
    dd += [dd_run(directory, nbytes, args.drop_caches) for _ in range(args.repeats)]
    wall = time.perf_counter() - t0
    for name in ("hdf5", *(f"torch_rank{r}.pt" for r in range(args.ranks))):
        _remove(directory / name)  # left behind only by a failed worker
    if not any(directory.iterdir()):
        directory.rmdir()

    dd_bytes = dd[0]["bytes"]
    dd_row = _row(DD, 1, dd_bytes, [d["save_s"] for d in dd], [d["load_s"] for d in dd])
    result = None
    if proc.returncode != 0 or not result_path.is_file():
        print(proc.stdout[-2000:] + proc.stderr[-4000:], file=sys.stderr)
        rows = [
            {"method": HDF5[m], "ranks": args.ranks, "error": f"exit {proc.returncode}"} for m in args.modes.split(",")
        ]
        rows.append({"method": TORCH, "ranks": args.ranks, "error": f"exit {proc.returncode}"})
    else:
        result = json.loads(result_path.read_text())
        rows = []
        for method, t in result["times"].items():
            n = result["torch_bytes"] if method == TORCH else result["hdf5_bytes"]
            rows.append(_row(method, args.ranks, n, t["save_s"], t["load_s"]))
    rows.append(dd_row)
    for r in rows:
        if "error" not in r:
            r["save_vs_dd"] = r["save_GBps"] / dd_row["save_GBps"]
            r["load_vs_dd"] = r["load_GBps"] / dd_row["load_GBps"]
    table = facts(args, directory, fs, result, dd) + "\n\n" + markdown(rows)
    if result is not None:
        by = {r["method"]: r for r in rows}
        table += "\n\n" + "\n".join(
            f"checkpoint_bench: {m} save = {100 * by[m]['save_vs_dd']:.0f}% of dd (goal >= 90%), "
            f"{by[m]['save_GBps'] / by[TORCH]['save_GBps']:.2f}x torch.save per rank (goal > 1); best repeats: "
            f"{100 * by[m]['save_best_GBps'] / by[DD]['save_best_GBps']:.0f}% of dd, "
            f"{by[m]['save_best_GBps'] / by[TORCH]['save_best_GBps']:.2f}x torch.save"
            for m in (HDF5[mode] for mode in args.modes.split(","))
        )
        table += "\n\n" + phase_table(result["phases"]) + "\n\n" + phase_table(result["load_phases"], "load")
        table += "\n" + "\n".join(
            f"checkpoint_bench: {m} load read {n / 1e9:.3f} GB from the file over all ranks, "
            f"{n / result['hdf5_bytes']:.2f}x its tensor bytes"
            for m, n in result["read_bytes"].items()
        )
    table += f"\ncheckpoint_bench: wall time {wall:.1f} s"
    return write_tables(out, rows, COLUMNS, table)


def phase_table(phases: dict[str, dict[str, list[float]]], kind: str = "save") -> str:
    """Where an HDF5 save's (load's) time goes: per phase (`Saved.phases`, `load`'s "phases", in the
    order they run), the mean over the repeats of the slowest rank's seconds."""
    methods = list(phases)
    order = list(dict.fromkeys(p for m in methods for p in phases[m]))
    lines = [f"| {kind} phase (slowest rank, mean s) | " + " | ".join(methods) + " |", "|---|" + "---|" * len(methods)]
    for phase in order:
        cells = [f"{statistics.mean(phases[m][phase]):.3f}" if phase in phases[m] else "" for m in methods]
        lines.append(f"| {phase} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

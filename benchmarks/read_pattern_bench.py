"""How fast a file system serves one file to several readers, by the order they read it in.

    .venv/bin/python benchmarks/read_pattern_bench.py [--file F | --size-mb 512] [--procs 4]
        [--piece-mb 4] [--repeats 3] [--drop-caches] [--dir DIR]

A checkpoint load reads one file from every rank. How fast that can be is the file system's
answer to the ranks' order of reads, not the loader's: this measures the three orders that
matter, with plain `preadv` calls into a reused buffer (no checksums, no copies, no MPI), in
alternating rounds:

  one stream          one process reads the whole file in 4 MiB requests, in order (dd's read)
  contiguous ranges   --procs processes, process r reads the r-th contiguous 1/procs of the file
                      (torch.save per rank: a file each; a collective read's file domains)
  interleaved pieces  --procs processes, process r reads pieces r, r + procs, r + 2 procs, ... of
                      --piece-mb each (a load on tp 2 x dp 2 with ZeRO-1: each rank 1/4 of every
                      dataset, the datasets one after another)

With --drop-caches (root: `sync`, `echo 3 > /proc/sys/vm/drop_caches`) every read starts from
the disk; without it they come from the page cache after the first. --file reads an existing
file (e.g. a checkpoint); else a file of --size-mb random bytes is written in --dir first and
deleted at the end. Prints a Markdown table: median and range of the seconds, GB/s of the
median (1 GB = 1e9 bytes), and each order's median against one stream's.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from checkpoint_bench import can_drop_caches, drop_caches

REQUEST = 4 << 20  # bytes per preadv call, as dd bs=4M


def ranges(size: int, order: str, procs: int, piece: int) -> list[list[tuple[int, int]]]:
    """Per process, the (offset, length) ranges it reads, in its order."""
    if order == "one stream":
        return [[(0, size)]]
    if order == "contiguous ranges":
        cuts = [size * r // procs for r in range(procs + 1)]
        return [[(cuts[r], cuts[r + 1] - cuts[r])] for r in range(procs)]
    pieces = [(offset, min(piece, size - offset)) for offset in range(0, size, piece)]
    return [pieces[r::procs] for r in range(procs)]


def read_ranges(path: str, mine: list[tuple[int, int]]) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        buf = memoryview(bytearray(REQUEST))
        for offset, length in mine:
            end = offset + length
            while offset < end:
                done = os.preadv(fd, [buf[: min(REQUEST, end - offset)]], offset)
                if done == 0:
                    raise OSError(f"{path} ends before byte {end}")
                offset += done
    finally:
        os.close(fd)


def timed(path: str, plan: list[list[tuple[int, int]]], drop: bool) -> float:
    """Seconds from starting the readers (already forked) to the last one's end."""
    if drop:
        drop_caches()
    ctx = multiprocessing.get_context("fork")
    gate = ctx.Barrier(len(plan) + 1)
    procs = [ctx.Process(target=_reader, args=(path, mine, gate)) for mine in plan]
    for p in procs:
        p.start()
    gate.wait()  # every reader forked and waiting: the clock starts with all of them
    start = time.perf_counter()
    for p in procs:
        p.join()
    seconds = time.perf_counter() - start
    if any(p.exitcode != 0 for p in procs):
        raise RuntimeError(f"a reader of {path} failed (exit {[p.exitcode for p in procs]})")
    return seconds


def _reader(path: str, mine: list[tuple[int, int]], gate) -> None:
    gate.wait()
    read_ranges(path, mine)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[1].strip(), usage=__doc__.split("\n\n")[0])
    parser.add_argument("--file", help="an existing file to read (default: write one of --size-mb)")
    parser.add_argument("--size-mb", type=int, default=512, help="size of the file written when no --file (MiB)")
    parser.add_argument("--dir", default=None, help="where that file goes (default: runs/read_pattern_bench)")
    parser.add_argument("--procs", type=int, default=4, help="readers of the contiguous and interleaved orders")
    parser.add_argument("--piece-mb", type=float, default=4.0, help="interleaved piece size (MiB)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--drop-caches", action="store_true", help="drop the page cache before every read (root)")
    args = parser.parse_args(argv)
    if args.procs < 1 or args.repeats < 1 or args.size_mb < 1 or args.piece_mb <= 0:
        parser.error("--procs, --repeats and --size-mb must be >= 1 and --piece-mb > 0")
    if args.drop_caches and not can_drop_caches():
        parser.error("--drop-caches needs root (it writes /proc/sys/vm/drop_caches)")

    made = None
    if args.file:
        path = args.file
        if not os.path.isfile(path):
            parser.error(f"--file {path}: no such file")
    else:
        directory = Path(args.dir or Path(__file__).resolve().parent.parent / "runs" / "read_pattern_bench")
        directory.mkdir(parents=True, exist_ok=True)
        fd, path = tempfile.mkstemp(prefix="read_pattern_", suffix=".bin", dir=directory)
        made = path
        with os.fdopen(fd, "wb") as f:
            block = os.urandom(REQUEST)
            for _ in range(args.size_mb * (1 << 20) // REQUEST):
                f.write(block)
            f.write(block[: args.size_mb * (1 << 20) % REQUEST])
            f.flush()
            os.fsync(f.fileno())
    try:
        size = os.path.getsize(path)
        piece = max(1, int(args.piece_mb * (1 << 20)))
        orders = ["one stream", "contiguous ranges", "interleaved pieces"]
        times: dict[str, list[float]] = {o: [] for o in orders}
        # Untimed: the first read of a fresh process tree pays for its page tables.
        timed(path, ranges(size, orders[0], args.procs, piece), args.drop_caches)
        for repeat in range(args.repeats):  # alternating: no order keeps its place
            for order in orders if repeat % 2 == 0 else orders[::-1]:
                times[order].append(timed(path, ranges(size, order, args.procs, piece), args.drop_caches))
        base = statistics.median(times["one stream"])
        print(
            f"read_pattern_bench: {path} ({size / 1e9:.3f} GB), {args.procs} readers, pieces of "
            f"{piece / (1 << 20):g} MiB, {args.repeats} repeats, page cache "
            f"{'dropped before every read' if args.drop_caches else 'NOT dropped: reads after the first come from memory'}"
        )
        print("\n| order | readers | s (median) | s (min - max) | GB/s | vs one stream |\n|---|---|---|---|---|---|")
        for order in orders:
            med = statistics.median(times[order])
            n = 1 if order == "one stream" else args.procs
            print(
                f"| {order} | {n} | {med:.3f} | {min(times[order]):.3f} - {max(times[order]):.3f} | "
                f"{size / med / 1e9:.2f} | {base / med:.2f} |"
            )
    finally:
        if made is not None:
            os.unlink(made)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark `python -m app.data.prepare` on this machine: MB/s of text tokenised at 1, 2 and 4 ranks.

    .venv/bin/python benchmarks/prepare_bench.py [--ranks 1 2 4] [--rounds 3] [--max-mb 24]
        [--tokenizers byte bpe] [--bpe-vocab 8192] [--out runs/prepare_bench]

The corpus is real text from this machine, copied once into <out>/corpus: the licences in
/usr/share/common-licenses, then the Python standard library's .py sources (site-packages left
out, files that are not UTF-8 skipped), in sorted order, up to --max-mb MB. `bpe` is a byte-level
BPE of --bpe-vocab ids trained on that corpus first (`--train-tokenizer`, timed once, not in the
table). Each round runs every (tokenizer, ranks) pair once, in turn, so a noisy neighbour hurts
all of them alike: `mpirun -n RANKS python -m app.data.prepare <out>/corpus --tokenizer T --out
<out>/r<RANKS>`. The table (Markdown on stdout, table.md and table.csv in --out) gives per pair
the medians over the rounds (each round's figure in brackets) of

- prepare MB/s: corpus bytes over the time `prepare` reports (from listing the inputs to the
  renames, on every rank; MPI and Python start-up not counted);
- job MB/s: corpus bytes over the whole `mpirun` command's wall time (start-up included);

the speed-up of prepare MB/s over 1 rank, and whether the token file's bytes equal the 1-rank
file's (they must). The corpus is read from the page cache after the first run: this measures
tokenising and writing, not the disk.

A benchmark, not a test: its numbers go to docs/DATA.md, with the machine and the command.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import re
import shutil
import statistics
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
import grid_bench  # noqa: E402

LICENSES = Path("/usr/share/common-licenses")
SUMMARY = re.compile(r"prepared (\d+) documents, (\d+) tokens .* from ([\d.]+) MB in ([\d.]+) s")
COLUMNS = ["tokenizer", "ranks", "round", "documents", "tokens", "mb", "prepare_mb_s", "job_mb_s", "same_bytes"]


def build_corpus(out: Path, max_mb: float) -> tuple[Path, int, int]:
    """<out>/corpus from the licences and the standard library (see the module docstring); (dir, files, bytes)."""
    corpus = out / "corpus"
    if corpus.exists():
        shutil.rmtree(corpus)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    candidates = [(p, corpus / "licenses" / p.name) for p in sorted(LICENSES.glob("*")) if p.is_file()]
    candidates += [
        (p, corpus / "stdlib" / p.relative_to(stdlib))
        for p in sorted(stdlib.rglob("*.py"))
        if not {"site-packages", "dist-packages"} & set(p.parts)
    ]
    files, total, limit = 0, 0, max_mb * 1e6
    for source, target in candidates:
        if total >= limit:
            break
        data = source.read_bytes()
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            continue  # the test suite's deliberately mis-encoded modules
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        files, total = files + 1, total + len(data)
    return corpus, files, total


def prepare_cmd(ranks: int, *args: str) -> list[str]:
    return ["mpirun", "-n", str(ranks), sys.executable, "-m", "app.data.prepare", *args]


def run_prepare(ranks: int, args: list[str], label: str) -> tuple[float, str]:
    """Runs one prepare job; (wall seconds, its stdout). Exits on failure with its output's tail."""
    cmd = prepare_cmd(ranks, *args)
    print(f"{label}: {' '.join(cmd)}", file=sys.stderr, flush=True)
    start = time.perf_counter()
    out = subprocess.run(cmd, cwd=REPO, env=grid_bench.mpi_env(), capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    if out.returncode != 0:
        raise SystemExit(f"prepare_bench: {label} failed (exit {out.returncode}):\n{(out.stdout + out.stderr)[-3000:]}")
    return wall, out.stdout


def digest(prefix: Path) -> str:
    h = hashlib.sha256()
    for ext in (".bin", ".idx.npy"):
        h.update(Path(f"{prefix}{ext}").read_bytes())
    return h.hexdigest()


def markdown(rows: list[dict], ranks: list[int], tokenizers: list[str]) -> str:
    lines = [
        "| tokenizer | ranks | prepare MB/s (median; rounds) | job MB/s (with start-up) | speed-up | same bytes |",
        "|" + "---|" * 6,
    ]
    for tok in tokenizers:
        base = statistics.median(r["prepare_mb_s"] for r in rows if r["tokenizer"] == tok and r["ranks"] == ranks[0])
        for n in ranks:
            cell = [r for r in rows if r["tokenizer"] == tok and r["ranks"] == n]
            speedup = statistics.median(r["prepare_mb_s"] for r in cell) / base
            same = "yes" if all(r["same_bytes"] for r in cell) else "NO"
            lines.append(
                f"| {tok} | {n} | {grid_bench.median_cell(cell, 'prepare_mb_s', '.1f')} | "
                f"{grid_bench.median_cell(cell, 'job_mb_s', '.1f')} | {speedup:.2f} | {same} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--rounds", type=int, default=3, help="rounds; each runs every (tokenizer, ranks) once")
    parser.add_argument("--max-mb", type=float, default=24.0, help="corpus size in MB (1 MB = 1e6 bytes)")
    parser.add_argument("--tokenizers", nargs="+", default=["byte", "bpe"], choices=["byte", "bpe"])
    parser.add_argument("--bpe-vocab", type=int, default=8192)
    parser.add_argument("--out", default="runs/prepare_bench")
    args = parser.parse_args(argv)
    out = (REPO / args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    corpus, files, size = build_corpus(out, args.max_mb)
    print(f"prepare_bench: corpus {corpus}: {files} files, {size / 1e6:.1f} MB", file=sys.stderr)
    specs = {"byte": "byte"}
    if "bpe" in args.tokenizers:
        wall, _ = run_prepare(1, [str(corpus), "--train-tokenizer", str(args.bpe_vocab), "--out", str(out / "bpe")],
                              "prepare_bench: training the BPE")  # fmt: skip
        print(f"prepare_bench: trained and applied the BPE in {wall:.1f} s", file=sys.stderr)
        specs["bpe"] = str(out / "bpe.tokenizer.json")
    rows: list[dict] = []
    reference: dict[str, str] = {}
    for round_ in range(args.rounds):
        for tok in args.tokenizers:
            for n in args.ranks:
                prefix = out / f"{tok}_r{n}"
                wall, stdout = run_prepare(n, [str(corpus), "--tokenizer", specs[tok], "--out", str(prefix)],
                                           f"prepare_bench: round {round_}: {tok}, {n} rank(s)")  # fmt: skip
                match = SUMMARY.search(stdout)
                if match is None:
                    raise SystemExit(f"prepare_bench: no summary line in the output of prepare:\n{stdout[-2000:]}")
                docs, tokens, mb, seconds = int(match[1]), int(match[2]), float(match[3]), float(match[4])
                same = reference.setdefault(tok, digest(prefix)) == digest(prefix)
                rows.append({"tokenizer": tok, "ranks": n, "round": round_, "documents": docs, "tokens": tokens,
                             "mb": mb, "prepare_mb_s": size / 1e6 / seconds, "job_mb_s": size / 1e6 / wall,
                             "same_bytes": same})  # fmt: skip
    table = markdown(rows, args.ranks, args.tokenizers)
    print(table)
    (out / "table.md").write_text(table + "\n")
    with open(out / "table.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    return 0 if all(r["same_bytes"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

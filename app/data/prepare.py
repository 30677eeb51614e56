"""Tokenise documents into a gridlm token dataset (see app/data/memmap.py for the format).

    python -m app.data.prepare INPUT... --out PREFIX [--tokenizer byte|PATH | --train-tokenizer N]
        [--eos TOKEN] [--field NAME] [--include GLOB] [--dtype auto|uint16|uint32]
    mpirun -n N python -m app.data.prepare ...      (the same files, N times faster)

Inputs are text files (one document each), directories (recursed, sorted) or, with --field,
JSONL files (one document per line); see app/data/sources.py. Every document is tokenised and
followed by EOS. The tokenizer is bytes, a Hugging Face tokenizer.json (--tokenizer PATH), or a
byte-level BPE of N ids trained on the inputs and saved as PREFIX.tokenizer.json
(--train-tokenizer N); the metadata records which (kind, path, sha256, vocab_size, eos).

Under mpirun each rank tokenises a contiguous run of the documents into a part file of its own;
an exclusive prefix sum of the token counts gives each rank its offset in the one PREFIX.bin,
into which it copies its part with positional writes (and its document offsets into
PREFIX.idx.npy); rank 0 writes the metadata. The bytes written do not depend on the number of
ranks. Outputs are written under temporary names and renamed at the end (the .json last), so a
crash never leaves a half-written dataset. A user error on any rank (a missing input, bytes that
are not UTF-8, a bad JSONL line) is agreed on by all ranks before any collective write: every
rank exits with status 2 and rank 0 prints the message, which names the file and the fix.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional, TypeVar

import numpy as np

from app.data.memmap import DTYPES, FORMAT, VERSION
from app.data.sources import Source, list_files, plan_sources, read_documents, split_sources
from app.data.tokenizer import (
    MAX_TOKENIZER_BYTES,
    AnyTokenizer,
    ByteTokenizer,
    HFTokenizer,
    load_tokenizer,
    train_bpe,
)
from app.errors import DataError, GridlmError
from app.names import LAUNCHER_RANK
from app.untrusted import read_bytes

T = TypeVar("T")
BATCH_BYTES = 4 << 20  # text per tokenizer call: large enough for its threads, small in memory
CHUNK_BYTES = 64 << 20  # JSONL files are cut into runs of lines of about this size (work units)
COPY_BYTES = 16 << 20  # a rank's part is copied into PREFIX.bin in blocks of this size
PROGRESS_S = 5.0  # seconds between rank 0's progress lines
FIX_WRITE = "fix: check that the directory of --out exists, is writable and has free space"


class SerialComm:
    """The few mpi4py communicator calls prepare makes, for one process without MPI."""

    rank, size = 0, 1

    def bcast(self, obj: T, root: int = 0) -> T:
        return obj

    def allgather(self, obj: T) -> list[T]:
        return [obj]


def _attempt(fn: Callable[[], T]) -> tuple[Optional[T], Optional[str]]:
    """(fn(), None), or (None, the message) of a user error or a failed write."""
    try:
        return fn(), None
    except GridlmError as err:
        return None, str(err)
    except OSError as err:
        return None, f"{err}; {FIX_WRITE}"


def agreed(comm: Any, fn: Callable[[], T]) -> T:
    """`fn()` on every rank; a user error on any rank (the first in rank order, i.e. in document
    order) is raised on every rank. One allgather: prepare agrees a handful of times per run."""
    result, error = _attempt(fn)
    errors = [e for e in comm.allgather(error) if e is not None]
    if errors:
        raise DataError(errors[0])
    return result  # type: ignore[return-value]


def on_root(comm: Any, fn: Callable[[], T]) -> T:
    """`fn()` on rank 0 only, its result (or its user error) broadcast to every rank."""
    result, error = _attempt(fn) if comm.rank == 0 else (None, None)
    result, error = comm.bcast((result, error), root=0)
    if error is not None:
        raise DataError(error)
    return result  # type: ignore[return-value]


@dataclass
class Share:
    """What one rank tokenised: its documents' token counts (EOS included), in order."""

    lengths: np.ndarray
    max_id: int
    text_bytes: int


def pick_dtype(dtype: str, vocab_size: int) -> str:
    """`auto`: uint16 when every id fits (vocab_size <= 65536), else uint32."""
    if dtype == "auto":
        return "uint16" if vocab_size <= 1 << 16 else "uint32"
    if dtype not in DTYPES:
        raise DataError(f"--dtype {dtype!r} is not supported; fix: use auto or one of {sorted(DTYPES)}")
    if dtype == "uint16" and vocab_size > 1 << 16:
        raise DataError(
            f"--dtype uint16 holds ids below 65536 but the tokenizer has {vocab_size} ids; fix: use --dtype auto "
            "or uint32"
        )
    return dtype


def tokenize_share(
    share: list[Source],
    tok: AnyTokenizer,
    field: Optional[str],
    dtype: str,
    part: str,
    progress: Optional[Callable[[int, int, int, int], None]] = None,
) -> Share:
    """Tokenises this rank's sources into `part` (ids, each document followed by EOS); `progress`
    is called with (documents, tokens, bytes read, bytes of the share) every PROGRESS_S seconds."""
    lengths: list[int] = []
    max_id, read, tokens, total = 0, 0, 0, sum(s.size for s in share)
    last = time.perf_counter()
    with open(part, "wb") as out:
        batch: list[bytes] = []
        batch_bytes = 0

        def flush() -> None:
            nonlocal max_id, tokens, batch_bytes
            if not batch:
                return
            ids = tok.encode_batch(batch)
            sizes = [len(a) + 1 for a in ids]
            buffer = np.empty(sum(sizes), dtype=DTYPES[dtype])
            top = max((int(a.max()) for a in ids if len(a)), default=0)
            if top > np.iinfo(buffer.dtype).max:  # a cast would wrap it silently
                raise DataError(
                    f"the tokenizer gave id {top}, which --dtype {dtype} cannot hold (its vocabulary says "
                    f"{tok.vocab_size} ids); fix: --dtype uint32"
                )
            at = 0
            for a, n in zip(ids, sizes):
                buffer[at : at + n - 1] = a
                buffer[at + n - 1] = tok.eos
                at += n
            buffer.tofile(out)
            max_id = max(max_id, top, tok.eos)  # the buffer's largest id (checked against model.vocab_size at open)
            lengths.extend(sizes)
            tokens += len(buffer)
            batch.clear()
            batch_bytes = 0

        for source in share:
            for doc in read_documents(source, field):
                batch.append(doc)
                batch_bytes += len(doc)
                if batch_bytes >= BATCH_BYTES:
                    flush()
            read += source.size
            if progress is not None and time.perf_counter() - last >= PROGRESS_S:
                flush()
                progress(len(lengths), tokens, read, total)
                last = time.perf_counter()
        flush()
    return Share(np.asarray(lengths, dtype=np.int64), max_id, read)


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def copy_part(part: str, bin_path: str, offset: int) -> None:
    """This rank's part file into PREFIX.bin (pre-sized by rank 0) at byte `offset`, then fsync."""
    fd = os.open(bin_path, os.O_WRONLY)
    try:
        with open(part, "rb") as f:
            while block := f.read(COPY_BYTES):
                _pwrite_all(fd, memoryview(block), offset)
                offset += len(block)
        os.fsync(fd)
    finally:
        os.close(fd)


def write_offsets(idx_path: str, header: int, first: int, offsets: np.ndarray) -> None:
    """Document offsets `offsets` as entries first.. of PREFIX.idx.npy (its .npy header is `header` bytes)."""
    fd = os.open(idx_path, os.O_WRONLY)
    try:
        _pwrite_all(fd, memoryview(offsets.astype("<i8").tobytes()), header + 8 * first)
        os.fsync(fd)
    finally:
        os.close(fd)


def _read_tokenizer(spec: str, eos: Optional[str]) -> tuple[str, Optional[str]]:
    """(spec, text of the tokenizer.json or None for bytes), checked by loading it once."""
    tok = load_tokenizer(spec, eos)
    if isinstance(tok, ByteTokenizer):
        return spec, None
    # Read again as the check read it (bounded, decoded): the sha256 is of the file's bytes.
    fail = lambda message: DataError(f"tokenizer {spec}: {message}")  # noqa: E731
    return spec, read_bytes(spec, "tokenizer.json", fail, "", MAX_TOKENIZER_BYTES).decode("utf-8")


def check_prefix(prefix: str, option: str = "--out") -> None:
    """A token file prefix (`option`'s: prepare's --out, memorization's --data) names files PREFIX.bin, ...:
    one with no file name part (empty, or a directory with its trailing '/') would name hidden files
    '.bin', '.json' in the working or that directory."""
    if not prefix.strip():
        raise DataError(
            f"{option} {prefix!r}: an empty prefix; fix: pass {option} PREFIX, e.g. {option} data/corpus "
            "(data/corpus.bin, .idx.npy and .json)"
        )
    if os.path.basename(prefix) in ("", ".", ".."):
        named = os.path.join(prefix, "corpus")
        raise DataError(
            f"{option} {prefix}: names a directory, not a file prefix; fix: add the files' name, e.g. {option} "
            f"{named} ({named}.bin, .idx.npy and .json)"
        )


def check_not_written(files: list[str], writes: list[str], out_prefix: str) -> None:
    """DataError if an input file is one that --out writes (found in review: `prepare train.json --field
    text --out train` replaced the JSONL corpus with the metadata; a second `prepare data --out
    data/corpus` read the first one's output as documents)."""
    written = {os.path.realpath(path) for path in writes}
    for path in files:
        if os.path.realpath(path) in written:
            raise DataError(
                f"input {path} is a file that --out {out_prefix} writes; fix: pass --out a prefix outside the "
                "inputs (e.g. in another directory), or leave the file out (--include GLOB for a directory)"
            )


def prepare(
    inputs: list[str],
    out_prefix: str,
    dtype: str = "auto",
    tokenizer: str = "byte",
    *,
    train_tokenizer: Optional[int] = None,
    eos: Optional[str] = None,
    field: Optional[str] = None,
    include: str = "*",
    comm: Any = None,
    report: Optional[Callable[[str], None]] = None,
) -> dict:
    """Writes out_prefix.{bin,idx.npy,json} (and out_prefix.tokenizer.json with `train_tokenizer`)
    from the inputs; returns the json metadata on every rank. `comm`: an mpi4py communicator whose
    ranks share the work (None: this process alone); `report`: where rank 0's progress and summary
    lines go (None: nowhere)."""
    comm = comm if comm is not None else SerialComm()
    check_prefix(out_prefix)  # the same on every rank: refused alike before any collective
    say = report if report is not None and comm.rank == 0 else (lambda line: None)
    start = time.perf_counter()
    finals = [out_prefix + ext for ext in (".bin", ".idx.npy", ".json")]
    tok_final = out_prefix + ".tokenizer.json"
    tmps = [f + ".tmp" for f in (*finals, tok_final)]
    part = f"{out_prefix}.bin.part{comm.rank}.tmp"

    # Every file this run writes, tokenizer included when it trains one: none may be an input.
    writes = [*finals, *tmps[:3]] + ([tok_final, tmps[3]] if train_tokenizer else [])
    writes += [f"{out_prefix}.bin.part{r}.tmp" for r in range(comm.size)]

    def plan() -> list[Source]:
        files = list_files(inputs, include)
        check_not_written(files, writes, out_prefix)
        os.makedirs(os.path.dirname(os.path.abspath(out_prefix)), exist_ok=True)
        return plan_sources(files, field is not None, CHUNK_BYTES)

    sources = on_root(comm, plan)
    try:
        tok = _tokenizer(comm, sources, tokenizer, train_tokenizer, eos, field, tok_final, tmps[3])
        dtype = pick_dtype(dtype, tok.vocab_size)
        share = split_sources(sources, comm.size)[comm.rank]

        def progress(docs: int, tokens: int, read: int, total: int) -> None:
            seconds = time.perf_counter() - start
            say(
                f"prepare: rank 0: {docs:,} documents, {tokens:,} tokens, {read / seconds / 1e6:.1f} MB/s "
                f"({100 * read / max(total, 1):.0f}% of its share, 1/{comm.size} of the input)"
            )

        mine = agreed(comm, lambda: tokenize_share(share, tok, field, dtype, part, progress))
        counts = comm.allgather((len(mine.lengths), int(mine.lengths.sum()), mine.max_id, mine.text_bytes))
        docs_before = sum(c[0] for c in counts[: comm.rank])
        tokens_before = sum(c[1] for c in counts[: comm.rank])
        num_docs, num_tokens = sum(c[0] for c in counts), sum(c[1] for c in counts)
        itemsize = DTYPES[dtype].itemsize

        def create() -> int:
            with open(tmps[0], "wb") as f:
                f.truncate(num_tokens * itemsize)  # every rank writes its part at its offset
            idx = np.lib.format.open_memmap(tmps[1], mode="w+", dtype="<i8", shape=(num_docs + 1,))
            header = int(idx.offset)
            idx[0] = 0
            idx.flush()
            del idx
            return header

        header = on_root(comm, create)

        def write() -> None:
            copy_part(part, tmps[0], tokens_before * itemsize)
            write_offsets(tmps[1], header, docs_before + 1, tokens_before + np.cumsum(mine.lengths))

        agreed(comm, write)
        meta = {
            "format": FORMAT,
            "version": VERSION,
            "dtype": dtype,
            **tok.describe(),
            "num_tokens": num_tokens,
            "num_documents": num_docs,
            "max_token_id": max(c[2] for c in counts),
        }
        meta = {key: meta[key] for key in sorted(meta, key=_KEY_ORDER.index)}
        on_root(comm, lambda: _commit(meta, finals, tmps, tok_final if train_tokenizer else None))
    finally:
        for path in [part] + (tmps if comm.rank == 0 else []):
            if os.path.exists(path):
                os.remove(path)
    seconds = time.perf_counter() - start
    mb = sum(c[3] for c in counts) / 1e6
    written = ", ".join(finals + ([tok_final] if train_tokenizer else []))
    say(
        f"prepared {num_docs} documents, {num_tokens} tokens ({dtype}, tokenizer {tok.name}, vocab {tok.vocab_size}) "
        f"from {mb:.3g} MB in {seconds:.3f} s: {mb / seconds:.1f} MB/s on {comm.size} rank(s) -> {written}"
    )
    return meta


_KEY_ORDER = ["format", "version", "dtype", "tokenizer", "tokenizer_path", "tokenizer_sha256", "vocab_size",
              "num_tokens", "num_documents", "eos", "max_token_id"]  # fmt: skip


def _tokenizer(
    comm: Any,
    sources: list[Source],
    spec: str,
    train: Optional[int],
    eos: Optional[str],
    field: Optional[str],
    tok_final: str,
    tok_tmp: str,
) -> AnyTokenizer:
    """The tokenizer on every rank: read (or trained) on rank 0, its JSON text broadcast."""
    if train is not None:
        if spec != "byte":
            raise DataError("--tokenizer and --train-tokenizer exclude each other; fix: pass one of them")

        def trained() -> str:
            text = train_bpe((doc for s in sources for doc in read_documents(s, field)), train)
            with open(tok_tmp, "w", encoding="utf-8") as f:
                f.write(text)  # renamed to tok_final with the dataset
            return text

        return HFTokenizer(tok_final, eos, text=on_root(comm, trained))
    spec, text = on_root(comm, lambda: _read_tokenizer(spec, eos))
    return ByteTokenizer() if text is None else HFTokenizer(spec, eos, text=text)


def _commit(meta: dict, finals: list[str], tmps: list[str], tok_final: Optional[str]) -> None:
    """Rank 0: the metadata, then the renames. The old .json goes first and the new one comes last,
    so that a crash in between leaves no .json: the dataset reads as absent, never as mixed."""
    with open(tmps[2], "w") as f:
        json.dump(meta, f, indent=1)
    if os.path.exists(finals[2]):
        os.remove(finals[2])
    if tok_final is not None:
        os.replace(tmps[3], tok_final)
    for tmp, final in zip(tmps[:3], finals):
        os.replace(tmp, final)


def launched_comm() -> Any:
    """COMM_WORLD under a launcher (its cores shared out, `share_cores`), else SerialComm: a plain
    `python -m app.data.prepare` is one process and need not pay for MPI's singleton start-up."""
    if not any(var in os.environ for var in LAUNCHER_RANK):
        return SerialComm()
    from app.runtime.mpi import singleton_rsh_agent

    # A batch script's one process (SLURM_PROCID=0) is Open MPI's singleton: on a machine without ssh
    # its MPI_Init aborts unless told not to start the daemon through it (as `python -m app`).
    singleton_rsh_agent(os.environ)
    from mpi4py import MPI

    share_cores(MPI.COMM_WORLD)
    return MPI.COMM_WORLD


def share_cores(comm: Any) -> None:
    """The `tokenizers` library encodes on a thread per core; ranks sharing a node get an equal share
    of its cores each (RAYON_NUM_THREADS, unless set), not all of them."""
    if "RAYON_NUM_THREADS" in os.environ:
        return
    from mpi4py import MPI

    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
    os.environ["RAYON_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // local.size))
    local.Free()


def main(argv: Optional[list[str]] = None) -> int:
    """Command line entry point (every rank); returns the exit status (2 on a user error)."""
    parser = argparse.ArgumentParser(
        prog="python -m app.data.prepare",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("inputs", nargs="+", metavar="INPUT", help="UTF-8 text files, directories or JSONL files")
    parser.add_argument("--out", required=True, metavar="PREFIX", help="output path prefix")
    parser.add_argument("--tokenizer", default="byte", metavar="byte|PATH", help="byte, or a tokenizer.json")
    parser.add_argument(
        "--train-tokenizer", type=int, metavar="N", help="train a byte-level BPE of N ids on the inputs first"
    )
    parser.add_argument("--eos", metavar="TOKEN", help="end-of-document token of a tokenizer.json")
    parser.add_argument("--field", metavar="NAME", help="inputs are JSONL: each line's text is under NAME")
    parser.add_argument("--include", default="*", metavar="GLOB", help="file names taken from directories")
    parser.add_argument("--dtype", default="auto", choices=["auto", *sorted(DTYPES)])
    args = parser.parse_args(argv)
    comm = launched_comm()
    try:
        prepare(
            args.inputs,
            args.out,
            args.dtype,
            args.tokenizer,
            train_tokenizer=args.train_tokenizer,
            eos=args.eos,
            field=args.field,
            include=args.include,
            comm=comm,
            report=lambda line: print(line, flush=True),
        )
    except GridlmError as e:  # raised on every rank alike (agreed)
        if comm.rank == 0:
            print(f"gridlm: {e}", file=sys.stderr, flush=True)
        if comm.size > 1:
            comm.Barrier()  # rank 0 has printed before any rank's exit status ends the job
        return 2
    except Exception:  # a bug: never leave the other ranks waiting in a collective
        if comm.size == 1:
            raise
        traceback.print_exc()
        sys.stderr.flush()
        comm.Abort(1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

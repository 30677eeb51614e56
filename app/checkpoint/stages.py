"""The collective stages of a parallel checkpoint write, each ended by an agreement.

An h5py call on an mpio file can fail on some ranks only: a full disk, an I/O error on one
node's client, a NaN in the slice one rank writes. A rank that left after its error while
the others went on to the next collective HDF5 / MPI-IO call (dataset creation, a
collective H5Dwrite, the flush's MPI_File_set_size, MPI_File_close) hangs the job. So
every stage runs through `Stages.run`: it catches any exception, and all ranks agree
(`app.runtime.mpi.failures`: one MPI_Allreduce of an int) before any rank starts the next
stage. After a failure every rank raises `Abandon` at the same point, and `abandon` leaves
the file together:

1. rank 0 notes the free space and frees its spare blocks (`store.prepare_write`); if the
   metadata was not written yet, it truncates the `.tmp` file to 0 bytes (the space comes
   back, e.g. a partial reservation). Once it was (`save` writes all metadata first, every
   attribute at its final size), the file keeps its blocks: the close then only rewrites
   blocks it has, and works on a full disk;
2. every rank closes the file (collective; all hold it, since the failed stage came after
   the agreed create), and the ranks agree again on how the close went. A file whose close
   failed is kept referenced for good: HDF5 crashes when such a file is released again;
3. rank 0 removes the `.tmp` file; `latest` still names the previous checkpoint;
4. every rank raises the same one-line error: `NonFiniteError` for a NaN/Inf,
   `CheckpointError` naming the file, the cause (errno or the MPI error text; an unnamed
   MPI_ERR_IO when the rest of the checkpoint no longer fits is reported as no space) and
   the space left.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, NoReturn, Optional, TypeVar

from app.checkpoint.store import describe_failure, format_bytes, free_bytes, latest_note, spare_file
from app.errors import CheckpointError, GridlmError, NonFiniteError
from app.runtime.mpi import Runtime, failures

T = TypeVar("T")
NO_SPACE = "no space left on device (ENOSPC)"


@dataclass(frozen=True)
class Failure:
    """One rank's failed stage, as the other ranks learn it (picklable)."""

    doing: str  # "writing /model/wte.weight"
    text: str  # the error's message, one line
    errno: Optional[int]
    error: type  # the exception's class (GridlmError subclasses are raised as themselves)

    @classmethod
    def of(cls, err: BaseException, doing: str) -> Failure:
        text = " ".join(str(err).split()) or type(err).__name__
        return cls(doing, text, getattr(err, "errno", None), type(err))


class Abandon(Exception):
    """Raised on every rank at once when a stage failed on any rank."""

    def __init__(self, op: str, failed: list[tuple[int, Failure]], local: Optional[BaseException]) -> None:
        super().__init__(f"{op} failed on rank(s) {[rank for rank, _ in failed]}")
        self.op, self.failed, self.local = op, failed, local


class PhaseTimes:
    """Seconds spent per phase of a save or a load on this rank (`seconds`, in the order first met):
    `add` a duration, time a block (`timed`), or `lap` (the time since the previous lap or the start)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._mark = time.perf_counter()

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.add(phase, now - self._mark)
        self._mark = now

    @contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(phase, time.perf_counter() - start)


class Stages:
    """Runs the stages of one write; `run` returns the stage's result on every rank or raises
    `Abandon` on every rank."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.doing = ""  # what the stage is doing, for the message; a stage may refine it as it goes
        # This rank's seconds per phase (each stage under its op or words, the agreements together):
        # where a write's time goes (`Saved.phases`, benchmarks/checkpoint_bench.py).
        self.phases = PhaseTimes()

    def run(self, op: Optional[str], doing: str, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)`, then agree. `op` names the collective HDF5 / MPI-IO call it makes, for the
        watchdog; None for a stage without one (rank-local work: independent writes may take
        long, and no rank waits for another in them)."""
        error: Optional[BaseException] = None
        result = None
        self.doing = doing
        settle = getattr(self.runtime.comm, "settle", None)  # a background writer's (background.sleeping_comm)
        if op and settle is not None:
            settle()  # the ranks meet asleep before a collective HDF5 / MPI-IO call, not spinning in it
        t0 = time.perf_counter()
        with self.runtime.watchdog.blocking(op, axis="world") if op else nullcontext():
            try:
                result = fn(*args)
            except Exception as err:  # agreed below: no rank goes on to the next collective alone
                error = err
        t1 = time.perf_counter()
        mine = None if error is None else Failure.of(error, self.doing)
        failed = failures(self.runtime, mine, f"MPI_Allreduce ({op or doing} agreed)")
        self.phases.add(op or doing, t1 - t0)
        self.phases.add("agreements", time.perf_counter() - t1)
        if failed:
            raise Abandon(op or doing, failed, error)
        return result  # type: ignore[return-value]


def abandon(
    runtime: Runtime, stop: Abandon, file: Any, tmp: Path, needed: int, final: Path, keep_blocks: bool
) -> NoReturn:
    """Every rank, after `Stages.run` raised `stop`: leave and remove the file together, raise
    the error (module docstring). `keep_blocks`: the metadata is on disk, do not truncate."""
    directory = tmp.parent
    measured: Optional[tuple[int, int, int]] = None  # free bytes, bytes the .tmp held, its size, at the failure
    if runtime.rank == 0:
        with suppress(OSError):
            held = os.stat(tmp)
            measured = (free_bytes(directory), held.st_blocks * 512, held.st_size)
        with suppress(OSError):
            spare_file(tmp).unlink(missing_ok=True)  # room for the metadata the close writes
            if not keep_blocks:
                os.truncate(tmp, 0)
    close_note = ""
    # A failed create leaves no file to close on the failing ranks, and after a failed close
    # the ranks that closed cannot take part again: only close when every rank holds it.
    if file is not None and stop.op not in ("H5Fcreate", "H5Fclose"):
        error: Optional[str] = None
        with runtime.watchdog.blocking("H5Fclose", axis="world"):
            try:
                file.close()
            except Exception as err:  # noted only: the first failure is the cause
                error = " ".join(str(err).split())
                runtime.keep_alive.append(file)  # releasing it again would crash HDF5 1.10
        bad = failures(runtime, error, "MPI_Allreduce (H5Fclose agreed)")
        if bad:
            close_note = f"; closing it failed too on rank {bad[0][0]} ({bad[0][1][:120]})"
    info = None
    if runtime.rank == 0:
        removed: Optional[bool] = True if tmp.exists() or spare_file(tmp).exists() else None  # None: never written
        try:
            tmp.unlink(missing_ok=True)
            spare_file(tmp).unlink(missing_ok=True)
        except OSError:
            removed = False
        try:
            free: Optional[int] = free_bytes(directory)
        except OSError:
            free = None
        info = (measured, free, removed, latest_note(directory))
    with runtime.watchdog.blocking("MPI_Bcast (checkpoint failure)", axis="world"):
        measured, free, removed, note = runtime.comm.bcast(info, root=0)

    rank, first = stop.failed[0]
    more = (
        f" (and {len(stop.failed) - 1} more rank{'s' if len(stop.failed) > 2 else ''})" if len(stop.failed) > 1 else ""
    )
    partial = {True: f"{tmp.name} removed", False: f"{tmp.name} could not be removed", None: "nothing written"}[removed]
    if issubclass(first.error, NonFiniteError):
        raise NonFiniteError(f"{first.text} on rank {rank}{more}; not committed: {final} ({partial}; {note})") from None
    if runtime.rank == rank and stop.local is not None and not _expected(stop.local):
        raise stop.local  # a bug: its own traceback (app.__main__ aborts the job)
    if issubclass(first.error, GridlmError):
        raise _same_kind(
            first.error, f"{first.text} (rank {rank}{more} while {first.doing}; {partial}; {note})"
        ) from None
    if not _expected_type(first.error):
        raise CheckpointError(
            f"cannot write checkpoint {tmp}: internal error on rank {rank} while {first.doing}: "
            f"{first.error.__name__}: {first.text}"
        ) from None
    cause = describe_failure(first.text, first.errno)
    # A .tmp whose blocks cover its size was reserved whole (store.reserve): its writes could not
    # run out of space, whatever is free now (`needed` is an upper bound: its slack is no proof).
    reserved = measured is not None and measured[1] >= measured[2] > 0
    if measured is not None and not reserved and cause != NO_SPACE and measured[0] < needed - measured[1]:
        # HDF5 error stacks rarely carry errno: if the rest of the checkpoint no longer fits, that is why.
        cause = f"{NO_SPACE}: disk full, {format_bytes(measured[0])} free (the error said: {cause})"
    raise CheckpointError(
        f"cannot write checkpoint {tmp}: {cause} while {first.doing} on rank {rank}{more}; {partial}, "
        f"{'?' if free is None else format_bytes(free)} free on {tmp.parent}; {note}{close_note}; "
        f"free space or set checkpoint.dir [{first.text[:300]}]"
    ) from None


def _expected_type(kind: type) -> bool:
    """I/O errors (h5py raises OSError, some HDF5 failures RuntimeError) and user errors."""
    return issubclass(kind, (OSError, RuntimeError, GridlmError))


def _expected(err: BaseException) -> bool:
    return _expected_type(type(err))


def _same_kind(kind: type, message: str) -> GridlmError:
    try:
        return kind(message)
    except TypeError:  # a richer constructor (DeckError)
        return CheckpointError(message)

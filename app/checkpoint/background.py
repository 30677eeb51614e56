"""Asynchronous checkpoints (`checkpoint.async: true`): the file is written while training goes on.

A save takes a `Snapshot` on the main thread — this rank's slices of every tensor copied to
host memory, the catalogue and the header (two small collectives) — and hands it to a
writer thread, which runs the very `io.write` of a synchronous save: the same file, the
same checksums, agreements, atomic commit, `latest` and retention. The step loop waits
only for the copy. Rules:

- **Its own communicator.** Every MPI call of the writer (h5py's mpio driver, the
  agreements, the checksum sum, rank 0's verdicts) is on a duplicate of the job's
  communicator, made once at start (collectively): the main thread keeps calling MPI
  (the stop-signal vote, `agree`) and two threads must never share a collective on one
  communicator. That needs MPI_THREAD_MULTIPLE; where the MPI library gives less
  (`MPI.Query_thread`, agreed over the ranks), saves stay synchronous and rank 0 warns once.
- **Its own watchdog** (when the job has one): the writer's collective calls are watched
  for `run.comm_timeout_s` like a synchronous save's, on a second watchdog thread (the
  job's watchdog keeps a stack of the main thread's open calls).
- **One write in flight.** The next save, a stop signal, the end of training and a
  rollback wait for it (`wait`); after every step the ranks check, in one MPI_Allreduce
  while a write is in flight, whether all of theirs are done (`done_everywhere`), so that
  its outcome is taken at the same step on every rank: the log line and the summary's
  record, or a failure, raised as a synchronous save's would be.
- **Few cycles from training.** h5py releases the GIL inside H5Dwrite (measured: the main
  thread ran on through a 200 MB write, its longest wait 9 ms), and numpy inside each
  checksum chunk. The writer's communicator waits asleep (`sleeping_comm`): a rank that
  reaches a collective early sleeps in an MPI_Ibarrier loop instead of spinning in Open
  MPI's polling on the cores the training threads need.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from contextlib import suppress
from pathlib import Path
from typing import Any, Optional, Union

from app.checkpoint.io import Saved, Snapshot, TrainingState, snapshot, write
from app.runtime.mpi import Runtime, settle, usable_cores
from app.runtime.watchdog import NullWatchdog, Watchdog

# The writer thread's nice value (Linux: per thread), 0: training's. Measured here (4 ranks on 2
# cores, three runs): nice 10 spread the write over 2-4 steps (+17-25% each) but training lost
# as much in all (1.3-2.4 s, against 0.9-1.6 s at 0, one step +26-55%) and the write took 4x
# longer (docs/CHECKPOINT.md); `BackgroundWriter(nice=...)` to compare.
NICE = 0
THREAD_LEVELS = ("MPI_THREAD_SINGLE", "MPI_THREAD_FUNNELED", "MPI_THREAD_SERIALIZED", "MPI_THREAD_MULTIPLE")


def sleeping_comm(comm: Any, interval: float = 0.002) -> Any:
    """A view of `comm` (the same handle) whose blocking collectives, and `settle`, first wait for every
    rank in an MPI_Ibarrier tested every `interval` seconds: a writer that arrives early sleeps
    instead of spinning in Open MPI's polling loop, on cores the training ranks need. Measured here
    (4 ranks on 2 cores) the spinning writers cost training more than the writing itself."""
    from mpi4py import MPI

    class Sleeping(MPI.Intracomm):
        def settle(self) -> None:
            settle(self, interval)

        def Barrier(self) -> None:
            self.settle()
            super().Barrier()

        def Allreduce(self, *args: Any, **kwargs: Any) -> None:
            self.settle()
            super().Allreduce(*args, **kwargs)

        def allreduce(self, *args: Any, **kwargs: Any) -> Any:
            self.settle()
            return super().allreduce(*args, **kwargs)

        def allgather(self, *args: Any, **kwargs: Any) -> Any:
            self.settle()
            return super().allgather(*args, **kwargs)

        def bcast(self, *args: Any, **kwargs: Any) -> Any:
            self.settle()
            return super().bcast(*args, **kwargs)

    return Sleeping(comm)


def thread_level_name(level: int) -> str:
    return THREAD_LEVELS[level] if 0 <= level < len(THREAD_LEVELS) else f"thread level {level}"


class BackgroundWriter:
    """Writes one checkpoint at a time on a thread of its own (module docstring). Built by every
    rank at the same point (`background_writer`); `start`, `wait`, `done_everywhere` and `close`
    are called by every rank at the same step."""

    def __init__(self, runtime: Runtime, nice: int = NICE) -> None:
        self.runtime, self.nice = runtime, nice
        comm = sleeping_comm(runtime.comm.Dup())  # collective: the writer's communicator, never the main thread's
        watchdog: Union[Watchdog, NullWatchdog] = NullWatchdog()
        if isinstance(runtime.watchdog, Watchdog):
            watchdog = Watchdog(dataclasses.replace(runtime, comm=comm), runtime.watchdog.timeout)
        # The same rank, node and keep_alive list; its own communicator and watchdog.
        self.io_runtime = dataclasses.replace(runtime, comm=comm, watchdog=watchdog)
        self._thread: Optional[threading.Thread] = None
        self._outcome: Union[Saved, BaseException, None] = None
        self._done = threading.Event()
        self.step = 0  # of the write in flight
        self.reason = ""
        self.final = False
        self._blocked = 0.0  # seconds the step loop has waited for the write in flight so far

    @property
    def in_flight(self) -> bool:
        return self._thread is not None

    def start(self, state: TrainingState, directory: Path, reason: str, final: bool = False, **hooks: Any) -> float:
        """Copy this rank's state (the step loop waits for this only) and start writing it; the
        seconds that took. `final`: a save with no later interval to retry in (end, stop).
        `hooks`: `io.write`'s test hooks (before_write, before_commit, reserve_space)."""
        if self._thread is not None:
            raise RuntimeError("a checkpoint write is already in flight: wait for it first")
        t0 = time.perf_counter()
        snap = snapshot(state, copy=True)
        self.step, self.reason, self.final = snap.step, reason, final
        self._outcome = None
        self._done.clear()
        self.io_runtime.watchdog.at(step=snap.step)
        # Not a daemon: a write in flight when Python exits ends before MPI is finalised.
        self._thread = threading.Thread(
            target=self._write, args=(snap, directory, hooks), name="gridlm-checkpoint-writer"
        )
        self._thread.start()
        self._blocked = time.perf_counter() - t0
        return self._blocked

    def _write(self, snap: Snapshot, directory: Path, hooks: dict[str, Any]) -> None:
        with suppress(OSError, AttributeError):  # Linux: a thread's own nice value
            if self.nice:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.nice)
        try:
            self._outcome = write(snap, self.io_runtime, directory, **hooks)
        except BaseException as err:  # handed to the main thread by `wait`
            self._outcome = err
        finally:
            self._done.set()

    def done_everywhere(self) -> bool:
        """Whether every rank's write has ended (collective on the job's communicator while one
        is in flight: one MPI_Allreduce; without one, False at no cost)."""
        if self._thread is None:
            return False
        from mpi4py import MPI

        with self.runtime.watchdog.blocking("MPI_Allreduce (checkpoint written?)", axis="world"):
            return bool(self.runtime.comm.allreduce(int(self._done.is_set()), op=MPI.MIN))

    def wait(self) -> Saved:
        """Wait for the write in flight; its `Saved` (with the seconds the step loop was blocked
        by it), or its error raised here (CheckpointError, NonFiniteError: agreed by every rank's
        writer, so every rank raises it)."""
        if self._thread is None:
            raise RuntimeError("no checkpoint write in flight")
        t0 = time.perf_counter()
        self._thread.join()
        self._thread = None
        blocked = self._blocked + time.perf_counter() - t0
        outcome, self._outcome = self._outcome, None
        if isinstance(outcome, BaseException):
            raise outcome
        assert outcome is not None
        return dataclasses.replace(outcome, blocked=blocked)

    def close(self) -> Union[Saved, BaseException, None]:
        """Wait for a write still in flight and release the communicator (every rank, once, however
        training ended). Returns that write's outcome, its `Saved` or its error instead of raising
        it (an error may be on its way out already); None when none was in flight."""
        outcome: Union[Saved, BaseException, None] = None
        if self._thread is not None:
            try:
                outcome = self.wait()
            except BaseException as err:  # the caller decides whether it still matters
                outcome = err
        self.io_runtime.watchdog.stop()
        with suppress(Exception):
            self.io_runtime.comm.Free()
        return outcome


def background_writer(runtime: Runtime) -> Optional[BackgroundWriter]:
    """The writer for checkpoint.async (every rank, at start), or None when the MPI library does not
    allow MPI calls from a second thread: then saves are synchronous, and rank 0 says so once."""
    from mpi4py import MPI

    level = runtime.comm.allreduce(MPI.Query_thread(), op=MPI.MIN)  # every rank decides alike
    if level < MPI.THREAD_MULTIPLE:
        runtime.log(
            f"gridlm: warning: checkpoint.async needs MPI_THREAD_MULTIPLE (MPI-IO from a writer thread), but MPI "
            f"was started with {thread_level_name(level)}: checkpoints are written synchronously (launch without "
            f"MPI4PY_RC_THREAD_LEVEL, or with an MPI library that provides it)"
        )
        return None
    # The writer thread needs a core the training threads do not use (measured, 1 rank, 35M
    # parameters: steps during a write +26% with the rank bound to one core, +0.6% with two).
    import torch

    threads = torch.get_num_threads()
    shared = runtime.comm.allreduce(int(usable_cores() <= threads), op=MPI.SUM)
    if shared:
        runtime.log(
            f"gridlm: warning: checkpoint.async: {shared} rank(s) may run on no more cores than their torch "
            f"threads ({threads}), so the writer thread takes CPU from training while a checkpoint "
            "is written; give each rank a spare core (srun --cpus-per-task, mpirun --bind-to none or "
            "--map-by slot:PE=N) or set run.threads lower"
        )
    return BackgroundWriter(runtime)


def describe(saved: Saved) -> str:
    """The end of a background save's log line: its full time and the step loop's share."""
    blocked = saved.blocked if saved.blocked is not None else saved.seconds
    share = blocked / max(saved.seconds, 1e-9)
    return f"written in the background; the step loop was blocked {blocked:.3f} s ({100 * share:.0f}%)"

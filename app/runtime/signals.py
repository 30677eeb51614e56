"""Stop requests from the scheduler: SIGTERM and SIGUSR1 end training cleanly.

Slurm sends SIGTERM at the time limit (SIGKILL follows after KillWait) and, with
`#SBATCH --signal=B:USR1@<lead>` (launch/submit.py's SIGNAL_LEAD_S, rendered into every job
template), SIGUSR1 that many seconds before it; preemption sends SIGTERM.
The handler only records the signal; after each step the ranks agree (an MPI MAX over
the job) on whether any of them got one, so all of them stop after the same step, write
a checkpoint and exit 0 — a resubmitted job continues from it (run.resume: auto).
Training records them from the process's start (`app.__main__`): one that comes while the job
starts (imports, the lock, building the model: minutes at scale) stops it after its first step,
instead of the default action killing that rank without a word.
"""

from __future__ import annotations

import signal
import threading
from contextlib import nullcontext
from types import FrameType
from typing import Any, Optional

from app.runtime.watchdog import AnyWatchdog

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopSignals:
    """Context manager: records STOP_SIGNALS while active, restores the old handlers after."""

    def __init__(self) -> None:
        self.received = 0
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():  # Python allows handlers only there
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._record)
                earlier = getattr(self._previous[sig], "__self__", None)
                if isinstance(earlier, StopSignals):  # one recorded since the process started (app.__main__)
                    self.received = self.received or earlier.received
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _record(self, signum: int, frame: Optional[FrameType]) -> None:
        self.received = signum

    def agreed(self, comm: Any, watchdog: Optional[AnyWatchdog] = None) -> int:
        """The signal any rank of `comm` received (0 for none); collective (watched when a
        watchdog is given)."""
        from mpi4py import MPI

        with watchdog.blocking("MPI_Allreduce (stop signals)") if watchdog is not None else nullcontext():
            return int(comm.allreduce(self.received, op=MPI.MAX))


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name

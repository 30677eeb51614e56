"""A rank's process around its MPI job: a start-up the cyclic garbage collector stays out of, and
an end without Python's own finalisation.

Both are CPU a rank spends for nothing. Importing torch (and torch.distributed, mpi4py, h5py)
creates about a million objects that live as long as the job, and the collector, which runs every
few hundred allocations, walks them again and again: 9% of a rank's start-up CPU on a 2-core
Xeon. At the end, Python's finalisation tears them down one by one: about 0.8 s of CPU on every
rank (a third of a short job's), repeated by every rank of every job, and by the hundreds of
short jobs of the test suite.
"""

from __future__ import annotations

import atexit
import gc
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import NoReturn


@contextmanager
def start_up() -> Iterator[None]:
    """The collector off while the job starts (imports, communicators), then the survivors frozen
    (`gc.freeze`: later collections, the training loop's too, skip them) and the collector back on.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if was_enabled:
            gc.enable()


def exit_now(code: int) -> NoReturn:
    """End the process with `code`, doing what a normal exit does that matters and skipping the rest.

    In order, as the interpreter's own exit: threading's shutdown (its exit hooks tell idle
    executor workers to stop, then every non-daemon thread is joined: a background checkpoint
    writer finishes), the atexit handlers (logging, h5py's files, torch's); then MPI finalised if
    mpi4py started it (its own finaliser is a C exit hook that os._exit skips, and mpirun reports
    a rank that exits without MPI_Finalize as failed), stdout and stderr flushed, and `os._exit`:
    no module teardown. Under a profiler or tracer (cProfile, coverage), which writes at the normal
    exit, it is a plain `sys.exit`. (`threading._shutdown` and `atexit._run_exitfuncs` are what CPython's
    finalisation calls; private, present from 3.8 to 3.13.) Call it from the main thread.
    """
    if sys.getprofile() is not None or sys.gettrace() is not None:
        sys.exit(code)  # cProfile or coverage measures this process: it writes its results at the normal exit
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()
    for stream in (sys.stdout, sys.stderr):
        with suppress(OSError, ValueError):  # a closed pipe or stream: nothing more can be said on it
            stream.flush()
    os._exit(code)

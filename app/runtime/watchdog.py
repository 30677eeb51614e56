"""Watchdog: no rank waits forever in a blocking operation.

Interface used by the rest of the code (the real implementation follows in this file):

    runtime.watchdog.at(step=5, micro=2)            # where this rank is (for the message)
    with runtime.watchdog.blocking("MPI_File_close", axis="world"):
        ...                                          # a call that waits for other ranks

`Runtime.watchdog` is a `NullWatchdog` (does nothing) until `app.__main__` starts a real
one; in-process tests therefore need nothing.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Optional


class NullWatchdog:
    """The no-op watchdog: same interface, nothing watched."""

    def at(self, step: Optional[int] = None, micro: Optional[int] = None) -> None:
        pass

    def blocking(self, op: str, axis: Optional[str] = None) -> AbstractContextManager:
        return nullcontext()

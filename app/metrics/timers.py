"""Communication timers: seconds spent in tp / pp / dp communication, per step.

On CPU (gloo) collectives block, so the wall time of a call is its cost, waiting for the
slowest peer included. On a GPU calls are asynchronous: when enabled, the timer
synchronises the device around each call, which makes the number honest and the run
slower (hence the `run.comm_timers` switch). Finer timers (forward, backward, optimizer,
exposed communication) build on this one.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Optional

import torch

AXES = ("tp", "pp", "dp")


class CommTimers:
    """Accumulates communication seconds per grid axis until `pop()`."""

    def __init__(self, device: torch.device, enabled: bool = True) -> None:
        self.device, self.enabled = device, enabled
        self.totals = dict.fromkeys(AXES, 0.0)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextmanager
    def region(self, axis: str) -> Iterator[None]:
        """Time the communication inside the `with` block and charge it to `axis`."""
        if not self.enabled:
            yield
            return
        self._sync()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.totals[axis] += time.perf_counter() - t0

    def pop(self) -> dict[str, float]:
        """The seconds per axis since the last pop, and reset."""
        totals, self.totals = self.totals, dict.fromkeys(AXES, 0.0)
        return totals


def comm_region(timers: Optional[CommTimers], axis: str) -> AbstractContextManager:
    """`timers.region(axis)`, or a no-op where no timers were passed."""
    return timers.region(axis) if timers is not None else nullcontext()

"""Step timers: time in forward, backward and the optimizer, and communication per grid
axis, split into its total and its *exposed* part (the time compute waited for it).

Definitions (per optimizer step, this rank):
  forward_s / backward_s   wall time of the pipeline's forward / backward passes, the
                           communication they wait for included.
  optimizer_s              from the end of the last backward to the end of the update:
                           waiting for the last gradient buckets, the grid-wide norm,
                           the update and (without overlap) the parameter all-gather.
  comm_s[axis]             wall time during which a collective on that axis was in
                           flight or waited for (the union of their intervals): a
                           blocking call's duration; an asynchronous one's from launch
                           to completion, and its wait if that outlasted the transfer
                           (measured on CPU by a completion callback; gloo's p2p
                           sends/receives have none, so for them, and on GPU, only the
                           exposed part is counted: a lower bound).
  exposed_comm_s[axis]     time this rank was blocked on that axis's communication:
                           blocking calls plus waits on asynchronous ones. Overlap shows
                           as comm_s > exposed_comm_s.

CPU: wall clock. GPU: CUDA events on the current (compute) stream, read once per step in
`pop()`, so timing never synchronises the device mid-step; on the compute stream a wait
on a collective is exactly the time that stream stalled.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Optional

import torch

from app.names import AXES, SUB_AXES, USED_AXES
from app.runtime.watchdog import AnyWatchdog, NullWatchdog

PHASES = ("forward", "backward", "optimizer")


class Pending:
    """An asynchronous collective in flight: its work handle and when it was launched."""

    def __init__(self, axis: str, work: Any, t0: Optional[float], op: str = "collective") -> None:
        self.axis, self.work, self.t0, self.op = axis, work, t0, op
        self.done_at: list[float] = []
        self.keep: Any = None  # a buffer the collective reads, kept alive until it completes


class StepTimers:
    """Accumulates phase and communication times until `pop()`; a no-op when disabled.

    Every blocking region and wait also runs inside `watchdog.blocking` (app/runtime/watchdog.py),
    timers enabled or not: these are the step's calls that wait for other ranks."""

    def __init__(self, device: torch.device, enabled: bool = True, watchdog: Optional[AnyWatchdog] = None) -> None:
        self.device, self.enabled = device, enabled
        self.watchdog = watchdog if watchdog is not None else NullWatchdog()
        self.cuda = device.type == "cuda"
        self._reset()

    def _reset(self) -> None:
        self.phases = dict.fromkeys(PHASES, 0.0)
        self.comm = dict.fromkeys(AXES + USED_AXES + tuple(SUB_AXES), 0.0)
        self.exposed = dict.fromkeys(AXES + USED_AXES + tuple(SUB_AXES), 0.0)
        self._charged: set[str] = set()  # the axes charged this step (sub-axes are reported only then)
        # GPU: (bucket dict, key, start event, end event), summed in pop().
        self._events: list[tuple[dict[str, float], str, Any, Any]] = []
        # CPU: (start, end) of every collective per axis; comm_s is the length of their union.
        self._spans: dict[str, list[tuple[float, float]]] = {a: [] for a in AXES + USED_AXES + tuple(SUB_AXES)}

    @contextmanager
    def _timed(self, *targets: tuple[dict[str, float], str]) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                yield
            finally:
                end.record()
                self._events += [(bucket, key, start, end) for bucket, key in targets]
            return
        t0 = time.perf_counter()
        try:
            yield
        finally:
            dt = time.perf_counter() - t0
            for bucket, key in targets:
                bucket[key] += dt

    def phase(self, name: str) -> AbstractContextManager:
        """Time a forward / backward / optimizer phase."""
        return self._timed((self.phases, name))

    @contextmanager
    def region(self, axis: str, op: str = "collective") -> Iterator[None]:
        """Time a blocking collective: all of it is exposed."""
        self._charged.add(axis)
        with self.watchdog.blocking(op, axis):
            if not self.enabled or self.cuda:
                with self._timed((self.comm, axis), (self.exposed, axis)):
                    yield
                return
            t0 = time.perf_counter()
            try:
                yield
            finally:
                t1 = time.perf_counter()
                self.exposed[axis] += t1 - t0
                self._spans[axis].append((t0, t1))

    def launched(self, axis: str, work: Any, op: str = "collective") -> Pending:
        """Register an asynchronous collective just launched; pass the result to `wait`."""
        pending = Pending(axis, work, time.perf_counter(), op)
        self._charged.add(axis)
        if self.enabled and not self.cuda and work is not None:
            # gloo completes the future on its own thread: that instant ends the transfer.
            try:
                work.get_future().then(lambda _: pending.done_at.append(time.perf_counter()))
            except RuntimeError:  # gloo p2p work has no future: only the wait is measured
                pending.t0 = None
        return pending

    def wait(self, pending: Pending) -> None:
        """Wait for an asynchronous collective; the time blocked is exposed communication."""
        if pending.work is None:
            return
        if not self.enabled:
            with self.watchdog.blocking(f"wait for {pending.op}", pending.axis):
                pending.work.wait()
            return
        with self._timed((self.exposed, pending.axis)) if self.cuda else nullcontext():
            t_wait = time.perf_counter()
            with self.watchdog.blocking(f"wait for {pending.op}", pending.axis):
                pending.work.wait()
        if self.cuda:
            return  # its duration on the NCCL stream is not visible here; the exposed part is counted
        now = time.perf_counter()
        self.exposed[pending.axis] += now - t_wait
        # Done before the wait began: the transfer ended then, and the wait's own time (it is
        # exposed) is a span of its own, so comm_s >= exposed_comm_s holds. Otherwise the
        # transfer ended, for this rank, when the wait returned.
        start, spans = (t_wait if pending.t0 is None else pending.t0), self._spans[pending.axis]
        if pending.done_at and pending.done_at[0] <= t_wait:
            spans += [(start, pending.done_at[0]), (t_wait, now)]
        else:
            spans.append((start, now))

    def pop(self) -> dict[str, Any]:
        """This step's times (seconds) since the last pop, and reset; call after the step ends."""
        if self.cuda and self._events:
            for bucket, key, start, end in self._events:
                end.synchronize()  # its own event, not the device: NCCL work may still be running
                bucket[key] += start.elapsed_time(end) / 1e3
        subs = [a for a in SUB_AXES if a in self._charged]
        used = [a for a in USED_AXES if a in self._charged]  # cp: an axis of its own, named where used
        for sub in subs:  # a sub-axis's collectives are its axis's too (tp_x: tp's, ep: dp's)
            axis = SUB_AXES[sub]
            self.exposed[axis] += self.exposed[sub]
            self._spans[axis] += self._spans[sub]
            if self.cuda:
                self.comm[axis] += self.comm[sub]
        for axis in (*AXES, *used, *subs):
            if self.cuda:  # overlapped durations are not measured on GPU: at least the exposed part
                self.comm[axis] = max(self.comm[axis], self.exposed[axis])
            else:
                self.comm[axis] = union_length(self._spans[axis])
        out = {f"{p}_s": self.phases[p] for p in PHASES}
        out["comm_s"] = {a: self.comm[a] for a in (*AXES, *used, *subs)}
        out["exposed_comm_s"] = {a: self.exposed[a] for a in (*AXES, *used, *subs)}
        self._reset()
        return out


def union_length(spans: list[tuple[float, float]]) -> float:
    """Total length covered by the (start, end) intervals: collectives in flight at once,
    queued on the same group, count once."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def comm_region(timers: Optional[StepTimers], axis: str, op: str = "collective") -> AbstractContextManager:
    """`timers.region(axis, op)`, or a no-op where no timers were passed."""
    return timers.region(axis, op) if timers is not None else nullcontext()


def launch(timers: Optional[StepTimers], axis: str, work: Any, op: str = "collective") -> Pending:
    """Track an asynchronous collective's work handle (timers optional)."""
    return timers.launched(axis, work, op) if timers is not None else Pending(axis, work, 0.0, op)


def wait(timers: Optional[StepTimers], pending: Pending) -> None:
    """Wait for a collective registered with `launch` (timers optional)."""
    if timers is not None:
        timers.wait(pending)
    elif pending.work is not None:
        pending.work.wait()

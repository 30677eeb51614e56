"""Kernel by kernel: `run.profile` steps under torch.profiler, summarised for a job log.

The timers say how long forward, backward and the optimizer take; a profile says which kernels
that time is made of, how many of them a step launches, and what kind they are (GEMM, attention,
element-wise, optimizer, copy, collective), which is what a performance model's terms and a fusion
are checked against. Rank 0 profiles `run.profile` steps after the timing warm-up
(`run.timing_warmup`) and writes `<run.dir>/profile.txt`: the kinds' device time and kernel counts
per step, then the kernels by device time. On CPU ranks the "kernels" are the ATen operators that
ran (their self CPU time). The profiled steps run slower (the profiler's own work) and count in
the run's mean step time: time a run without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from app.metrics.report import replace_text

# A kernel's kind by substrings of its name, first match wins (CUDA kernel names; ATen op names on CPUs).
GEMM_MARKS = ("gemm", "cutlass", "cublas", "sm90_xmma", "sm80_xmma", "nvjet", "aten::mm", "aten::addmm", "aten::bmm",
              "aten::linear", "aten::matmul")  # fmt: skip
KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("collective", ("nccl", "c10d::", "gloo", "allreduce", "all_gather", "reduce_scatter")),
    ("copy", ("memcpy", "memset", "aten::copy_", "aten::_to_copy", "aten::clone", "aten::contiguous")),
    ("attention", ("flash", "fmha", "attention", "sdpa", "_efficient_attention")),
    ("optimizer", ("adam", "multi_tensor_apply", "_foreach", "lamb")),
    ("gemm", GEMM_MARKS),
)
OTHER = "element-wise and other"


def kind_of(name: str) -> str:
    """The kind of a kernel (or CPU operator) by its name."""
    low = name.lower()
    for kind, marks in KINDS:
        if any(mark in low for mark in marks):
            return kind
    return OTHER


@dataclass(frozen=True)
class Kernel:
    """One kernel name's totals over the profiled steps."""

    name: str
    calls: int
    seconds: float  # device time (CPU ranks: self CPU time)

    @property
    def kind(self) -> str:
        return kind_of(self.name)


def summarise(
    kernels: list[Kernel], steps: int, device: str, top: int = 30, host: Optional[list[Kernel]] = None
) -> str:
    """profile.txt's text: per step, the time and launches of each kind, then the `top` kernels;
    on GPUs also the host's ATen operators (`host`: every thread's, e.g. an offloaded update's)."""
    total = sum(k.seconds for k in kernels) or 1e-30
    unit = "kernels" if device == "cuda" else "operators"
    lines = [
        f"gridlm profile: {steps} step(s) on {device}; per step: {sum(k.calls for k in kernels) / steps:.0f} "
        f"{unit}, {total / steps * 1e3:.2f} ms of {'device' if device == 'cuda' else 'self CPU'} time",
        "",
        f"| kind | ms per step | share | {unit} per step |",
        "|---|---|---|---|",
    ]
    kinds: dict[str, list[Kernel]] = {}
    for k in kernels:
        kinds.setdefault(k.kind, []).append(k)
    for kind, group in sorted(kinds.items(), key=lambda kv: -sum(k.seconds for k in kv[1])):
        seconds = sum(k.seconds for k in group)
        lines.append(
            f"| {kind} | {seconds / steps * 1e3:.3f} | {seconds / total:.1%} | {sum(k.calls for k in group) / steps:.0f} |"
        )
    lines += ["", "| kernel | kind | ms per step | calls per step | us per call |", "|---|---|---|---|---|"]
    for k in sorted(kernels, key=lambda k: -k.seconds)[:top]:
        name = k.name if len(k.name) <= 100 else k.name[:97] + "..."
        lines.append(
            f"| `{name}` | {k.kind} | {k.seconds / steps * 1e3:.3f} | {k.calls / steps:g} | "
            f"{k.seconds / max(k.calls, 1) * 1e6:.1f} |"
        )
    if host:
        busy = sum(k.seconds for k in host)
        lines += ["", f"Host: {sum(k.calls for k in host) / steps:.0f} ATen operators per step, {busy / steps * 1e3:.2f} ms of "
                  "self CPU time per step over all threads (beside the device time above: a step whose host time "
                  "approaches its device time is bound by launching kernels, not by running them)", "",
                  "| host operator | ms per step | calls per step |", "|---|---|---|"]  # fmt: skip
        for k in sorted(host, key=lambda k: -k.seconds)[:15]:
            lines.append(f"| `{k.name}` | {k.seconds / steps * 1e3:.3f} | {k.calls / steps:g} |")
    return "\n".join(lines) + "\n"


def kernels_of(profile: Any) -> tuple[list[Kernel], list[Kernel]]:
    """The profile's CUDA kernels (device-side events, their device time) and its host ATen
    operators (their self CPU time), each name with its totals."""
    found: tuple[dict[str, list[float]], dict[str, list[float]]] = ({}, {})
    for event in profile.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            into, seconds = found[0], event.device_time_total * 1e-6  # a kernel's own device time
        elif event.device_type == torch.autograd.DeviceType.CPU and event.name.startswith("aten::"):
            into, seconds = found[1], event.self_cpu_time_total * 1e-6
        else:
            continue
        calls_and_time = into.setdefault(event.name, [0, 0.0])
        calls_and_time[0] += 1
        calls_and_time[1] += seconds
    kernels, host = ([Kernel(name, int(c), t) for name, (c, t) in kind.items()] for kind in found)
    return kernels, host


class StepProfiler:
    """On rank 0, profiles `steps` steps after the first `warmup` of this run (`steps` 0: does
    nothing) and writes the summary to `out` when the last of them ends."""

    def __init__(self, steps: int, warmup: int, rank: int, out: Path, device: torch.device) -> None:
        self.steps, self.warmup = (steps if rank == 0 else 0), warmup
        self.out, self.device = out, device.type
        self.active: Optional[Any] = None
        self.seen = self.done = 0

    def begin(self) -> None:
        """Before a step runs."""
        self.seen += 1
        if self.steps and self.active is None and self.seen == self.warmup + 1:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.active = torch.profiler.profile(activities=activities)
            self.active.__enter__()

    def end(self) -> Optional[Path]:
        """After a step ran (its device work synchronised); the summary's path once written."""
        if self.active is None:
            return None
        self.done += 1
        return self.close() if self.done >= self.steps else None

    def close(self) -> Optional[Path]:
        """Stop profiling and write the summary of the steps done (also for a run that ended inside
        the profiled steps); its path, or None when nothing was profiled."""
        if self.active is None:
            return None
        self.active.__exit__(None, None, None)
        profile, self.active, self.steps = self.active, None, 0
        if not self.done:
            return None
        self.out.parent.mkdir(parents=True, exist_ok=True)
        kernels, host = kernels_of(profile)
        if self.device == "cuda":
            text = summarise(kernels, self.done, self.device, host=host)
        else:  # CPU ranks: the operators are the kernels
            text = summarise(host, self.done, self.device)
        replace_text(self.out, text)  # whole or not at all: the job may be killed while it writes
        return self.out

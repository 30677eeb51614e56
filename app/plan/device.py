"""The compute constants of one device, from a machine file (`device_of`): what the performance
model (app/plan/perf.py) and the optimizer's time (app/plan/optimizer_time.py) both charge work at."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from app.plan.machine import Machine


@dataclass(frozen=True)
class Device:
    """The compute constants of one device (from a machine file)."""

    peak_flops: float  # dense FLOP/s at the deck's precision
    gemm_efficiency: float  # achieved fraction of peak on large GEMMs
    attention_efficiency: float  # achieved fraction of peak of flash attention, forward (+ backward)
    hbm_bytes_s: float  # achieved memory bandwidth, bytes/s
    compute_units: int  # SMs / CUs: the wave quantisation of GEMM tiles
    tile: tuple[int, int]  # output tile (rows, columns) of a large GEMM
    op_seconds: float = 0.0  # host time per framework op (CPUs; 0 where launches overlap the work)
    attention_backward_efficiency: Optional[float] = None  # the backward's, where a machine gives it apart
    # Achieved bytes/s of element-wise kinds slower than a memory stream (CPUs: GELU's tanh and the
    # softmax's exp are compute-bound), by machine.ELEMENTWISE_KINDS name; the others run at hbm_bytes_s.
    kind_bytes_s: tuple[tuple[str, float], ...] = ()
    # Memory past the last-level cache (machine.memory_gbs; None: hbm_bytes_s is the memory).
    memory_bytes_s: Optional[float] = None
    # CPUs: bytes/s at which a fresh result of at least `mmap_threshold` bytes (glibc mmaps it,
    # run.malloc_mmap_threshold_kb) is page-faulted in (machine.fault_gbs); None: no such cost.
    fault_bytes_s: Optional[float] = None
    mmap_threshold: float = 0.0  # bytes; 0: glibc's dynamic threshold (results come from the heap)

    def gemm(self, m: int, n: int, k: int, element: int) -> float:
        """Seconds of an (m x k) @ (k x n) GEMM."""
        tiles = math.ceil(m / self.tile[0]) * math.ceil(n / self.tile[1])
        waves = math.ceil(tiles / self.compute_units)
        quantisation = tiles / (waves * self.compute_units)
        compute = 2.0 * m * n * k / (self.peak_flops * self.gemm_efficiency * quantisation)
        memory = (m * k + k * n + m * n) * element / self.hbm_bytes_s
        return max(compute, memory)

    def fresh(self, nbytes: float) -> float:
        """Seconds to page-fault in a new result of `nbytes`: on a CPU rank a result of at least the
        mmap threshold is a fresh mapping, faulted in page by page as it is written (0 below it,
        and on GPUs)."""
        if self.fault_bytes_s is None or self.mmap_threshold <= 0 or nbytes < self.mmap_threshold:
            return 0.0
        return nbytes / self.fault_bytes_s

    def linear(self, tokens: int, n: int, k: int, element: int) -> tuple[float, float, float]:
        """Seconds of a Linear's three GEMMs, `tokens` x `k` in, `n` out: the forward X W^T (tokens x
        n, inner k), the input gradient dY W (tokens x k, inner n) and the weight gradient dY^T X
        (n x k, inner tokens), each with its new result's page faults where it is mmapped (`fresh`;
        on this CPU a 256 x 1024 x 256 forward ran at 78 GFLOP/s so, 105 on a warm heap)."""
        return (
            self.gemm(tokens, n, k, element) + self.fresh(tokens * n * element),
            self.gemm(tokens, k, n, element) + self.fresh(tokens * k * element),
            self.gemm(n, k, tokens, element) + self.fresh(n * k * element),
        )

    def stream(self, nbytes: float, kind: Optional[str] = None) -> float:
        """Seconds to read and write `nbytes` in element-wise kernels: memory-bound, unless the
        machine measured `kind` (one of machine.ELEMENTWISE_KINDS) slower."""
        return nbytes / dict(self.kind_bytes_s).get(kind, self.hbm_bytes_s)

    def from_memory(self, nbytes: float) -> float:
        """Seconds to bring `nbytes` that no cache holds from memory and back, on top of the
        passes `stream` charges at hbm_bytes_s; 0 where hbm_bytes_s is the memory (GPUs)."""
        return 0.0 if self.memory_bytes_s is None else nbytes / self.memory_bytes_s


def device_of(machine: Machine, precision: str, mmap_threshold_kb: int = 0) -> Device:
    """The machine's device constants (`mmap_threshold_kb`: the deck's run.malloc_mmap_threshold_kb,
    above which new results page-fault, `Device.fresh`), from a machine file that has them: the
    caller has checked it (`Machine.require_prediction`; `app.plan.perf.place` does, and the search
    before it ranks anything)."""
    peak = machine.peak(precision)
    assert peak is not None and machine.gemm is not None
    g = machine.gemm
    return Device(
        peak_flops=peak * 1e12,
        gemm_efficiency=g["efficiency"],
        attention_efficiency=g.get("attention_efficiency", g["efficiency"]),
        attention_backward_efficiency=g.get("attention_backward_efficiency"),
        hbm_bytes_s=machine.hbm_gbs * 1e9 * g.get("memory_efficiency", 1.0),  # type: ignore[operator]
        compute_units=int(g["compute_units"]),
        tile=(int(g["tile"][0]), int(g["tile"][1])),
        op_seconds=(machine.op_overhead_us or 0.0) * 1e-6,
        memory_bytes_s=None if machine.memory_gbs is None else machine.memory_gbs * 1e9,
        fault_bytes_s=None if machine.fault_gbs is None else machine.fault_gbs * 1e9,
        mmap_threshold=mmap_threshold_kb * 1024,
        kind_bytes_s=tuple(sorted((k, v * 1e9) for k, v in (machine.elementwise_gbs or {}).items())),
    )

"""Measure this machine's primitives and write them as a machine file for the performance model.

    mpirun -n N python -m app.plan.calibrate [--base local] [--out inputs/machines/local_calibrated.yaml]

Every rank measures at once, in loops long enough that ranks sharing cores share them as in
a run (on this CPU machine they share its cores): the fp32 GEMM rate over a set of shapes in
the three layouts of a Linear in training (the best is the peak, the median's share of it
the efficiency), causal attention forward and backward (its efficiency), an element-wise op
that allocates its result, at a size caches hold (`hbm_gbs`), and STREAM's add at its size, 4x
the last-level cache (`memory_gbs`: on CPUs the first is a cache rate), all on a heap warmed as
a run's is (`app.runtime.mpi.warm_heap`), the host time per framework operation of a
chain of tiny modules, and the all-reduce of the job's ranks (gloo on CPUs, NCCL on GPUs) at
a small and a large size, from which a ring's per-step latency and bus bandwidth follow (on
CPU ranks also each call's wait for its peers after a compute block, `busy_us`), and the
node's disk under the temp directory (`nvme_read_gbs`, `nvme_write_gbs`, for optim.offload:
nvme): every rank writes its share of DISK_BYTES with fsync and reads it back with pread.
Only primitives are measured, never a training step, so a wrong step model cannot be hidden
by the calibration. The file is the base machine file with these constants (and their date
and command as the source) in place.

This module measures, so it imports torch and MPI; the rest of app/plan/ stays pure.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import statistics
import sys
import tempfile
import time
import traceback
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

from app.deck_yaml import dump_yaml, read_yaml_file
from app.metrics.peaks import peak_tflops
from app.plan.machine import COLLECTIVE_OPS, ELEMENTWISE_KINDS, NCCL_RING_LATENCY_US, MachineError
from app.plan.perf import BACKWARD_BYTES, ring_terms
from app.runtime.preflight import MEMORY_FILESYSTEMS, filesystem_type

if TYPE_CHECKING:
    from app.runtime.mpi import Runtime

# (m, n, k) of the GEMMs timed: square ones and the skinny shapes of small models.
GEMM_SHAPES = [(256, 256, 256), (512, 512, 512), (1024, 1024, 1024), (256, 768, 256), (256, 1024, 256),
               (2048, 2048, 2048)]  # fmt: skip
# (batch, heads, seq, head dim) of the causal attention timed (forward and backward).
ATTENTION_SHAPES = [(4, 8, 64, 32), (4, 8, 128, 64), (2, 16, 256, 64)]
ELEMENTWISE = 4 * 2**20  # bytes of each operand and of the result of the element-wise op timed
# On GPUs the shapes a one-GPU training step runs (the decks of inputs/gpu/: micro-batches of 4 x 2048
# and 2 x 2048 tokens): in bf16, each Linear of the GPT 1.3B and 2.7B and Llama 0.84B blocks and the
# 1.3B head. Sizes a CPU times make a GPU look slow (a 2048-cube GEMM at a fraction of its peak: the
# first H100 calibration predicted +340%, issue 38).
GPU_GEMM_SHAPES = [(8192, 6144, 2048), (8192, 2048, 2048), (8192, 8192, 2048), (8192, 2048, 8192),
                   (4096, 7680, 2560), (4096, 2560, 2560), (4096, 10240, 2560), (4096, 2560, 10240),
                   (8192, 11008, 2048), (8192, 2048, 5504), (8192, 51200, 2048)]  # fmt: skip
GPU_ATTENTION_SHAPES = [(4, 16, 2048, 128), (2, 32, 2048, 80), (1, 32, 4096, 128)]
# Operands past a GPU's L2 cache (50 MB on an H100, 60 on an H200, 256 on an MI300X): 4x the largest.
GPU_STREAM_BYTES = 1 << 30
HEAP = 64 * 2**20  # warm heap for the compute primitives: more than their largest result (GEMM 16 MiB)
# Memory past the caches: STREAM's rule (McCalpin, www.cs.virginia.edu/stream/ref.html: each array
# at least 4x the size of the caches). Measured here (2026-11-27, result allocated once, 4 ranks on
# 2 cores): 4 MiB operands 48 GB/s a rank, 128 MiB 17.
LLC_GUESS = 32 * 2**20  # last-level cache where the OS does not say (bytes)
SMALL, LARGE = 8 * 2**10, 8 * 2**20  # collective sizes (the full tensor), bytes
# A blocking collective between compute phases (`busy_us`): timed at SMALL and at MID, the size of a
# small model's tp activation (gpt_tiny: 4 x 64 x 256 fp32), after a GEMM block of about BLOCK
# seconds, the time a small model computes between two tp collectives on a CPU rank.
MID = 256 * 2**10
BLOCK = 2e-3
ELEMENTWISE_TOKENS = 256  # tokens of the element-wise kinds timed (gpt_tiny's micro-batch of 4 x 64)
MIN_SECONDS = 0.25  # per timed loop
# The disk: bytes per node, split over its ranks (each writes its own file, as NvmeStore does), in
# blocks of DISK_BLOCK. A few hundred MB: a second or two on an SSD.
DISK_BYTES = 256 * 2**20
DISK_BLOCK = 8 * 2**20


def _agreed(comm: Any, value: float) -> float:
    """The median of every rank's `value` (collective: every rank gets the same)."""
    return statistics.median(comm.allgather(value))


def _timed(
    fn: Callable[[], Any], comm: Any, sync: Callable[[], None], rounds: int = 3, min_seconds: float = MIN_SECONDS
) -> float:
    """Seconds per call of `fn`: the median of `rounds` sustained loops, every rank looping at once.

    Each loop runs long enough (`min_seconds`, many scheduler time slices) for ranks that share
    cores to share them as they do in a run: a single short call would be timed whenever its
    rank happened to hold a core, and would report a core's rate instead of a rank's share."""
    return statistics.median(_round_times(fn, comm, sync, rounds, min_seconds))


def _round_times(
    fn: Callable[[], Any], comm: Any, sync: Callable[[], None], rounds: int = 3, min_seconds: float = MIN_SECONDS
) -> list[float]:
    """Seconds per call of `fn` in each of `rounds` sustained loops (`_timed`)."""
    from mpi4py import MPI

    fn()  # warm-up
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    once = time.perf_counter() - t0
    calls = int(comm.allreduce(max(1, math.ceil(min_seconds / max(once, 1e-7))), op=MPI.MAX))
    times = []
    for _ in range(rounds):
        comm.Barrier()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        times.append((time.perf_counter() - t0) / calls)
    return times


def op_overhead_seconds(chain: Callable[[], None], comm: Any, sync: Callable[[], None], repeat: int) -> float:
    """Host seconds per framework op of `chain` (whose arithmetic is nothing): its fastest round, not
    the median. The ops' own time is fixed; a slower round is a rank that waited for a core (another
    tenant's load once gave 1039 us an op, against 22 on a quiet machine)."""
    return min(_round_times(chain, comm, sync, repeat)) / count_aten_ops(chain)


def _module_chain(dev: Any) -> Callable[[], None]:
    """Forward and backward of 20 residual blocks of LayerNorm, Linear and GELU on tensors so small
    that their arithmetic is nothing: what is left is the host time of the framework's ops, as
    module-structured training code runs them (autograd recording included)."""
    import torch
    from torch import nn

    blocks = nn.ModuleList(
        nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8), nn.GELU(approximate="tanh")) for _ in range(20)
    ).to(dev)
    x0 = torch.randn(2, 4, 8, device=dev)

    def step() -> None:
        x = x0
        for block in blocks:
            x = x + block(x)
        x.sum().backward()

    return step


def count_aten_ops(fn: Callable[[], None]) -> int:
    """The aten operations `fn` runs (views included), as perf.OPS counts gridlm's."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            self.n += 1
            return func(*args, **(kwargs or {}))

    with Count() as count:
        fn()
    return count.n


def fit_ring(op: str, n: int, t_small: float, t_large: float, gloo: bool = True) -> tuple[float, float]:
    """(bus bandwidth bytes/s, per-step latency s) of the ring `op` over `n` ranks that takes the two
    measured times at SMALL and LARGE bytes, with the model's own terms (`perf.ring_terms`):
    t = a bytes / B + c latency. Gloo runs its ring at every size, as the model's CPU links do."""
    a, c = ring_terms(op, n, gloo)
    bandwidth = a * (LARGE - SMALL) / max(t_large - t_small, 1e-9)
    latency = max(t_small - a * SMALL / bandwidth, 0.0) / c
    return bandwidth, latency


def group_sizes(world: int) -> list[int]:
    """The group sizes timed: every divisor of the world from 2 (tp, pp and dp groups)."""
    return [g for g in range(2, world + 1) if world % g == 0]


def _collectives(
    runtime: Runtime, repeat: int, agreed: Callable[[float], float]
) -> tuple[dict[str, dict[int, dict[str, Any]]], dict[str, dict[int, dict[str, Any]]]]:
    """(inside a node, across nodes): every op of COLLECTIVE_OPS at SMALL and LARGE bytes, on the
    world split into groups of consecutive ranks, all groups at once (as a grid's tp or dp groups
    run); p2p between pairs (ping-pong, half of the round trip). Each fitted with the model's ring
    terms. A group whose ranks are on several nodes goes to the second table; across nodes, the
    groups of one rank per node (the ranks of equal local rank: every rank of a node uses the
    network at once, as a dp or pp axis over the nodes does) and the pairs between nodes are
    timed too."""
    world, placement = runtime.world_size, runtime.placement
    inside: dict[str, dict[int, dict[str, Any]]] = {op: {} for op in COLLECTIVE_OPS}
    across: dict[str, dict[int, dict[str, Any]]] = {op: {} for op in COLLECTIVE_OPS}
    timer = _GroupTimer(runtime, repeat, agreed)
    for g in group_sizes(world):
        groups = [list(range(i, i + g)) for i in range(0, world, g)]
        crosses = any(len({placement[r][0] for r in group}) > 1 for group in groups)
        for op, fit in timer.collectives(groups).items():
            (across if crosses else inside)[op][g] = fit
    if world >= 2 and world % 2 == 0:
        pairs = [[r, r + 1] for r in range(0, world, 2)]
        if all(placement[a][0] == placement[b][0] for a, b in pairs):
            inside["p2p"][2] = timer.p2p(pairs)
        else:
            across["p2p"][2] = timer.p2p(pairs)
    uniform = len(set(runtime.ranks_per_node_list)) == 1
    # With one rank a node the consecutive groups and pairs above already are these.
    if runtime.nodes > 1 and uniform and runtime.ranks_per_node > 1:
        # One rank per node: the ranks of each local rank, in node order.
        by_local = [sorted(r for r in range(world) if placement[r][1] == i) for i in range(runtime.ranks_per_node)]
        for op, fit in timer.collectives(by_local).items():
            across[op][runtime.nodes] = fit
        if runtime.nodes % 2 == 0:  # pairs of nodes, every rank of both at once
            across["p2p"][2] = timer.p2p([group[k : k + 2] for group in by_local for k in range(0, len(group), 2)])
    return inside, across


class _GroupTimer:
    """Times collectives on a partition of the world into groups (every rank in one), all groups
    at once; every rank makes every group (torch's new_group is collective)."""

    def __init__(self, runtime: Runtime, repeat: int, agreed: Callable[[float], float]) -> None:
        import torch

        self.runtime, self.repeat, self.agreed = runtime, repeat, agreed
        self.dev = runtime.device
        self.sync = torch.cuda.synchronize if self.dev.type == "cuda" else (lambda: None)
        self.gloo = self.dev.type != "cuda"
        self.block = _compute_block(self.dev, runtime.comm, self.sync)

    def _timed(self, fn: Callable[[], Any]) -> float:
        return _timed(fn, self.runtime.comm, self.sync, self.repeat)

    def busy(self, fn: Callable[[], Any]) -> float:
        """How much longer the blocking `fn` takes, call by call, right after a compute block than
        in a loop of its own: every group at once, so while its ranks compute, the other ranks of
        the node compute too, and a rank that reaches the call first waits for its peers to get a
        core and arrive (the median call, less `fn` alone; agreed over the ranks).

        The wait is charged to the step in full: a waiting rank's core goes to the node's other
        ranks, but in a training step those are tied to it by the pipeline's transfers and the
        step's collectives, so the work they do ahead is waited for later. (The loop's excess,
        block plus collective over the two alone, credits the core back in full; it is near zero
        for ranks in lockstep and left the tp grids 20-35% fast: docs/PERFORMANCE_MODEL.md,
        eleventh run.)"""
        calls: list[float] = []

        def both() -> None:
            self.block()
            t0 = time.perf_counter()
            fn()
            calls.append(time.perf_counter() - t0)

        self._timed(both)
        # A rank can wait no less than nothing: clamped before the median, so that a rank whose
        # loop alone was slowed by a neighbour (a few ms of negative wait) does not cancel a peer's
        # real wait in the median of two.
        return self.agreed(max(0.0, statistics.median(calls) - self._timed(fn)))

    def collectives(self, groups: list[list[int]]) -> dict[str, dict[str, Any]]:
        import torch
        import torch.distributed as dist

        made = [dist.new_group(group) for group in groups]
        rank = self.runtime.rank
        group = next(made[i] for i, members in enumerate(groups) if rank in members)
        g = len(groups[0])
        times: dict[str, list[float]] = {op: [] for op in COLLECTIVE_OPS if op != "p2p"}
        for nbytes in (SMALL, LARGE):
            full = torch.ones(nbytes // 4, device=self.dev)
            shard = torch.ones(nbytes // 4 // g, device=self.dev)
            for op in times:
                times[op].append(self.agreed(self._timed(partial(_call, op, full, shard, group))))
        out: dict[str, dict[str, Any]] = {}
        for op, (t_small, t_large) in times.items():
            out[op] = dict(zip(("bandwidth_bytes_s", "latency_s"), fit_ring(op, g, t_small, t_large, self.gloo)))
            out[op]["seconds"] = (t_small, t_large)
        if self.gloo:  # GPU ranks do not share cores: nothing to wait for
            for op in times:  # each op its own: gloo's gathers and scatters wait on more messages
                waits = []
                for nbytes in (SMALL, MID):
                    full, shard = (
                        torch.ones(nbytes // 4, device=self.dev),
                        torch.ones(nbytes // 4 // g, device=self.dev),
                    )
                    waits.append(self.busy(partial(_call, op, full, shard, group)))
                out[op]["busy_s"] = statistics.mean(waits)
        return out

    def p2p(self, pairs: list[list[int]]) -> dict[str, Any]:
        """Ping-pong between the ranks of each pair (all pairs at once): half the round trip."""
        import torch
        import torch.distributed as dist

        rank = self.runtime.rank
        a, b = next(pair for pair in pairs if rank in pair)
        peer, first = (b if rank == a else a), rank == a

        def round_trip(x: Any) -> None:
            for send in (first, not first):
                dist.send(x, peer) if send else dist.recv(x, peer)

        times = [
            self.agreed(self._timed(partial(round_trip, torch.ones(nbytes // 4, device=self.dev)))) / 2
            for nbytes in (SMALL, LARGE)
        ]
        fit: dict[str, Any] = dict(zip(("bandwidth_bytes_s", "latency_s"), fit_ring("p2p", 2, *times, self.gloo)))
        fit["seconds"] = tuple(times)
        if self.gloo:  # one block, then the round trip: two transfers
            fit["busy_s"] = self.busy(partial(round_trip, torch.ones(MID // 4, device=self.dev))) / 2
        return fit


def _call(op: str, full: Any, shard: Any, group: Any) -> None:
    """One collective `op` of COLLECTIVE_OPS (not p2p) over `group`: `full` the whole tensor, `shard`
    this rank's 1/n of it."""
    import torch.distributed as dist

    if op == "all_reduce":
        dist.all_reduce(full, group=group)
    elif op == "all_gather":
        dist.all_gather_single(full, shard, group=group)
    else:
        dist.reduce_scatter_single(shard, full, group=group)


def _compute_block(dev: Any, comm: Any, sync: Callable[[], None]) -> Callable[[], None]:
    """GEMMs of a small model's Linear (256 tokens, 256 x 384) repeated to about BLOCK seconds, the
    same count on every rank."""
    import torch
    from mpi4py import MPI

    x, w = torch.randn(256, 256, device=dev), torch.randn(256, 384, device=dev)
    once = _timed(lambda: x @ w, comm, sync, 1)
    count = int(comm.allreduce(max(1, round(BLOCK / max(once, 1e-9))), op=MPI.MAX))

    def block() -> None:
        for _ in range(count):
            x @ w

    return block


def _fault_rate(dev: Any, comm: Any, sync: Callable[[], None], repeat: int) -> Optional[float]:
    """Bytes/s at which a fresh result of the run's mmap threshold is page-faulted in (CPUs): a
    Linear of 256 tokens whose output is that size, timed first on this process's own heap, which
    nothing has grown (each output a new mapping, as a step's large results are) and then on a warm
    one (cut from its free top); the difference per byte of output. Call before anything warms the
    heap. None where the two do not differ (no threshold: results come from the heap). The
    difference is agreed over the ranks (their median), so that every rank returns None or none
    does: `measure` makes one more collective for the rate, and a rank that skipped it alone would
    leave its peers waiting in it."""
    import torch
    import torch.nn.functional as F

    from app.deck import RunConfig
    from app.runtime.mpi import warm_heap

    tokens, k = 256, 256
    n = max(1, RunConfig().malloc_mmap_threshold_kb * 1024 // (tokens * 4))
    x, w = torch.randn(tokens, k, device=dev), torch.randn(n, k, device=dev)

    def fn() -> None:
        F.linear(x, w)

    cold = _timed(fn, comm, sync, repeat)
    warm_heap(HEAP)
    warm = _timed(fn, comm, sync, repeat)
    gain = _agreed(comm, cold - warm)
    return tokens * n * 4 / gain if gain > 0 else None


def _elementwise(
    dev: Any, comm: Any, sync: Callable[[], None], repeat: int, op_seconds: float
) -> dict[str, tuple[float, float]]:
    """(bytes, seconds) of each ELEMENTWISE_KINDS kind, forward and backward, in the bytes the model
    counts for it (perf._layer_passes, perf._head_passes), at the token count of a small model's
    micro-batch (more on a GPU, where so few would time the launches). The host time of its
    framework ops is taken out of the seconds (the model charges that apart, op_overhead_us): they
    may come out at or below zero (`elementwise_rates`)."""
    import torch
    import torch.nn.functional as F

    tokens, h, f, vocab = ELEMENTWISE_TOKENS * (64 if dev.type == "cuda" else 1), 256, 1024, 512
    x = torch.randn(tokens, h, device=dev, requires_grad=True)
    w, b = torch.ones(h, device=dev, requires_grad=True), torch.zeros(h, device=dev, requires_grad=True)
    a = torch.randn(tokens, f, device=dev, requires_grad=True)
    logits = torch.randn(tokens, vocab, device=dev, requires_grad=True)
    targets = torch.randint(0, vocab, (tokens,), device=dev)
    dx, da = torch.randn(tokens, h, device=dev), torch.randn(tokens, f, device=dev)
    kinds = {  # kind: (forward + backward, bytes the model counts for both)
        "layernorm": (lambda: F.layer_norm(x, (h,), w, b).backward(dx), (1 + BACKWARD_BYTES) * 2 * tokens * h * 4),
        "gelu": (lambda: F.gelu(a, approximate="tanh").backward(da), (1 + BACKWARD_BYTES) * 2 * tokens * f * 4),
        "softmax": (lambda: F.cross_entropy(logits, targets).backward(), tokens * vocab * ((4 + 12) + (4 + 2 * 4))),
    }
    assert tuple(kinds) == ELEMENTWISE_KINDS
    timed = {}
    for kind, (fn, nbytes) in kinds.items():
        timed[kind] = (nbytes, _timed(fn, comm, sync, repeat) - count_aten_ops(fn) * op_seconds)
    return timed


def elementwise_rates(timed: dict[str, tuple[float, float]]) -> tuple[dict[str, float], list[str]]:
    """(bytes/s of each kind, the kinds dropped) from `_elementwise`'s (bytes, seconds less the host
    time), the seconds agreed over the ranks. A kind whose time is no more than its ops' host time
    has no rate to measure (it was 1.5e6 GB/s from a floor of 1 ns): it is dropped, and the model
    charges it as any element-wise op (hbm_gbs)."""
    rates = {kind: nbytes / seconds for kind, (nbytes, seconds) in timed.items() if seconds > 0}
    return rates, [kind for kind in timed if kind not in rates]


def measure(runtime: Runtime, repeat: int = 3, scratch: Optional[Path] = None) -> dict[str, Any]:
    """The primitives, each the median over ranks of each rank's median; the disk under `scratch`
    (default: the temp directory) as the node's, all its ranks at once."""
    import torch
    import torch.nn.functional as F

    from app.runtime.mpi import cool_heap, warm_heap

    load_before = load_average()
    comm = runtime.comm
    dev = runtime.device
    gpu = dev.type == "cuda"
    sync = torch.cuda.synchronize if gpu else (lambda: None)  # kernels are asynchronous
    # GPUs: the training shapes in bf16 (their datasheet peak is the reference); CPUs: fp32, small.
    dtype = torch.bfloat16 if gpu else torch.float32
    gemm_shapes, attention_shapes = (GPU_GEMM_SHAPES, GPU_ATTENTION_SHAPES) if gpu else (GEMM_SHAPES, ATTENTION_SHAPES)
    # A run's temporaries come from the heap its activations grew, not from fresh mmapped pages: the
    # compute primitives are timed on such a heap (without it, every result of 1 MiB or more paid its
    # page faults here and the element-wise rates came out 10x low; see warm_heap). The results a
    # step makes at or above the threshold do page-fault: their rate first, on the heap as it is.
    fault = _fault_rate(dev, comm, sync, repeat) if dev.type == "cpu" else None  # GPUs cache their memory
    warm_heap(HEAP)
    gemm = {}
    for m, n, k in gemm_shapes:
        # The three layouts of a Linear in training: forward x W^T, input gradient dY W, weight
        # gradient dY^T X.
        x, w, dy = (torch.randn(*shape, device=dev, dtype=dtype) for shape in ((m, k), (n, k), (m, n)))
        for layout, fn in (("fwd", lambda x=x, w=w: F.linear(x, w)), ("dgrad", lambda dy=dy, w=w: dy @ w),
                           ("wgrad", lambda dy=dy, x=x: dy.t() @ x)):  # fmt: skip
            gemm[f"{m}x{n}x{k} {layout}"] = 2.0 * m * n * k / _timed(fn, comm, sync, repeat)
    del x, w, dy  # the largest shape's operands would hold the warm heap: warm it again for each part
    warm_heap(HEAP)
    attention: dict[str, dict[str, float]] = {"forward": {}, "backward": {}}
    for b, heads, s, d in attention_shapes:
        q, k_, v = (torch.randn(b, heads, s, d, device=dev, dtype=dtype, requires_grad=True) for _ in range(3))
        grad = torch.randn(b, heads, s, d, device=dev, dtype=dtype)

        def forward(q=q, k_=k_, v=v) -> torch.Tensor:
            return F.scaled_dot_product_attention(q, k_, v, is_causal=True)

        def both(forward=forward, grad=grad) -> None:
            forward().backward(grad)

        # The FLOPs the model counts a causal flash kernel executing: forward half of 4 b s^2 h, the
        # backward 2.5 times the forward's.
        name, half = f"b{b} heads{heads} s{s} d{d}", 0.5 * 4.0 * b * s * s * heads * d
        t_forward = _timed(forward, comm, sync, repeat)
        attention["forward"][name] = half / t_forward
        # Backward as the difference of two timings: under another tenant's load it can come out near
        # zero (a machine file with an efficiency of 1e8); a backward recomputes the scores and runs
        # more matmuls than its forward, so it is never taken as shorter than the forward.
        t_backward = max(_timed(both, comm, sync, repeat) - t_forward, t_forward)
        attention["backward"][name] = 2.5 * half / t_backward
    del q, k_, v, grad
    warm_heap(HEAP)
    # Element-wise: an eager op reads its operands and writes a new tensor (as gridlm's LayerNorm,
    # GELU, adds and dropout do): allocating the result (from the warm heap) is part of its cost.
    # On a GPU past its L2 cache: the device's memory (hbm_gbs), there is no second rate.
    size = GPU_STREAM_BYTES if gpu else ELEMENTWISE
    x, y = torch.randn(size // 4, device=dev), torch.randn(size // 4, device=dev)
    stream = 3 * size / _timed(lambda x=x, y=y: torch.add(x, y), comm, sync, repeat)
    del x, y
    memory = None
    if not gpu:
        # Past the caches, STREAM's add into a result allocated once: a result of hundreds of MB would
        # be mmapped and faulted afresh by every call, which no run's update does (its temporaries are
        # a bucket's size, from the heap).
        big = memory_operand_bytes(runtime.local_size)
        a, b, c = (torch.randn(big // 4, device=dev) for _ in range(3))
        memory = 3 * big / _timed(lambda a=a, b=b, c=c: torch.add(a, b, out=c), comm, sync, repeat)
        del a, b, c  # hundreds of MB a rank
    agreed = partial(_agreed, comm)
    # Agreed before it is used: every rank then takes out the same host time, and drops the same kinds.
    op = agreed(op_overhead_seconds(_module_chain(dev), comm, sync, repeat))
    # A GPU's launches overlap its kernels (the host runs ahead): no host time to take out, none charged.
    timed = _elementwise(dev, comm, sync, repeat, 0.0 if gpu else op)
    elementwise, dropped = elementwise_rates({kind: (b, agreed(t)) for kind, (b, t) in timed.items()})

    cool_heap()

    collectives, network_collectives = _collectives(runtime, repeat, agreed)
    disk = _disk(runtime, scratch if scratch is not None else Path(tempfile.gettempdir()))
    return {
        **disk,
        "gemm_flops": {shape: agreed(v) for shape, v in gemm.items()},
        "attention_flops": {
            part: {shape: agreed(v) for shape, v in rates.items()} for part, rates in attention.items()
        },
        "stream_bytes_s": agreed(stream),
        **({} if memory is None else {"memory_bytes_s": agreed(memory)}),
        **({} if fault is None else {"fault_bytes_s": fault}),  # agreed by _fault_rate
        "elementwise_bytes_s": elementwise,
        **({"elementwise_dropped": dropped} if dropped else {}),
        "op_seconds": op,
        "collectives": collectives,
        "network_collectives": network_collectives,
        "nodes": runtime.nodes,
        "world": runtime.world_size,
        # This node's (every rank's is the same node's on one node; rank 0's is printed): the warning's.
        **({} if load_before is None else {"load": (load_before, load_average()), "cores": os.cpu_count()}),
        "ranks_per_node": runtime.local_size,
        "device": dev.type,
        **({"compute_units": torch.cuda.get_device_properties(dev).multi_processor_count} if gpu else {}),
    }


def load_average() -> Optional[float]:
    """The node's 1-minute load average, None where the OS does not give one."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def time_disk(path: Path, nbytes: int) -> tuple[float, float]:
    """(seconds to write `nbytes` to a new file at `path` and fsync it, seconds to read them back
    with pread once their pages are dropped from the page cache: posix_fadvise DONTNEED after the
    fsync, so that the reads come from the drive, as NvmeStore's do once its file outgrows the
    cache). The file is removed."""
    block = os.urandom(min(DISK_BLOCK, nbytes))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        t0 = time.perf_counter()
        done = 0
        while done < nbytes:
            done += os.pwrite(fd, block[: nbytes - done], done)
        os.fsync(fd)
        write = time.perf_counter() - t0
    finally:
        os.close(fd)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        buffer = bytearray(len(block))
        t0 = time.perf_counter()
        done = 0
        while done < nbytes:
            got = os.preadv(fd, [memoryview(buffer)[: nbytes - done]], done)
            if got <= 0:
                raise OSError(f"{path}: short read at byte {done}")
            done += got
        read = time.perf_counter() - t0
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)
    return write, read


def _disk(runtime: Runtime, directory: Path) -> dict[str, float]:
    """The node's disk under `directory`, every rank of the node at once on its own file: bytes/s
    per node written (with fsync) and read (from the drive), or nothing on a memory file system."""
    from mpi4py import MPI

    if filesystem_type(directory) in MEMORY_FILESYSTEMS:
        return {}
    comm = runtime.comm
    nbytes = DISK_BYTES // runtime.local_size
    comm.Barrier()
    write, read = time_disk(directory / f"gridlm-calibrate-disk-{os.getpid()}-{runtime.rank}", nbytes)
    slowest_write, slowest_read = comm.allreduce(write, op=MPI.MAX), comm.allreduce(read, op=MPI.MAX)
    node = nbytes * runtime.local_size
    return {"nvme_write_bytes_s": node / slowest_write, "nvme_read_bytes_s": node / slowest_read}


def last_level_cache_bytes() -> int:
    """The largest CPU cache Linux reports (sysfs), else LLC_GUESS."""
    sizes = []
    for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = path.read_text().strip().upper()
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    return max(sizes, default=LLC_GUESS)


def memory_operand_bytes(ranks_on_node: int) -> int:
    """Bytes of each operand of the memory rate's add: 4x the last-level cache (STREAM's rule,
    per array), at most a sixteenth of the node's memory per rank."""
    try:
        host = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        host = 2**40
    return max(ELEMENTWISE, min(4 * last_level_cache_bytes(), host // (16 * max(1, ranks_on_node))))


# The keys a calibration measures (or derives from what it measures). They are dropped from the base
# before this run's are written: a base that is itself a calibrated file would otherwise hand on the
# constants this run did not measure (a disk rate measured before where the scratch is now a tmpfs, a
# page-fault rate, collectives across nodes from a run on several nodes), under this run's source line.
MEASURED_KEYS = ("peak_tflops", "hbm_gbs", "memory_gbs", "fault_gbs", "nvme_read_gbs", "nvme_write_gbs", "gemm",
                 "op_overhead_us", "elementwise_gbs", "links", "collectives", "network_collectives")  # fmt: skip
DESCRIBED = "; primitives measured by app.plan.calibrate"  # appended to the base's description
SOURCE_WORDS = ("measured on ", "app.plan.calibrate")  # a calibration's source line starts and names these


def check_gpu_base(base: dict[str, Any], ranks_per_node: int) -> None:
    """A GPU calibration keeps the base's node (its devices, their memory, its links): a MachineError
    where this node runs more GPU ranks than the base's nodes hold devices."""
    devices = int(base["devices_per_node"])
    if ranks_per_node > devices:
        raise MachineError(
            f"calibrate: {ranks_per_node} GPU ranks on a node, but the base machine file {base.get('name')!r} has "
            f"devices_per_node = {devices}; give a --base whose nodes hold {ranks_per_node} GPUs, or run at most "
            f"{devices} rank(s) a node"
        )


def calibration_warnings(measured: dict[str, Any], out: dict[str, Any]) -> list[str]:
    """What makes a calibration's figures doubtful, one sentence each (printed, and in the file's source):
    element-wise kinds without a rate, a cache rate below the memory rate, a loaded machine."""
    warnings = []
    if measured.get("elementwise_dropped"):
        warnings.append(
            f"element-wise kinds {', '.join(measured['elementwise_dropped'])} not rated: their time was no more "
            "than their ops' host time (op_overhead_us), so the model charges them at hbm_gbs"
        )
    if out.get("memory_gbs") is not None and out["hbm_gbs"] < out["memory_gbs"]:
        warnings.append(
            f"hbm_gbs {out['hbm_gbs']} GB/s (operands the caches hold) is below memory_gbs {out['memory_gbs']} GB/s "
            "(operands past the caches): a rate was slowed by other load; calibrate again on a quiet machine"
        )
    before, after = measured.get("load") or (None, None)
    load = load_warning(before, after, measured.get("cores"), int(measured.get("ranks_per_node", 1)))
    if load:
        warnings.append(load)
    return warnings


def load_warning(before: Optional[float], after: Optional[float], cores: Optional[int], ranks: int) -> str:
    """A sentence where other processes loaded this node while it was measured: its load average
    before measuring, or after less this node's `ranks` (which were busy), above its `cores`; "" where
    not (or where the OS gives no load average)."""
    if before is None or not cores:
        return ""
    if max(before, (after or 0.0) - ranks) <= cores:
        return ""
    after_text = "" if after is None else f" and {after:.2f} after (this calibration's {ranks} rank(s) among them)"
    return (
        f"the load average was {before:.2f} before measuring{after_text}, above the {cores} cores: other processes "
        "shared them, so the rates are low and noisy; calibrate again on a quiet machine"
    )


def _level(name: str, devices: Optional[int], fit: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "devices": devices, "gbs": round(fit["bandwidth_bytes_s"] / 1e9, 4),
            "latency_us": round(fit["latency_s"] * 1e6, 3)}  # fmt: skip


def _levels(
    base: dict[str, Any],
    out: dict[str, Any],
    ranks: int,
    ar: Optional[dict[str, Any]],
    across: Optional[dict[str, Any]],
    gpu: bool,
) -> list[dict[str, Any]]:
    """The link levels written (empty: none, the defaults of intra_node_gbs and inter_node_gbs). `ar`:
    the all-reduce of one node's ranks measured here; `across`: that of one rank per node, every rank of
    a node at once, so each group's bus bandwidth is one device's share of the node's link (the network
    level's `gbs`); `ranks`: this run's ranks a node."""
    devices = int(out["devices_per_node"])
    if gpu:
        # The base's node stays: its sourced levels (NVLink, NVSwitch, xGMI; the collectives measured here
        # replace a level's figures for groups of their size, perf.group_link), or those of its
        # intra_node_gbs and inter_node_gbs; the node's all-reduce where this run used every GPU of it.
        sourced = [dict(level) for level in base.get("links") or []]
        if ar is None and across is None:
            return sourced
        levels = sourced or [
            {"name": "node", "devices": devices, "gbs": float(base["intra_node_gbs"]),
             "latency_us": NCCL_RING_LATENCY_US["node"]},
            {"name": "network", "devices": None, "gbs": float(base["inter_node_gbs"]) / devices,
             "latency_us": NCCL_RING_LATENCY_US["network"]},
        ]  # fmt: skip
        if ar is not None and not sourced and ranks == devices:
            levels[0] = _level("node", devices, ar)
        if across is not None:
            levels[-1] = _level(levels[-1]["name"], None, across)
        return levels
    levels = [] if ar is None else [_level("node", devices, ar)]
    if across is not None:
        return levels + [_level("network", None, across)]
    # One node only here: the network level is the base file's placeholder.
    return levels + [{"name": "network", "devices": None,
                      "gbs": float(base["inter_node_gbs"]) / int(base["devices_per_node"]),
                      "latency_us": levels[0]["latency_us"] if levels else 10.0}]  # fmt: skip


def machine_file(base: dict[str, Any], name: str, measured: dict[str, Any], command: str) -> dict[str, Any]:
    """The base machine file with this run's measured constants in place of every constant a
    calibration measures (MEASURED_KEYS: a calibrated base's own are dropped) and the base's sourced
    ones kept (pure; tests check it)."""
    gpu = measured.get("device") == "cuda"
    out = {key: value for key, value in base.items() if key not in MEASURED_KEYS}
    best = max(measured["gemm_flops"].values())
    today = datetime.date.today().isoformat()
    # The node level: the all-reduce of all the ranks of one node (the whole world on one node).
    ar = measured["collectives"]["all_reduce"].get(int(measured["ranks_per_node"]))
    out["name"] = name
    if gpu:
        # A GPU rank has its own device: the base's node stays (its devices, their memory, its links),
        # whether this run used one GPU of it or all.
        check_gpu_base(base, int(measured["ranks_per_node"]))
    else:
        # The ranks measured share this node: that many devices per node, each with its share of memory.
        out["devices_per_node"] = int(measured["ranks_per_node"])
        out["memory_per_device_gib"] = round(
            base["memory_per_device_gib"] * base["devices_per_node"] / out["devices_per_node"], 2
        )
    out["description"] = str(base["description"]).removesuffix(DESCRIBED) + DESCRIBED
    # GPUs: bf16 GEMMs against the datasheet's peak (app/metrics/peaks.py by the base's device_name,
    # the one MFU uses); where the table lacks the device, the best rate measured is its bf16 peak.
    # CPUs: the best measured fp32 GEMM rate is the peak (MFU against it).
    datasheet = peak_tflops(str(base.get("device_name", "")), "bf16") if gpu else None
    if gpu and datasheet is None:
        out["peak_tflops"] = {"bf16": round(best / 1e12, 3)}
    elif not gpu:
        out["peak_tflops"] = {"fp32": round(best / 1e12, 6)}
    reference = datasheet * 1e12 if datasheet is not None else best
    out["hbm_gbs"] = round(measured["stream_bytes_s"] / 1e9, 3)
    if "memory_bytes_s" in measured:  # past the caches (STREAM-sized operands)
        out["memory_gbs"] = round(measured["memory_bytes_s"] / 1e9, 3)
    if measured.get("fault_bytes_s"):  # CPUs: a fresh mmapped result's pages
        out["fault_gbs"] = round(measured["fault_bytes_s"] / 1e9, 3)
    disk = ""
    if "nvme_read_bytes_s" in measured:  # the node's disk (optim.offload: nvme)
        out["nvme_read_gbs"] = round(measured["nvme_read_bytes_s"] / 1e9, 3)
        out["nvme_write_gbs"] = round(measured["nvme_write_bytes_s"] / 1e9, 3)
        disk = (
            f"; disk (the temp directory's, every rank of the node at once, {DISK_BYTES // 2**20} MiB a node): "
            f"written with fsync {out['nvme_write_gbs']} GB/s, read with pread after POSIX_FADV_DONTNEED "
            f"{out['nvme_read_gbs']} GB/s per node"
        )
    # The model applies one efficiency to every GEMM: the median shape and layout's share of the peak.
    # No waves on a CPU (one compute unit, tiles of one element); a GPU's SMs, the base's tile.
    base_gemm = base.get("gemm") or {}
    out["gemm"] = {
        "efficiency": round(statistics.median(measured["gemm_flops"].values()) / reference, 4),
        "compute_units": int(measured["compute_units"]) if gpu else 1,
        "tile": list(base_gemm.get("tile", [256, 128])) if gpu else [1, 1],
    }
    for key, part in (("attention_efficiency", "forward"), ("attention_backward_efficiency", "backward")):
        out["gemm"][key] = round(statistics.median(measured["attention_flops"][part].values()) / reference, 4)
    if not gpu:  # a GPU's launches overlap its kernels: no host time per op
        out["op_overhead_us"] = round(measured["op_seconds"] * 1e6, 3)
    slower = {k: v for k, v in measured["elementwise_bytes_s"].items() if v < measured["stream_bytes_s"]}
    if slower:  # the kinds a memory stream would under-charge (compute-bound on CPUs)
        out["elementwise_gbs"] = {k: round(v / 1e9, 3) for k, v in slower.items()}
    network = measured.get("network_collectives") or {}
    nodes = int(measured.get("nodes", 1))
    across = (network.get("all_reduce") or {}).get(nodes)
    links = _levels(base, out, int(measured["ranks_per_node"]), ar, across, gpu)
    if links:
        out["links"] = links

    def table(by_op: dict[str, dict[int, dict[str, Any]]]) -> dict[str, dict[int, dict[str, float]]]:
        return {
            op: {g: {"gbs": round(fit["bandwidth_bytes_s"] / 1e9, 4), "latency_us": round(fit["latency_s"] * 1e6, 3),
                     **({"busy_us": round(fit["busy_s"] * 1e6, 3)} if "busy_s" in fit else {})}
                 for g, fit in sizes.items()}
            for op, sizes in by_op.items() if sizes
        }  # fmt: skip

    # Every op and group size, for the groups of that size (perf.group_link): inside a node, and
    # (measured on several nodes) across nodes.
    if any(measured["collectives"].values()):  # none on one rank
        out["collectives"] = table(measured["collectives"])
    if any(network.values()):
        out["network_collectives"] = table(network)

    def timings(by_op: dict[str, dict[int, dict[str, Any]]]) -> str:
        return "; ".join(
            f"{op} " + ", ".join(f"{g} ranks {fit['seconds'][0] * 1e3:.3f} / {fit['seconds'][1] * 1e3:.3f} ms"
                                 + (f" (+{fit['busy_s'] * 1e3:.3f} ms a call after a {BLOCK * 1e3:.0f} ms compute block)"
                                    if "busy_s" in fit else "")
                                 for g, fit in sizes.items())
            for op, sizes in by_op.items() if sizes
        )  # fmt: skip

    timed = timings(measured["collectives"])
    if any(network.values()):
        timed += f"; across {nodes} nodes: {timings(network)}"
    kinds = ", ".join(f"{k} {v / 1e9:.2f}" for k, v in measured["elementwise_bytes_s"].items())
    shapes = ", ".join(f"{s} {v / 1e9:.1f}" for s, v in measured["gemm_flops"].items())
    attention = "; ".join(f"{part} " + ", ".join(f"{s} {v / 1e9:.1f}" for s, v in rates.items())
                          for part, rates in measured["attention_flops"].items())  # fmt: skip
    out["sources"] = [
        f"measured on {today} by `{command}`, every rank at once: {'bf16' if gpu else 'fp32'} GEMM GFLOP/s per "
        f"rank {shapes}{f' (against the datasheet peak {datasheet} TFLOP/s)' if datasheet else ''}; "
        f"causal attention GFLOP/s {attention}; element-wise op "
        f"{measured['stream_bytes_s'] / 1e9:.2f} GB/s; element-wise kinds GB/s (model bytes) {kinds}; "
        + (f"a fresh mmapped result's page faults {out['fault_gbs']} GB/s; " if "fault_gbs" in out else "")
        + f"{measured['op_seconds'] * 1e6:.1f} us per framework op; collectives of {SMALL} / {LARGE} bytes on "
        f"groups of consecutive ranks side by side ({timed}; a ring's latency and bandwidth follow){disk}"
        + "".join(f"; warning: {w}" for w in calibration_warnings(measured, out)),
        # The base's sources, less a calibration's line: its figures are not in this file.
        *[line for line in base.get("sources", []) if not _calibration_source(line)],
    ]
    return out


def _calibration_source(line: Any) -> bool:
    """Whether a source line is one a calibration wrote (`machine_file`)."""
    return isinstance(line, str) and line.startswith(SOURCE_WORDS[0]) and SOURCE_WORDS[1] in line


def _read_base(path: Path) -> dict[str, Any]:
    return read_yaml_file(path, "machine file", lambda message: MachineError(f"machine file {path}: {message}"),
                          "inputs/machines/local.yaml")  # fmt: skip


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m app.plan.calibrate", description=__doc__.split("\n")[0])
    parser.add_argument("--base", default="local", help="machine file the result is based on (default: local)")
    parser.add_argument("--out", default=None, help="output file (default: inputs/machines/<base>_calibrated.yaml)")
    parser.add_argument(
        "--repeat", type=int, default=3, help="timed loops per primitive, the median reported (default 3)"
    )
    parser.add_argument(
        "--scratch", default=None, help="directory on the disk whose rates to measure (default: the temp directory)"
    )
    args = parser.parse_args(argv)
    from app.deck import RunConfig
    from app.errors import GridlmError
    from app.plan.machine import MACHINES_DIR, load_machine, machine_path
    from app.runtime.mpi import (
        abort,
        bind_device,
        init_mpi,
        init_torch_distributed,
        node_summary,
        on_root,
        set_malloc_mmap_threshold,
        set_threads,
    )

    runtime = init_mpi()
    base_path = machine_path(args.base)
    out = Path(args.out or MACHINES_DIR / f"{base_path.stem}_calibrated.yaml")

    def check_paths() -> None:
        """Before minutes of measuring: the base machine file is valid, the output writable, --repeat
        and --scratch usable."""
        load_machine(args.base)
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise GridlmError(f"calibrate: cannot make {out.parent} ({err.strerror}); give a writable --out") from None
        if not os.access(out if out.exists() else out.parent, os.W_OK) or out.is_dir():
            raise GridlmError(f"calibrate: cannot write {out}; give a writable --out file")
        if args.repeat < 1:  # a median of no loops would end the run after its measuring
            raise GridlmError(f"calibrate: --repeat must be at least 1, not {args.repeat}")
        scratch = Path(args.scratch) if args.scratch is not None else None
        if scratch is not None and not (scratch.is_dir() and os.access(scratch, os.W_OK)):
            why = "is not a directory" if scratch.exists() else "does not exist"
            raise GridlmError(
                f"calibrate: --scratch {scratch} {why}; give a writable directory on the disk whose rates to measure"
            )

    try:
        on_root(runtime, check_paths)  # one rank looks at the file system
    except GridlmError as err:
        if runtime.is_root:
            print(f"gridlm: {err}", file=sys.stderr, flush=True)
        return err.exit_code
    bind_device(runtime, "auto")
    if runtime.device.type == "cuda":  # a GPU calibration keeps the base's node: it must hold these ranks
        try:
            on_root(runtime, lambda: check_gpu_base(_read_base(base_path), runtime.local_size))
        except GridlmError as err:
            if runtime.is_root:
                print(f"gridlm: {err}", file=sys.stderr, flush=True)
            return err.exit_code
    warning = load_warning(load_average(), None, os.cpu_count(), runtime.local_size)
    if warning and runtime.is_root:  # at once, not only in the file minutes later
        print(f"calibrate: warning: {warning}", file=sys.stderr, flush=True)
    set_threads(runtime, None)
    set_malloc_mmap_threshold(RunConfig().malloc_mmap_threshold_kb)  # the allocator a run has
    init_torch_distributed(runtime)
    try:
        measured = measure(runtime, args.repeat, None if args.scratch is None else Path(args.scratch))
    except BaseException:  # a bug on one rank: end them all, none left waiting in a collective
        print(f"calibrate: rank {runtime.rank}: internal error, aborting the job", file=sys.stderr)
        traceback.print_exc()
        abort(runtime, 1)
    if runtime.is_root:
        base = _read_base(base_path)
        command = f"mpirun -n {runtime.world_size} python -m app.plan.calibrate --base {args.base}"
        if runtime.nodes > 1:
            command += f" on {runtime.nodes} nodes: {node_summary(runtime)}"
        try:
            data = machine_file(base, out.stem, measured, command)
        except GridlmError as err:  # a node with more GPU ranks than rank 0's (checked there before measuring)
            print(f"gridlm: {err}", file=sys.stderr, flush=True)
            return err.exit_code
        header = f"# Written by app.plan.calibrate ({command}); primitives only, see its docstring.\n"
        out.write_text(header + dump_yaml(data, sort_keys=False, width=120))
        best = max(measured["gemm_flops"].values())
        print(f"calibrate: wrote {out}: GEMM up to {best / 1e9:.1f} GFLOP/s per rank (efficiency "
              f"{data['gemm']['efficiency']}), {data['hbm_gbs']} GB/s, {data.get('op_overhead_us', 0)} us per op, "
              f"links {data.get('links', 'of intra_node_gbs and inter_node_gbs')}", flush=True)  # fmt: skip
        for warning in calibration_warnings(measured, data):  # also in the file's source line
            print(f"calibrate: warning: {warning}", file=sys.stderr, flush=True)
    import torch.distributed as dist

    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from app.runtime.process import exit_now

    exit_now(main())

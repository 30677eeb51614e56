"""The offloaded update's traffic between the device and the host (`optim.offload`), overlapped.

Gradients. The host keeps a copy of this rank's reduced gradient shards (in the reduce dtype:
`train.grad_reduce_dtype`), pinned when CUDA is present. A bucket's shard leaves the device as
soon as backward has finished it: `DataParallel` tells this object (`ready`) when it launches the
bucket's reduction, and the copy is queued on a stream of its own behind that reduction (CUDA:
the stream waits for the collective, the host does not), or, on CPU ranks, made as soon as the
reduction has completed (polled at every later `ready`). Buckets that other sums still change
after the dp reduction (sequence-parallel norms summed over tp, the tied embedding over the
pipeline) and ZeRO-2/3's shards (reduced once per micro-batch) cross at `final`, when
`finish_grad_reduce` is done. So by the time the norm is known, most gradients are on the host.

Parameters. The update writes each chunk's fp32 master, cast to the compute dtype, into one of
two pinned buffers and copies it to the device shard on another stream (`param`): the copy of
chunk i runs while chunk i + 1 is updated, and a buffer is reused only once its copy is done.

The delayed update (`optim.offload_delay: 1`) runs on a host thread while the next step's forward
and backward run: its gradients are the set the last backward filled (two sets, alternating:
`take`), and it writes its parameters into a whole-shard staging buffer (`stage`), which the
optimizer publishes at the end of the next step (`publish_staged`).

On CPU ranks the device is the host: the same pipeline, the copies plain host copies.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from app.optim.offload import host_views, pin_exactly
from app.parallel.data import DataParallel


class HostTransfer:
    """Host copies of the gradients (`sets` of them) and the way of the parameters back (module
    docstring). Attach it to `dp` before the first backward (`dp.attach_sink`)."""

    def __init__(self, dp: DataParallel, max_chunk: int, sets: int = 1, staging: bool = False) -> None:
        self.dp = dp
        self.cuda = dp.device.type == "cuda"
        if self.cuda:
            pin_exactly()  # the gradient copies, parameter and staging buffers are pinned
        sizes = [b.shard_hi - b.shard_lo for b in dp.buckets]
        grad_dtype = dp.reduce_dtype
        param_dtype = dp.param_shard(0).dtype if dp.buckets else torch.float32
        self.host_grads = [host_views(sizes, grad_dtype, self.cuda) for _ in range(sets)]
        self.filling = 0  # the set this step's backward ships into
        self.shipped = [False] * len(sizes)
        self.waiting: list[tuple[int, Any]] = []  # CPU ranks: (bucket, reduction in flight)
        self.events: list[list[Optional[torch.cuda.Event]]] = [[None] * len(sizes) for _ in range(sets)]
        self.grad32 = torch.empty(max_chunk if grad_dtype != torch.float32 else 0, dtype=torch.float32)
        self.d2h = torch.cuda.Stream(dp.device) if self.cuda else None
        self.h2d = torch.cuda.Stream(dp.device) if self.cuda else None
        # Two buffers: chunk i's parameters cross from one while chunk i + 1 fills the other.
        self.param_bufs = host_views([max_chunk] * 2, param_dtype, True) if self.cuda else []
        self.param_sent: list[Optional[torch.cuda.Event]] = [None, None]
        self.chunks_sent = 0
        self.staging = host_views(sizes, param_dtype, self.cuda) if staging else []
        self.staged_sent: Optional[torch.cuda.Event] = None
        self.early = 0  # buckets shipped before `final` this step (tests/test_delayed_update.py reads it)

    def host_bytes(self) -> int:
        """Host memory these buffers hold."""
        tensors = [g for s in self.host_grads for g in s] + self.param_bufs + self.staging + [self.grad32]
        return sum(t.numel() * t.element_size() for t in tensors)

    # ---- gradients (DataParallel calls these: its `GradSink`) ---------------------------

    def begin(self) -> None:
        """A new step: the device's gradient buffers are about to be zeroed, so every copy out of
        them must be done first."""
        if self.cuda:
            assert self.d2h is not None
            torch.cuda.current_stream(self.dp.device).wait_stream(self.d2h)
        self.shipped = [False] * len(self.shipped)
        self.waiting.clear()
        self.early = 0

    def ready(self, k: int, work: Any) -> None:
        """Bucket k's reduction was launched (`work`; None: nothing to reduce) and nothing else
        changes its gradient this step: copy it out once the reduction is done."""
        if self.cuda:
            self._ship(k, work, early=True)
        else:
            self.waiting.append((k, work))
            self._poll()

    def final(self) -> None:
        """Every reduction and sum is done (`finish_grad_reduce`): ship what is left."""
        for k, sent in enumerate(self.shipped):
            if not sent:
                self._ship(k, None, early=False)
        self.waiting.clear()

    def _poll(self) -> None:
        still = []
        for k, work in self.waiting:
            if work is None or work.is_completed():
                self._ship(k, None, early=True)
            else:
                still.append((k, work))
        self.waiting = still

    def _ship(self, k: int, work: Any, early: bool) -> None:
        src, dst = self.dp.grads(k), self.host_grads[self.filling][k]
        self.shipped[k] = True
        self.early += early
        if not self.cuda:
            dst.copy_(src)
            return
        assert self.d2h is not None
        # Taken before the stream context, inside which the current stream is d2h itself (found in
        # review: d2h waited for itself, and the copy raced the kernels writing the gradients).
        compute = torch.cuda.current_stream(self.dp.device)
        with torch.cuda.stream(self.d2h):
            if work is not None:
                work.wait()  # NCCL: this stream waits for the reduction; the host goes on
            else:
                self.d2h.wait_stream(compute)  # the gradients' last writes (dp 1, the late buckets' sums)
            dst.copy_(src, non_blocking=True)
            event = self.events[self.filling][k] = torch.cuda.Event()
            event.record(self.d2h)

    def take(self) -> int:
        """The set this step's backward filled, for its update; the next backward fills the other
        one (two sets: the delayed update reads one while the next backward writes the other)."""
        filled = self.filling
        self.filling = (filled + 1) % len(self.host_grads)
        return filled

    def grad(self, s: int, b: int, lo: int, hi: int) -> torch.Tensor:
        """Elements [lo, hi) of bucket b's host gradient from set s, in fp32, once it has arrived (the
        fused update unscales it in place: a copy the device no longer needs)."""
        event = self.events[s][b]
        if event is not None:
            event.synchronize()
        g = self.host_grads[s][b][lo:hi]
        return g if g.dtype == torch.float32 else self.grad32[: hi - lo].copy_(g)

    # ---- parameters ----------------------------------------------------------------------

    def param(self, b: int, lo: int, master: torch.Tensor) -> None:
        """Send the updated fp32 `master` range to elements lo.. of bucket b's device shard."""
        dst = self.dp.param_shard(b)[lo : lo + master.numel()]
        if not self.cuda:
            dst.copy_(master)
            return
        assert self.h2d is not None
        i = self.chunks_sent % 2
        self.chunks_sent += 1
        sent = self.param_sent[i]
        if sent is not None:
            sent.synchronize()  # this buffer's last copy has left it
        else:  # the first chunk: nothing on the device may still read the parameters
            self.h2d.wait_stream(torch.cuda.current_stream(self.dp.device))
        low = self.param_bufs[i][: master.numel()].copy_(master)
        with torch.cuda.stream(self.h2d):
            dst.copy_(low, non_blocking=True)
            event = self.param_sent[i] = torch.cuda.Event()
            event.record(self.h2d)

    def params_done(self) -> None:
        """After the last `param`: the device's stream waits for the copies (the all-gathers follow)."""
        if self.cuda:
            assert self.h2d is not None
            torch.cuda.current_stream(self.dp.device).wait_stream(self.h2d)
            self.param_sent = [None, None]
            self.chunks_sent = 0

    def stage(self, b: int, lo: int, master: torch.Tensor) -> None:
        """The delayed update: write the updated fp32 `master` range, in the compute dtype, into the
        staging buffer (the device still trains on the published parameters)."""
        if self.staged_sent is not None:
            self.staged_sent.synchronize()  # the last publication has left the buffer
            self.staged_sent = None
        self.staging[b][lo : lo + master.numel()].copy_(master)

    def publish_staged(self) -> None:
        """Copy the staged parameters to the device shards (on the device's stream: the next
        forward runs after them)."""
        for b, values in enumerate(self.staging):
            self.dp.param_shard(b).copy_(values, non_blocking=self.cuda)
        if self.cuda:
            self.staged_sent = torch.cuda.Event()
            self.staged_sent.record(torch.cuda.current_stream(self.dp.device))

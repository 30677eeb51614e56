"""AdamW on host (CPU) tensors at memory bandwidth: torch's fused CPU kernel with every element
through its vector body, so that an element's update does not depend on where it sits.

`torch._fused_adamw_` on CPU tensors is one vectorised, multi-threaded pass over the master, the
gradient and both moments (measured on this project's 2-core test machine: 1.5x the bytes per
second of a STREAM triad, where the eager passes of `ShardedOptimizer._update` reach 0.45x). Its
kernel runs the last (n mod vector width) elements of each tensor it is given in scalar code,
which rounds differently from its vector body (measured: 6 of 1,000 second moments 1 ulp apart
between one tensor and the same elements cut into three views). The same element could thus get
another value when the views are cut elsewhere: with the NVMe store's chunks of another size, or
on another grid. `HostAdamW` therefore hands the kernel only views whose lengths are multiples of
`ALIGN` elements (a multiple of every CPU's fp32 vector width, and of the kernel's 64-byte
thread split) and gathers the tails of all views into one zero-padded buffer that goes through
the vector body too; zeros stay zero under the update (no gradient, no moment, no parameter).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from app.deck import OptimConfig
from app.optim.multi_tensor import complement, fused_adamw

# fp32 elements: a multiple of the vector width (4 NEON, 8 AVX2, 16 AVX-512) and of the 16-element
# (64-byte) units the kernel splits between threads.
ALIGN = 64
Ranges = Sequence[tuple[int, int]]


class _Part:
    """One weight-decay class of a `HostAdamW`: the aligned bodies of its runs (views of master,
    exp_avg and exp_avg_sq; the gradient's are cut each step) and their tails' indices with the
    padded buffer (rows: master, gradient, exp_avg, exp_avg_sq)."""

    def __init__(self, tensors: Sequence[torch.Tensor], runs: Ranges) -> None:
        self.bodies: list[tuple[int, int]] = []
        tails: list[torch.Tensor] = []
        for lo, hi in runs:
            body = lo + (hi - lo) // ALIGN * ALIGN
            if body > lo:
                self.bodies.append((lo, body))
            if hi > body:
                tails.append(torch.arange(body, hi, dtype=torch.long))
        self.index = torch.cat(tails) if tails else None
        n = 0 if self.index is None else self.index.numel()
        self.pad = torch.zeros(4, -(-n // ALIGN) * ALIGN, dtype=torch.float32)
        self.state = [[t[lo:hi] for lo, hi in self.bodies] + ([row] if n else []) for t, row in
                      zip(tensors, (self.pad[0], self.pad[2], self.pad[3]))]  # fmt: skip

    def grads(self, grad: torch.Tensor) -> list[torch.Tensor]:
        return [grad[lo:hi] for lo, hi in self.bodies] + ([self.pad[1]] if self.index is not None else [])


class HostAdamW:
    """AdamW over flat fp32 CPU tensors of one length (master, exp_avg, exp_avg_sq; the gradient
    given each step), weight decay on `decay_runs` (sorted, disjoint element ranges) and none
    elsewhere. Built once per set of tensors and kept: their views and the tails' index are reused."""

    def __init__(self, tensors: Sequence[torch.Tensor], decay_runs: Ranges) -> None:
        assert len(tensors) == 3 and all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)
        self.tensors = list(tensors)
        n = tensors[0].numel()
        self.parts = [(_Part(tensors, decay_runs), True), (_Part(tensors, complement(decay_runs, n)), False)]

    def step(
        self, cfg: OptimConfig, lr: float, step: torch.Tensor, grad: torch.Tensor, unscale: torch.Tensor | None = None
    ) -> None:
        """One update with the fp32 CPU gradient `grad`; `step` the update's count (a CPU float
        tensor), `unscale` 1 / the gradient's scale (the kernel divides the gradient by it and
        writes it back so)."""
        assert grad.device.type == "cpu" and grad.dtype == torch.float32 and grad.numel() == self.tensors[0].numel()
        p, m, v = self.tensors
        for part, decayed in self.parts:
            if part.index is not None:
                k = part.index.numel()
                for row, t in zip(part.pad, (p, grad, m, v)):
                    torch.index_select(t, 0, part.index, out=row[:k])
            params, exp_avgs, exp_avg_sqs = part.state
            if params:
                lists = (params, part.grads(grad), exp_avgs, exp_avg_sqs)
                fused_adamw(lists, step, cfg, lr, cfg.weight_decay if decayed else 0.0, unscale)
            if part.index is not None:
                k = part.index.numel()
                for row, t in ((part.pad[0], p), (part.pad[2], m), (part.pad[3], v)):
                    t.index_copy_(0, part.index, row[:k])

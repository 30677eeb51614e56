"""Data parallelism: average gradients over the dp group.

A first, correct version: all gradients are packed into one flat buffer per dtype and
all-reduced once after the last micro-batch (bucketing and overlap with backward come
later). Each dp rank computes gradients of the mean loss over its own micro-batches;
averaging over dp gives the gradient of the mean over the whole global batch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from app.runtime.grid import ProcessGrid


@torch.no_grad()
def allreduce_gradients(model: nn.Module, grid: ProcessGrid) -> None:
    """grad <- mean over dp ranks of grad, for every parameter of `model`."""
    dp = grid.size("dp")
    if dp == 1:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)  # every rank must contribute the same buffer layout
        by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    for grads in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        flat.div_(dp)  # divide first: the sum of averages cannot overflow in low precision
        dist.all_reduce(flat, group=grid.group["dp"])
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

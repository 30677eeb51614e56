"""Data parallelism: average gradients over the dp group.

A first, correct version: all gradients are packed into one flat buffer per dtype and
all-reduced once after the last micro-batch (bucketing and overlap with backward come
later). Each dp rank computes gradients of the mean loss over its own micro-batches;
averaging over dp gives the gradient of the mean over the whole global batch.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from app.metrics.timers import CommTimers, comm_region
from app.runtime.grid import ProcessGrid


def filled_grads(params: list[torch.Tensor]) -> list[torch.Tensor]:
    """The gradients of `params`, a missing one zero-filled: every rank of a reduction must
    contribute the same buffer layout, whether or not a parameter took part in its backward."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    return [p.grad for p in params]


@torch.no_grad()
def allreduce_flat(
    tensors: list[torch.Tensor], group: Any, timers: Optional[CommTimers], axis: str, divide: int = 1
) -> None:
    """In place: each tensor <- (sum over `group` of it) / divide, packed into one buffer per dtype."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for same in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in same])
        if divide != 1:
            flat.div_(divide)  # divide first: the sum of averages cannot overflow in low precision
        with comm_region(timers, axis):
            dist.all_reduce(flat, group=group)
        offset = 0
        for t in same:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()


@torch.no_grad()
def allreduce_gradients(model: nn.Module, grid: ProcessGrid, timers: Optional[CommTimers] = None) -> None:
    """grad <- mean over dp ranks of grad, for every parameter of `model`."""
    dp = grid.size("dp")
    if dp == 1:
        return
    allreduce_flat(filled_grads(list(model.parameters())), grid.group["dp"], timers, "dp", divide=dp)

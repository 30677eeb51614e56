"""Tensor parallelism at the gradient level: what `ParamMeta.sequence_parallel` implies.

Under sequence parallelism the LayerNorm weights, the row-parallel biases and the position
embedding act on a sequence shard, so each tp rank holds a partial gradient; their sum
over tp is the gradient of the 1-rank model (Korthikanti et al. 2022). Everything else
that is replicated over tp already has identical gradients on every tp rank.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from app.metrics.timers import CommTimers
from app.parallel.data import allreduce_flat, filled_grads
from app.runtime.grid import ProcessGrid


@torch.no_grad()
def allreduce_sequence_parallel_gradients(
    model: nn.Module, grid: ProcessGrid, timers: Optional[CommTimers] = None
) -> None:
    """grad <- sum over tp of grad, for the parameters tagged sequence_parallel."""
    params = [p for p in model.parameters() if p.meta.sequence_parallel]
    if grid.size("tp") == 1 or not params:
        return
    allreduce_flat(filled_grads(params), grid.group["tp"], timers, "tp")

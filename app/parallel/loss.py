"""The global-batch mean loss from each rank's partial sum: one home for training's logged loss
and evaluation's (app/eval), so both are the 1-rank value on every grid."""

from __future__ import annotations

from typing import Optional

import torch

from app.runtime.grid import ProcessGrid
from app.tensor_parallel.mappings import TensorParallel
from app.tensor_parallel.tensor3d import Tensor3D


def global_loss(loss_sum: torch.Tensor, grid: ProcessGrid, tp: Optional[Tensor3D | TensorParallel] = None) -> float:
    """The global-batch mean loss: held by the last stage (summed over pp), averaged over dp (and
    under 3D tensor parallelism over Z, which splits the batch too, and over cp, whose ranks hold
    equally many positions of each sequence)."""
    value = loss_sum.detach().clone()
    grid.all_reduce(value, ("pp", "dp", "cp"))
    if isinstance(tp, Tensor3D) and tp.z.size > 1:
        value = tp.z.all_reduce(value) / tp.z.size
    with grid.watchdog.blocking("device sync (the loss's all-reduce)"):  # on NCCL the host waits here
        total = float(value)
    return total / (grid.size("dp") * grid.size("cp"))

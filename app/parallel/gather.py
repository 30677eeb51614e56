"""Assemble the full (1-rank) parameters of a model sharded over the grid, on one rank.

For the equivalence tests (any grid = one rank) on small models: every tensor travels
through MPI to rank 0 of the grid. Each logical tensor is contributed once: by dp rank 0
(experts split over ep: their slices by dp ranks 0 .. ep-1), by tp rank 0 when it is
replicated over tp, and never from the tied head copy (`ParamMeta.tied`).
Checkpoints (and export, which reads them) write and read hyperslabs in parallel instead.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch
from torch import nn

from app.runtime.grid import ProcessGrid


def owned_shards(model: nn.Module, grid: ProcessGrid) -> dict[str, tuple[tuple[int, ...], tuple[int, ...], np.ndarray]]:
    """name -> (global shape, offset, values) of the shards this rank contributes."""
    shards = {}
    for name, p in model.named_parameters():
        meta = p.meta
        # Experts split over ep: the first ep dp ranks hold them all (one expert-data place each).
        replicas = meta.global_shape[0] // meta.local_shape[0] if "ep" in meta.split else 1
        if grid.replicas.rank >= replicas or not meta.owned_by(grid.coords["tp"]):
            continue
        offset = meta.offset or (0,) * p.dim()
        shards[name] = (
            meta.global_shape,
            offset,
            p.detach().float().cpu().clone().numpy(),
        )  # numpy has no bf16; a copy leaves ZeRO-3's buffer free
    return shards


def gather_parameters(model: nn.Module, grid: ProcessGrid, comm: object) -> Optional[dict[str, torch.Tensor]]:
    """On rank 0 of `comm` (the grid's communicator): name -> full tensor; None elsewhere."""
    parts = comm.gather(owned_shards(model, grid), root=0)  # type: ignore[attr-defined]
    if parts is None:
        return None
    full: dict[str, np.ndarray] = {}
    filled: dict[str, int] = {}
    for shards in parts:
        for name, (shape, offset, values) in shards.items():
            target = full.setdefault(name, np.zeros(shape, dtype=values.dtype))
            target[tuple(slice(o, o + n) for o, n in zip(offset, values.shape))] = values
            filled[name] = filled.get(name, 0) + values.size
    incomplete = [name for name, target in full.items() if filled[name] != target.size]
    if incomplete:
        raise RuntimeError(f"shards do not tile the global tensors of {incomplete}")
    return {name: torch.from_numpy(values) for name, values in full.items()}

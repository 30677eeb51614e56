"""AdamW with decoupled weight decay on matrices only, an LR schedule and global-norm clipping."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from app.deck import OptimConfig
from app.runtime.grid import ProcessGrid


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """AdamW; biases, LayerNorm parameters (ParamMeta.decay False) get no weight decay."""
    decay = [p for p in model.parameters() if p.meta.decay]
    no_decay = [p for p in model.parameters() if not p.meta.decay]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    # foreach=False: the per-tensor loop is the same arithmetic on every grid.
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, foreach=False)


def learning_rate(cfg: OptimConfig, step: int, total_steps: int) -> float:
    """LR for optimizer step `step` (0-based): linear warm-up, then cosine/linear/constant decay."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant" or total_steps <= cfg.warmup_steps:
        return cfg.lr
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps - 1))
    factor = 1.0 - progress if cfg.schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * factor


@torch.no_grad()
def grad_norm(model: nn.Module, grid: ProcessGrid) -> float:
    """Global L2 norm of the gradient of the 1-rank model, computed from the shards.

    Call after the gradients are synchronised (sequence-parallel sums, tied embedding, dp).
    Each logical element counts once (`ParamMeta.owned_by`); dp replicas are equal, so
    the sum is reduced over tp and pp only.
    """
    params = list(model.parameters())
    local = torch.zeros((), dtype=torch.float64, device=params[0].device)
    for p in params:
        if p.grad is not None and p.meta.owned_by(grid.coords["tp"]):
            local += p.grad.detach().double().pow(2).sum()
    for axis in ("tp", "pp"):
        if grid.size(axis) > 1:
            dist.all_reduce(local, group=grid.group[axis])
    return float(local.sqrt())


@torch.no_grad()
def clip_gradients(model: nn.Module, grid: ProcessGrid, max_norm: float) -> float:
    """Scale gradients so their global norm is at most `max_norm` (0: no clipping); returns the norm."""
    norm = grad_norm(model, grid)
    if max_norm > 0 and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(scale)
    return norm

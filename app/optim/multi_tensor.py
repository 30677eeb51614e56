"""The optimizer's flat shards as lists of views, for multi-tensor kernels.

A rank's master shards, moments and reduced gradients are flat per-bucket tensors; weight decay
and the norms need them cut by parameter (`ParamLayout`'s segments and decay runs). Cutting them
into views once and handing the lists to one multi-tensor call (torch's fused AdamW, the
`_foreach_*` ops, `_foreach_norm`) makes a step a fixed number of dispatches, however many
elements or parameters there are: on a GPU a few kernel launches per list instead of about ten
whole-buffer passes per bucket and four kernels per 1 MiB chunk of the norm.

Norms: `_foreach_norm` in float32 over each view, the squares of those norms summed in float64.
A GPU reduces each view as a tree (float32 partial sums of 64K elements, combined per view); a
CPU reduces a view left to right in vector lanes, whose rounding grows with the view's length
(a float32 norm of 50M elements on one CPU core was 0.4% off), so on a CPU the views are cut
into pieces of CPU_NORM_PIECE elements: 1e-8 relative to the float64 sum of squares, and 5-8x
faster than squaring float64 copies (measured on 4M elements, one core).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Optional

import torch

if TYPE_CHECKING:
    from app.deck import OptimConfig

CPU_NORM_PIECE = 2**14  # elements of one float32 norm on a CPU (see the module docstring)
Ranges = Sequence[tuple[int, int]]


def complement(runs: Ranges, n: int) -> tuple[tuple[int, int], ...]:
    """The parts of [0, n) outside the sorted, disjoint `runs`."""
    out, at = [], 0
    for lo, hi in runs:
        if lo > at:
            out.append((at, lo))
        at = hi
    if at < n:
        out.append((at, n))
    return tuple(out)


def clip_runs(runs: Ranges, lo: int, hi: int) -> list[tuple[int, int]]:
    """The parts of `runs` inside [lo, hi), relative to lo (a chunk's decay runs)."""
    return [(max(a, lo) - lo, min(z, hi) - lo) for a, z in runs if a < hi and z > lo]


def fused_adamw(
    lists: Sequence[list[torch.Tensor]],
    step: torch.Tensor,
    cfg: OptimConfig,
    lr: float,
    weight_decay: float,
    unscale: Optional[torch.Tensor] = None,
) -> None:
    """torch's fused AdamW over lists of (params, grads, exp_avgs, exp_avg_sqs) views, `step` the
    update's count (a float tensor on their device), `unscale` 1 / the gradient's scale (the kernel
    divides each gradient by it and writes it back so)."""
    torch._fused_adamw_(*lists, [], [step] * len(lists[0]), lr=lr, beta1=cfg.beta1, beta2=cfg.beta2,
                        weight_decay=weight_decay, eps=cfg.eps, amsgrad=False, maximize=False, grad_scale=unscale,
                        found_inf=None)  # fmt: skip


def cut(t: torch.Tensor, ranges: Ranges) -> list[torch.Tensor]:
    """Views t[lo:hi] of a flat tensor, one per range."""
    return [t[lo:hi] for lo, hi in ranges]


def pieces(ranges: Ranges, device: torch.device) -> list[tuple[int, int]]:
    """`ranges` as they are reduced by `sum_squares` on `device`: whole on a GPU, cut into at
    most CPU_NORM_PIECE elements on a CPU."""
    if device.type != "cpu":
        return list(ranges)
    return [(a, min(a + CPU_NORM_PIECE, hi)) for lo, hi in ranges for a in range(lo, hi, CPU_NORM_PIECE)]


class NormViews:
    """Views whose squares are summed by group: `add(t, ranges, group)` registers views of `t`
    (cut for the device, `pieces`), `sum_squares()` returns the float64 sum of squares per group
    (a tensor of `groups` elements on the device) in one `_foreach_norm`. Build once, call every
    step: the views follow the tensors' memory, not their values."""

    def __init__(self, groups: int, device: torch.device) -> None:
        self.groups, self.device = groups, device
        self.views: list[torch.Tensor] = []
        self._group_of: list[int] = []
        self._index: torch.Tensor | None = None

    def add(self, t: torch.Tensor, ranges: Ranges, group: int = 0) -> None:
        for lo, hi in pieces(ranges, self.device):
            if lo < hi:
                self.views.append(t[lo:hi])
                self._group_of.append(group)
        self._index = None

    @torch.no_grad()
    def sum_squares(self) -> torch.Tensor:
        """Float64 sums of squares by group (inf/nan propagate)."""
        out = torch.zeros(self.groups, dtype=torch.float64, device=self.device)
        if not self.views:
            return out
        if self._index is None:
            self._index = torch.tensor(self._group_of, dtype=torch.long, device=self.device)
        norms = torch._foreach_norm(self.views, 2.0, dtype=torch.float32)
        return out.index_add_(0, self._index, torch.stack(norms).double().square())

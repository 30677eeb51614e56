"""AxoNN's 3D tensor parallelism (Singh, Bhatele et al., SC'24): the tp ranks as an X x Y x Z grid.

A Linear's weight W (out, in) is split (out / Y, in / X) over the X x Y grid ("A" layout; the
"B" layout, on every second Linear, swaps the roles: (out / X, in / Y)), and each such block
is sharded 1/Z along its rows over Z, in a ZeRO-3-like way. The batch is split over dp x Z.

    forward    gather W's rows over Z; y = x W^T (a partial sum over the in-features' axis);
               all-reduce y over that axis
    backward   gather W again; dx = dy W, all-reduced over the out-features' axis, overlapped
               with the weight-gradient GEMM dW = dy^T x (OAR); dW reduce-scattered over Z
               into the shard's gradient, behind the backward of the layers before it (ORS)

The gather of the next Linear of a block is started before this one's GEMM, in the order the
pass runs them: forward qkv -> attn.proj -> mlp.fc -> mlp.proj, backward the reverse (OAG).

With A on the first Linear of a pair and B on the second, the first's output split (over Y)
is the second's input split, and the second's output split (over X) is the first's input: no
re-layout between them. In a block the residual stream is (b, s, h / X) of the rank's own
samples (the batch is split over Z), replicated over
Y; the attention heads and the MLP's hidden features are split over Y, replicated over X
(the attention core runs X times over); LayerNorm's statistics are summed over X.

`Tensor3D` holds the three sub-axes' groups; each sub-axis is a `TensorParallel`, so the
1D mapping reduce_from_tp is the 3D one on a sub-axis.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from app.names import strides3d
from app.runtime.timers import Pending
from app.sharding.init import new_param
from app.sharding.layout import ORS_IN_FLIGHT, SUB_AXES, ParamMeta, box3d, coords3d, weight_splits  # noqa: F401  (coords3d, weight_splits re-exported)
from app.tensor_parallel.mappings import TensorParallel, reduce_from_tp

if TYPE_CHECKING:
    from app.runtime.grid import ProcessGrid
    from app.runtime.timers import StepTimers


def add_to_grad(param: nn.Parameter, grad: torch.Tensor) -> None:
    """Accumulate `grad` into `param.grad`, as autograd would (without its gradient hooks)."""
    param.grad = grad if param.grad is None else param.grad + grad


class ZGradients:
    """ORS: the weight gradients' reduce-scatters over Z in flight, oldest first.

    `_Linear3D`'s backward launches each where it computes the gradient and returns none for the
    shard; a reduction is retired (waited for, its shard of the sum handed to `sink`) when
    ORS_IN_FLIGHT newer ones are in flight or at `flush`, which the pipeline calls after every
    backward pass. `sink(param, grad)` does what autograd's accumulation would: in a run it is
    DataParallel.accumulate (the work of its gradient hook), elsewhere `add_to_grad`."""

    def __init__(self) -> None:
        self.in_flight: deque[tuple[TensorParallel, Pending, torch.Tensor, nn.Parameter]] = deque()
        self.sink: Callable[[nn.Parameter, torch.Tensor], None] = add_to_grad

    def launch(self, z: TensorParallel, grad_w: torch.Tensor, shard: nn.Parameter) -> None:
        out, pending = z.reduce_scatter_async(grad_w, 0)
        pending.keep = grad_w  # read by the collective until it completes
        self.in_flight.append((z, pending, out, shard))
        while len(self.in_flight) > ORS_IN_FLIGHT:
            self._retire()

    def _retire(self) -> None:
        z, pending, out, shard = self.in_flight.popleft()
        z.wait(pending)
        pending.keep = None
        self.sink(shard, out)

    def flush(self) -> None:
        """Retire every reduction in flight (the end of a backward pass)."""
        while self.in_flight:
            self._retire()


class GatherSlot:
    """OAG: a Linear3D's weight block gathered over Z ahead of its use, by the Linear that runs
    before it in the pass (`next` in forward, `prev` in backward). `take` returns the prefetched
    block, or gathers it now."""

    def __init__(self, shard_of: Callable[[], torch.Tensor]) -> None:
        self.shard_of = shard_of  # the parameter as it is now (DataParallel rebinds its storage)
        self.pending: Optional[tuple[torch.Tensor, Pending]] = None
        self.next: Optional[GatherSlot] = None
        self.prev: Optional[GatherSlot] = None

    def start(self, z: TensorParallel) -> None:
        if self.pending is None and z.size > 1:
            self.pending = z.all_gather_rows_async(self.shard_of().detach())

    def take(self, shard: torch.Tensor, z: TensorParallel) -> torch.Tensor:
        if self.pending is None:
            return _gathered(shard, z)
        (block, pending), self.pending = self.pending, None
        z.wait(pending)
        return block

    def drain(self, z: TensorParallel) -> None:
        """Drop a prefetched block nobody took (a recomputation that stopped early)."""
        if self.pending is not None:
            z.wait(self.pending[1])
            self.pending = None


def chain_gathers(slots: list[GatherSlot]) -> None:
    """Link Linears in the order a forward pass runs them (OAG prefetches along this chain)."""
    for a, b in zip(slots, slots[1:]):
        a.next, b.prev = b, a


@dataclass(frozen=True)
class Tensor3D:
    """The X, Y and Z sub-axes of the tensor-parallel group (each a `TensorParallel`).

    By default (`order` "xyz") a tp rank r sits at x = r % X, y = (r // X) % Y, z = r // (X Y):
    X innermost, so that the all-reduces of every Linear run between the nearest ranks
    (parallel.tensor_order puts another sub-axis innermost). The overlaps (AxoNN's names):
    `overlap_all_reduce` (OAR), the backward all-reduce of the input gradient runs during the
    weight-gradient GEMM; `overlap_reduce_scatter` (ORS), the weight gradient's reduce-scatter
    over Z runs behind the backward of the layers before it (`grads`); `overlap_all_gather`
    (OAG), the next Linear's gather over Z is started before this one's GEMM, in forward and,
    with `prefetch_backward`, in backward (`GatherSlot`; not under ZeRO-3, whose dp gather of
    the earlier Linear's parameters is not there yet when backward reaches the later one).
    """

    x: TensorParallel = field(default_factory=TensorParallel)
    y: TensorParallel = field(default_factory=TensorParallel)
    z: TensorParallel = field(default_factory=TensorParallel)
    overlap_all_reduce: bool = False
    overlap_reduce_scatter: bool = False
    overlap_all_gather: bool = False
    prefetch_backward: bool = True
    order: str = "xyz"  # the sub-axes' order in the tp group, innermost first (parallel.tensor_order)
    grads: ZGradients = field(default_factory=ZGradients, compare=False, repr=False)
    slots: list[GatherSlot] = field(default_factory=list, compare=False, repr=False)

    @property
    def size(self) -> int:
        return self.x.size * self.y.size * self.z.size

    sequence_parallel = False  # not with 3D: the hidden is already split over X

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.x.size, self.y.size, self.z.size

    @property
    def tp_rank(self) -> int:
        """This rank's place in the tp group (`strides3d` of the shape and order)."""
        return sum(a.rank * s for a, s in zip((self.x, self.y, self.z), strides3d(self.shape, self.order)))

    def axes(self, transposed: bool) -> tuple[TensorParallel, TensorParallel]:
        """(in-features axis, out-features axis) of a Linear in the A (or, transposed, B) layout."""
        return (self.y, self.x) if transposed else (self.x, self.y)

    def finish_backward(self) -> None:
        """After a backward pass: every ORS reduction retired into its gradient, no block left
        prefetched."""
        self.grads.flush()
        for slot in self.slots:
            slot.drain(self.z)


class _GatherRows(torch.autograd.Function):
    """All-gather a weight's Z shards along its rows; backward: reduce-scatter the gradient."""

    @staticmethod
    def forward(ctx: Any, shard: torch.Tensor, z: TensorParallel) -> torch.Tensor:
        ctx.z = z
        return z.all_gather(shard, 0)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.z.reduce_scatter(grad, 0), None


def gather_rows(shard: torch.Tensor, z: TensorParallel) -> torch.Tensor:
    """The whole (X x Y) block of a Z-sharded weight, for this pass."""
    return shard if z.size == 1 else _GatherRows.apply(shard, z)


class _Linear3D(torch.autograd.Function):
    """x W^T for the (X x Y) block W gathered from its Z shards, as one step (the partial sum over
    the in axis; `linear3d` all-reduces it).

    Only the shard is kept for backward, not the gathered block: backward gathers it again
    (AxoNN's order), so a stage holds one layer's block at a time instead of every layer's for
    every micro-batch in flight. Backward computes dx and starts its all-reduce over the out axis,
    computes dW meanwhile when the overlap is on (OAR, `parallel.overlap_tp_comm`), then
    reduce-scatters dW over Z into the shard's gradient, asynchronously under ORS (`ZGradients`).
    With a `slot` (OAG) the block comes from the gather the previous Linear of the pass started,
    and this one starts the next's. The arithmetic is the same in any order: results are bitwise
    equal with each overlap on or off."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, shard: torch.Tensor, t3d: Tensor3D, transposed: bool, slot: Optional[GatherSlot]
    ) -> torch.Tensor:
        block = slot.take(shard, t3d.z) if slot is not None else _gathered(shard, t3d.z)
        if slot is not None and slot.next is not None and t3d.overlap_all_gather:
            slot.next.start(t3d.z)  # during this GEMM
        ctx.save_for_backward(x, shard)
        # The parameter itself, for ORS's delivery: ZeRO-3's saved-tensor hooks unpack another tensor.
        ctx.t3d, ctx.transposed, ctx.slot, ctx.param = t3d, transposed, slot, shard
        return F.linear(x, block)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        x, shard = ctx.saved_tensors
        t3d: Tensor3D = ctx.t3d
        slot: Optional[GatherSlot] = ctx.slot
        _, out_axis = t3d.axes(ctx.transposed)
        need_x, need_w = ctx.needs_input_grad[:2]
        grad_x = handle = None
        if need_x:
            block = slot.take(shard, t3d.z) if slot is not None else _gathered(shard, t3d.z)
            if slot is not None and slot.prev is not None and t3d.overlap_all_gather and t3d.prefetch_backward:
                slot.prev.start(t3d.z)  # during this Linear's GEMMs
            # Each rank holds the gradient through its out-features only: sum over the out axis.
            grad_x = grad_out.matmul(block.to(grad_out.dtype))
            if out_axis.size > 1:
                grad_x, handle = out_axis.all_reduce_async(grad_x)
                if not t3d.overlap_all_reduce:
                    out_axis.wait(handle)
                    handle = None
        grad_w = None
        if need_w:
            flat_grad = grad_out.reshape(-1, grad_out.shape[-1])
            grad_w = flat_grad.t().matmul(x.reshape(-1, x.shape[-1]).to(grad_out.dtype)).to(shard.dtype)
            if t3d.z.size > 1:  # each Z rank ran its own samples: sum over Z, keep this shard's rows
                # ORS for the blocks' Linears (a slot), each used once per pass; the head's table
                # may have a second gradient (the tied embedding) that autograd must sum first.
                if t3d.overlap_reduce_scatter and slot is not None:
                    t3d.grads.launch(t3d.z, grad_w, ctx.param)
                    grad_w = None  # it reaches the shard through `grads.sink`
                else:
                    grad_w = t3d.z.reduce_scatter(grad_w, 0)
        if handle is not None:
            out_axis.wait(handle)
        if grad_x is not None:
            grad_x = grad_x.contiguous().to(x.dtype)
        return grad_x, grad_w, None, None, None


def _gathered(shard: torch.Tensor, z: TensorParallel) -> torch.Tensor:
    """The whole (X x Y) block of a Z-sharded weight (no autograd: `_Linear3D` reduces its
    gradient)."""
    return shard if z.size == 1 else z.all_gather(shard, 0)


def linear3d(
    x: torch.Tensor,
    shard: torch.Tensor,
    bias: Optional[torch.Tensor],
    t3d: Tensor3D,
    transposed: bool,
    slot: Optional[GatherSlot] = None,
) -> torch.Tensor:
    """x W^T + b for this rank's Z shard of W's (X x Y) block. x: (..., in / |in axis|) replicated
    over the out axis; returns (..., out / |out axis|) replicated over the in axis. `slot`: the
    Linear's place in the OAG chain (none: gathered where used)."""
    in_axis, _ = t3d.axes(transposed)
    y = reduce_from_tp(_Linear3D.apply(x, shard, t3d, transposed, slot), in_axis)
    return y if bias is None else y + bias


def tensor3d_from_grid(
    grid: ProcessGrid,
    shape: tuple[int, int, int],
    order: str = "xyz",
    timers: Optional[StepTimers] = None,
    overlap_all_reduce: bool = False,
    overlap_reduce_scatter: bool = False,
    overlap_all_gather: bool = False,
    prefetch_backward: bool = True,
) -> Tensor3D:
    """The `Tensor3D` of this rank's tp group on `grid` split as `shape` and laid out `order`,
    with the overlaps asked for (OAR, ORS, OAG; `prefetch_backward` False under ZeRO-3)."""
    groups = grid.tensor3d(shape, order)
    axes = [
        TensorParallel(n, groups[a][0], groups[a][1] if n > 1 else None, False, timers, overlap_all_reduce, a)
        for a, n in zip(SUB_AXES, shape)
    ]
    return Tensor3D(
        *axes,
        overlap_all_reduce=overlap_all_reduce,
        overlap_reduce_scatter=overlap_reduce_scatter,
        overlap_all_gather=overlap_all_gather,
        prefetch_backward=prefetch_backward,
        order=order,
    )


class _AllReduceBothWays(torch.autograd.Function):
    """A sum over a sub-axis whose result each rank uses for its own slice: the gradient of each
    rank's input is the sum of the ranks' gradients (an all-reduce in backward too)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, t: TensorParallel) -> torch.Tensor:
        ctx.t = t
        return t.all_reduce(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.t.all_reduce(grad), None


def layer_norm3d(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float, t: TensorParallel
) -> torch.Tensor:
    """LayerNorm over a hidden dimension split over the sub-axis `t` (X): each rank holds h / X
    features and the matching slices of `weight` and `bias`; the mean and the variance are
    summed over `t` (two passes, in fp32, as F.layer_norm computes them)."""
    if t.size == 1:
        return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)
    h = x.shape[-1] * t.size
    xf = x.float()
    mean = _AllReduceBothWays.apply(xf.sum(dim=-1, keepdim=True), t) / h
    centred = xf - mean
    var = _AllReduceBothWays.apply((centred * centred).sum(dim=-1, keepdim=True), t) / h
    return (centred * torch.rsqrt(var + eps) * weight.float() + bias.float()).to(x.dtype)


def embedding3d(tokens: torch.Tensor, shard: torch.Tensor, row_start: int, t3d: Tensor3D) -> torch.Tensor:
    """Token embedding from a (vocab, hidden) table split (vocab / Y, hidden / X) and Z-sharded
    along its rows (the A layout of the tied head): each rank looks up the tokens in its row
    range [row_start, row_start + rows) (zeros elsewhere) and the sum over Y is the embedding,
    (..., hidden / X) replicated over Y."""
    table = gather_rows(shard, t3d.z)
    if t3d.y.size == 1:
        return F.embedding(tokens, table)
    outside = (tokens < row_start) | (tokens >= row_start + table.shape[0])
    local = (tokens - row_start).masked_fill(outside, 0)
    return reduce_from_tp(F.embedding(local, table).masked_fill(outside.unsqueeze(-1), 0.0), t3d.y)


def param3d(
    meta: ParamMeta, t3d: Tensor3D, splits: list[tuple[str, int]], device: Optional[torch.device]
) -> nn.Parameter:
    """This rank's block of the parameter `meta`, cut by `splits` (`box3d`)."""
    return new_param(box3d(meta, t3d.shape, t3d.tp_rank, splits, t3d.order), device)


class Linear3D(nn.Module):
    """A Linear under 3D tensor parallelism, A layout (in over X, out over Y) or, `transposed`,
    B (in over Y, out over X); the weight block Z-sharded by rows, the bias split like the
    output and replicated over the in axis and Z."""

    def __init__(
        self, n_in: int, n_out: int, std: float, t3d: Tensor3D, transposed: bool, device: Optional[torch.device]
    ) -> None:
        super().__init__()
        self.t3d, self.transposed = t3d, transposed
        self.weight = param3d(ParamMeta((n_out, n_in), std=std), t3d, weight_splits(transposed), device)
        out_axis = "tp_x" if transposed else "tp_y"
        self.bias = param3d(ParamMeta((n_out,), init="zeros", decay=False), t3d, [(out_axis, 0)], device)
        self.slot = GatherSlot(lambda: self.weight)
        t3d.slots.append(self.slot)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear3d(x, self.weight, self.bias, self.t3d, self.transposed, self.slot)


class LayerNorm3D(nn.Module):
    """LayerNorm of a hidden dimension split over X (`layer_norm3d`); replicated over Y and Z."""

    def __init__(self, hidden: int, eps: float, t3d: Tensor3D, device: Optional[torch.device]) -> None:
        super().__init__()
        self.eps, self.t3d = eps, t3d
        self.weight = param3d(ParamMeta((hidden,), init="ones", decay=False), t3d, [("tp_x", 0)], device)
        self.bias = param3d(ParamMeta((hidden,), init="zeros", decay=False), t3d, [("tp_x", 0)], device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm3d(x, self.weight, self.bias, self.eps, self.t3d.x)


class Embedding3D(nn.Module):
    """The (vocab, hidden) table in the head's A layout (`embedding3d`)."""

    def __init__(self, vocab: int, hidden: int, std: float, t3d: Tensor3D, device: Optional[torch.device]) -> None:
        super().__init__()
        self.t3d = t3d
        self.weight = param3d(ParamMeta((vocab, hidden), std=std), t3d, weight_splits(False), device)
        self.start = t3d.y.rank * (vocab // t3d.y.size)  # this Y rank's first row

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return embedding3d(tokens, self.weight, self.start, self.t3d)

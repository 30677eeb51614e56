"""Tensor- and sequence-parallel communication: (forward, backward) pairs of collectives.

Each mapping is a pair (forward, backward) of collectives over the tp group, side by side
(Megatron-LM's mappings.py, Shoeybi et al. 2019; Korthikanti et al. 2022 for the
sequence-parallel ones):

    copy_to_tp              identity            | all-reduce        enter a column-parallel region
    reduce_from_tp          all-reduce          | identity          leave a row-parallel region
    scatter_to_sequence     split (own chunk)   | all-gather
    gather_from_sequence    all-gather          | reduce-scatter    enter a column-parallel region (SP)
    reduce_scatter_to_seq   reduce-scatter      | all-gather        leave a row-parallel region (SP)

Activations are (batch, sequence, hidden); sequence chunks are along `SEQ_DIM`. With
tp = 1 every mapping is the identity and issues no communication.

The entry of a column-parallel region (copy_to_tp, or gather_from_sequence under SP) is
fused with the matmul in `app/tensor_parallel/layers.py`, so that the backward all-reduce
(reduce-scatter under SP) can run while the weight gradient is computed
(`TensorParallel.overlap`); it uses `all_reduce_async` / `reduce_scatter_async` and
`wait` below. `leave_tp_region` picks the exit mapping of a row-parallel region.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
import torch.distributed as dist

from app.runtime.timers import Pending, StepTimers, comm_region, launch, wait

if TYPE_CHECKING:
    from app.runtime.grid import ProcessGrid

SEQ_DIM = 1


def reduced_copy(
    x: torch.Tensor, group: Any, timers: Optional[StepTimers], axis: str, op: Any = dist.ReduceOp.SUM
) -> torch.Tensor:
    """A new tensor: x summed (or max-ed) over `group`, charged to `axis` of the step timers."""
    x = x.contiguous().clone()
    with comm_region(timers, axis, "all_reduce"):
        dist.all_reduce(x, op=op, group=group)
    return x


@dataclass(frozen=True)
class TensorParallel:
    """What a tensor-parallel layer needs to know: its tp group, its place in it, and SP.

    `group` is None when tp = 1. `timers` (optional) is charged with the time of every
    tp collective. `overlap`: the column-parallel linears' backward collective runs during
    their weight-gradient GEMM instead of before it (same arithmetic, same results).
    """

    size: int = 1
    rank: int = 0
    group: Any = None
    sequence_parallel: bool = False
    timers: Optional[StepTimers] = None
    overlap: bool = False
    axis: str = "tp"  # the timers' axis: tp, or a 3D sub-axis (tp_x, tp_y, tp_z)

    @classmethod
    def from_grid(
        cls,
        grid: ProcessGrid,
        sequence_parallel: bool = False,
        timers: Optional[StepTimers] = None,
        overlap: bool = False,
    ) -> TensorParallel:
        size = grid.size("tp")
        group = grid.group["tp"] if size > 1 else None
        return cls(size, grid.coords["tp"], group, sequence_parallel, timers, overlap)

    def all_reduce(self, x: torch.Tensor, op: Any = dist.ReduceOp.SUM) -> torch.Tensor:
        """A new tensor: x summed (or max-ed) over the tp group."""
        return reduced_copy(x, self.group, self.timers, self.axis, op)

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Concatenate the tp ranks' x along `dim`, in tp-rank order."""
        x0 = x.movedim(dim, 0).contiguous()
        out = torch.empty((self.size * x0.shape[0], *x0.shape[1:]), dtype=x.dtype, device=x.device)
        with comm_region(self.timers, self.axis, "all_gather"):
            dist.all_gather_single(out, x0, group=self.group)
        return out.movedim(0, dim).contiguous()

    def reduce_scatter(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Sum x over the tp group and keep this rank's chunk along `dim`."""
        x0 = x.movedim(dim, 0).contiguous()
        out = torch.empty((x0.shape[0] // self.size, *x0.shape[1:]), dtype=x.dtype, device=x.device)
        with comm_region(self.timers, self.axis, "reduce_scatter"):
            dist.reduce_scatter_single(out, x0, group=self.group)
        return out.movedim(0, dim).contiguous()

    def all_reduce_async(self, x: torch.Tensor) -> tuple[torch.Tensor, Pending]:
        """Start summing x over the tp group, in place when x is contiguous (pass a buffer
        nobody else reads, e.g. a gradient just computed). Returns (out, handle): out holds
        the sum after `wait(handle)`."""
        out = x.contiguous()
        work = dist.all_reduce(out, group=self.group, async_op=True)
        return out, launch(self.timers, self.axis, work, "all_reduce")

    def all_gather_rows_async(self, x: torch.Tensor) -> tuple[torch.Tensor, Pending]:
        """Start `all_gather(x, 0)`. Returns (out, handle): out holds the tp ranks' x stacked
        along dim 0, in tp-rank order, after `wait(handle)`."""
        x0 = x.contiguous()
        out = torch.empty((self.size * x0.shape[0], *x0.shape[1:]), dtype=x.dtype, device=x.device)
        work = dist.all_gather_single(out, x0, group=self.group, async_op=True)
        pending = launch(self.timers, self.axis, work, "all_gather")
        pending.keep = x0  # the shard it reads, alive until it completes
        return out, pending

    def reduce_scatter_async(self, x: torch.Tensor, dim: int) -> tuple[torch.Tensor, Pending]:
        """Start `reduce_scatter(x, dim)`. Returns (out, handle): out, this rank's chunk
        along `dim` (not contiguous unless dim = 0), holds the sum after `wait(handle)`."""
        x0 = x.movedim(dim, 0).contiguous()
        out = torch.empty((x0.shape[0] // self.size, *x0.shape[1:]), dtype=x.dtype, device=x.device)
        work = dist.reduce_scatter_single(out, x0, group=self.group, async_op=True)
        return out.movedim(0, dim), launch(self.timers, self.axis, work, "reduce_scatter")

    def wait(self, handle: Pending) -> None:
        """Block until an `*_async` collective has finished (charged to the timers' tp axis)."""
        wait(self.timers, handle)

    def split(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's chunk of x along `dim` (no communication)."""
        return x.chunk(self.size, dim=dim)[self.rank].contiguous()


def _same(tp: TensorParallel, x: torch.Tensor) -> torch.Tensor:
    return x


def _sum(tp: TensorParallel, x: torch.Tensor) -> torch.Tensor:
    return tp.all_reduce(x)


def _own_chunk(tp: TensorParallel, x: torch.Tensor) -> torch.Tensor:
    return tp.split(x, SEQ_DIM)


def _gather(tp: TensorParallel, x: torch.Tensor) -> torch.Tensor:
    return tp.all_gather(x, SEQ_DIM)


def _sum_and_split(tp: TensorParallel, x: torch.Tensor) -> torch.Tensor:
    return tp.reduce_scatter(x, SEQ_DIM)


Step = Callable[[TensorParallel, torch.Tensor], torch.Tensor]


class _Mapping(torch.autograd.Function):
    """One row of the module docstring's table: `forward` over the tp group, and `backward` on the
    gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: TensorParallel, forward: Step, backward: Step) -> torch.Tensor:
        ctx.tp, ctx.backward_step = tp, backward
        return forward(tp, x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return ctx.backward_step(ctx.tp, grad), None, None, None


def copy_to_tp(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    return x if tp.size == 1 else _Mapping.apply(x, tp, _same, _sum)


def reduce_from_tp(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    return x if tp.size == 1 else _Mapping.apply(x, tp, _sum, _same)


def scatter_to_sequence(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    return x if tp.size == 1 else _Mapping.apply(x, tp, _own_chunk, _gather)


def gather_from_sequence(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    # The consumer is tp-parallel compute: each rank holds a partial gradient; sum and split.
    return x if tp.size == 1 else _Mapping.apply(x, tp, _gather, _sum_and_split)


def reduce_scatter_to_sequence(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    return x if tp.size == 1 else _Mapping.apply(x, tp, _sum_and_split, _gather)


def leave_tp_region(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Output of a row-parallel layer (partial sums): summed, and sequence-sharded under SP."""
    return reduce_scatter_to_sequence(x, tp) if tp.sequence_parallel else reduce_from_tp(x, tp)


def in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread (a recomputation too)."""
    return torch._C._current_graph_task_id() != -1


def _exchange_rows(
    x: torch.Tensor, send: list[int], recv: list[int], group: Any, timers: Optional[StepTimers]
) -> torch.Tensor:
    """The blocking all-to-all of rows (`all_to_all`), timed as the "ep" sub-axis of dp."""
    out = x.new_empty((sum(recv), *x.shape[1:]))
    with comm_region(timers, "ep", "all_to_all"):
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """Rows of x, `send[i]` of them to rank i of `group` in rank order, in exchange for `recv[i]` from
    each; backward sends the gradients back the same way (the exchange reversed)."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, send: list[int], recv: list[int], group: Any, timers: Optional[StepTimers]
    ) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group, ctx.timers = send, recv, group, timers
        return _exchange_rows(x, send, recv, group, timers)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        return _exchange_rows(grad, ctx.recv, ctx.send, ctx.group, ctx.timers), None, None, None, None


def all_to_all(
    x: torch.Tensor, send: list[int], recv: list[int], group: Any, timers: Optional[StepTimers] = None
) -> torch.Tensor:
    """Differentiable all-to-all with variable splits (expert parallelism's token exchange): rows
    [sum(send[:i]), sum(send[:i + 1])) of x go to rank i of `group`; the result holds `recv[i]` rows
    from rank i, in rank order. Timed as the "ep" sub-axis of dp (`timers`)."""
    return _AllToAll.apply(x, list(send), list(recv), group, timers)


class _Exchange:
    """An all-to-all in flight (`all_to_all_start`): its pending work, then nothing."""

    pending: Optional[Pending] = None


class _AllToAllStart(torch.autograd.Function):
    """`_AllToAll` launched asynchronously: the output is filled once `_AllToAllWait` returns."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, send: list[int], recv: list[int], group: Any,
                timers: Optional[StepTimers], flight: _Exchange) -> torch.Tensor:  # fmt: skip
        ctx.send, ctx.recv, ctx.group, ctx.timers = send, recv, group, timers
        out, rows = x.new_empty((sum(recv), *x.shape[1:])), x.contiguous()
        work = dist.all_to_all_single(out, rows, recv, send, group=group, async_op=True)
        flight.pending = launch(timers, "ep", work, "all_to_all")
        flight.pending.keep = rows  # what is sent, alive until the exchange completes
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        return _exchange_rows(grad, ctx.recv, ctx.send, ctx.group, ctx.timers), None, None, None, None, None


class _AllToAllWait(torch.autograd.Function):
    """y = x once the exchange filling x completed (backward: the gradient as it is)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, flight: _Exchange, timers: Optional[StepTimers]) -> torch.Tensor:
        if flight.pending is not None:
            wait(timers, flight.pending)
            flight.pending.keep = None
            flight.pending = None
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad, None, None


def all_to_all_start(
    x: torch.Tensor, send: list[int], recv: list[int], group: Any, timers: Optional[StepTimers] = None
) -> Callable[[], torch.Tensor]:
    """`all_to_all` launched now and returned by the call of the result, so that work independent of
    it runs in between (a mixture of experts' shared experts while the tokens travel). Its backward
    is `all_to_all`'s (blocking)."""
    flight = _Exchange()
    out = _AllToAllStart.apply(x, list(send), list(recv), group, timers, flight)
    return lambda: _AllToAllWait.apply(out, flight, timers)

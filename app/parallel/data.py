"""Data parallelism: flat parameter/gradient buffers, bucketed and overlapped reductions,
ZeRO-1 sharding of the fp32 master weights and ZeRO-2 sharding of the gradients.

Layout. All parameters of this rank's model live in one flat parameter buffer (the
compute dtype: fp32, bf16 or fp16) and accumulate their gradients in one flat gradient
buffer (fp32 by default: `train.grad_reduce_dtype`), both in reverse registration order,
which is roughly the order backward produces gradients. The buffers are cut into buckets
of whole parameters of about `parallel.dp_bucket_mb`, each padded to a multiple of dp.
The parameter layout depends only on the local shapes, so it is the same on every tp rank
of a stage (and every dp replica); the tied embedding gets a bucket of its own, so its
shards line up between the first and the last pipeline stage.

Overlap. A hook on each parameter adds its gradient into the buffer after every backward
(gradient accumulation over micro-batches happens there, in the reduce dtype). When every
parameter of a bucket has received its gradient from the last micro-batch, the bucket's
reduction is launched asynchronously — an all-reduce, or a reduce-scatter under ZeRO-1 —
and only `finish_grad_reduce` (before the optimizer step) waits for them. With
`parallel.overlap_grad_reduce: false` the same reductions run after backward, one by one.

ZeRO-2 (`optim.zero: 2`). No whole gradient buffer: a bucket's gradients accumulate in a
buffer of the bucket's size, allocated at its first gradient; once every parameter of the
bucket has added one gradient, it is reduce-scattered into this rank's 1/dp shard
(asynchronously) and the buffer is released, to be allocated again by the next micro-batch.
So each micro-batch reduces its gradients (micro-batches x the ZeRO-1 traffic), and a rank
holds its gradient shard plus the buckets being filled or reduced. Sums are linear, so it
does not matter whether the gradients a bucket reduces come from one micro-batch or two
(interleaved chunks): each one is reduced exactly once. At most ZERO2_IN_FLIGHT reductions
are in flight (launching one more waits for the oldest), so their buffers are released in
step with the backward instead of piling up.

ZeRO-3 (`optim.zero: 3`). The parameters are sharded too: a rank keeps only its 1/dp shard of
every bucket (`param_shards`, the fp32 master itself in fp32 runs). Buckets never mix the
model's gather units (`GPT.param_units`: the embedding, each block, the head); each bucket has
a full buffer whose storage exists only while the bucket is gathered, and the parameters are
views of it. The model calls `enter(unit)` before a unit reads its parameters (the gather,
waited for) and `exit(unit)` after its forward (the storage is freed); the next unit of the
chunk pass (`plan`) is gathered ahead, ZERO3_PREFETCH units. In backward, the saved-tensor
hooks (`saving`) stand a marker in for a saved parameter, and unpacking it gathers its bucket
again (and the previous unit ahead); a full recomputation's forward gathers through `enter`. A
bucket's storage is freed again once every parameter of it has its gradient of the
micro-batch, when the gradients are reduce-scattered as under ZeRO-2. Nothing is gathered
after the optimizer step: the next forward gathers the updated shards.

Shards. Each rank updates a shard of every bucket: the whole bucket without ZeRO, its
1/dp slice with ZeRO-1 and ZeRO-2 (`optim.zero: 1`, `2`). Its fp32 master weights (`master`) and the
optimizer moments cover only that shard, so their memory drops ~dp x. After the update
each bucket's shards are all-gathered into the parameter buffer: asynchronously, with
each bucket waited for by a forward pre-hook of the first module that uses it in the next
step (`parallel.overlap_param_gather`), or at once.

Gradient sums over other axes commute with the dp mean, so they run on the reduced shard:
sequence-parallel partial gradients summed over tp (the shard ranges agree across tp
ranks), and the tied embedding summed between the first and last stage.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Optional, Protocol

import torch
import torch.distributed as dist
from torch import nn

from app.runtime.grid import ProcessGrid
from app.runtime.timers import Pending, StepTimers, comm_region, launch, wait
from app.sharding.init import initial_values
from app.sharding.layout import ZERO2_IN_FLIGHT, ZERO3_PREFETCH, ParamLayout, Segment
from app.shards import MASTER, MODEL, ShardState
from app.tensor_parallel.mappings import in_backward


@torch.no_grad()
def allreduce_flat(
    tensors: Sequence[torch.Tensor], group: Any, timers: Optional[StepTimers], axis: str, divide: int = 1
) -> None:
    """In place: each tensor <- (sum over `group` of it) / divide, packed into one buffer per dtype."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for same in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in same])
        if divide != 1:
            flat.div_(divide)  # divide first: the sum of averages cannot overflow in low precision
        with comm_region(timers, axis, "all_reduce"):
            dist.all_reduce(flat, group=group)
        offset = 0
        for t in same:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()


@dataclass
class InFlight:
    """A bucket's communication state within a step."""

    ready: int = 0  # gradients received this step
    reduce: Optional[Pending] = None
    gather: Optional[Pending] = None
    launched: bool = False
    grad_shard: Optional[torch.Tensor] = None  # ZeRO: the reduce-scatter output
    # ZeRO-2: the bucket's gradients being accumulated, and the arrivals since its last reduction.
    full: Optional[torch.Tensor] = None
    count: int = 0
    resident: bool = False  # ZeRO-3: the bucket's parameter storage exists (gathered or being gathered)


@dataclass(frozen=True)
class _Held:
    """ZeRO-3: a parameter (or a view of one) autograd saved for backward, by bucket."""

    bucket: int
    tensor: torch.Tensor


class GradSink(Protocol):
    """Who copies each bucket's reduced gradient out as soon as it is final (an offloaded
    optimizer's `HostTransfer`)."""

    def begin(self) -> None:
        """A step starts: the gradient buffers are about to be zeroed."""

    def ready(self, k: int, work: Any) -> None:
        """Bucket k's reduction (`work`, None: none) is launched and nothing else changes it."""

    def final(self) -> None:
        """Every reduction and sum of the step is done."""


def mixed_gemm_works(device: torch.device, inputs: torch.dtype, out: torch.dtype) -> bool:
    """Whether this device multiplies `inputs` matrices into an `out` matrix and adds into one in a
    single GEMM (`torch.mm`/`addmm` with out_dtype: CUDA's, torch >= 2.8; not CPUs' in torch 2.13)."""
    if inputs == out or device.type == "meta":
        return False
    try:  # as `wgrad_into` calls them: the gradient transposed (a view), the accumulator the output
        a, c = torch.ones(16, 8, dtype=inputs, device=device), torch.ones(8, 8, dtype=out, device=device)
        torch.mm(a.t(), a, out_dtype=out, out=c)
        torch.addmm(c, a.t(), a, out_dtype=out, out=c)
        return bool((c == 32.0).all().item())
    except (RuntimeError, TypeError, NotImplementedError):
        return False


class DataParallel:
    """Flat buffers, bucketed dp reductions and the (sharded) fp32 master weights of one rank.

    `params`: the model's parameters in buffer order. `master[b]`: fp32 master weights of
    this rank's shard of bucket b (a view of the parameter buffer when the compute dtype is
    fp32; its own tensor otherwise). `grads(b)`: the reduced gradient of the
    same shard, once `finish_grad_reduce` returned.
    """

    def __init__(
        self,
        model: nn.Module,
        grid: ProcessGrid,
        *,
        compute_dtype: torch.dtype = torch.float32,
        reduce_dtype: torch.dtype = torch.float32,
        bucket_mb: float = 25.0,
        zero: int = 0,
        overlap_grad_reduce: bool = True,
        overlap_param_gather: bool = True,
        tied: Optional[tuple[torch.Tensor, Any]] = None,
        timers: Optional[StepTimers] = None,
        units: Optional[Sequence[tuple[str, Sequence[torch.Tensor]]]] = None,
        seed: Optional[int] = None,
        device: Optional[torch.device] = None,
        ep: int = 1,
        fuse_wgrad: bool = False,
    ) -> None:
        self.timers = timers
        # The replicas of these parameters: dp, times cp under context parallelism (its ranks hold
        # the same parameters and partial gradients of the same loss: averaged over dp x cp at once).
        replicas = grid.replicas
        self.dp, self.dp_rank = replicas.size, replicas.rank
        self.group = replicas.group if self.dp > 1 else None
        # Expert parallelism: expert buckets are reduced and sharded over the expert-data group.
        self.ep = ep
        self.expert_group = grid.expert_groups(ep)["edp"][1] if ep > 1 else None
        # zero >= 1: the optimizer state is sharded over dp; 2: the gradients as well (no whole buffer).
        self.zero = zero >= 1 and self.dp > 1
        self.shard_grads = zero >= 2 and self.dp > 1
        self.shard_params = zero >= 3 and self.dp > 1
        if self.shard_params and units is None:
            raise ValueError("ZeRO-3 needs the model's gather units (GPT.param_units)")
        self.level = zero if self.dp > 1 else 0  # the ZeRO stage in effect (checkpoint header, reports)
        self.overlap_grad_reduce, self.overlap_param_gather = overlap_grad_reduce, overlap_param_gather
        self.tied_param, self.tied_group = tied if tied is not None else (None, None)
        self.params: list[nn.Parameter] = list(reversed(list(model.parameters())))
        names = {id(p): name for name, p in model.named_parameters()}
        self.names = [names[id(p)] for p in self.params]  # the 1-rank model's names
        self.tp_rank = grid.coords["tp"]
        # A model built on "meta" has shapes only: its values come from (seed, name) here, and
        # its parameters become views of the buffers on `device`.
        self.seed = seed
        device = self.device = device if device is not None else self.params[0].device
        if any(p.is_meta for p in self.params) and (seed is None or device.type == "meta"):
            raise ValueError("a model built on the meta device needs DataParallel(seed=..., device=...)")
        self.reduce_dtype = reduce_dtype
        element = torch.empty((), dtype=reduce_dtype).element_size()
        tied_index = next((i for i, p in enumerate(self.params) if p is self.tied_param), None)
        metas = [p.meta for p in self.params]  # type: ignore[attr-defined]
        wrong = [n for n, p, m in zip(self.names, self.params, metas) if tuple(p.shape) != m.local_shape]
        if wrong:  # a layer that built a parameter outside its own ParamMeta's box
            raise RuntimeError(f"parameters whose shape is not their ParamMeta's local shape: {wrong}")
        unit_of: dict[int, str] = {}
        for unit, members in units or ():
            for q in members:
                unit_of.setdefault(id(q), unit)  # the tied embedding: its first unit
        self.layout = ParamLayout.build(
            metas,
            tp_rank=self.tp_rank,
            dp=self.dp,
            dp_rank=self.dp_rank,
            zero=self.zero,
            bucket_elements=bucket_mb * 1e6 / element,
            alone=tied_index,
            units=[unit_of[id(q)] for q in self.params] if self.shard_params else None,
            ep=ep,
        )
        self.offsets, self.buckets = self.layout.offsets, self.layout.buckets
        self.flight = [InFlight() for _ in self.buckets]
        self.bucket_of = {id(self.params[i]): k for i, k in self.layout.bucket_of().items()}
        self.index_of = {id(q): i for i, q in enumerate(self.params)}
        # ZeRO 0/1: the parameters whose accumulator this step has not written yet. The first
        # gradient of a step is copied in, not added to a zeroed buffer (no zeroing pass over the
        # buffer, no read of it: 8 of the 10 + 4 bytes an element a step of micro-batch 1 moves;
        # the same values). What got none is zeroed when its bucket's reduction starts.
        self.fresh = [True] * len(self.params)
        # fp32 compute: the master shard is the parameter buffer's own slice (no second copy).
        self.master_is_param = compute_dtype == torch.float32
        self.master_offloaded = False  # an offloaded optimizer keeps the masters (`offload_master`)
        # ZeRO-3: per bucket, the shard this rank keeps and the full buffer gathered into.
        self.param_shards: list[torch.Tensor] = []
        self.full: list[torch.Tensor] = []
        self.param_buffer: Optional[torch.Tensor] = None
        # Without ZeRO-3: each bucket's range of the parameter buffer, under a version counter of
        # its own (`_bucket_range`); the bucket's parameters, masters (fp32) and gathers use it.
        self.bucket_params: list[torch.Tensor] = []
        # Bucket by bucket, so start-up holds one bucket's fp32 values beyond the buffers (ZeRO-3:
        # its shard only), never a flat fp32 copy of the stage.
        self.master = []
        if self.shard_params:
            for b in self.buckets:
                self.master.append(self._initial(b.shard_lo, b.shard_hi, b.params))
                self.full.append(torch.empty(b.end - b.start, dtype=compute_dtype, device=device))
            self.param_shards = self.master if self.master_is_param else [m.to(compute_dtype) for m in self.master]
        else:
            self.param_buffer = torch.zeros(self.layout.size, dtype=compute_dtype, device=device)
            for b in self.buckets:
                fp32 = self._initial(b.start, b.end, b.params)
                values = self._bucket_range(self.param_buffer, b.start, b.end)
                self.bucket_params.append(values)
                values.copy_(fp32)  # rounded to the compute dtype
                if self.master_is_param:
                    self.master.append(values[b.shard_lo - b.start : b.shard_hi - b.start])
                else:
                    self.master.append(fp32[b.shard_lo - b.start : b.shard_hi - b.start].clone())
        # ZeRO-2 keeps no whole gradient buffer: per-bucket buffers come and go (`_open`).
        self.grad_buffer: Optional[torch.Tensor] = (
            None if self.shard_grads else torch.zeros(self.layout.size, dtype=reduce_dtype, device=device)
        )
        if self.zero:
            for b, f in zip(self.buckets, self.flight):
                f.grad_shard = torch.zeros(b.shard_hi - b.shard_lo, dtype=reduce_dtype, device=device)
        # The model's parameters and their gradient accumulators become views of the buffers.
        for k in range(len(self.full)):  # ZeRO-3: views of each bucket's full buffer
            self._bind(k)
        bucket_index = self.layout.bucket_of()
        for i, (p, off) in enumerate(zip(self.params, self.offsets)):
            if self.bucket_params:
                k = bucket_index[i]
                lo = off - self.buckets[k].start
                self._view(p, self.bucket_params[k][lo : lo + p.numel()].view(p.shape))
            if self.grad_buffer is not None:
                p.main_grad = self.grad_buffer[off : off + p.numel()].view(p.shape)  # type: ignore[attr-defined]
            p.register_post_accumulate_grad_hook(self._on_grad)
            if fuse_wgrad and getattr(p, "wgrad_fusable", False) and p is not self.tied_param:
                p.wgrad_into = self.wgrad_into  # type: ignore[attr-defined]  # the Linear's backward calls it
            elif hasattr(p, "wgrad_into"):  # an earlier DataParallel's, over the same model
                del p.wgrad_into
        # Parameters whose gradient of this backward a GEMM already added into the accumulator
        # (`wgrad_into`): their hook only counts it.
        self.in_main: set[int] = set()
        self.fused_wgrads = sum(hasattr(p, "wgrad_into") for p in self.params)
        # A GPU GEMM of compute-dtype inputs that writes the fp32 accumulator (torch >= 2.8 on CUDA).
        self.mixed_gemm = bool(self.fused_wgrads) and mixed_gemm_works(device, compute_dtype, reduce_dtype)
        self.micro_batches, self.reduced = 1, False
        self.sink: Optional[GradSink] = None  # `attach_sink`
        self.late: list[bool] = []
        # ZeRO-2: (bucket, reduction, the shard it writes), oldest first; each shard is added into
        # the bucket's grad_shard once its reduction completes.
        self.reducing: deque[tuple[int, Pending, torch.Tensor]] = deque()
        # ZeRO-2: bytes of bucket buffers (and their output shards) alive now, and the most so far.
        self.bucket_bytes, self.bucket_peak_bytes = 0, 0
        # ZeRO-3: each unit's buckets, the units a chunk pass runs next and before (`plan`), the
        # bucket of each storage the parameters view, and the gathered bytes now and at most.
        self.unit_buckets: dict[str, tuple[int, ...]] = {}
        self.next_unit: dict[str, str] = {}
        self.prev_unit: dict[str, str] = {}
        self.unit_of_bucket: dict[int, str] = {}
        self.storage_bucket: dict[int, int] = {}
        self.gathered_bytes, self.gathered_peak_bytes = 0, 0
        if self.shard_params:
            for unit, members in units or ():
                ks = sorted({self.bucket_of[id(q)] for q in members})
                self.unit_buckets[unit] = tuple(ks)
                for k in ks:
                    self.unit_of_bucket.setdefault(k, unit)
            for k, full in enumerate(self.full):
                self.storage_bucket[full.untyped_storage()._cdata] = k
                full.untyped_storage().resize_(0)  # gathered when a unit enters

    @torch.no_grad()
    def _initial(self, start: int, end: int, indices: Sequence[int]) -> torch.Tensor:
        """The fp32 initial values of parameters `indices` in buffer range [start, end) (padding
        zero): the master weights come from them, not from a rounded copy. A meta parameter's
        values are computed from (seed, name) (`app.sharding.init`), only the range's."""
        out = torch.zeros(end - start, dtype=torch.float32, device=self.device)
        for i in indices:
            lo, hi = self.layout.local_range(i, (start, end))
            if lo < hi:
                at = self.offsets[i] + lo - start
                p = self.params[i]
                if p.is_meta:
                    assert self.seed is not None
                    values = initial_values(self.seed, self.names[i], p.meta, lo, hi, self.device)  # type: ignore[attr-defined]
                else:
                    values = p.detach().reshape(-1)[lo:hi]
                out[at : at + hi - lo].copy_(values)
        return out

    def _group(self, k: int) -> Any:
        """The group holding bucket k alike: dp, or the expert-data group for an expert bucket."""
        return self.expert_group if self.buckets[k].expert else self.group

    @staticmethod
    def _bucket_range(buffer: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """Elements [start, end) of `buffer`, the same memory under a version counter of their own
        (`.data`). Why: gloo completes an all-gather by copying into its output on a worker thread,
        which bumps the output's counter; if every parameter shared the whole buffer's counter, a
        bucket whose overlapped ZeRO-1 gather completes after the forward saved another bucket's
        weights would make autograd refuse those in backward ("modified by an inplace operation",
        the race 3 of 14 loaded 4-rank runs hit). Per bucket, autograd still sees every write to a
        bucket's own parameters."""
        return buffer[start:end].data

    @staticmethod
    def _view(p: nn.Parameter, values: torch.Tensor) -> None:
        """Parameter `p` becomes `values` (a view of a buffer), keeping its identity: a meta
        parameter cannot take a real tensor's data, so the two objects swap contents."""
        if not p.is_meta:
            p.data = values
            return
        real = nn.Parameter(values, requires_grad=p.requires_grad)
        real.__dict__.update(p.__dict__)  # `meta` and the other tags
        torch.utils.swap_tensors(p, real)

    # ---- gradients -------------------------------------------------------------------

    def attach_sink(self, sink: GradSink) -> None:
        """Tell `sink` each bucket's gradient as soon as it is final: at its reduction's launch,
        except for buckets that later sums change (sequence-parallel parameters, summed over tp; the
        tied embedding, over the pipeline) and ZeRO-2/3's shards (reduced per micro-batch), which
        are final only when `finish_grad_reduce` is done."""
        self.sink = sink
        metas = [p.meta for p in self.params]  # type: ignore[attr-defined]
        self.late = [
            self.shard_grads or any(metas[i].sequence_parallel or self.params[i] is self.tied_param for i in b.params)
            for b in self.buckets
        ]

    def start_step(self, micro_batches: int) -> None:
        """Begin a step: every accumulator takes its first gradient as a copy (`fresh`; ZeRO-2/3's
        shards are zeroed); the buckets wait for `micro_batches` gradients per parameter."""
        if self.reducing or any(f.reduce is not None or f.full is not None for f in self.flight):
            raise RuntimeError("start_step before finish_grad_reduce: a reduction is still in flight")
        self.micro_batches, self.reduced = micro_batches, False
        if self.sink is not None:
            self.sink.begin()
        self.fresh = [True] * len(self.params)  # each accumulator's first gradient is copied in
        self.in_main.clear()  # (left over only by a backward that raised)
        for f in self.flight:
            f.ready, f.launched, f.count = 0, False, 0
            if self.shard_grads:
                f.grad_shard.zero_()  # type: ignore[union-attr]  # the micro-batches' reductions add into it

    def _first_write(self, p: torch.Tensor) -> bool:
        """Whether this is the step's first gradient into p's accumulator, which is then copied in, not
        added (`fresh`, cleared here). ZeRO-2/3: p's bucket buffer opened (zeroed) if it is not; never."""
        if self.shard_grads:
            k = self.bucket_of[id(p)]
            if self.flight[k].full is None:
                self._open(k)
            return False
        i = self.index_of[id(p)]
        fresh, self.fresh[i] = self.fresh[i], False
        return fresh

    @torch.no_grad()
    def wgrad_into(self, p: torch.Tensor, grad_t: torch.Tensor, inputs: torch.Tensor) -> None:
        """Gradient accumulation fusion (train.fuse_grad_accumulation): p's weight gradient
        grad_t @ inputs goes straight into its accumulator, by one GEMM that writes it (a step's first
        gradient, `fresh`) or adds into it; the placeholder autograd then hands the hook is not read.
        A GPU GEMM of bf16/fp16 inputs writes and adds in the fp32 accumulator's own dtype."""
        fresh = self._first_write(p)
        main: torch.Tensor = p.main_grad  # type: ignore[attr-defined]
        if grad_t.dtype == main.dtype:
            if fresh:
                torch.mm(grad_t, inputs, out=main)
            else:
                main.addmm_(grad_t, inputs)
        elif self.mixed_gemm:
            if fresh:
                torch.mm(grad_t, inputs, out_dtype=main.dtype, out=main)
            else:
                torch.addmm(main, grad_t, inputs, out_dtype=main.dtype, out=main)
        elif fresh:  # no mixed-dtype GEMM (CPU): the hook's copy or add, and its rounding (no fusion)
            main.copy_(grad_t.mm(inputs))
        else:
            main.add_(grad_t.mm(inputs))
        self.in_main.add(id(p))

    @torch.no_grad()
    def _on_grad(self, p: torch.Tensor) -> None:
        grad, p.grad = p.grad, None
        if grad is not None:  # none: autograd got no gradient for p (3D's ORS delivers it via accumulate)
            self.accumulate(p, grad)

    @torch.no_grad()
    def accumulate(self, p: torch.Tensor, grad: torch.Tensor) -> None:
        """Add one backward's gradient of parameter `p` into its bucket (what the gradient hook does
        with autograd's; 3D's deferred reduce-scatters hand theirs here, `ZGradients.sink`), and
        launch the bucket's reduction once it has all of them."""
        k = self.bucket_of[id(p)]
        flight = self.flight[k]
        fresh = self._first_write(p)  # (False after `wgrad_into` took this gradient)
        if id(p) in self.in_main:  # the weight-gradient GEMM added it (`wgrad_into`): `grad` is a placeholder
            self.in_main.remove(id(p))
        elif fresh:
            p.main_grad.copy_(grad)  # type: ignore[attr-defined]
        else:
            p.main_grad.add_(grad)  # type: ignore[attr-defined]
        if self.shard_grads:
            flight.count += 1
            if flight.count == len(self.buckets[k].params):
                self._reduce_partial(k)
                if self.shard_params:
                    self._free(k)  # no later node of this backward reads its parameters
            return
        flight.ready += 1
        if self.overlap_grad_reduce and flight.ready == len(self.buckets[k].params) * self.micro_batches:
            self._launch_reduce(k)

    def _launch_reduce(self, k: int) -> None:
        b, f = self.buckets[k], self.flight[k]
        f.launched = True
        for i in b.params:  # a parameter without a gradient this step (`fresh`): zero, as if accumulated
            if self.fresh[i]:
                self.params[i].main_grad.zero_()  # type: ignore[attr-defined]
                self.fresh[i] = False
        if self.dp == 1:
            if self.sink is not None and not self.late[k]:
                self.sink.ready(k, None)
            return
        assert self.grad_buffer is not None  # ZeRO-2 reduces its bucket buffers (_reduce_partial)
        grads = self.grad_buffer[b.start : b.end]
        grads.div_(self.dp)  # the mean; dividing first keeps low-precision sums in range
        if self.zero:
            work = dist.reduce_scatter_single(f.grad_shard, grads, group=self._group(k), async_op=True)
        else:
            work = dist.all_reduce(grads, group=self._group(k), async_op=True)
        f.reduce = launch(self.timers, "dp", work, "gradient reduction")
        if self.sink is not None and not self.late[k]:
            self.sink.ready(k, work)

    def _open(self, k: int) -> None:
        """ZeRO-2: a zeroed buffer for bucket k's gradients, and its parameters' accumulators in it."""
        b, f = self.buckets[k], self.flight[k]
        f.full = torch.zeros(b.end - b.start, dtype=self.reduce_dtype, device=self.device)
        self._count_bytes(f.full)
        for i in b.params:
            p, lo = self.params[i], self.offsets[i] - b.start
            p.main_grad = f.full[lo : lo + p.numel()].view(p.shape)  # type: ignore[attr-defined]

    def _reduce_partial(self, k: int) -> None:
        """ZeRO-2: reduce-scatter bucket k's accumulated gradients (the mean over dp) into a shard
        added to grad_shard once it completes; the bucket's buffer goes with the reduction."""
        f = self.flight[k]
        while len(self.reducing) >= ZERO2_IN_FLIGHT:
            self._retire()
        full, f.full, f.count = f.full, None, 0
        assert full is not None and f.grad_shard is not None
        for i in self.buckets[k].params:  # their views would keep the buffer alive past the reduction
            self.params[i].main_grad = None  # type: ignore[attr-defined]
        full.div_(self.dp)
        shard = torch.empty_like(f.grad_shard)
        self._count_bytes(shard)
        work = dist.reduce_scatter_single(shard, full, group=self._group(k), async_op=True)
        pending = launch(self.timers, "dp", work, "gradient reduce_scatter")
        pending.keep = full  # alive until the reduction completes
        self.reducing.append((k, pending, shard))
        if not self.overlap_grad_reduce:
            self._retire()

    def _retire(self) -> None:
        """ZeRO-2: wait for the oldest reduction in flight and add its shard into its bucket's."""
        k, pending, shard = self.reducing.popleft()
        wait(self.timers, pending)
        self.flight[k].grad_shard.add_(shard)  # type: ignore[union-attr]
        self._count_bytes(pending.keep, -1)
        self._count_bytes(shard, -1)
        pending.keep = None

    def _count_bytes(self, t: torch.Tensor, sign: int = 1) -> None:
        self.bucket_bytes += sign * t.numel() * t.element_size()
        self.bucket_peak_bytes = max(self.bucket_peak_bytes, self.bucket_bytes)

    @torch.no_grad()
    def finish_grad_reduce(self, sp_group: Any = None) -> None:
        """Launch what backward did not, wait for every bucket, then sum the sequence-parallel
        partial gradients over tp (`sp_group`) and the tied embedding over its group. Once per step."""
        if self.reduced:
            return
        self.reduced = True
        if self.shard_grads:
            for k, f in enumerate(self.flight):
                if f.full is not None:  # gradients not yet reduced (a parameter without one this step)
                    self._reduce_partial(k)
            while self.reducing:
                self._retire()
        for k, f in enumerate(self.flight):
            if not f.launched and not self.shard_grads:
                self._launch_reduce(k)
                if not self.overlap_grad_reduce and f.reduce is not None:
                    wait(self.timers, f.reduce)
                    f.reduce = None
        for f in self.flight:
            if f.reduce is not None:
                wait(self.timers, f.reduce)
                f.reduce = None
        self.release()  # ZeRO-3: nothing gathered or in flight across the update
        if sp_group is not None:
            views = [v for s, _, v in self.held_grads() if self.layout.metas[s.param].sequence_parallel]
            if views:
                allreduce_flat(views, sp_group, self.timers, "tp")
        if self.tied_group is not None:
            views = [v for _, p, v in self.held_grads() if p is self.tied_param]
            if views:
                allreduce_flat(views, self.tied_group, self.timers, "pp")
        if self.sink is not None:
            self.sink.final()

    def grads(self, b: int) -> torch.Tensor:
        """The reduced gradient of this rank's shard of bucket b (reduce dtype)."""
        bucket, grad_shard = self.buckets[b], self.flight[b].grad_shard
        if grad_shard is not None:
            return grad_shard
        assert self.grad_buffer is not None
        return self.grad_buffer[bucket.shard_lo : bucket.shard_hi]

    def held_grads(self) -> Iterator[tuple[Segment, nn.Parameter, torch.Tensor]]:
        """(segment, parameter, reduced-gradient view) for every parameter part this rank updates."""
        for k in range(len(self.buckets)):
            g = self.grads(k)
            for s in self.layout.segments(k):
                yield s, self.params[s.param], g[s.lo : s.hi]

    # ---- parameters ------------------------------------------------------------------

    @property
    def separate_master(self) -> bool:
        """Whether this object keeps fp32 masters apart from the parameters (bf16/fp16, not offloaded):
        they are copied into the parameters after an update and checkpointed as their own group."""
        return not self.master_is_param and not self.master_offloaded

    def param_shard(self, b: int) -> torch.Tensor:
        """This rank's shard of bucket b's parameters on the device (compute dtype): where an
        offloaded optimizer writes its update (ZeRO-3: the kept shard)."""
        if self.shard_params:
            return self.param_shards[b]
        bucket = self.buckets[b]
        return self.bucket_params[b][bucket.shard_lo - bucket.start : bucket.shard_hi - bucket.start]

    def offload_master(self) -> list[torch.Tensor]:
        """Hand the fp32 master shards over to an offloaded optimizer (`app.optim.offload`): from
        now on it keeps them, writes each update into `param_shard`, and checkpoints them; the
        device keeps only the parameters. Returns the shards (their initial values)."""
        masters, self.master, self.master_offloaded = self.master, [], True
        if self.shard_params and self.master_is_param:  # fp32 ZeRO-3: the kept shards were the masters
            self.param_shards = [m.clone() for m in masters]
        return masters

    @torch.no_grad()
    def publish_params(self) -> None:
        """Copy the updated master shards into the parameter buffer and all-gather them over dp
        (ZeRO-3: into the kept shards; the next forward gathers them). With the masters
        offloaded, the optimizer has written the shards: only the all-gathers are left."""
        if self.shard_params:
            if self.separate_master:
                for shard, master in zip(self.param_shards, self.master):
                    shard.copy_(master)
            return
        assert self.param_buffer is not None
        if not self.zero:
            if self.separate_master:
                for k, master in enumerate(self.master):
                    self.param_shard(k).copy_(master)
            return
        for k, f in enumerate(self.flight):
            if f.gather is not None:
                raise RuntimeError("publish_params before the previous gather was waited for")
            # Never gather from the output itself: a copy of the shard.
            source = self.param_shard(k) if self.master_offloaded else self.master[k]
            send = source.to(self.param_buffer.dtype, copy=True)
            # Into the bucket's own range: its completion bumps only this bucket's version counter.
            work = dist.all_gather_single(self.bucket_params[k], send, group=self._group(k), async_op=True)
            f.gather = launch(self.timers, "dp", work, "parameter all_gather")
            f.gather.keep = send  # alive until the gather completes
            if not self.overlap_param_gather:
                self._wait_gather(f)

    def _wait_gather(self, f: InFlight) -> None:
        if f.gather is not None:
            wait(self.timers, f.gather)
            f.gather = None

    def wait_params(self, params: Optional[Sequence[torch.Tensor]] = None) -> None:
        """Wait for the all-gathers of the buckets holding `params` (all buckets by default;
        ZeRO-3: every gather, and the buckets are freed)."""
        if self.shard_params:
            self.release()
            return
        if params is None:
            for f in self.flight:
                self._wait_gather(f)
            return
        for k in sorted({self.bucket_of[id(p)] for p in params}):
            self._wait_gather(self.flight[k])

    def prefetch_hooks(self, first_uses: Sequence[tuple[nn.Module, Sequence[torch.Tensor]]]) -> None:
        """Forward pre-hooks: before `module` runs, wait for the buckets of the parameters it is
        the first to use (the overlapped ZeRO-1 all-gather)."""
        if not (self.zero and self.overlap_param_gather) or self.shard_params:
            return
        for module, params in first_uses:
            module.register_forward_pre_hook(lambda _m, _a, ps=tuple(params): self.wait_params(ps))

    # ---- ZeRO-3: gathered parameters ---------------------------------------------------

    def _gather(self, k: int) -> None:
        """Launch bucket k's parameter all-gather into its full buffer, unless it is there."""
        f, full = self.flight[k], self.full[k]
        if f.resident:
            return
        f.resident = True
        full.untyped_storage().resize_(full.numel() * full.element_size())
        self._count_gathered(full, 1)
        work = dist.all_gather_single(full, self.param_shards[k], group=self._group(k), async_op=True)
        f.gather = launch(self.timers, "dp", work, "parameter all_gather")
        if not self.overlap_param_gather:
            self._wait_gather(f)

    def _ensure(self, k: int) -> None:
        """Bucket k's parameters gathered and complete."""
        self._gather(k)
        self._wait_gather(self.flight[k])

    def _free(self, k: int) -> None:
        """Release bucket k's full buffer (its storage; the parameters' views stay)."""
        f, full = self.flight[k], self.full[k]
        if not f.resident:
            return
        self._wait_gather(f)  # never free a buffer a gather still writes
        if full.untyped_storage().resizable():
            full.untyped_storage().resize_(0)
        else:  # a reader pinned it (`.numpy()` does): the parameters move to a fresh buffer
            self._rebind(k)
        f.resident = False
        self._count_gathered(full, -1)

    def _rebind(self, k: int) -> None:
        """Bucket k's parameters become views of a new, empty full buffer (the old storage is
        left to whoever holds it)."""
        old = self.full[k]
        del self.storage_bucket[old.untyped_storage()._cdata]
        self.full[k] = torch.empty_like(old)
        self._bind(k)
        self.storage_bucket[self.full[k].untyped_storage()._cdata] = k
        self.full[k].untyped_storage().resize_(0)

    def _bind(self, k: int) -> None:
        """ZeRO-3: bucket k's parameters become views of its full buffer."""
        start = self.buckets[k].start
        for i in self.buckets[k].params:
            p, lo = self.params[i], self.offsets[i] - start
            self._view(p, self.full[k][lo : lo + p.numel()].view(p.shape))

    def _count_gathered(self, full: torch.Tensor, sign: int) -> None:
        self.gathered_bytes += sign * full.numel() * full.element_size()
        self.gathered_peak_bytes = max(self.gathered_peak_bytes, self.gathered_bytes)

    def _ahead(self, unit: str, links: dict[str, str]) -> list[int]:
        """The buckets of the ZERO3_PREFETCH units after `unit` along `links` (next or previous)."""
        out: list[int] = []
        for _ in range(ZERO3_PREFETCH):
            unit = links.get(unit, "")
            out += self.unit_buckets.get(unit, ())
        return out

    def _prefetch(self, unit: str, links: dict[str, str]) -> None:
        if self.overlap_param_gather:
            for k in self._ahead(unit, links):
                self._gather(k)

    def plan(self, units: list[str]) -> None:
        """The units one chunk pass runs, in order: whom each prefetches, forward and backward."""
        for a, b in zip(units, units[1:]):
            self.next_unit[a], self.prev_unit[b] = b, a

    def enter(self, unit: str) -> None:
        """Before `unit` reads its parameters: gather its buckets (waited for), and the next
        unit's ahead (the previous one's in backward, where a recomputation runs it again)."""
        if not self.shard_params:
            return
        ks = self.unit_buckets.get(unit, ())
        for k in ks:
            self._gather(k)
        self._prefetch(unit, self.prev_unit if in_backward() else self.next_unit)
        for k in ks:
            self._wait_gather(self.flight[k])

    def exit(self, unit: str) -> None:
        """After `unit`'s forward: free its buckets, but not those the unit ahead already holds.
        In backward (a recomputation) they stay: their gradients free them."""
        if not self.shard_params or in_backward():
            return
        ahead = set(self._ahead(unit, self.next_unit))
        for k in self.unit_buckets.get(unit, ()):
            if k not in ahead:
                self._free(k)

    def release(self) -> None:
        """Free every gathered bucket (ZeRO-3), waiting for gathers in flight."""
        for k in range(len(self.full)):
            self._free(k)

    def _pack(self, t: torch.Tensor) -> Any:
        k = self.storage_bucket.get(t.untyped_storage()._cdata)
        return t if k is None else _Held(k, t)

    def _unpack(self, saved: Any) -> torch.Tensor:
        if isinstance(saved, _Held):
            self._ensure(saved.bucket)
            self._prefetch(self.unit_of_bucket[saved.bucket], self.prev_unit)
            return saved.tensor
        return saved

    def saving(self) -> AbstractContextManager[Any]:
        """The context of the passes of a step: under ZeRO-3, autograd saves a marker for a
        parameter, and backward gathers its bucket when it needs it; otherwise nothing."""
        if not self.shard_params:
            return nullcontext()
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    @contextmanager
    def gathered(self) -> Iterator[None]:
        """Every parameter complete inside (ZeRO-3 gathers all buckets, and frees them after):
        for reading the model whole (tests, gathering to one rank). Collective over dp."""
        if not self.shard_params:
            self.wait_params()
            yield
            return
        for k in range(len(self.full)):
            self._ensure(k)
        try:
            yield
        finally:
            self.release()

    # ---- checkpoint state --------------------------------------------------------------

    def shard_states(self) -> list[ShardState]:
        """The parameters ("model", in the compute dtype) and, where they are apart from them,
        the fp32 master weights ("optimizer/master") as shard descriptors (`app.shards`)."""
        if self.shard_params:  # ZeRO-3: each rank holds (and loads) its shard of the parameters
            out = self.held_states(MODEL, self.param_shards)
            return out + (self.held_states(MASTER, self.master) if self.separate_master else [])
        out = []
        buffer = self.param_buffer
        assert buffer is not None
        for i, p in enumerate(self.params):
            off = self.offsets[i]
            out.append(self._shard_state(MODEL, i, buffer.dtype, (0, p.numel()),
                                         lambda lo, hi, off=off: buffer[off + lo : off + hi]))  # fmt: skip
        if self.separate_master:
            out += self.held_states(MASTER, self.master)
        return out

    def held_states(self, group: str, shards: Sequence[torch.Tensor]) -> list[ShardState]:
        """Shard descriptors of per-bucket state over this rank's shard of each bucket (`shards[b]`
        for bucket b, like `master`: the optimizer's moments), one per parameter part it holds."""
        return self.held_state_ranges(
            group, torch.float32 if not shards else shards[0].dtype, lambda b, lo, hi: shards[b][lo:hi]
        )

    def held_state_ranges(
        self,
        group: str,
        dtype: torch.dtype,
        view: Callable[[int, int, int], torch.Tensor],
        store: Optional[Callable[[int, int, torch.Tensor], None]] = None,
    ) -> list[ShardState]:
        """As `held_states`, for state reached by range: `view(b, lo, hi)` is elements [lo, hi) of
        bucket b's shard, `store(b, lo, values)` (state not in memory, e.g. a file) sets them."""
        out = []
        for b, bucket in enumerate(self.buckets):
            for i in bucket.params:
                lo, hi = self.layout.local_range(i, (bucket.shard_lo, bucket.shard_hi))
                base = self.offsets[i] - bucket.shard_lo
                keep = None if store is None else (lambda lo, values, b=b, base=base: store(b, base + lo, values))
                out.append(self._shard_state(group, i, dtype, (lo, hi),
                                             lambda lo, hi, b=b, base=base: view(b, base + lo, base + hi), keep))  # fmt: skip
        return out

    def _shard_state(
        self,
        group: str,
        i: int,
        dtype: torch.dtype,
        hold: tuple[int, int],
        view: Callable[[int, int], torch.Tensor],
        store: Optional[Callable[[int, torch.Tensor], None]] = None,
    ) -> ShardState:
        """Parameter i's state: the owner of its elements (`ParamLayout.owned`: every tp shard, tp
        rank 0 of a replicated tensor, never the tied head copy) writes its dp slice of the
        bucket, whether or not the optimizer shards (ZeRO-1), so every element is written once."""
        meta = self.layout.metas[i]
        # Inside `hold`: without ZeRO-1 a rank holds whole buckets, with it its shard is the slice.
        dp_slice = self.layout.dp_slice(self.bucket_of[id(self.params[i])])
        write = self.layout.local_range(i, dp_slice) if self.layout.owned[i] else (0, 0)
        return ShardState(group, self.names[i], tuple(meta.global_shape), tuple(meta.offset), meta.local_shape, dtype,
                          write, hold, view, store)  # fmt: skip

    # ---- reports ---------------------------------------------------------------------

    def master_bytes(self) -> int:
        """Bytes of fp32 master weights held apart from the parameter buffer."""
        return 0 if self.master_is_param else sum(m.numel() * m.element_size() for m in self.master)

    def buffer_bytes(self) -> dict[str, int]:
        """Bytes of the parameter buffer (ZeRO-3: the kept shards), the whole gradient buffer
        (none under ZeRO-2), the ZeRO gradient shards, the most ZeRO-2 bucket buffers held at
        once so far, and the most ZeRO-3 gathered parameters."""
        grads = self.grad_buffer
        shards = [f.grad_shard for f in self.flight if f.grad_shard is not None]
        params = [self.param_buffer] if self.param_buffer is not None else self.param_shards
        return {
            "parameters": sum(t.numel() * t.element_size() for t in params),
            "parameters_gathered_peak": self.gathered_peak_bytes,
            "gradients": 0 if grads is None else grads.numel() * grads.element_size(),
            "gradient_shard": sum(t.numel() * t.element_size() for t in shards),
            "gradient_buckets_peak": self.bucket_peak_bytes,
        }

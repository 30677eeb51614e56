"""AdamW and LAMB on (ZeRO-1 sharded) fp32 master weights, the LR schedule, grid-wide
gradient-norm clipping and the fp16 dynamic loss scaler.

The optimizer updates what `DataParallel` says this rank holds: for every bucket, a flat
fp32 master shard and its reduced gradient. Updates are element-wise, so a shard's update
is the same arithmetic as the unsharded one — except LAMB's layer-wise trust ratio, which
needs the norms of the whole logical parameter: partial sums over this rank's parts,
reduced over dp (ZeRO-1 shards) and tp (tp shards; a tensor replicated over tp counts
once), as in You et al., "Large Batch Optimization for Deep Learning", ICLR 2020.

On GPUs AdamW is torch's fused AdamW kernel (`torch._fused_adamw_`, what
torch.optim.AdamW(fused=True) runs: decoupled weight decay, bias correction, the gradient's
unscaling, one pass over memory), called once for the weight-decayed views of every bucket and
once for the rest (`app.optim.multi_tensor`); on CPUs torch.optim.AdamW's single-tensor
arithmetic, bucket by bucket (`ShardedOptimizer.fused` says why). Offloaded (`optim.offload`),
AdamW runs on the host as torch's fused CPU kernel with every element through its vector body
(`app.optim.host_adamw`), chunk by chunk as the store hands them out. Weight decay applies to
matrices only (`ParamMeta.decay`). LAMB's element-wise part runs bucket by bucket, its decay and
trust ratio as multi-tensor ops.

Every step's loss and gradient norm are checked on the whole grid at once (`step_verdict`: the
step's one device-to-host copy); `LossScaler` handles fp16 overflows and `NonFiniteGuard`
applies train.nonfinite to the rest.
"""

from __future__ import annotations

import math
import sys
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from app.deck import OptimConfig
from app.errors import NonFiniteError
from app.names import GRID_AXES
from app.optim.host_adamw import HostAdamW
from app.optim.multi_tensor import NormViews, clip_runs, complement, cut, fused_adamw
from app.optim.offload import HostStore, NvmeStore, OffloadStore
from app.optim.transfer import HostTransfer
from app.parallel.data import DataParallel
from app.runtime.grid import ProcessGrid
from app.shards import EXP_AVG, EXP_AVG_SQ, MASTER, ShardState


def device_thread(device: torch.device, name: str) -> ThreadPoolExecutor:
    """A one-thread executor whose thread works on `device`: a new thread's current CUDA device is 0,
    and its first CUDA call (an event's synchronize) would make a context there, on every rank of a
    node where each rank sees every GPU (0.3-0.5 GB of GPU 0 a rank)."""
    if device.type != "cuda":
        return ThreadPoolExecutor(1, thread_name_prefix=name)
    return ThreadPoolExecutor(1, thread_name_prefix=name, initializer=torch.cuda.set_device, initargs=(device,))


def learning_rate(cfg: OptimConfig, step: int, total_steps: int) -> float:
    """LR for optimizer step `step` (0-based): linear warm-up, then cosine/linear/constant decay."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant" or total_steps <= cfg.warmup_steps:
        return cfg.lr
    decay_steps = total_steps - cfg.warmup_steps - 1  # after the first: the last step reaches min_lr
    progress = 1.0 if decay_steps <= 0 else min(1.0, (step - cfg.warmup_steps) / decay_steps)
    factor = 1.0 - progress if cfg.schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * factor


class Scratch:
    """Work buffers kept from step to step, by name, device and dtype, each as large as its largest
    request. On a CPU a fresh temporary of at least glibc's mmap threshold (run.malloc_mmap_threshold_kb)
    is often mmapped and page-faulted in anew: measured on gpt_tiny, 4 ranks, the update's and the
    norm's temporaries took 4.6k-16.8k minor faults a step a rank, 1.1k-3.3k with these buffers,
    and the step 228-234 ms against 201-209."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.device, torch.dtype], torch.Tensor] = {}

    def like(self, name: str, t: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """A buffer of `t`'s shape and device (`dtype`: else t's), its values undefined."""
        dtype = t.dtype if dtype is None else dtype
        key = (name, t.device, dtype)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < t.numel():
            buf = self._buffers[key] = torch.empty(t.numel(), dtype=dtype, device=t.device)
        return buf[: t.numel()].view(t.shape)


def grad_norm_views(dp: DataParallel) -> NormViews:
    """The views of this rank's reduced gradients whose squares make the global norm: each
    logical element once (`ParamLayout.owned`), adjacent owned segments merged; group 1 the
    expert buckets', group 0 the rest (`dp_replicas`)."""
    views = NormViews(2, dp.device)
    for b, bucket in enumerate(dp.buckets):
        views.add(dp.grads(b), dp.layout.owned_runs(b), int(bucket.expert))
    return views


def dp_replicas(dp: DataParallel, expert: bool) -> int:
    """How many ranks of the dp group hold the same values of a bucket's state that each rank holds
    whole (no ZeRO): dp, or dp / ep for experts split over ep. A sum over dp divided by it counts
    each element once (`norm_axes`)."""
    return 1 if dp.zero else (dp.dp // dp.ep if expert else dp.dp)


def norm_axes(dp: DataParallel) -> tuple[str, ...]:
    """The axes a sum over this rank's parts (divided by `dp_replicas`) is summed over: all of them
    when ZeRO shards the buckets over dp (and cp: the shards are spread over dp x cp) or experts are
    split over ep, else tp and pp (dp and cp replicas hold the same values). The condition is the
    deck's (`dp.ep`), the same on every rank: a stage that holds no experts (`model.moe_every`) sums
    like the others, or the reductions over pp would mix divided and undivided parts."""
    return GRID_AXES if dp.zero or dp.ep > 1 else ("tp", "pp")


@torch.no_grad()
def step_verdict(
    squares: torch.Tensor, loss_sum: Optional[torch.Tensor], dp: DataParallel, grid: ProcessGrid
) -> tuple[float, bool, bool]:
    """(the global L2 norm of the 1-rank model's gradient, this step's loss is non-finite on some
    rank, the norm is non-finite on some rank), the same on every rank.

    `squares`: this rank's float64 sum of squares of its owned gradient elements (`NormViews`),
    summed here over tp and pp, and over dp when ZeRO shards the gradients (otherwise dp replicas
    hold the same values); `loss_sum`: this rank's local loss (the last stage holds it, the others
    0; None: not checked). Two flags, MAX over tp, pp and dp; the fp16 overflow test is the second
    flag. The norm and the flags reach the host in one copy: the step's only synchronisation."""
    grid.all_reduce(squares, norm_axes(dp))
    device = squares.device
    loss_bad = (
        torch.zeros((), dtype=torch.float64, device=device)
        if loss_sum is None
        else (~torch.isfinite(loss_sum.detach())).to(torch.float64)
    )
    flags = torch.stack((loss_bad, (~torch.isfinite(squares)).to(torch.float64)))
    grid.all_reduce(flags, GRID_AXES, dist.ReduceOp.MAX)  # every rank, cp's included
    # Watched: on NCCL the all-reduces return at once and the host waits here, in the copy.
    with grid.watchdog.blocking("device sync (the gradient norm's and flags' all-reduces)"):
        norm, loss_flag, norm_flag = torch.cat((squares.sqrt().reshape(1), flags)).tolist()
    return norm, loss_flag > 0, norm_flag > 0


class LossScaler:
    """fp16 dynamic loss scaling (Micikevicius et al. 2018): on an overflow anywhere in the
    grid the step is skipped and the scale halved; after `window` clean steps it doubles.
    A scale that would fall below `min_scale` means the gradients overflow even (nearly)
    unscaled: the run has diverged, and skipping more steps would only hide it."""

    def __init__(self, scale: float, window: int, min_scale: float = 1.0) -> None:
        self.scale, self.window, self.clean = scale, window, 0
        self.min_scale = min_scale
        self.skipped = 0

    def state_dict(self) -> dict[str, Any]:
        """The checkpoint's record of the scaler (`app.shards.JsonState`)."""
        return {"scale": self.scale, "clean": self.clean, "skipped": self.skipped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale, self.clean, self.skipped = state["scale"], state["clean"], state["skipped"]

    def update(self, overflow: bool, step: int = 0) -> None:
        """Count a clean step or an overflow at optimizer step `step` (1-based; for the message).
        Raises NonFiniteError when an overflow would take the scale below `min_scale`."""
        if overflow:
            halved = self.scale / 2
            if halved < self.min_scale:
                raise NonFiniteError(
                    f"fp16 gradients overflow at step {step} with the loss scale at {self.scale:g}: halving it "
                    f"would go below train.min_loss_scale = {self.min_scale:g} ({self.skipped} steps skipped on "
                    f"overflow before); training has diverged: lower optim.lr, use train.precision: bf16, or raise "
                    f"optim.warmup_steps"
                )
            # min_scale 0 never aborts; keep the scale a positive number all the same.
            self.scale, self.clean = max(halved, sys.float_info.min), 0
            self.skipped += 1
            return
        self.clean += 1
        if self.clean >= self.window:  # >=: a resume may bring a count past a smaller deck's window
            self.scale, self.clean = self.scale * 2, 0


NONFINITE_NAMES = {"loss": "loss", "grad_norm": "gradient norm"}  # metrics key -> words


class NonFiniteGuard:
    """What `train.nonfinite` does with a step whose loss or gradient norm is NaN/Inf on some
    rank. Pure counting and deciding; the verdict it gets is grid-wide, so every rank takes
    the same branch and raises the same NonFiniteError.

    abort: raise at once (before the update, so nothing of the bad state is checkpointed).
    skip: drop the step; raise when more than `max_skipped` are non-finite in a row.
    rollback: the trainer reloads the job's last checkpoint; raise after more than `max_skipped`
    rollbacks with no parameter update past the streak's last non-finite step in between (the
    steps a rollback replays up to it do not end the streak). An fp16 overflow (finite loss) is
    the `LossScaler`'s business, not this one's.
    """

    def __init__(self, policy: str, max_skipped: int, precision: str) -> None:
        self.policy, self.max_skipped, self.precision = policy, max_skipped, precision
        self.events = 0  # non-finite steps so far, resumes included (checkpoint header nonfinite_events)
        self.rollbacks = 0  # this run's
        self.in_a_row = 0  # non-finite steps (skip) or rollbacks (rollback) since the last update past them
        self.bad_step = 0  # the streak's latest non-finite step: only an update after it ends the streak

    def fix(self) -> str:
        bf16 = ", or use train.precision: bf16 (fp32's range)" if self.precision == "fp16" else ""
        return f"lower optim.lr or raise optim.warmup_steps{bf16}"

    def updated(self, step: int) -> None:
        """Step `step` updated the parameters: the streak is over if that is past its last non-finite
        step (a rollback replays the steps from its checkpoint up to there: they do not end it)."""
        if step > self.bad_step:
            self.in_a_row = 0

    def resumed(self, in_a_row: int, step: int) -> None:
        """A resume from a checkpoint of `step` written `in_a_row` non-finite steps or rollbacks into
        a streak (its header's nonfinite_in_a_row): the streak goes on from there."""
        self.in_a_row, self.bad_step = int(in_a_row), int(step)

    def nonfinite(self, step: int, what: list[str]) -> str:
        """Count non-finite step `step` (`what`: keys of NONFINITE_NAMES); returns the action,
        "skip" or "rollback", or raises NonFiniteError."""
        self.events += 1
        named = describe_nonfinite(what)
        if self.policy == "abort":
            raise NonFiniteError(
                f"non-finite {named} at step {step} (train.nonfinite: abort): stopped before the update, no "
                f"checkpoint of this state was written; {self.fix()} (train.nonfinite: skip or rollback goes on past "
                f"a bad batch)"
            )
        self.in_a_row += 1
        self.bad_step = max(self.bad_step, step)
        if self.in_a_row > self.max_skipped:
            streak = "non-finite steps skipped" if self.policy == "skip" else "rollbacks without an update"
            raise NonFiniteError(
                f"non-finite {named} at step {step}, after {self.in_a_row - 1} {streak} in a row (train.nonfinite: "
                f"{self.policy}, train.max_skipped = {self.max_skipped}): training has diverged; {self.fix()}"
            )
        if self.policy == "rollback":
            self.rollbacks += 1
        return self.policy

    def no_checkpoint(self, step: int, what: list[str], directory: object) -> str:
        """The message when rollback finds nothing to roll back to."""
        return (
            f"non-finite {describe_nonfinite(what)} at step {step} (train.nonfinite: rollback) and no checkpoint in "
            f"{directory} to roll back to: set checkpoint.every so that one is written before the problem; "
            f"{self.fix()}"
        )


def describe_nonfinite(what: list[str]) -> str:
    """["loss", "grad_norm"] -> "loss and gradient norm"."""
    return " and ".join(NONFINITE_NAMES[w] for w in what)


class ShardedOptimizer:
    """AdamW or LAMB over the master shards of a `DataParallel`, on the device, or offloaded
    (`store`: `app.optim.offload`, which then keeps the masters and moments)."""

    def __init__(
        self,
        dp: DataParallel,
        cfg: OptimConfig,
        grid: ProcessGrid,
        offload_file: Optional[Path] = None,
        offload_sharing: int = 1,
    ) -> None:
        self.dp, self.cfg, self.grid = dp, cfg, grid
        self.store: Optional[OffloadStore] = None
        self.exp_avg: list[torch.Tensor] = []
        self.exp_avg_sq: list[torch.Tensor] = []
        # LAMB's update of each bucket, alive from the update to the trust ratio (on the device only).
        self._lamb_updates: list[torch.Tensor] = []
        if cfg.offload == "none":
            self.exp_avg = [torch.zeros_like(m) for m in dp.master]
            self.exp_avg_sq = [torch.zeros_like(m) for m in dp.master]
            if cfg.name == "lamb":
                self._lamb_updates = [torch.empty_like(m) for m in dp.master]
        elif cfg.offload == "host":
            self.store = HostStore(dp.offload_master())
        else:
            if offload_file is None:
                raise ValueError("optim.offload = nvme needs this rank's state file")
            buffer = int(cfg.offload_buffer_mb * 1e6)
            self.store = NvmeStore(dp.offload_master(), offload_file, buffer, offload_sharing)
        self.steps = 0
        self.scratch = Scratch()  # LAMB's scaled gradient and denominator, bucket by bucket
        # Built at the first use, kept: views of buffers that live as long as this optimizer.
        self._norm_views: Optional[NormViews] = None
        self._adamw: Optional[list[_AdamWCall]] = None
        self._lamb_views: Optional[_LambViews] = None
        self._decay_views: list[list[torch.Tensor]] = []
        # The step count and 1 / grad_scale as device tensors, as the fused kernel reads them.
        self._step_t = torch.zeros((), dtype=torch.float32, device=dp.device)
        self._unscale_t = torch.ones((), dtype=torch.float32, device=dp.device)
        # Offloaded AdamW: the host's step count and 1 / grad_scale, the update of each chunk (kept:
        # views of the chunk's buffers) and the device <-> host traffic (attached to dp now: the
        # gradients leave during the first backward already).
        self._host_step_t = torch.zeros((), dtype=torch.float32)
        self._host_unscale_t = torch.ones((), dtype=torch.float32)
        self._host_adamw: dict[tuple[int, ...], HostAdamW] = {}
        self._transfer: Optional[HostTransfer] = None
        # Seconds of each recent AdamW pass on the host, from its first chunk to its last (the run's
        # log reports them: with the delay, whether the update slows beside forward and backward).
        self.host_update_s: deque[float] = deque(maxlen=1000)
        # optim.offload_delay: the update in flight on the host thread, and whether an update's
        # parameters wait in the staging buffer to be published (checkpointed: `unpublished`).
        self.delay = cfg.offload_delay if self.store is not None else 0
        self._worker = device_thread(dp.device, "gridlm-delayed-update") if self.delay else None
        self._pending: Optional[Future] = None
        self.unpublished = False
        if self.store is not None:
            self._transfer = HostTransfer(
                dp, self.store.max_chunk(), sets=2 if self.delay else 1, staging=bool(self.delay)
            )
            dp.attach_sink(self._transfer)

    def grad_squares(self) -> torch.Tensor:
        """This rank's float64 sum of squares of the gradient elements it counts (`step_verdict`
        sums it over the grid), in one multi-tensor norm; call after `finish_grad_reduce`."""
        if self._norm_views is None:
            self._norm_views = grad_norm_views(self.dp)
        dense, expert = self._norm_views.sum_squares()
        if self.dp.ep == 1:  # the whole grid's condition (`norm_axes`), not this stage's buckets
            return dense
        # Experts split over ep: the sum runs over dp too (`norm_axes`), each copy counted 1 / replicas.
        return dense / dp_replicas(self.dp, False) + expert / dp_replicas(self.dp, True)

    def shard_states(self) -> list[ShardState]:
        """The moments of the master shards (and, offloaded, the masters themselves unless the
        parameters are them: fp32), as shard descriptors (`app.shards`)."""
        if self.store is None:
            return self.dp.held_states(EXP_AVG, self.exp_avg) + self.dp.held_states(EXP_AVG_SQ, self.exp_avg_sq)
        self.wait_update()  # the delayed update in flight writes the state
        store, fp32 = self.store, torch.float32
        in_file = isinstance(store, NvmeStore)
        # Delayed: the masters are one update ahead of the parameters, so they are saved apart even in fp32.
        apart = not self.dp.master_is_param or self.delay
        groups = ([(0, MASTER)] if apart else []) + [
            (1, EXP_AVG), (2, EXP_AVG_SQ)
        ]  # fmt: skip
        out = []
        for which, group in groups:
            write = (lambda b, lo, values, w=which: store.write(w, b, lo, values)) if in_file else None
            out += self.dp.held_state_ranges(group, fp32, lambda b, lo, hi, w=which: store.read(w, b, lo, hi), write)
        return out

    @torch.no_grad()
    def restored(self, unpublished: bool = False) -> None:
        """After a checkpoint load: an offloaded fp32 run's masters are the parameters just read
        (delayed, they were read as a group of their own). `unpublished`: the checkpoint
        was taken with a delayed update's parameters not yet published; a delayed run publishes
        them at the end of its next step (its parameters were read as they were), another run
        read the masters' values as its parameters."""
        self._pending = None
        self.unpublished = False
        if self.store is None:
            return
        if self.dp.master_is_param and not self.delay:
            for b in range(len(self.dp.buckets)):
                self.store.write(0, b, 0, self.dp.param_shard(b).float())
        if self.delay and unpublished:
            assert self._transfer is not None
            for chunk in self.store.stream(range(len(self.dp.buckets))):
                self._transfer.stage(chunk.bucket, chunk.lo, chunk.master)
            self.unpublished = True

    def wait_update(self) -> None:
        """Return once no delayed update is in flight (its exception, if any, raised here)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    @torch.no_grad()
    def publish(self) -> None:
        """The delayed update: wait for the one in flight and put its parameters on the device (the
        end of the next step, and of the run)."""
        self.wait_update()
        if self.unpublished:
            assert self._transfer is not None
            self.dp.wait_params()  # the last publication's all-gathers (the run's end has no forward between)
            self._transfer.publish_staged()
            self.dp.publish_params()
            self.unpublished = False

    def state_bytes(self) -> int:
        """Bytes of optimizer state in this rank's memory: the moments, any separate fp32 master
        copy and LAMB's update buffers (offloaded: what the store holds in host memory)."""
        if self.store is not None:
            return self.store.host_bytes() + (self._transfer.host_bytes() if self._transfer is not None else 0)
        kept = sum(t.numel() * t.element_size() for t in self.exp_avg + self.exp_avg_sq + self._lamb_updates)
        return kept + self.dp.master_bytes()

    def close(self) -> None:
        """Release an offload store's files and threads (after the delayed update in flight)."""
        if self._worker is not None:
            try:
                self.wait_update()
            finally:
                self._worker.shutdown()
        if self.store is not None:
            self.store.close()

    def _grad(self, b: int, grad_scale: float) -> torch.Tensor:
        """Bucket b's reduced gradient in fp32, times `grad_scale` (in scratch: the buffer is not changed)."""
        g = self.dp.grads(b)
        if g.dtype != torch.float32:
            return self.scratch.like("grad", g, torch.float32).copy_(g).mul_(grad_scale)
        return torch.mul(g, grad_scale, out=self.scratch.like("grad", g)) if grad_scale != 1.0 else g

    def fused(self) -> bool:
        """Whether AdamW runs as torch's fused kernel: on GPUs. A CPU's fused kernel rounds the last
        (n mod vector width) elements of each tensor it is given in scalar code, 1 ulp apart from its
        vector body, so the same element could round differently on two grids (whose views are cut
        differently), which fp16 training amplified past the equivalence matrix's bounds (a 3D
        fp16 case: a bias 4.9e-3 off where the eager ops gave 3.8e-3). CPU ranks keep the eager
        passes, the same arithmetic for every element wherever it sits, bucket by bucket."""
        return self.cfg.name == "adamw" and self.dp.device.type == "cuda"

    @torch.no_grad()
    def step(self, lr: float, grad_scale: float = 1.0) -> None:
        """One update with gradients multiplied by `grad_scale` (clipping and loss unscaling)."""
        self.steps += 1
        if self.store is not None:
            self._offloaded_step(self.store, lr, grad_scale)
            return
        if self.fused():
            self._fused_adamw(lr, grad_scale)
        else:
            cfg = self.cfg
            bc1, bc2 = 1 - cfg.beta1**self.steps, 1 - cfg.beta2**self.steps
            lamb = cfg.name == "lamb"
            if not self._decay_views:  # AdamW's decayed elements of each bucket, as views kept
                self._decay_views = [cut(p, self.dp.layout.decay_runs(b)) for b, p in enumerate(self.dp.master)]
            for b, (p, m, v) in enumerate(zip(self.dp.master, self.exp_avg, self.exp_avg_sq)):
                out = self._lamb_updates[b] if lamb else None
                self._update(
                    p, m, v, self._grad(b, grad_scale), [] if lamb else self._decay_views[b], lr, bc1, bc2, out
                )
            if lamb:
                self._lamb_decay(self.dp.master, self._lamb_updates)
                self._lamb_apply(lr, self._lamb_updates)
        self.dp.publish_params()

    def _fused_adamw(self, lr: float, grad_scale: float) -> None:
        """AdamW over every bucket in two fused calls (decayed views, the rest); gradients in
        another dtype than fp32 are copied into an fp32 buffer bucket by bucket first."""
        if self._adamw is None:
            self._adamw = _AdamWCall.build(self.dp, self.exp_avg, self.exp_avg_sq)
        self._step_t.fill_(float(self.steps))
        unscale = None if grad_scale == 1.0 else self._unscale_t.fill_(1.0 / grad_scale)
        for call in self._adamw:
            call.run(self.dp, self.cfg, lr, self._step_t, unscale)

    def _update(
        self,
        p: torch.Tensor,
        m: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        decayed: Sequence[torch.Tensor],
        lr: float,
        bc1: float,
        bc2: float,
        out: Optional[torch.Tensor] = None,
    ) -> Optional[torch.Tensor]:
        """The eager element-wise update of master `p` with moments `m`, `v` and gradient `g`
        (torch.optim.AdamW's single-tensor arithmetic; `decayed`: views of p that weight decay
        applies to): AdamW applies it to `p`; LAMB writes its update (without decay, `_lamb_decay`)
        into `out` (else a new tensor) and returns it, for the trust ratio (`_lamb_apply`)."""
        cfg = self.cfg
        m.lerp_(g, 1 - cfg.beta1)
        v.mul_(cfg.beta2).addcmul_(g, g, value=1 - cfg.beta2)
        # Into scratch, then in place: no temporary per bucket (on CPUs a large one costs fresh
        # pages every step); the same values, bit for bit.
        denom = torch.sqrt(v, out=self.scratch.like("denom", v)).div_(math.sqrt(bc2)).add_(cfg.eps)
        if cfg.name == "adamw":
            if decayed:
                torch._foreach_mul_(list(decayed), 1 - lr * cfg.weight_decay)
            p.addcdiv_(m, denom, value=-lr / bc1)
            return None
        return torch.div(m, bc1, out=out if out is not None else torch.empty_like(m)).div_(denom)

    def _lamb_lists(self, masters: list[torch.Tensor], updates: list[torch.Tensor]) -> _LambViews:
        """LAMB's views of these masters and updates: built once for the device's (kept, like the
        buffers), per step for an offloaded step's host chunks."""
        if masters is self.dp.master and self._lamb_views is not None:
            return self._lamb_views
        views = _LambViews.build(self.dp, self.grid, masters, updates)
        if masters is self.dp.master:
            self._lamb_views = views
        return views

    def _lamb_decay(self, masters: list[torch.Tensor], updates: list[torch.Tensor]) -> None:
        """LAMB's weight decay, u += wd * w on the decayed elements of every bucket, in one call."""
        views = self._lamb_lists(masters, updates)
        if views.decayed_updates:
            torch._foreach_add_(views.decayed_updates, views.decayed_masters, alpha=self.cfg.weight_decay)

    def _offloaded_step(self, store: OffloadStore, lr: float, grad_scale: float) -> None:
        """The update chunk by chunk on the host (`OffloadStore.stream`), from the gradients the
        backward already copied out, each chunk's parameters copied back while the next is updated
        (`HostTransfer`). AdamW is torch's fused CPU kernel (`HostAdamW`: an element's update does
        not depend on how the chunks are cut), delayed by a step with optim.offload_delay; LAMB the
        eager arithmetic of `_update`."""
        transfer = self._transfer
        assert transfer is not None
        if self.cfg.name == "adamw" and self.delay:
            self.publish()  # the last step's update: its parameters go to the device now
            filled = transfer.take()
            assert self._worker is not None
            self._pending = self._worker.submit(self._host_adamw_pass, store, filled, lr, grad_scale, self.steps, True)
            self.unpublished = True
            return
        if self.cfg.name == "adamw":
            self._host_adamw_pass(store, transfer.take(), lr, grad_scale, self.steps, False)
            transfer.params_done()
            self.dp.publish_params()
            return
        cfg, dp = self.cfg, self.dp
        bc1, bc2 = 1 - cfg.beta1**self.steps, 1 - cfg.beta2**self.steps
        filled = transfer.take()
        masters: list[torch.Tensor] = []
        updates: list[torch.Tensor] = []
        for chunk in store.stream(range(len(dp.buckets))):  # LAMB: host only (the deck refuses nvme)
            b, lo, hi = chunk.bucket, chunk.lo, chunk.hi
            g = transfer.grad(filled, b, lo, hi)
            if grad_scale != 1.0:
                g.mul_(grad_scale)
            p = chunk.master
            update = self._update(p, chunk.exp_avg, chunk.exp_avg_sq, g, [], lr, bc1, bc2)
            assert update is not None
            masters.append(p)
            updates.append(update)
        self._lamb_decay(masters, updates)
        self._lamb_apply(lr, updates, masters)
        for b, p in enumerate(masters):
            transfer.param(b, 0, p)
        transfer.params_done()
        dp.publish_params()

    @torch.no_grad()
    def _host_adamw_pass(
        self, store: OffloadStore, filled: int, lr: float, grad_scale: float, step: int, staged: bool
    ) -> None:
        """AdamW over every chunk the store hands out, with the gradients of host set `filled`; the
        parameters go to the device (`HostTransfer.param`) or, delayed (`staged`, on the update
        thread), into the staging buffer."""
        dp, transfer = self.dp, self._transfer
        assert transfer is not None
        t0 = time.perf_counter()
        self._host_step_t.fill_(float(step))
        unscale = None if grad_scale == 1.0 else self._host_unscale_t.fill_(1.0 / grad_scale)
        for chunk in store.stream(range(len(dp.buckets))):
            b, lo, hi = chunk.bucket, chunk.lo, chunk.hi
            g = transfer.grad(filled, b, lo, hi)
            key = (b, lo, hi, chunk.master.data_ptr())
            update = self._host_adamw.get(key)
            if update is None:  # a store hands out the same chunks in the same buffers every step
                runs = clip_runs(dp.layout.decay_runs(b), lo, hi)
                update = self._host_adamw[key] = HostAdamW((chunk.master, chunk.exp_avg, chunk.exp_avg_sq), runs)
            update.step(self.cfg, lr, self._host_step_t, g, unscale)
            (transfer.stage if staged else transfer.param)(b, lo, chunk.master)
        self.host_update_s.append(time.perf_counter() - t0)

    def _lamb_apply(self, lr: float, updates: list[torch.Tensor], masters: Optional[list[torch.Tensor]] = None) -> None:
        """w <- w - lr * (||w|| / ||u||) * u, the norms over each whole logical parameter
        (`masters`: the fp32 master shards, the device's by default): one multi-tensor norm for
        all of them, one all-reduce, one copy of the ratios to the host, two multi-tensor ops."""
        dp = self.dp
        views = self._lamb_lists(dp.master if masters is None else masters, updates)
        n = len(dp.params)
        sums = views.norms.sum_squares().view(2, n)
        if views.replicas is not None:  # summed over dp as well (`norm_axes`): each copy counted 1 / replicas
            sums = sums / views.replicas
        # optim.offload: host sums its masters on the host, and a CUDA run's groups are nccl's alone,
        # which take device tensors only: the 2n sums cross to the device for the all-reduce.
        sums = sums.to(dp.device)
        self.grid.all_reduce(sums, tuple(a for a in norm_axes(dp) if a != "pp"))
        w_norm, u_norm = sums.sqrt()
        ratio = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm.clamp_min(1e-300), torch.ones_like(w_norm))
        ratio = ratio.float().tolist()
        if views.updates:
            torch._foreach_mul_(views.updates, [-lr * ratio[i] for i in views.params])
            torch._foreach_add_(views.masters, views.updates)


@dataclass
class _LambViews:
    """LAMB's lists over masters and updates: the norm views (group i: parameter i's master, n + i:
    its update; a tensor replicated over tp counted on one tp rank), the decayed ranges of both,
    and every segment of both with its parameter's index (the trust-ratio update)."""

    norms: NormViews
    decayed_updates: list[torch.Tensor]
    decayed_masters: list[torch.Tensor]
    updates: list[torch.Tensor]
    masters: list[torch.Tensor]
    params: list[int]
    # Experts split over ep: each parameter's dp replicas (`dp_replicas`), dividing its norms' sums.
    replicas: Optional[torch.Tensor] = None

    @classmethod
    def build(
        cls, dp: DataParallel, grid: ProcessGrid, masters: list[torch.Tensor], updates: list[torch.Tensor]
    ) -> _LambViews:
        layout, n = dp.layout, len(dp.params)
        norms = NormViews(2 * n, masters[0].device if masters else dp.device)
        tp_rank = grid.coords["tp"]
        views = cls(norms, [], [], [], [], [])
        if layout.has_experts:
            experts = {i for b in dp.buckets if b.expert for i in b.params}
            replicas = [float(dp_replicas(dp, i in experts)) for i in range(n)]
            views.replicas = torch.tensor(replicas * 2, dtype=torch.float64, device=norms.device).view(2, n)
        for b in range(len(masters)):
            runs = layout.decay_runs(b)
            views.decayed_updates += cut(updates[b], runs)
            views.decayed_masters += cut(masters[b], runs)
            for s in layout.segments(b):
                if layout.metas[s.param].counts_on(tp_rank):  # tp replicas hold the same values: once
                    norms.add(masters[b], [(s.lo, s.hi)], s.param)
                    norms.add(updates[b], [(s.lo, s.hi)], n + s.param)
                views.updates.append(updates[b][s.lo : s.hi])
                views.masters.append(masters[b][s.lo : s.hi])
                views.params.append(s.param)
        return views


class _AdamWCall:
    """One fused AdamW call's tensor lists: views of master shards, gradients and moments cut into
    the weight-decayed ranges and the rest (padding included: zero gradients leave it zero). On
    the device one call covers every bucket when the gradients are fp32; otherwise one bucket,
    whose gradient is first copied into an fp32 buffer (`grad_from`, `fp32`)."""

    def __init__(self) -> None:
        self.decayed: list[list[torch.Tensor]] = [[], [], [], []]  # params, grads, exp_avgs, exp_avg_sqs
        self.rest: list[list[torch.Tensor]] = [[], [], [], []]
        self.grad_from: Optional[int] = None
        self.fp32: Optional[torch.Tensor] = None

    def add(self, tensors: Sequence[torch.Tensor], decay_runs: Sequence[tuple[int, int]]) -> _AdamWCall:
        """Views of (master, gradient, exp_avg, exp_avg_sq), flat and of one length."""
        for lists, runs in ((self.decayed, decay_runs), (self.rest, complement(decay_runs, tensors[0].numel()))):
            for lst, t in zip(lists, tensors):
                lst += cut(t, runs)
        return self

    @classmethod
    def build(cls, dp: DataParallel, exp_avg: list[torch.Tensor], exp_avg_sq: list[torch.Tensor]) -> list[_AdamWCall]:
        """The calls of a device step over `dp`'s master shards and these moments."""
        sizes = [m.numel() for m in dp.master]
        copy = any(dp.grads(b).dtype != torch.float32 for b in range(len(sizes)))
        if not copy:
            call = cls()
            for b in range(len(sizes)):
                call.add((dp.master[b], dp.grads(b), exp_avg[b], exp_avg_sq[b]), dp.layout.decay_runs(b))
            return [call]
        fp32 = torch.empty(max(sizes, default=0), dtype=torch.float32, device=dp.device)
        calls = []
        for b, n in enumerate(sizes):
            call = cls().add((dp.master[b], fp32[:n], exp_avg[b], exp_avg_sq[b]), dp.layout.decay_runs(b))
            call.grad_from, call.fp32 = b, fp32
            calls.append(call)
        return calls

    def run(self, dp: DataParallel, cfg: OptimConfig, lr: float, step: torch.Tensor,
            unscale: Optional[torch.Tensor]) -> None:  # fmt: skip
        """The update: the fused kernel divides each gradient by `unscale` (1 / grad_scale) as it
        reads it, and writes it back so (nothing reads the reduced gradients after the update)."""
        if self.grad_from is not None:
            assert self.fp32 is not None
            g = dp.grads(self.grad_from)
            self.fp32[: g.numel()].copy_(g)
        for lists, decay in ((self.decayed, cfg.weight_decay), (self.rest, 0.0)):
            if lists[0]:
                fused_adamw(lists, step, cfg, lr, decay, unscale)


def clip_coefficient(norm: float, max_norm: float) -> float:
    """The factor that brings the gradient norm down to `max_norm` (1 when within it or 0 = off)."""
    return max_norm / (norm + 1e-6) if max_norm > 0 and norm > max_norm else 1.0

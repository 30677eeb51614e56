"""AdamW and LAMB on (ZeRO-1 sharded) fp32 master weights, the LR schedule, grid-wide
gradient-norm clipping and the fp16 dynamic loss scaler.

The optimizer updates what `DataParallel` says this rank holds: for every bucket, a flat
fp32 master shard and its reduced gradient. Updates are element-wise, so a shard's update
is the same arithmetic as the unsharded one — except LAMB's layer-wise trust ratio, which
needs the norms of the whole logical parameter: partial sums over this rank's parts,
reduced over dp (ZeRO-1 shards) and tp (tp shards; a tensor replicated over tp counts
once), as in You et al., "Large Batch Optimization for Deep Learning", ICLR 2020.

AdamW is torch.optim.AdamW's single-tensor arithmetic (decoupled weight decay, bias
correction); weight decay applies to matrices only (`ParamMeta.decay`).

Every step's loss and gradient norm are checked on the whole grid at once
(`nonfinite_anywhere`); `LossScaler` handles fp16 overflows and `NonFiniteGuard` applies
train.nonfinite to the rest.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from app.deck import OptimConfig
from app.errors import NonFiniteError
from app.optim.offload import HostStore, NvmeStore, OffloadStore
from app.parallel.data import DataParallel
from app.runtime.grid import ProcessGrid
from app.shards import ShardState


def learning_rate(cfg: OptimConfig, step: int, total_steps: int) -> float:
    """LR for optimizer step `step` (0-based): linear warm-up, then cosine/linear/constant decay."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant" or total_steps <= cfg.warmup_steps:
        return cfg.lr
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps - 1))
    factor = 1.0 - progress if cfg.schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * factor


NORM_CHUNK = 2**20  # elements of a gradient squared at once in float64 (8 MiB of scratch)


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


@torch.no_grad()
def add_squares(acc: torch.Tensor, x: torch.Tensor, scratch: Scratch) -> None:
    """acc (a float64 scalar, or a view of one) += the float64 sum of x's squares, NORM_CHUNK
    elements at a time in `scratch`'s "norm" buffer on x's device (no whole-tensor temporary)."""
    for lo in range(0, x.numel(), NORM_CHUNK):
        part = x[lo : lo + NORM_CHUNK]
        squares = scratch.like("norm", part, torch.float64)
        squares.copy_(part)
        acc += squares.pow_(2).sum().to(acc.device)


@torch.no_grad()
def grad_norm(dp: DataParallel, grid: ProcessGrid, scratch: Optional[Scratch] = None) -> float:
    """Global L2 norm of the gradient of the 1-rank model, from the reduced shards.

    Call after `dp.finish_grad_reduce()`. Each logical element counts once
    (`ParamLayout.owned`); the sum is reduced over tp and pp, and over dp when ZeRO-1
    shards the gradients (otherwise dp replicas hold the same values). inf/nan propagate.
    Squares are summed in float64, NORM_CHUNK elements at a time in `scratch`'s buffer.
    """
    scratch = Scratch() if scratch is None else scratch
    local = torch.zeros((), dtype=torch.float64, device=dp.device)
    for s, _, g in dp.held_grads():
        if dp.layout.owned[s.param]:
            add_squares(local, g, scratch)
    grid.all_reduce(local, ("tp", "pp", "dp") if dp.zero else ("tp", "pp"))
    return float(local.sqrt())


def nonfinite_anywhere(
    loss_sum: Optional[torch.Tensor], norm: float, grid: ProcessGrid, device: torch.device
) -> tuple[bool, bool]:
    """(this step's loss is non-finite on some rank, the gradient norm is non-finite on some
    rank), the same on every rank: one MAX all-reduce of two flags over tp, pp and dp.

    `loss_sum` is this rank's local loss (the last stage holds it, the others hold 0; None:
    not checked). The fp16 overflow test is the second flag, so it costs nothing extra."""
    loss_bad = torch.zeros((), device=device) if loss_sum is None else (~torch.isfinite(loss_sum.detach())).float()
    flags = torch.stack((loss_bad, torch.tensor(float(not math.isfinite(norm)), device=device)))
    grid.all_reduce(flags, ("tp", "pp", "dp"), dist.ReduceOp.MAX)
    loss_flag, norm_flag = flags.tolist()
    return loss_flag > 0, norm_flag > 0


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
        if self.clean == self.window:
            self.scale, self.clean = self.scale * 2, 0


NONFINITE_NAMES = {"loss": "loss", "grad_norm": "gradient norm"}  # metrics key -> words


class NonFiniteGuard:
    """What `train.nonfinite` does with a step whose loss or gradient norm is NaN/Inf on some
    rank. Pure counting and deciding; the verdict it gets is grid-wide, so every rank takes
    the same branch and raises the same NonFiniteError.

    abort: raise at once (before the update, so nothing of the bad state is checkpointed).
    skip: drop the step; raise when more than `max_skipped` are non-finite in a row.
    rollback: the trainer reloads the last checkpoint; raise after more than `max_skipped`
    rollbacks with no parameter update in between. An fp16 overflow (finite loss) is the
    `LossScaler`'s business, not this one's.
    """

    def __init__(self, policy: str, max_skipped: int, precision: str) -> None:
        self.policy, self.max_skipped, self.precision = policy, max_skipped, precision
        self.events = 0  # non-finite steps so far, resumes included (checkpoint header nonfinite_events)
        self.rollbacks = 0  # this run's
        self.in_a_row = 0  # non-finite steps (skip) or rollbacks (rollback) since the last update

    def fix(self) -> str:
        bf16 = ", or use train.precision: bf16 (fp32's range)" if self.precision == "fp16" else ""
        return f"lower optim.lr or raise optim.warmup_steps{bf16}"

    def updated(self) -> None:
        """A step updated the parameters: the streak is over."""
        self.in_a_row = 0

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
        self, dp: DataParallel, cfg: OptimConfig, grid: ProcessGrid, offload_file: Optional[Path] = None
    ) -> None:
        self.dp, self.cfg, self.grid = dp, cfg, grid
        self.store: Optional[OffloadStore] = None
        self.exp_avg: list[torch.Tensor] = []
        self.exp_avg_sq: list[torch.Tensor] = []
        if cfg.offload == "none":
            self.exp_avg = [torch.zeros_like(m) for m in dp.master]
            self.exp_avg_sq = [torch.zeros_like(m) for m in dp.master]
        elif cfg.offload == "host":
            self.store = HostStore(dp.offload_master())
        else:
            if offload_file is None:
                raise ValueError("optim.offload = nvme needs this rank's state file")
            self.store = NvmeStore(dp.offload_master(), offload_file, int(cfg.offload_buffer_mb * 1e6))
        self.steps = 0
        self.scratch = Scratch()  # the scaled gradient and the denominator, bucket by bucket

    def shard_states(self) -> list[ShardState]:
        """The moments of the master shards (and, offloaded, the masters themselves unless the
        parameters are them: fp32), as shard descriptors (`app.shards`)."""
        if self.store is None:
            return self.dp.held_states("optimizer/exp_avg", self.exp_avg) + self.dp.held_states(
                "optimizer/exp_avg_sq", self.exp_avg_sq
            )
        store, fp32 = self.store, torch.float32
        in_file = isinstance(store, NvmeStore)
        groups = ([] if self.dp.master_is_param else [(0, "optimizer/master")]) + [
            (1, "optimizer/exp_avg"), (2, "optimizer/exp_avg_sq")
        ]  # fmt: skip
        out = []
        for which, group in groups:
            write = (lambda b, lo, values, w=which: store.write(w, b, lo, values)) if in_file else None
            out += self.dp.held_state_ranges(group, fp32, lambda b, lo, hi, w=which: store.read(w, b, lo, hi), write)
        return out

    @torch.no_grad()
    def restored(self) -> None:
        """After a checkpoint load: an offloaded fp32 run's masters are the parameters just read."""
        if self.store is not None and self.dp.master_is_param:
            for b in range(len(self.dp.buckets)):
                self.store.write(0, b, 0, self.dp.param_shard(b).float())

    def state_bytes(self) -> int:
        """Bytes of optimizer state in this rank's memory: the moments and any separate fp32
        master copy (offloaded: what the store holds in host memory)."""
        if self.store is not None:
            return self.store.host_bytes()
        moments = sum(t.numel() * t.element_size() for t in self.exp_avg + self.exp_avg_sq)
        return moments + self.dp.master_bytes()

    def close(self) -> None:
        """Release an offload store's files and threads."""
        if self.store is not None:
            self.store.close()

    def _grad(self, b: int, grad_scale: float) -> torch.Tensor:
        """Bucket b's reduced gradient in fp32, times `grad_scale` (in scratch: the buffer is not changed)."""
        g = self.dp.grads(b)
        if g.dtype != torch.float32:
            return self.scratch.like("grad", g, torch.float32).copy_(g).mul_(grad_scale)
        return torch.mul(g, grad_scale, out=self.scratch.like("grad", g)) if grad_scale != 1.0 else g

    @torch.no_grad()
    def step(self, lr: float, grad_scale: float = 1.0) -> None:
        """One update with gradients multiplied by `grad_scale` (clipping and loss unscaling)."""
        self.steps += 1
        if self.store is not None:
            self._offloaded_step(self.store, lr, grad_scale)
            return
        cfg = self.cfg
        bc1, bc2 = 1 - cfg.beta1**self.steps, 1 - cfg.beta2**self.steps
        updates = []
        for b, (p, m, v) in enumerate(zip(self.dp.master, self.exp_avg, self.exp_avg_sq)):
            decay_runs = self.dp.layout.decay_runs(b)  # elements with weight decay, neighbours merged
            update = self._update(p, m, v, self._grad(b, grad_scale), decay_runs, lr, bc1, bc2)
            if update is not None:
                updates.append(update)
        if cfg.name == "lamb":
            self._lamb_apply(lr, updates)
        self.dp.publish_params()

    def _update(
        self,
        p: torch.Tensor,
        m: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        decay_runs: Sequence[tuple[int, int]],
        lr: float,
        bc1: float,
        bc2: float,
    ) -> Optional[torch.Tensor]:
        """The element-wise part of one update of master `p` with moments `m`, `v` and gradient
        `g` (weight decay on `decay_runs`): AdamW applies it to `p`; LAMB returns the update,
        which its trust ratio scales (`_lamb_apply`)."""
        cfg = self.cfg
        m.lerp_(g, 1 - cfg.beta1)
        v.mul_(cfg.beta2).addcmul_(g, g, value=1 - cfg.beta2)
        # Into scratch, then in place: no temporary per bucket (on CPUs a large one costs fresh
        # pages every step); the same values, bit for bit.
        denom = torch.sqrt(v, out=self.scratch.like("denom", v)).div_(math.sqrt(bc2)).add_(cfg.eps)
        if cfg.name == "adamw":
            for lo, hi in decay_runs:
                p[lo:hi].mul_(1 - lr * cfg.weight_decay)
            p.addcdiv_(m, denom, value=-lr / bc1)
            return None
        update = (m / bc1).div_(denom)
        for lo, hi in decay_runs:
            update[lo:hi].add_(p[lo:hi], alpha=cfg.weight_decay)
        return update

    def _offloaded_step(self, store: OffloadStore, lr: float, grad_scale: float) -> None:
        """The same update, chunk by chunk on the host (`OffloadStore.stream`): each gradient range
        copied from the device, the update on the CPU, the parameters copied back into the
        device's shard. AdamW's arithmetic is element-wise, so chunks change no bit of it."""
        cfg, dp = self.cfg, self.dp
        bc1, bc2 = 1 - cfg.beta1**self.steps, 1 - cfg.beta2**self.steps
        masters: list[torch.Tensor] = []
        updates: list[torch.Tensor] = []
        for chunk in store.stream(range(len(dp.buckets))):
            b, lo, hi = chunk.bucket, chunk.lo, chunk.hi
            g = dp.grads(b)[lo:hi].to("cpu", torch.float32, copy=dp.device.type == "cpu")
            if grad_scale != 1.0:
                g.mul_(grad_scale)
            p = chunk.master
            runs = [(max(a, lo) - lo, min(z, hi) - lo) for a, z in dp.layout.decay_runs(b) if a < hi and z > lo]
            update = self._update(p, chunk.exp_avg, chunk.exp_avg_sq, g, runs, lr, bc1, bc2)
            if update is None:
                dp.param_shard(b)[lo:hi].copy_(p, non_blocking=True)
            else:  # LAMB, host only (the deck refuses it with nvme): whole bucket shards
                masters.append(p)
                updates.append(update)
        if cfg.name == "lamb":
            self._lamb_apply(lr, updates, masters)
            for b, p in enumerate(masters):
                dp.param_shard(b).copy_(p, non_blocking=True)
        if dp.device.type == "cuda":
            torch.cuda.current_stream(dp.device).synchronize()  # the host buffers are reused next chunk/step
        dp.publish_params()

    def _lamb_apply(self, lr: float, updates: list[torch.Tensor], masters: Optional[list[torch.Tensor]] = None) -> None:
        """w <- w - lr * (||w|| / ||u||) * u, the norms over each whole logical parameter
        (`masters`: the fp32 master shards, the device's by default)."""
        dp, grid = self.dp, self.grid
        masters = dp.master if masters is None else masters
        tp_rank = grid.coords["tp"]
        sums = torch.zeros(len(dp.params), 2, dtype=torch.float64, device=dp.device)
        for b in range(len(dp.buckets)):
            for s in dp.layout.segments(b):
                if not dp.layout.metas[s.param].counts_on(tp_rank):
                    continue  # the tp replicas hold the same values: count them once
                add_squares(sums[s.param, 0], masters[b][s.lo : s.hi], self.scratch)
                add_squares(sums[s.param, 1], updates[b][s.lo : s.hi], self.scratch)
        grid.all_reduce(sums, ("tp", "dp") if dp.zero else ("tp",))
        norms = sums.sqrt()
        w_norm, u_norm = norms[:, 0], norms[:, 1]
        ratio = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm.clamp_min(1e-300), torch.ones_like(w_norm))
        ratio = ratio.float().tolist()
        for b in range(len(dp.buckets)):
            for s in dp.layout.segments(b):
                masters[b][s.lo : s.hi].add_(updates[b][s.lo : s.hi], alpha=-lr * ratio[s.param])


def clip_coefficient(norm: float, max_norm: float) -> float:
    """The factor that brings the gradient norm down to `max_norm` (1 when within it or 0 = off)."""
    return max_norm / (norm + 1e-6) if max_norm > 0 and norm > max_norm else 1.0

"""The optimizer step's time in the performance model (`app.plan.perf`): bytes per element of a
rank's shard as `app/optim/optimizer.py` moves them, on the device (`ShardedOptimizer.step`) or
offloaded (`optim.offload`: `_offloaded_step`), and the seconds they take on a machine.

Pure Python, like the rest of the model. N is the elements of the shard a rank updates (1/dp of
its stage's parameters under ZeRO >= 1 with dp > 1, all of them otherwise), g the bytes of a
reduced gradient element, e of a parameter in the compute dtype.

The offloaded step, chunk by chunk (a whole bucket shard in host memory; a slot of
`optim.offload_buffer_mb` / 36 elements streamed from the rank's file with nvme):

* the gradients cross device -> host during backward, each bucket's as its reduction completes, on
  a stream of their own (`app.optim.transfer`; N g over the host link, in the reduce dtype): only
  the last bucket's copy is left when backward ends (1 / buckets of it); a bf16/fp16 gradient
  becomes fp32 on the CPU;
* the update runs on the CPU (`offload_update_bytes`), at the rank's share of the node's DRAM
  bandwidth (host_memory_gbs / ranks on the node): AdamW as torch's fused CPU kernel, LAMB as
  eager passes;
* AdamW: the master range becomes the compute dtype on the CPU and crosses host -> device on
  another stream (N e over the link) while the next chunk is updated: a two-stage pipeline over
  the chunks, max(update, copy) + min(update, copy) / chunks; LAMB: the same, the compute dtype
  made on the CPU once the trust ratios are known.

nvme adds the file (O_DIRECT, past the page cache): a reader thread reads the next chunk's 12
bytes per element and a writer thread writes the previous chunk back while the main thread
updates, so per step the slowest of the three streams counts, plus one chunk read before the
first update and one written after the last. ZeRO-1/2 then copy the parameter shard into the
all-gather's send buffer on the device (2 e).

The delayed update (optim.offload_delay: 1) runs all that but the parameters' crossing on a host
thread during the next step's forward and backward: the step waits for what of it outlasts them,
then for the staged parameters' crossing (N e) and the gather's copy. On a CPU machine the thread
shares the cores the passes use, so nothing is hidden. docs/PERFORMANCE_MODEL.md, "Optimizer
offload", has the equations, the constants' sources and what is left out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from app.deck import Deck
from app.names import BYTES, offload_chunk, reduce_precision
from app.plan.device import Device
from app.plan.estimate import OFFLOAD_STATE_BYTES
from app.plan.machine import Machine

# AdamW on GPUs is torch's fused kernel (`_AdamWCall`): one pass that reads the master, the fp32
# gradient and both moments and writes the master and both moments; when it unscales the gradient
# (clipping, fp16's loss scale) it writes the gradient back too (4).
FUSED_ADAMW_BYTES = 16 + 12
# The eager passes of `ShardedOptimizer._update` (CPU ranks, offloaded steps, LAMB): m.lerp_(g) 12,
# v.mul_() 8, v.addcmul_(g, g) 12; the denominator v.sqrt() 8, .div_() 8, .add_(eps) 8.
MOMENTS_BYTES = 12 + 8 + 12
DENOMINATOR_BYTES = 8 + 8 + 8
# Framework ops of one offloaded chunk under LAMB: two slices, the gradient's copy, its scaling, the
# six passes of the moments and the denominator, the update, the parameter copy.
OFFLOAD_CHUNK_OPS = 12
# Under AdamW (`HostAdamW`): the gradient's slice and copy, per weight-decay class four gathers of
# the tails, the fused call and three scatters, the parameter's slice and copy.
OFFLOAD_ADAMW_CHUNK_OPS = 2 + 2 * (4 + 1 + 3) + 2
# Framework ops of a device step that do not grow with the model (tests/test_optim.py counts 22 on
# AdamW in fp32): the norm's multi-tensor call and its sums, the verdict, the fused calls.
STEP_OPS = 22


def grad_norm_bytes(g: int) -> int:
    """Bytes per gradient element of the gradient norm (`app.optim.multi_tensor.NormViews`): one
    multi-tensor norm reads each element once (float32 partial sums; nothing is written)."""
    return g


def _scaled(deck: Deck) -> bool:
    """Whether the step multiplies the gradient by a scale (clipping; fp16's loss-scale inverse)."""
    return deck.optim.grad_clip > 0 or deck.train.precision == "fp16"


def _lamb_apply_bytes() -> int:
    """LAMB's bytes per element after the denominator: m / bc1 into the update buffer (8), / denom
    (12), + wd w on the decayed elements (12), the two multi-tensor norms of w and u (4 + 4), u times
    its parameter's ratio (8), w += u (12)."""
    return 8 + 12 + 12 + 8 + 8 + 12


def _update_bytes(deck: Deck, fused: bool) -> int:
    """Bytes per element of the update proper, from the fp32 gradient on: on GPUs (`fused`) AdamW's
    fused pass (and its write-back of the unscaled gradient); on CPUs, and for LAMB, the scaling into
    scratch and the eager passes (AdamW's decay and update: 8 + 16)."""
    if fused and deck.optim.name == "adamw":
        return FUSED_ADAMW_BYTES + (4 if _scaled(deck) else 0)
    apply = _lamb_apply_bytes() if deck.optim.name == "lamb" else 8 + 16
    return (8 if _scaled(deck) else 0) + MOMENTS_BYTES + DENOMINATOR_BYTES + apply


def _updates_params_in_place(deck: Deck) -> bool:
    """Whether the update writes the parameters themselves (fp32, no ZeRO-1/2; under ZeRO-3 the
    fp32 master is the parameter shard): otherwise the fp32 master is written again to the
    parameters, or to the ZeRO-1/2 gather's send buffer."""
    return deck.train.precision == "fp32" and not (deck.optim.zero in (1, 2) and deck.replicas > 1)


def _grad_bytes(deck: Deck) -> int:
    tr = deck.train
    return BYTES[reduce_precision(tr.precision, tr.grad_reduce_dtype)]


def optimizer_bytes(deck: Deck, fused: bool = True) -> int:
    """Bytes per element of a rank's shard moved by `ShardedOptimizer.step`, kernel by kernel as it
    runs (fp32 moments; every kernel reads its operands and writes its results once); `fused`: on a
    GPU (`ShardedOptimizer.fused`), else a CPU's eager passes."""
    e, g = BYTES[deck.train.precision], _grad_bytes(deck)
    total = (g + 4) if g != 4 else 0  # the gradient to fp32
    total += _update_bytes(deck, fused)
    if not _updates_params_in_place(deck):
        total += 4 + e  # the fp32 master written to the parameters (or to the ZeRO-1 gather's send buffer)
    return total


def optimizer_ops(deck: Deck, buckets: int, fused: bool = True) -> int:
    """Framework ops of a device step (host time on CPUs): STEP_OPS, and per bucket the fp32 copy of a
    lower-precision gradient with its own two fused calls, the parameters' copy or gather; the eager
    path (CPUs, LAMB) about 14 ops per bucket (tests/test_optim.py counts them)."""
    per_bucket = 0 if _grad_bytes(deck) == 4 else 3
    per_bucket += 0 if _updates_params_in_place(deck) else 2
    per_bucket += 0 if fused and deck.optim.name == "adamw" else 14
    return STEP_OPS + per_bucket * buckets


def optimizer_state_bytes(deck: Deck) -> int:
    """Bytes per element of a rank's shard the update reads from memory and writes back once a
    step: the reduced gradient, the fp32 master and both moments in, master and moments out (and
    the parameter, where it is not the master). Each rank's shard outgrows its share of the
    last-level cache as soon as a model is not tiny, so the step brings all of it in again."""
    return _grad_bytes(deck) + 12 + 12 + (0 if _updates_params_in_place(deck) else BYTES[deck.train.precision])


def offload_update_bytes(deck: Deck) -> int:
    """Bytes per element the CPU moves in `_offloaded_step` (with nvme the drive reads and writes the
    stream's buffers directly, O_DIRECT: no copy through the page cache).

    From the gradients' host copy (`HostTransfer`; on a CPU machine that copy is a pass of its own,
    `offload_time`): a bf16/fp16 gradient made fp32 (g + 4; an fp32 one is updated where it
    lies), the update (AdamW: torch's fused pass, `HostAdamW`; LAMB: `_update`'s eager passes), and
    the master made the compute dtype (4 + e) into the buffer the parameters cross from (or are
    staged in, delayed), fp32 included."""
    e, g = BYTES[deck.train.precision], _grad_bytes(deck)
    fused = deck.optim.name == "adamw"
    return ((g + 4) if g != 4 else 0) + _update_bytes(deck, fused=fused) + 4 + e


def offload_state_bytes(deck: Deck) -> int:
    """Bytes per element of the offloaded step that no cache holds (CPU machines, `memory_gbs`):
    the gradient in, the master and both moments in and out, the parameter out (the store keeps
    its own master, even in fp32)."""
    return _grad_bytes(deck) + 2 * OFFLOAD_STATE_BYTES + BYTES[deck.train.precision]


def nvme_chunk_elements(deck: Deck) -> int:
    """Elements of one nvme stream slot, as `NvmeStore` cuts them from optim.offload_buffer_mb
    (`offload_chunk`; the callers cap it at the shard)."""
    return offload_chunk(int(deck.optim.offload_buffer_mb * 1e6))


@dataclass(frozen=True)
class OffloadRates:
    """One rank's rates for the offloaded step, bytes/s: its device's host link, its share of the
    node's DRAM bandwidth and of the node's drive (None where the machine gives none or the deck
    does not use it)."""

    link: Optional[float]
    memory: Optional[float]
    read: Optional[float] = None
    write: Optional[float] = None


def offload_rates(deck: Deck, machine: Machine, ranks_on_node: int) -> OffloadRates:
    """The rates of `deck`'s offload on `machine` with `ranks_on_node` ranks sharing a node, from a
    machine file checked for them (`Machine.require_prediction`; `app.plan.perf.place` does)."""

    def share(gbs: Optional[float]) -> Optional[float]:
        return None if gbs is None else gbs * 1e9 / ranks_on_node

    link = None if machine.host_link_gbs is None else machine.host_link_gbs * 1e9
    nvme = deck.optim.offload == "nvme"
    return OffloadRates(
        link=link,
        memory=share(machine.host_memory_gbs),
        read=share(machine.nvme_read_gbs) if nvme else None,
        write=share(machine.nvme_write_gbs) if nvme else None,
    )


@dataclass(frozen=True)
class OffloadTime:
    """Seconds of one rank's offloaded step, by part (`total` is what the step waits for)."""

    to_host: float  # the gradient copies device -> host (all of them; `main` counts the last bucket's)
    update: float  # the CPU's passes
    to_device: float  # the parameter copies host -> device
    read: float = 0.0  # nvme: the state read from the file
    write: float = 0.0  # nvme: the state written back
    fill: float = 0.0  # nvme: the first chunk's read and the last chunk's write, not overlapped
    after: float = 0.0  # ZeRO-1/2: the parameter shard copied into the gather's send buffer
    host: float = 0.0  # framework overhead per op
    buckets: int = 1  # the gradients cross bucket by bucket during backward
    chunks: int = 1  # the update and the parameters' copies overlap chunk by chunk
    delayed: bool = False  # optim.offload_delay: the update runs during the next forward and backward
    hidden: bool = True  # whether a delayed update can hide (not on a CPU machine: the same cores)

    @property
    def main(self) -> float:
        """The update's critical path after backward: the last bucket's gradient copy, then the update
        and the parameters' copies as a two-stage pipeline over the chunks (delayed: the update alone;
        the parameters cross at once, when published)."""
        if self.delayed:
            return self.to_host / self.buckets + self.update
        slow, fast = max(self.update, self.to_device), min(self.update, self.to_device)
        return self.to_host / self.buckets + slow + fast / self.chunks

    @property
    def total(self) -> float:
        """The offloaded update's seconds, from the end of backward (delayed: on its thread), and the
        parameters' publication."""
        return (
            max(self.main, self.read, self.write) + self.fill + self.after + self.host + self.to_device * self.delayed
        )

    def waited(self, overlapped: float) -> float:
        """What the step waits for, when `overlapped` seconds of forward and backward run meanwhile
        (the delayed update; the exact one waits for all of it)."""
        if not (self.delayed and self.hidden):
            return self.total
        background = max(self.main, self.read, self.write) + self.fill + self.host
        return max(0.0, background - overlapped) + self.to_device + self.after


def offload_time(
    deck: Deck, dev: Device, rates: OffloadRates, shard: float, buckets: int, matrices: int, host_is_device: bool
) -> OffloadTime:
    """The offloaded step of a rank that updates `shard` elements in `buckets` buckets, `matrices`
    of its tensors weight matrices (their decay runs), on device `dev`; `host_is_device`: a CPU
    machine, whose passes run at its calibrated rates (`dev.stream` and `dev.from_memory`)."""
    e, g = BYTES[deck.train.precision], _grad_bytes(deck)
    nvme = deck.optim.offload == "nvme"
    chunks = max(buckets, math.ceil(shard / nvme_chunk_elements(deck))) if nvme else buckets
    cpu = shard * offload_update_bytes(deck)
    gather = 2 * e if deck.optim.zero in (1, 2) and deck.replicas > 1 else 0  # the send buffer's copy
    if host_is_device:
        to_host = to_device = 0.0  # the copies are passes of the update (offload_update_bytes)
        # The gradients' host copy (a pass during backward, on the same cores) and the update.
        update = dev.stream(cpu + shard * 2 * g) + dev.from_memory(shard * offload_state_bytes(deck))
        after = dev.stream(shard * gather)
    else:
        assert rates.link is not None and rates.memory is not None
        to_host = shard * g / rates.link
        update = cpu / rates.memory
        to_device = shard * e / rates.link  # the compute dtype crosses, made on the CPU (offload_update_bytes)
        after = dev.stream(shard * gather)
    read = write = fill = 0.0
    if nvme:
        assert rates.read is not None and rates.write is not None
        state = shard * OFFLOAD_STATE_BYTES
        first = min(shard, nvme_chunk_elements(deck)) * OFFLOAD_STATE_BYTES
        read, write = state / rates.read, state / rates.write
        fill = first / rates.read + first / rates.write
    if deck.optim.name == "adamw":
        ops = OFFLOAD_ADAMW_CHUNK_OPS * chunks * dev.op_seconds
    else:
        ops = (OFFLOAD_CHUNK_OPS * chunks + 2 * matrices) * dev.op_seconds
    return OffloadTime(
        to_host, update, to_device, read, write, fill, after, ops, buckets=max(1, buckets), chunks=max(1, chunks),
        delayed=bool(deck.optim.offload_delay), hidden=not host_is_device,
    )  # fmt: skip

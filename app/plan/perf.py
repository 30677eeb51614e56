"""Step-time model: how long one optimizer step of a deck takes on a machine, and why.

Pure Python (no torch, no MPI), from the deck, the grid layout and the machine's constants
(`app/plan/machine.py`, each with its source). Nothing is fitted to a training run: the
constants describe primitives (a GEMM, a memory stream, a link), and the step is assembled
from gridlm's own implementation. docs/PERFORMANCE_MODEL.md has the equations and what is
left out.

Per pipeline stage and micro-batch, every pass (forward, backward, recomputed forward) is

* GEMMs, each at a roofline: max(FLOPs / (peak x gemm_efficiency x wave quantisation),
  bytes / HBM bandwidth). Wave quantisation: an m x n output is cut into tiles of the
  device's GEMM tile, and the last wave of tiles over the compute units runs part-empty;
* attention (scaled_dot_product_attention, flash kernels, causal: half the score and
  context FLOPs are executed) at peak x attention_efficiency;
* element-wise work (LayerNorm, GELU, bias and residual adds, dropout, the loss) at HBM
  bandwidth, counted as bytes read and written by each of gridlm's eager operations;
* tensor-parallel collectives of the exact sizes gridlm sends, on the link level the tp
  groups span: the forward ones exposed, the backward input-gradient ones hidden behind
  the weight-gradient GEMM when `parallel.overlap_tp_comm` is on.

* expert parallelism's all-to-alls (`parallel.ep`, a mixture of experts): per MoE layer and
  micro-batch the counts' exchange and the token rows to the experts' ranks and back, forward and
  backward (and the forward's again under full recompute), on the ep group's link, exposed but
  for the forward dispatch's part that the shared experts' GEMMs hide.

The passes run in the order of the schedule (`app.parallel.schedule.build_schedule`), with
point-to-point transfers between stages, so the bubble, warm-up and stage imbalance come
out of the simulation. After the pipeline: the exposed part of the data-parallel gradient
reduction (overlapped with the last backward when `parallel.overlap_grad_reduce` is on; the
experts' over the expert-data group of dp/ep ranks under expert parallelism), the
tied-embedding sum, the gradient norm, the step's small all-reduces (norm, non-finite check,
stop-signal vote) and the optimizer's passes, at HBM bandwidth as `app/optim/optimizer.py`
runs them, or with `optim.offload` its copies to and from the host, its update on the CPU and
nvme's file (`app/plan/optimizer_time.py`).

Collectives use ring costs: all-reduce 2 (n-1)/n x bytes / B + 2 (n-1) x latency, all-gather
and reduce-scatter half of that, or a tree's 2 log2(n) x latency for small messages
(whichever is faster, as NCCL chooses). B is the group's bottleneck bandwidth over the link
levels it crosses: at each level the members of the group inside one domain share that
domain's links with the other groups of the same axis (see `group_bandwidth`). Gloo (CPU
ranks) has only the ring, and its reduce-scatter costs an all-reduce (`Link.gloo`); CPU
ranks that outnumber the cores share them (`core_sharing`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Union

from app.archs.spec import ParamSpec
from app.deck import Deck, ModelConfig, replaced, resolve_for_world
from app.metrics.flops import step_flops
from app.names import AXES, BYTES, TP_SUB_AXES, reduce_precision, strides3d
from app.parallel.schedule import Action, build_schedule
from app.plan.device import Device, device_of
from app.plan.estimate import block_expert_params, block_params, linear_weight_params, stage_params, unit_buckets
from app.plan.machine import LinkLevel, Machine, MachineError, load_machine
from app.plan.optimizer_time import (
    OffloadRates,
    grad_norm_bytes,
    offload_rates,
    offload_time,
    optimizer_bytes,
    optimizer_ops,
    optimizer_state_bytes,
)
from app.runtime.grid import GridLayout

# Bytes one element-wise backward moves per byte of its forward: it reads the output
# gradient and the saved input and writes the input gradient (LayerNorm, GELU, adds).
BACKWARD_BYTES = 2.0
# Framework operations (aten ops, views included) gridlm runs per transformer block and for the
# embedding + head + loss, forward and backward (the backward's with the hooks that add each of a
# block's 12 parameter gradients into the flat buffer: 2 ops each), counted on one rank in fp32
# by tests/test_perf.py. A machine's op_overhead_us (host time per op, measured on CPUs by
# app.plan.calibrate) multiplies them; on GPUs the launches hide behind the kernels.
OPS = {"layer_forward": 32, "layer_backward": 66 + 24, "other_forward": 13, "other_backward": 23}
# A block whose MLP is a mixture of experts (ep = 1, dropless, no shared experts; 13 parameters):
# the router, the sort by expert and the combine are many small ops, and each of the rank's
# experts runs its own GEMMs over its rows (7 ops forward, 18 backward). Each shared expert MLP
# adds 8 forward and 22 + 2 x 4 backward (its 4 parameters' hooks). Expert parallelism's
# exchanges add a few more (not counted). Counted by tests/test_perf.py like OPS.
MOE_OPS = {"layer_forward": 96, "layer_backward": 108 + 26, "expert_forward": 7, "expert_backward": 18,
           "shared_forward": 8, "shared_backward": 22 + 8}  # fmt: skip
# Above this many passes (stages x chunks x micro-batches) the pipeline is not simulated pass by
# pass (about a second of Python); its steady state plus the schedule's bubble is used instead.
MAX_SIMULATED_PASSES = 200_000


# -- communication -----------------------------------------------------------------------


def ring_terms(op: str, n: int, gloo: bool) -> tuple[float, float]:
    """(a, c) of a ring collective's cost a x bytes / B + c x latency over `n` ranks, `bytes` its
    full (unsharded) size: all-reduce 2 (n-1)/n and 2 (n-1); all-gather (n-1)/n and n-1; a
    reduce-scatter as an all-gather (NCCL) or as an all-reduce (gloo, see `Link.reduce_scatter`);
    p2p one message; an all-to-all whose full size is what each rank holds before it (n - 1)/n leave
    the rank, n - 1 messages: an all-gather's terms. `app.plan.calibrate` fits measured times with
    these same terms."""
    if op == "p2p":
        return 1.0, 1.0
    if op == "all_reduce" or (op == "reduce_scatter" and gloo):
        return 2.0 * (n - 1) / n, 2.0 * (n - 1)
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n, float(n - 1)
    raise ValueError(f"unknown collective {op!r}")


@dataclass(frozen=True)
class Link:
    """A group's effective link: bus bandwidth (bytes/s) and per-step latency (s).

    `measured` holds (op, (bandwidth, latency)) for the ops a calibration timed on groups of
    this size (`Machine.collectives`); they replace the level's figures in that op's ring."""

    bandwidth: float
    latency: float
    level: str  # the outermost level the group crosses
    gloo: bool = False  # gloo (CPU ranks): no tree all-reduce, and a reduce-scatter costs an all-reduce
    measured: tuple[tuple[str, tuple[float, float]], ...] = ()
    # The extra time of one blocking collective (`busy`, (op, seconds) per op) or transfer
    # (`busy_p2p`) while the node's other ranks compute: CPU ranks sharing cores wait for their
    # group to be scheduled together (Machine.busy_seconds; 0 on GPUs). Charged only where the
    # code waits for the op at once.
    busy: tuple[tuple[str, float], ...] = ()
    busy_p2p: float = 0.0

    def busy_wait(self, op: str) -> float:
        """`busy` of one blocking `op` (0 where not measured)."""
        return dict(self.busy).get(op, 0.0)

    def _ring(self, op: str, n: int, nbytes: float) -> float:
        if n <= 1 or nbytes <= 0:
            return 0.0
        bandwidth, latency = self._fit(op)
        a, c = ring_terms(op, n, self.gloo)
        return a * nbytes / bandwidth + c * latency

    def latency_part(self, op: str, n: int) -> float:
        """The latency terms of one ring `op` over `n` ranks (its waits for the peers)."""
        if n <= 1:
            return 0.0
        return ring_terms(op, n, self.gloo)[1] * self._fit(op)[1]

    def _fit(self, op: str) -> tuple[float, float]:
        """(bandwidth, latency) of `op`: the calibration's for this group size, else the level's. The
        calibration times no all-to-all: it takes the all-gather's fit, the same bytes per rank and
        messages (`ring_terms`)."""
        measured = dict(self.measured)
        if op == "all_to_all" and op not in measured:
            op = "all_gather"
        return measured.get(op, (self.bandwidth, self.latency))

    def all_reduce(self, n: int, nbytes: float) -> float:
        ring = self._ring("all_reduce", n, nbytes)
        if self.gloo or ring == 0.0:
            return ring
        tree = 2.0 * nbytes / self.bandwidth + 2.0 * math.ceil(math.log2(n)) * self.latency
        return min(ring, tree)

    def reduce_scatter(self, n: int, nbytes: float) -> float:
        """Reduce-scatter of `nbytes` (the full size). NCCL's ring moves what an all-gather does;
        gloo reduces the whole tensor and keeps a slice (measured here on 2 ranks: 1.0-1.3x an
        all-reduce of the same size), so it costs an all-reduce."""
        return self._ring("reduce_scatter", n, nbytes)

    def all_gather(self, n: int, nbytes: float) -> float:
        """All-gather whose full (gathered) size is `nbytes`."""
        return self._ring("all_gather", n, nbytes)

    def all_to_all(self, n: int, nbytes: float) -> float:
        """All-to-all of `nbytes` per rank (what it holds before the exchange), (n - 1)/n of them sent
        to the other ranks (and as many received): expert parallelism's token exchange."""
        return self._ring("all_to_all", n, nbytes)

    def p2p(self, nbytes: float) -> float:
        return self._ring("p2p", 2, nbytes)


def group_bandwidth(levels: list[LinkLevel], stride: int, size: int, gloo: bool = False) -> Link:
    """The bottleneck link of a group of `size` ranks `stride` apart (ranks placed in order).

    Level j joins the domains of level j - 1 (domain sizes grow outwards; the last level is
    the network, domain = the whole machine). A group uses level j when its members lie in
    more than one level-(j - 1) domain of a level-j domain. Through level j, the k members
    inside one level-(j - 1) domain send on k devices' shares of that level's bandwidth
    (the other groups of the axis use the rest), so the group's bus bandwidth is the least
    of k x gbs over the levels it uses. A group of one rank uses no link. `gloo`: the group's
    collectives are gloo's (CPU ranks), not NCCL's.
    """
    if size <= 1:
        return Link(bandwidth=math.inf, latency=0.0, level="none", gloo=gloo)
    inside_before = 1
    bandwidth, latency, name = math.inf, 0.0, "none"
    for level in levels:
        span = level.devices if level.devices is not None else math.inf
        inside = size if span == math.inf else min(size, max(1, int(span // stride)))
        if inside > inside_before:
            bandwidth = min(bandwidth, inside_before * level.gbs * 1e9)
            latency, name = max(latency, level.latency_us * 1e-6), level.name
        inside_before = inside
        if inside >= size:
            return Link(bandwidth=bandwidth, latency=latency, level=name, gloo=gloo)
    # No level holds the whole group (levels without the network): its bandwidth is unknown, not infinite.
    raise MachineError(
        f"link levels {', '.join(level.name for level in levels) or '(none)'}: no level holds a group of {size} ranks "
        f"{stride} apart; the last level must be the network (devices: null)"
    )


# -- the model ----------------------------------------------------------------------------


@dataclass
class Prediction:
    """A deck's predicted step on a machine. Times in seconds per optimizer step."""

    step_time_s: float
    tokens_per_s: float
    tflops_per_device: float  # model FLOPs (the MFU basis)
    hardware_tflops_per_device: float  # with the recomputed forward (Megatron SC21's table)
    mfu: float
    breakdown: dict[str, float]  # compute, recompute, attention, elementwise, exposed comm, bubble, ...
    levels: dict[str, str]  # axis -> the outermost link level its groups cross (ep, edp: expert parallelism's)
    stage_times: list[float] = field(default_factory=list)  # pipeline finish time of each stage
    # 3D tensor parallelism (parallel.tensor): the slowest stage's exposed tp seconds by sub-axis,
    # tp_x + tp_y + tp_z = breakdown["tp_exposed"]; and tp_z_grad_sum, the Z sum of the replicated
    # parameters' gradients after the step's backward (counted in breakdown["dp_exposed"]). Empty for 1D.
    tensor3d: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, object]:
        return {
            "step_time_s": self.step_time_s,
            "tokens_per_s": self.tokens_per_s,
            "tflops_per_device": self.tflops_per_device,
            "hardware_tflops_per_device": self.hardware_tflops_per_device,
            "mfu": self.mfu,
            "breakdown": dict(self.breakdown),
            "levels": dict(self.levels),
            **({"tensor3d": dict(self.tensor3d)} if self.tensor3d else {}),
        }


@dataclass(frozen=True)
class _Pass:
    """One forward or backward pass of one chunk on one micro-batch, split by kind."""

    gemm: float = 0.0
    attention: float = 0.0
    elementwise: float = 0.0
    tp: float = 0.0  # exposed tensor-parallel communication
    host: float = 0.0  # framework overhead per op (op_overhead_us)
    axes: tuple[float, float, float] = (0.0, 0.0, 0.0)  # 3D: `tp` by sub-axis (X, Y, Z); 1D: zeros
    ep: float = 0.0  # expert parallelism's all-to-alls (exposed)

    @property
    def total(self) -> float:
        return self.gemm + self.attention + self.elementwise + self.tp + self.host + self.ep

    def __add__(self, other: _Pass) -> _Pass:
        return _Pass(
            self.gemm + other.gemm,
            self.attention + other.attention,
            self.elementwise + other.elementwise,
            self.tp + other.tp,
            self.host + other.host,
            tuple(a + b for a, b in zip(self.axes, other.axes)),  # type: ignore[arg-type]
            self.ep + other.ep,
        )

    def scaled(self, k: float) -> _Pass:
        axes = tuple(a * k for a in self.axes)
        return _Pass(self.gemm * k, self.attention * k, self.elementwise * k, self.tp * k, self.host * k, axes,  # type: ignore[arg-type]
                     self.ep * k)  # fmt: skip


def tp_collectives(deck: Deck) -> dict[str, list[tuple[str, float]]]:
    """The tensor-parallel collectives gridlm runs per micro-batch, as (op, bytes) with bytes the
    full (unsharded) size: per block forward and backward (the column-parallel input gradients,
    which overlap the weight-gradient GEMM, apart), the head (+ vocab-parallel cross-entropy)
    and the embedding. tests/test_perf.py counts what a run really sends against these.

    `layer_recompute` is what full recomputation runs again: torch's checkpoint stops once it
    has rebuilt every tensor the backward saved, so without dropout (whose mask is saved) it
    stops at the MLP's output GEMM (after it where its weight gradient is fused, before it
    where not: `step_flops`), before that GEMM's all-reduce or reduce-scatter."""
    m, par, tr = deck.model, deck.parallel, deck.train
    if par.tp == 1:
        return {k: [] for k in ("layer_forward", "layer_recompute", "layer_backward", "layer_backward_overlapped",
                                "head_forward", "head_backward", "embedding_forward", "embedding_backward")}  # fmt: skip
    tokens = tr.micro_batch * m.seq_len
    x = float(tokens * m.hidden * BYTES[tr.precision])
    if par.sequence_parallel:
        # all-gather before QKV and fc, reduce-scatter after the output projection and proj; in
        # backward the reduce-scatters' all-gathers, and the column-parallel input gradients'
        # reduce-scatters; the embedding reduce-scatters (its backward all-gathers); the head
        # all-gathers its input (its backward reduce-scatters the input gradient).
        forward = [("all_gather", x)] * 2 + [("reduce_scatter", x)] * 2
        return {
            "layer_forward": forward,
            "layer_recompute": forward if m.dropout > 0 else forward[:-1],
            "layer_backward": [("all_gather", x)] * 2,
            "layer_backward_overlapped": [("reduce_scatter", x)] * 2,
            "head_forward": [("all_gather", x)] + [("all_reduce", tokens * 4.0)] * 3,
            "head_backward": [("reduce_scatter", x)],
            "embedding_forward": [("reduce_scatter", x)],
            "embedding_backward": [("all_gather", x)],
        }
    return {
        "layer_forward": [("all_reduce", x)] * 2,
        "layer_recompute": [("all_reduce", x)] * (2 if m.dropout > 0 else 1),
        "layer_backward": [],
        "layer_backward_overlapped": [("all_reduce", x)] * 2,
        "head_forward": [("all_reduce", tokens * 4.0)] * 3,  # max, sum of exponentials, target logit
        "head_backward": [("all_reduce", x)],
        "embedding_forward": [("all_reduce", x)],
        "embedding_backward": [],
    }


def moe_tp_collectives(deck: Deck) -> dict[str, list[tuple[str, float]]]:
    """The tensor-parallel collectives of a block whose MLP is a mixture of experts, per micro-batch,
    keyed like `tp_collectives`' block lists: the attention's only, since the experts run whole on
    every tp rank on the block's input as it is (all tokens without sequence parallelism, the
    rank's sequence shard with it: nothing gathered or reduced around them); under sequence
    parallelism also the routers' sums over the tokens (E counts, E probability sums and the
    z-loss's, fp32: one all-reduce, `moe.balance_losses`). Full recomputation runs all of the
    forward's (the MoE's saved tensors come after them)."""
    par, tr, m = deck.parallel, deck.train, deck.model
    if par.tp == 1:
        return {k: [] for k in ("layer_forward", "layer_recompute", "layer_backward", "layer_backward_overlapped")}
    x = float(tr.micro_batch * m.seq_len * m.hidden * BYTES[tr.precision])
    if par.sequence_parallel:
        forward = [("all_gather", x), ("reduce_scatter", x), ("all_reduce", 4.0 * (2 * m.moe_experts + 1))]
        return {
            "layer_forward": forward,
            "layer_recompute": forward,
            "layer_backward": [("all_gather", x)],
            "layer_backward_overlapped": [("reduce_scatter", x)],
        }
    return {
        "layer_forward": [("all_reduce", x)],
        "layer_recompute": [("all_reduce", x)],
        "layer_backward": [],
        "layer_backward_overlapped": [("all_reduce", x)],
    }


def moe_sp_sum(deck: Deck, stage: int) -> float:
    """Elements of the gradients one rank of pipeline `stage` sums over tp after the dp reduction
    under sequence parallelism for its MoE blocks: each one's router, stacked experts (E/ep of them)
    and shared experts, whole on every tp rank and fed the rank's sequence shard, so partial over tp
    (`ParamMeta.sequence_parallel`); under ZeRO the rank's shards of them (1/dp, the experts
    1/(dp/ep)). 0 without SP, tp or experts. The norms' and row-parallel biases' few h per block,
    summed alike, are left out (as for dense blocks)."""
    m, par = deck.model, deck.parallel
    if not (m.moe_experts and par.sequence_parallel and par.tp > 1):
        return 0.0
    pp, v, dp, ep = par.pp, par.virtual_stages, deck.dp, par.ep
    blocks = sum(moe_chunk_layers(deck)[c] for c in range(stage, pp * v, pp))
    params = m.spec.moe_params(m, "blocks.0", 0.0)
    dense = sum(p.numel for p in params if not p.expert)
    experts = sum(p.numel for p in params if p.expert) // ep
    if deck.optim.zero and dp > 1:
        return blocks * (dense / dp + experts / (dp // ep))
    return float(blocks * (dense + experts))


def routed(deck: Deck) -> tuple[int, int, Optional[int]]:
    """A mixture of experts on one rank and micro-batch: (the tokens it routes, micro_batch x seq_len,
    / tp under sequence parallelism; the assignments it keeps, T k, at most E x the capacity; the
    capacity per expert, `MoE.capacity`, None: dropless)."""
    m, par, tr = deck.model, deck.parallel, deck.train
    tokens = tr.micro_batch * m.seq_len // (par.tp if par.sequence_parallel else 1)
    if m.moe_capacity_factor is None:
        return tokens, tokens * m.moe_top_k, None
    capacity = max(1, math.ceil(m.moe_capacity_factor * tokens * m.moe_top_k / m.moe_experts))
    return tokens, min(tokens * m.moe_top_k, m.moe_experts * capacity), capacity


def ep_collectives(deck: Deck) -> dict[str, list[tuple[str, float]]]:
    """Expert parallelism's all-to-alls (`parallel.ep` > 1) per MoE layer and micro-batch on one rank,
    as (op, bytes) with bytes what the rank holds before the exchange ((ep - 1)/ep of it leaves the
    rank on average, as many bytes arrive; `app/model/moe.py`, `MoE._exchange`).

    The rank routes T tokens (micro_batch x seq_len; T/tp under sequence parallelism), T k
    assignments, of which at most E x capacity are kept with `model.moe_capacity_factor`. Forward:
    the counts' all-to-all (E int64, read on the host: the split sizes), the kept assignments' token
    rows (hidden wide, compute dtype) to their experts' ranks, and the outputs back; backward: the
    two row exchanges reversed; full recomputation runs the forward's again. Empty at ep = 1."""
    m, par, tr = deck.model, deck.parallel, deck.train
    if par.ep == 1 or not m.moe_experts:
        return {"forward": [], "backward": [], "recompute": []}
    rows = float(routed(deck)[1] * m.hidden * BYTES[tr.precision])
    forward = [("all_to_all", 8.0 * m.moe_experts), ("all_to_all", rows), ("all_to_all", rows)]
    return {"forward": forward, "backward": [("all_to_all", rows)] * 2, "recompute": forward}


def moe_chunk_layers(deck: Deck) -> list[int]:
    """The MoE layers of each global chunk (`ModelConfig.is_moe` over `deck.chunks`)."""
    return [sum(deck.model.is_moe(i) for i in chunk) for chunk in deck.chunks]


def expert_exchange(deck: Deck, stage: int) -> tuple[int, float]:
    """(all-to-alls, bytes sent) of one rank of pipeline `stage` per optimizer step under expert
    parallelism: each `ep_collectives` call sends (ep - 1)/ep of its bytes to the ep group's other
    ranks (receiving as many). (0, 0.0) at ep = 1."""
    ep = deck.parallel.ep
    calls = ep_collectives(deck)
    per_layer = calls["forward"] + calls["backward"] + (calls["recompute"] if deck.train.recompute == "full" else [])
    pp, v = deck.parallel.pp, deck.parallel.virtual_stages
    moe = moe_chunk_layers(deck)
    n = deck.num_micro_batches * sum(moe[c] for c in range(stage, pp * v, pp))
    return n * len(per_layer), n * sum(b for _, b in per_layer) * (ep - 1) / ep


def step_messages(deck: Deck, stage: int) -> dict[tuple[str, str], float]:
    """Bytes one rank of pipeline `stage` sends per optimizer step, by (axis, op): the messages
    the time model charges (collectives by their full size, p2p sends by their payload).
    Under 3D tensor parallelism the tp messages are by sub-axis (tp_x, tp_y, tp_z: `tp3d_collectives`).
    Under expert parallelism: the all-to-alls on "ep" (`ep_collectives`), and the experts' gradient
    reduction (and ZeRO's gathers) on "edp", the expert-data group, the rest on "dp".
    Not included: scalar all-reduces (loss, gradient norm, the non-finite check) and the tp sums of
    the replicated parameters' gradients (under sequence parallelism over tp, under 3D over Z), but
    for the MoE blocks' (`moe_sp_sum`)."""
    m, par, tr = deck.model, deck.parallel, deck.train
    pp, v, micro = par.pp, par.virtual_stages, deck.num_micro_batches
    e, g = BYTES[tr.precision], BYTES[reduce_precision(tr.precision, tr.grad_reduce_dtype)]
    chunks = deck.chunks
    mine = list(range(stage, pp * v, pp))
    layers = sum(len(chunks[c]) for c in mine)
    first, last = stage == 0, stage == pp - 1
    out: dict[tuple[str, str], float] = {}

    def add(axis: str, op: str, nbytes: float) -> None:
        if nbytes:
            out[(axis, op)] = out.get((axis, op), 0.0) + nbytes

    shape = tensor_shape(deck)
    moe = moe_chunk_layers(deck)
    moe_blocks = sum(moe[c] for c in mine)  # blocks whose MLP is a mixture of experts
    tp: dict[str, list[tuple[str, str, float]]]
    if shape is None:
        tp = {k: [("tp", op, n) for op, n in v] for k, v in tp_collectives(deck).items()}
        moe_tp = {k: [("tp", op, n) for op, n in v] for k, v in moe_tp_collectives(deck).items()}
    else:  # by sub-axis, tp_x / tp_y / tp_z
        tp, moe_tp = tp3d_collectives(deck), {}

    def block(lists: dict[str, list[tuple[str, str, float]]]) -> list[tuple[str, str, float]]:
        recompute = lists["layer_recompute"] if tr.recompute == "full" else []
        return lists["layer_forward"] + recompute + lists["layer_backward"] + lists.get("layer_backward_overlapped", [])

    per_micro = block(tp) * (layers - moe_blocks) + (block(moe_tp) * moe_blocks if moe_blocks else [])
    per_micro += (tp["embedding_forward"] + tp["embedding_backward"]) if first else []
    per_micro += (tp["head_forward"] + tp["head_backward"]) if last else []
    for axis, op, nbytes in per_micro:
        add(axis, op, micro * nbytes)
    if pp > 1:
        sends = sum(int(c < pp * v - 1) + int(c > 0) for c in mine)  # activations forward, gradients back
        add("pp", "send", micro * sends * p2p_bytes(deck))
    add("tp", "all_reduce", moe_sp_sum(deck, stage) * g)  # the MoE blocks' partial gradients under SP
    exchange = ep_collectives(deck)
    per_moe_layer = (
        exchange["forward"] + exchange["backward"] + (exchange["recompute"] if tr.recompute == "full" else [])
    )
    for op, nbytes in per_moe_layer:
        add("ep", op, micro * moe_blocks * nbytes)
    if deck.dp > 1:
        params = (
            stage_params(m, par.tp, layers, first, last, ep=par.ep)
            if shape is None
            else stage_params3d(m, shape, layers, first, last)[0]
        )
        experts = layers * block_expert_params(m, par.ep) if par.ep > 1 else 0
        for axis, n in (("dp", params - experts), ("edp", experts if deck.dp > par.ep else 0)):
            if deck.optim.zero:
                # ZeRO-2: once per micro-batch (every bucket reduces each time all its parameters added one gradient).
                add(axis, "reduce_scatter", (micro if deck.optim.zero >= 2 else 1) * n * g)
                # ZeRO-3 gathers every unit before its forward and again before its backward (the recompute
                # reuses the backward's), each micro-batch, and nothing after the step; ZeRO-1/2 once after it.
                add(axis, "all_gather", (2 * micro if deck.optim.zero >= 3 else 1) * n * e)
            else:
                add(axis, "all_reduce", n * g)
        if deck.optim.zero >= 3 and tied_here(deck, first, last):
            # The head gathers the tied embedding's bucket again (the embedding freed it).
            add("dp", "all_gather", micro * unit_buckets(deck, True, True)["embed"][0] * e)
    if m.tie_embeddings and pp > 1 and (first or last):
        add("pp", "all_reduce", (m.vocab_size // par.tp) * m.hidden * g)
    return out


def zero3_gathers(
    deck: Deck,
    link: Link,
    chunks: list[int],
    fwd: list[float],
    bwd: list[float],
    overlap: bool,
    expert_link: Optional[Link] = None,
) -> list[tuple[float, float]]:
    """ZeRO-3: the exposed all-gather seconds of each global chunk's forward and backward pass,
    one micro-batch. A pass gathers every unit of its chunk (embedding, blocks, head), bucket by
    bucket, in the compute dtype; `fwd[c]`, `bwd[c]`: the passes' own times. Under expert
    parallelism a block's expert buckets are gathered over the expert-data group (`expert_link`,
    dp/ep ranks).

    With `overlap` (parallel.overlap_param_gather) the next unit's gather runs while a unit
    computes: on GPUs a pass waits for its first unit's gathers, and for whatever of the rest
    outlasts its compute; on gloo every ring's bandwidth terms are charged (its copies share the
    cores) and the latency terms hide, all but the pass's first bucket's (as for the dp
    reductions). Without it every gather is waited for."""
    par, e, dp = deck.parallel, BYTES[deck.train.precision], deck.dp
    pp, last = par.pp, len(chunks) - 1
    ends = unit_buckets(deck, True, pp == 1), unit_buckets(deck, pp == 1, True)

    def gather(buckets: list[int]) -> float:
        return sum(link.all_gather(dp, n * e) for n in buckets)

    experts = ends[0].get("block_experts", [])
    group = expert_link if expert_link is not None else link
    expert_gathers = sum(group.all_gather(dp // par.ep, n * e) for n in experts)
    block = ends[0]["block"] + experts
    embed, head, one = gather(ends[0]["embed"]), gather(ends[1]["head"]), gather(ends[0]["block"]) + expert_gathers
    tied = tied_here(deck, True, pp == 1)  # the head's forward gathers the embedding's bucket again
    head_forward = head + (gather(ends[0]["embed"][:1]) if tied else 0.0)
    out = []
    for c, n in enumerate(chunks):
        total = n * one + (embed if c == 0 else 0.0) + (head if c == last else 0.0)
        total_f = total + (head_forward - head if c == last else 0.0)
        count = n * len(block) + (len(ends[0]["embed"]) if c == 0 else 0) + (len(ends[1]["head"]) if c == last else 0)
        if not overlap:
            out.append((total_f, total))
        elif link.gloo:
            hidden = (count - 1) * link.latency_part("all_gather", dp)
            out.append((total_f - hidden, total - hidden))
        else:  # forward: the embedding or a block first; backward: the head or a block first
            first_f, first_b = embed if c == 0 else one, head if c == last else one
            out.append((max(first_f, total_f - fwd[c]), max(first_b, total - bwd[c])))
    return out


def tied_here(deck: Deck, first: bool, last: bool) -> bool:
    """Whether a stage runs both the embedding and the head of one tied weight (pp = 1)."""
    return deck.model.tie_embeddings and first and last


def p2p_bytes(deck: Deck) -> float:
    """One pipeline message: a micro-batch's activation (or its gradient), sequence-sharded under SP,
    its hidden split over X under 3D tensor parallelism."""
    return float(math.prod(deck.stage_message) * BYTES[deck.train.precision])


def group_link(machine: Machine, stride: int, size: int) -> Link:
    """The link of a group of `size` ranks `stride` apart (`group_bandwidth` on the machine's
    levels), with the collectives a calibration measured on groups of that size, and its p2p:
    those measured inside a node, or across nodes for a group that crosses them."""
    levels = machine.link_levels()
    link = group_bandwidth(levels, stride, size, uses_gloo(machine))
    # A group that crosses nodes takes what was measured across nodes (none: the level's figures).
    network = len(levels) > 1 and link.level == levels[-1].name
    measured = machine.measured_collectives(size, network)
    if measured:
        link = dataclasses.replace(link, measured=tuple(sorted(measured.items())))
    if size <= 1:
        return link
    ops = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")  # all_to_all: the all-reduce's wait
    busy = tuple((op, machine.busy_seconds(op, size, network)) for op in ops)
    return dataclasses.replace(link, busy=busy, busy_p2p=machine.busy_seconds("p2p", 2, network))


def axis_links(machine: Machine, layout: GridLayout, ep: int = 1) -> dict[str, Link]:
    """Each axis's group link (`group_link`); with expert parallelism (ep > 1) also "ep", an expert
    group (ep consecutive dp ranks: `ProcessGrid.expert_groups`), and "edp", an expert-data group
    (the dp/ep ranks ep dp-strides apart that hold the same experts)."""
    links = {axis: group_link(machine, layout.stride(axis), layout.size(axis)) for axis in layout.axes}
    if layout.cp > 1:  # the gradients' group is dp x cp (ProcessGrid.replicas): from the inner one, as wide
        links["dp"] = group_link(machine, min(layout.stride("dp"), layout.stride("cp")), layout.dp * layout.cp)
    if ep > 1:
        stride = layout.stride("dp")
        links["ep"] = group_link(machine, stride, ep)
        links["edp"] = group_link(machine, stride * ep, layout.size("dp") // ep)
    return links


def uses_gloo(machine: Machine) -> bool:
    """CPU ranks communicate with gloo, GPUs with NCCL/RCCL (`Link.gloo` says what differs)."""
    return machine.device_name == "cpu"


def as_run_on(deck: Deck, machine: Machine) -> Deck:
    """`deck` with what its null or auto keys become on the machine's ranks: run.compile (compiled
    chains on GPUs, `_elementwise`), train.fuse_grad_accumulation (on GPUs) and
    model.attention_kernel (math on CPU ranks with dropout: `ModelConfig.attention_on`). The plan's
    memory, FLOPs and predicted step use it."""
    return deck.on_device(not uses_gloo(machine))


def _cost(link: Link, n: int, op: str, nbytes: float) -> float:
    """A blocking collective (tp, ep, the step's): its ring, and the wait for the group's ranks to run together."""
    cost = {"all_reduce": link.all_reduce, "reduce_scatter": link.reduce_scatter, "all_gather": link.all_gather,
            "all_to_all": link.all_to_all}  # fmt: skip
    return cost[op](n, nbytes) + (link.busy_wait(op) if n > 1 and nbytes > 0 else 0.0)


def _elementwise(deck: Deck, tokens: int, t: int) -> tuple[float, float, float]:
    """A block's element-wise work in one forward as gridlm runs it, from its architecture's features
    (`app/archs/spec.py`: `norm_bytes`, `act_bytes`, `rotary_bytes`): (bytes per element of a norm,
    of the activation per ffn element, and the rotary embedding's and GQA's bytes on this tp rank).
    GQA's repeat_interleave reads the kv heads' keys and values and writes them for every query head."""
    m, e, compiled = deck.model, BYTES[deck.train.precision], deck.run.compile
    assert compiled is not None, "predict resolves run.compile for the machine"
    d = m.hidden // m.heads
    rotated = tokens * (m.heads + m.kv) * d / t  # this rank's q and k elements
    chains = rotated * m.spec.rotary_bytes(e, compiled)
    if m.heads > m.kv:
        chains += tokens * 2 * (m.kv + m.heads) * d * e / t
    return m.spec.norm_bytes(e, compiled), m.spec.act_bytes(e, compiled), chains


def _chains_saved(deck: Deck, moe: bool) -> tuple[float, float]:
    """Bytes per token of one block's forward and of its backward, on one tp rank, that run.compile's
    chains across the block's modules save (`Block._chained`, app/model/fused.py; 1D tp, dropout 0).
    In hidden-wide passes (h e / t_sp bytes a token each): `add_norm` reads the attention's
    projection and the residual stream and writes the new stream and its norm, 4 where eagerly its
    output bias add (2), the residual add (3) and the norm (2, compiled or LayerNorm) took 7, or 5
    without a bias (3 or 1 saved); `bias_residual` 3 for the MLP's bias add and residual add (5: 2
    saved). The backward saves 2, not twice the forward (`BACKWARD_BYTES`): the norm's input
    gradient (3) and the residual stream's gradient sum (3) become one kernel (4), a bias add's
    backward is its column sum in either, and the residual add passes its gradient on. MoE blocks
    keep their MLP's add eager."""
    m = deck.model
    if not deck.run.compile or m.dropout > 0:
        return 0.0, 0.0
    bias = m.spec.bias
    unit = m.hidden * BYTES[deck.train.precision] / (deck.parallel.tp if deck.parallel.sequence_parallel else 1)
    return ((3 if bias else 1) + (2 if bias and not moe else 0)) * unit, 2 * unit


def _layer_passes(
    deck: Deck, dev: Device, tp_link: Link, tp_msgs: dict[str, list[tuple[str, float]]], moe: bool = False
) -> tuple[_Pass, _Pass, _Pass]:
    """(forward, backward, full recompute) of one transformer block on one micro-batch, one tp rank;
    `moe`: its MLP a mixture of experts (`_moe_work`)."""
    m, par, tr = deck.model, deck.parallel, deck.train
    t, sp = par.tp, par.sequence_parallel
    e = BYTES[tr.precision]
    tokens, h, f = tr.micro_batch * m.seq_len, m.hidden, m.ffn
    t_sp = t if sp else 1
    # (m, n, k, count): QKV (GQA: (heads + 2 kv) x head_dim rows), out, fc (SwiGLU: gate and up), proj
    shapes = [(tokens, m.qkv_rows // t, h, 1), (tokens, h, h // t, 1)]
    shapes += [(tokens, m.fc_rows // t, h, 1), (tokens, h, f // t, 1)] if not moe else []
    moe_bytes, moe_experts, moe_shared = 0.0, 0.0, 0.0
    if moe:
        more, moe_bytes, moe_experts, moe_shared = _moe_work(deck)
        shapes += more
    moe_fresh = moe_experts + moe_shared
    # Each Linear's forward, input gradient (m x k from m x n) and weight gradient (n x k from m).
    gemms = [tuple(count * x for x in dev.linear(rows, n, k, e)) for rows, n, k, count in shapes]
    fwd_gemm = sum(g[0] for g in gemms)
    dgrad, wgrad = [g[1] for g in gemms], [g[2] for g in gemms]
    attn_fwd, attn_bwd, _ = _attention(deck, dev)
    # Element-wise bytes per token of one forward (see the module docstring of estimate.py for
    # the block): LayerNorm x 2, row-parallel bias add x 2 (where the Linears have biases), residual
    # add x 2 on h/t_sp; the attention output's transpose copy on h/t; GELU on f/t; dropout (p > 0)
    # x 2 with its mask.
    per_token = ((2 + 2 if m.spec.bias else 0) + 3 + 3) * h * e / t_sp + 2 * h * e / t
    if m.dropout > 0:
        per_token += 2 * (2 * h * e + h) / t_sp
    # Bytes per element of a norm and of the activation, and the rotary and GQA chains (`_elementwise`).
    norm, act, chains = _elementwise(deck, tokens, t)
    layernorm = tokens * 2 * norm * h / t_sp
    # The stacked experts' activation runs eager (`GPT.fuse`), the shared experts' as the dense MLP's.
    gelu = tokens * act * f / t if not moe else (m.spec.act_bytes(e, False) * moe_experts + act * moe_shared) / e
    elem_fwd = dev.stream(tokens * per_token + chains + moe_bytes) + dev.stream(layernorm, "layernorm")
    elem_fwd += dev.stream(gelu, "gelu")
    # run.compile's chains across the block's modules: the bytes they save, forward and backward.
    fwd_saved, bwd_saved = (dev.stream(tokens * b) for b in _chains_saved(deck, moe))
    # The MLP's activation (tokens x f/t; the experts' and shared experts' rows) is the block's
    # largest new tensor, in the forward and as the activation's input gradient: where it is
    # mmapped, its pages fault in (CPUs).
    fresh = dev.fresh(tokens * f * e / t if not moe else moe_fresh)
    tp_fwd = sum(_cost(tp_link, t, op, n) for op, n in tp_msgs["layer_forward"])
    tp_recompute = sum(_cost(tp_link, t, op, n) for op, n in tp_msgs["layer_recompute"])
    row_bwd = sum(_cost(tp_link, t, op, n) for op, n in tp_msgs["layer_backward"])
    col_bwd = [_cost(tp_link, t, op, n) for op, n in tp_msgs["layer_backward_overlapped"]]
    # QKV and fc (linears 0 and 2) are the column-parallel ones: their input-gradient collective
    # overlaps their weight-gradient GEMM when overlap_tp_comm is on.
    hidden_by = [wgrad[0], wgrad[2]] if par.overlap_tp_comm else [0.0, 0.0]
    tp_bwd = row_bwd + sum(max(0.0, c - w) for c, w in zip(col_bwd, hidden_by))
    ops = MOE_OPS if moe else OPS
    host_f, host_b = ops["layer_forward"] * dev.op_seconds, ops["layer_backward"] * dev.op_seconds
    if moe:  # each local expert's own GEMMs
        local = m.moe_experts // par.ep
        host_f += local * MOE_OPS["expert_forward"] * dev.op_seconds
        host_b += local * MOE_OPS["expert_backward"] * dev.op_seconds
    if moe and m.moe_shared_experts:
        host_f += MOE_OPS["shared_forward"] * dev.op_seconds
        host_b += MOE_OPS["shared_backward"] * dev.op_seconds
    forward = _Pass(fwd_gemm, attn_fwd, elem_fwd - fwd_saved + fresh, tp_fwd, host_f)
    backward = _Pass(sum(dgrad) + sum(wgrad), attn_bwd, BACKWARD_BYTES * elem_fwd - bwd_saved + fresh, tp_bwd, host_b)
    # Full recomputation stops once the saved tensors are rebuilt (`step_flops`): a dense block's MLP
    # output GEMM runs again only where its weight gradient is fused (a custom function) or dropout
    # follows (its mask is saved); see tp_collectives.
    skipped = gemms[3][0] if not moe and m.dropout == 0 and deck.train.fuse_grad_accumulation is False else 0.0
    recompute = _Pass(fwd_gemm - skipped, attn_fwd, elem_fwd - fwd_saved + fresh, tp_recompute, host_f)
    return forward, backward, recompute


def _moe_work(deck: Deck) -> tuple[list[tuple[int, int, int, int]], float, float, float]:
    """A mixture of experts' MLP on one tp rank and micro-batch, as `app/model/moe.py` runs it: (its
    GEMMs as (rows, out, in, how many): the router, each local expert's fc and proj, the shared
    experts; the bytes its dispatch and combine move; the bytes of its new activations, the stacked
    experts' and the shared experts'). The experts
    are whole on every tp rank, fed all T tokens (T / tp each under sequence parallelism); each rank's
    T k assignments (at most the capacity's) are what its experts run on average, whatever ep, as
    E / ep GEMM pairs, each over its expert's rows: mu = T k ep / E of them under uniform routing.
    Dispatch: the kept rows gathered, sorted by expert and the outputs put back in order (compute
    dtype), weighted and summed over k: about 8 T k h e bytes."""
    m, par, tr = deck.model, deck.parallel, deck.train
    e, h, fe = BYTES[tr.precision], m.hidden, m.expert_ffn
    tokens, rows, _ = routed(deck)
    shared = m.moe_shared_experts * fe
    local = m.moe_experts // par.ep
    each = max(1, math.ceil(rows / local))  # an expert's rows: the rank's T k spread over E / ep
    gemms = [(tokens, m.moe_experts, h, 1), (each, m.spec.fc_rows(fe), h, local), (each, h, fe, local)]
    if shared:
        gemms += [(tokens, m.spec.fc_rows(shared), h, 1), (tokens, h, shared, 1)]
    return gemms, 8.0 * rows * h * e, float(rows * fe * e), float(tokens * shared * e)


def _attention(deck: Deck, dev: Device, split: Optional[int] = None) -> tuple[float, float, float]:
    """Seconds of the attention core (scores, softmax, context), forward, backward and selective
    recomputation's re-run before the backward, one tp rank holding heads / `split` of the heads
    (tp; under 3D, Y).

    auto (flash kernels), causal: half of the 4 b s^2 h score + context FLOPs run in the forward,
    2.5x that in the backward (it recomputes the scores), at peak x attention_efficiency (the
    backward at attention_backward_efficiency where the machine gives it). Selective recomputation
    runs the kernel again whole (one op, which saves its output).
    math (torch's reference backend): the two batched GEMMs of the full square, and the scores
    (b x heads/t x s x s elements) written, masked, softmaxed, dropped out and read again. Selective
    recomputation rebuilds only the saved scores (QK^T, mask, softmax, dropout): torch's
    non-reentrant checkpoint stops there, the context GEMM's inputs being rebuilt (`step_flops`).
    """
    m, tr = deck.model, deck.train
    t = deck.parallel.tp if split is None else split
    e, b, s, h = BYTES[tr.precision], tr.micro_batch, m.seq_len, m.hidden
    flops = 4.0 * b * s * s * h / t
    if m.attention_kernel != "math":  # auto and the fused kernels (flash, cudnn, efficient)
        forward = 0.5 * flops / (dev.peak_flops * dev.attention_efficiency)
        backward_efficiency = dev.attention_backward_efficiency or dev.attention_efficiency
        return forward, 2.5 * 0.5 * flops / (dev.peak_flops * backward_efficiency), forward
    scores = b * (m.heads // t) * s * s
    drop = 2 * e + 1 if m.dropout > 0 else 0  # read, write, and a one-byte mask
    gemm_rate = dev.peak_flops * dev.gemm_efficiency
    # Forward: QK^T writes the scores; mask, softmax (and dropout) read and write them; PV reads them.
    rebuild = 0.5 * flops / gemm_rate + dev.stream(scores * (e + 2 * e + 2 * e + drop))
    forward = rebuild + 0.5 * flops / gemm_rate + dev.stream(scores * e)
    # Backward: four GEMMs (dV, dP, dQ, dK) over the scores; dropout, softmax and mask gradients.
    backward = 2 * flops / gemm_rate + dev.stream(scores * (4 * e + drop + 3 * e + 2 * e))
    return forward, backward, rebuild


def context_view(deck: Deck) -> Deck:
    """A context-parallel deck as one of its ranks works it, for the terms that do not see cp: its
    seq_len / cp positions of each sequence, the dp x cp ranks that share the parameters as dp (the
    gradients are reduced and ZeRO shards over them), and a global batch cp times larger, so that
    each keeps its micro-batches. What differs is added by `_ring_passes`: the attention over the
    whole sequence (cp times the view's) and the ring's messages."""
    m, par, tr = deck.model, deck.parallel, deck.train
    order = "-".join(a for a in par.order.split("-") if a != "cp")
    return replaced(
        deck,
        model=replaced(m, seq_len=m.seq_len // par.cp),
        parallel=replaced(par, cp=1, dp=deck.dp * par.cp, order=order),
        train=replaced(tr, global_batch=tr.global_batch * par.cp),
    )


def _ring_passes(
    view: Deck, dev: Device, link: Link, cp: int, layer_f: _Pass, layer_b: _Pass, gloo: bool
) -> tuple[_Pass, _Pass]:
    """What context parallelism adds to a block's forward and backward over `context_view`'s: the
    rest of the attention (a rank's queries meet the whole sequence's keys, causally: cp times the
    view's work, the load-balanced split giving every rank as much), and the ring's messages. Forward:
    cp - 1 hops, each the rank's keys and values (2 x micro-batch x seq / cp x kv heads / tp x head
    size, compute dtype); backward: those again and cp hops of their fp32 gradients. Each hop travels
    while a block is computed: exposed beyond the attention's time, or in full on CPU ranks (gloo's
    copies take the cores the blocks run on). The all-to-all kind instead: four blocking all-to-alls
    each way. Counted with the attention."""
    m, tr, par = view.model, view.train, view.parallel
    e, d = BYTES[tr.precision], m.hidden // m.heads
    attention_f, attention_b = layer_f.attention * (cp - 1), layer_b.attention * (cp - 1)
    if par.cp_kind == "all_to_all":
        # q, k, v to the head split and the output back, forward; their gradients backward: blocking
        # all-to-alls of the rank's tensors (k and v expanded to every query head where cp does not
        # divide the key/value heads).
        heads, kv_heads = m.heads // par.tp, m.kv // par.tp
        kv_heads = kv_heads if kv_heads % cp == 0 else heads
        tokens = tr.micro_batch * m.seq_len * d * e
        moved = sum(link.all_to_all(cp, tokens * h) for h in (heads, kv_heads, kv_heads, heads))
        return _Pass(attention=attention_f + moved), _Pass(attention=attention_b + moved)
    kv = 2.0 * tr.micro_batch * m.seq_len * (m.kv // par.tp) * d  # elements a hop
    send_f = (cp - 1) * link.p2p(kv * e)
    send_b = (cp - 1) * link.p2p(kv * e) + cp * link.p2p(kv * 4)
    hidden_f = 0.0 if gloo else layer_f.attention + attention_f
    hidden_b = 0.0 if gloo else layer_b.attention + attention_b
    return (
        _Pass(attention=attention_f + max(0.0, send_f - hidden_f)),
        _Pass(attention=attention_b + max(0.0, send_b - hidden_b)),
    )


def _head_passes(
    deck: Deck, dev: Device, tp_link: Link, msgs: dict[str, list[tuple[str, float]]]
) -> tuple[_Pass, _Pass]:
    """(forward, backward) of the output head and vocab-parallel cross-entropy, one micro-batch."""
    m, par, tr = deck.model, deck.parallel, deck.train
    t, e = par.tp, BYTES[tr.precision]
    tokens, v = tr.micro_batch * m.seq_len, m.vocab_size // par.tp
    comm_fwd = sum(_cost(tp_link, t, op, n) for op, n in msgs["head_forward"])
    comm_bwd = sum(_cost(tp_link, t, op, n) for op, n in msgs["head_backward"])
    # Logits written in the compute dtype, then max, exp (fp32), sum, the picked logit; backward:
    # the softmax gradient.
    # The embedding's and the loss's framework ops are counted here (OPS["other_*"]).
    host_f, host_b = OPS["other_forward"] * dev.op_seconds, OPS["other_backward"] * dev.op_seconds
    head, head_dgrad, head_wgrad = dev.linear(tokens, v, m.hidden, e)
    fresh = dev.fresh(tokens * v * 4)  # the fp32 log-probabilities, and their gradient
    fwd = _Pass(head, 0.0, dev.stream(tokens * v * (e + 12), "softmax") + fresh, comm_fwd, host_f)
    bwd_gemm = head_dgrad + head_wgrad
    bwd = _Pass(bwd_gemm, 0.0, dev.stream(tokens * v * (4 + 2 * e), "softmax") + fresh, comm_bwd, host_b)
    return fwd, bwd


def _embedding_passes(
    deck: Deck, dev: Device, tp_link: Link, msgs: dict[str, list[tuple[str, float]]]
) -> tuple[_Pass, _Pass]:
    m, par, tr = deck.model, deck.parallel, deck.train
    e, tokens = BYTES[tr.precision], tr.micro_batch * m.seq_len
    x = tokens * m.hidden * e
    comm_fwd = sum(_cost(tp_link, par.tp, op, n) for op, n in msgs["embedding_forward"])
    comm_bwd = sum(_cost(tp_link, par.tp, op, n) for op, n in msgs["embedding_backward"])
    # Token rows + positions gathered and added; backward scatter-adds into the tables.
    return _Pass(0.0, 0.0, dev.stream(4 * x), comm_fwd), _Pass(0.0, 0.0, dev.stream(6 * x), comm_bwd)


def _expert_passes(deck: Deck, dev: Device, link: Optional[Link], overlap: bool) -> tuple[_Pass, _Pass, _Pass]:
    """(forward, backward, full recompute) all-to-alls of one MoE layer on one micro-batch under
    expert parallelism (`ep_collectives`) on the ep group's `link`, each waited for (the next
    operation needs its result), but for the forward's dispatch of the token rows, which runs while
    the shared experts compute (`MoE._exchange`, `all_to_all_start`) where `overlap` (not on gloo's
    shared cores): only what outlasts their GEMMs is exposed. Zero at ep = 1. The device-to-host copy
    of the counts is not charged apart (its collective's latency is)."""
    calls = ep_collectives(deck)
    if link is None or not calls["forward"]:
        return _Pass(), _Pass(), _Pass()
    m, par, tr = deck.model, deck.parallel, deck.train
    ep, e = par.ep, BYTES[tr.precision]
    hidden_by = 0.0
    width = m.moe_shared_experts * m.expert_ffn
    if overlap and width:  # the shared experts' forward GEMMs on the rank's tokens (whole on every tp rank)
        tokens = routed(deck)[0]
        hidden_by = (
            dev.linear(tokens, m.spec.fc_rows(width), m.hidden, e)[0] + dev.linear(tokens, m.hidden, width, e)[0]
        )

    def seconds(key: str) -> _Pass:
        costs = [_cost(link, ep, op, n) for op, n in calls[key]]
        if key != "backward":  # [counts, dispatch, combine]: the dispatch behind the shared experts
            costs[1] = max(0.0, costs[1] - hidden_by)
        return _Pass(ep=sum(costs))

    return seconds("forward"), seconds("backward"), seconds("recompute")


# -- 3D tensor parallelism (parallel.tensor: app/tensor_parallel/tensor3d.py) ---------------------

_KEYS = ("layer_forward", "layer_recompute", "layer_backward", "head_forward", "head_backward",
         "embedding_forward", "embedding_backward")  # fmt: skip


def tensor_shape(deck: Deck) -> Optional[tuple[int, int, int]]:
    """(X, Y, Z) of a 3D deck (`parallel.tensor`), None for 1D tensor parallelism."""
    t = deck.parallel.tensor
    return None if t is None else (int(t[0]), int(t[1]), int(t[2]))


@dataclass(frozen=True)
class Overlap3D:
    """Which 3D collectives run behind compute, as `linear3d` runs them: AxoNN's OAR, ORS and OAG.

    OAR (`parallel.overlap_tp_comm`): a Linear's dx all-reduce during its own weight-gradient GEMM.
    ORS (`parallel.overlap_tensor_reduce_scatter`): the blocks' dW reduce-scatters over Z retire
    once newer ones are in flight or when the chunk's backward ends, so they run behind the
    backward of the layers before them. OAG (`parallel.overlap_tensor_all_gather`): each Linear of
    a block starts the next one's gather over Z before its GEMM, in forward and (not under ZeRO-3,
    `gather_backward`) in backward; the block's first gather of a pass is waited for."""

    all_reduce: bool = False
    reduce_scatter: bool = False
    all_gather: bool = False
    gather_backward: bool = False


def overlap3d(deck: Deck) -> Overlap3D:
    """The overlaps gridlm runs for a 3D deck (`Overlap3D`), from its `parallel.overlap_*` keys."""
    par = deck.parallel
    return Overlap3D(
        all_reduce=par.overlap_tp_comm,
        reduce_scatter=par.overlap_tensor_reduce_scatter,
        all_gather=par.overlap_tensor_all_gather,
        gather_backward=par.overlap_tensor_all_gather and not deck.zero3,
    )


@dataclass(frozen=True)
class Linear3DShape:
    """One Linear's GEMM on a 3D rank, (tokens x k) @ (k x n), and the sub-axes of its collectives.

    A layout (`transposed` False: qkv, mlp.fc, the head): W (out, in) split (out / Y, in / X), the
    forward's output summed over X, the backward's dx over Y. B layout (attn.proj, mlp.proj): split
    (out / X, in / Y), the roles swapped. The (n x k) block is Z-sharded by rows: gathered over Z for
    the pass, its gradient reduce-scattered over Z."""

    name: str
    n: int  # out / |out axis|: the block's rows, gathered over Z
    k: int  # in / |in axis|
    forward_axis: str  # the in axis: all-reduce of the (tokens x n) output
    backward_axis: str  # the out axis: all-reduce of the (tokens x k) input gradient


def linears3d(m: ModelConfig, shape: tuple[int, int, int]) -> list[Linear3DShape]:
    """A block's four Linears in forward order (qkv A, attn.proj B, mlp.fc A, mlp.proj B)."""
    x, y, _ = shape
    h, f = m.hidden, m.ffn

    def a(name: str, out: int, inp: int) -> Linear3DShape:
        return Linear3DShape(name, out // y, inp // x, "tp_x", "tp_y")

    def b(name: str, out: int, inp: int) -> Linear3DShape:
        return Linear3DShape(name, out // x, inp // y, "tp_y", "tp_x")

    return [a("qkv", 3 * h, h), b("attn.proj", h, h), a("mlp.fc", f, h), b("mlp.proj", h, f)]


def _tp3d_lists(deck: Deck) -> dict[str, list[tuple[str, str, float]]]:
    """`tp3d_collectives` with the collectives of one-rank sub-axes kept (they cost 0), in the order
    `_layer_passes3d` reads them: per Linear (all-gather, forward all-reduce) in the forward,
    (all-gather again, dx all-reduce, reduce-scatter) in the backward."""
    m, tr = deck.model, deck.train
    shape = tensor_shape(deck)
    assert shape is not None
    x, y, _ = shape
    e, tokens = BYTES[tr.precision], tr.micro_batch * m.seq_len
    stats = [("tp_x", "all_reduce", tokens * 4.0)] * 2  # one LayerNorm3D: mean and variance, fp32
    forward: list[tuple[str, str, float]] = []
    backward: list[tuple[str, str, float]] = []
    for i, lin in enumerate(linears3d(m, shape)):
        if i in (0, 2):  # ln1 before qkv, ln2 before mlp.fc
            forward += stats
        weight = float(lin.n * lin.k * e)
        forward += [("tp_z", "all_gather", weight), (lin.forward_axis, "all_reduce", tokens * lin.n * e)]
        backward += [("tp_z", "all_gather", weight), (lin.backward_axis, "all_reduce", tokens * lin.k * e),
                     ("tp_z", "reduce_scatter", weight)]  # fmt: skip
    backward += stats * 2  # each LayerNorm3D's backward sums its two statistics' gradients again
    table = float((m.vocab_size // y) * (m.hidden // x) * e)  # the embedding's / head's (V/Y, h/X) block
    return {
        "layer_forward": forward,
        # Full recomputation stops once every saved tensor is rebuilt: without dropout, after mlp.proj's
        # GEMM, before its forward all-reduce (as in 1D, `tp_collectives`).
        "layer_recompute": forward if m.dropout > 0 else forward[:-1],
        "layer_backward": backward,
        # ln_f's statistics, the head block's gather, the logits' sum over X; the vocab-parallel
        # cross-entropy's max, sum of exponentials and target logit over Y (one fp32 per token each).
        "head_forward": stats + [("tp_z", "all_gather", table), ("tp_x", "all_reduce", tokens * (m.vocab_size // y) * e)]
        + [("tp_y", "all_reduce", tokens * 4.0)] * 3,
        "head_backward": [("tp_z", "all_gather", table), ("tp_y", "all_reduce", tokens * (m.hidden // x) * e),
                          ("tp_z", "reduce_scatter", table)] + stats,
        # The table block's gather; the lookup summed over Y (embedding3d). Backward: the reduce-scatter.
        "embedding_forward": [("tp_z", "all_gather", table), ("tp_y", "all_reduce", tokens * (m.hidden // x) * e)],
        "embedding_backward": [("tp_z", "reduce_scatter", table)],
    }  # fmt: skip


def tp3d_collectives(deck: Deck) -> dict[str, list[tuple[str, str, float]]]:
    """The 3D tensor-parallel collectives gridlm runs per micro-batch, as (sub-axis, op, bytes), bytes
    the full size (an all-gather's gathered block, a reduce-scatter's whole gradient), keyed like
    `tp_collectives`. Per block and micro-batch of T = micro_batch x seq_len tokens (this rank's:
    the batch is split over dp x Z), e bytes of the compute dtype, each Linear (n x k block):

        forward    all-gather over Z of n k e; all-reduce of the output T n e over its in axis
        backward   all-gather over Z of n k e again (the gathered block is not kept); all-reduce
                   of dx, T k e, over its out axis; reduce-scatter over Z of n k e
        LayerNorm  all-reduce over X of 4 T bytes, twice forward (mean, variance), twice backward

    The head: the same for its (V/Y, h/X) block plus the cross-entropy's three 4 T all-reduces over
    Y; the embedding: the gather of that block and the lookup's sum over Y (T h/X e); its backward
    the reduce-scatter. Collectives over a sub-axis of one rank are left out. Not here: the sum over
    Z of the replicated parameters' gradients after the backward (`predict`: dp_exposed)."""
    sizes = dict(zip(TP_SUB_AXES, tensor_shape(deck) or (1, 1, 1)))
    return {k: [c for c in v if sizes[c[0]] > 1] for k, v in _tp3d_lists(deck).items()}


def stage_params3d(
    m: ModelConfig, shape: tuple[int, int, int], layers: int, first: bool, last: bool
) -> tuple[int, int]:
    """(parameters one 3D tp rank of a pipeline stage holds, those of them replicated over Z).

    Each weight: its (X x Y) block's 1/Z rows (`tensor3d.weight_splits`); the embedding table and
    the head, the A layout's (V/Y, h/X) block likewise. Replicated over Z (their gradients summed
    over Z after the backward): LayerNorms (h/X each), the A biases (out/Y), the B biases (h/X), and
    the positions (seq_len x h/X)."""
    x, y, z = shape
    h, v = m.hidden, m.vocab_size
    lins = linears3d(m, shape)
    sharded = layers * sum((lin.n // z) * lin.k for lin in lins)
    replicated = layers * (2 * 2 * (h // x) + lins[0].n + lins[1].n + lins[2].n + lins[3].n)
    table = (v // y // z) * (h // x)
    if first:
        sharded += table
        replicated += m.seq_len * (h // x)
    if last:
        replicated += 2 * (h // x)
        if not m.tie_embeddings or not first:
            sharded += table
    return sharded + replicated, replicated


def axis_links3d(
    machine: Machine, layout: GridLayout, shape: tuple[int, int, int], order: str = "xyz"
) -> dict[str, Link]:
    """The links of the 3D sub-axes laid out `order` (parallel.tensor_order). Inside the tp axis
    (stride s in the world) a sub-axis of tp-rank stride `strides3d` t has its groups s t apart: by
    default (xyz, X innermost) the X groups s apart, the Y groups s X and the Z groups s X Y
    (`group_link`: the same sharing of each level's links as the other axes)."""
    s = layout.stride("tp")
    strides = strides3d(shape, order)
    return {a: group_link(machine, s * inner, n) for a, inner, n in zip(TP_SUB_AXES, strides, shape)}


def _exposed3d(items: list[tuple[str, str, float]], links: dict[str, Link], sizes: dict[str, int]) -> list[float]:
    return [_cost(links[a], sizes[a], op, n) for a, op, n in items]


def _by_axis(items: list[tuple[str, str, float]], costs: list[float]) -> tuple[float, float, float]:
    return tuple(sum(c for (a, _, _), c in zip(items, costs) if a == axis) for axis in TP_SUB_AXES)  # type: ignore[return-value]


def _comm_pass(axes: tuple[float, float, float]) -> _Pass:
    return _Pass(tp=sum(axes), axes=axes)


def _layer_passes3d(deck: Deck, dev: Device, links: dict[str, Link], ov: Overlap3D) -> tuple[_Pass, _Pass, _Pass]:
    """(forward, backward, full recompute) of one transformer block on one micro-batch, one 3D rank."""
    m, tr = deck.model, deck.train
    shape = tensor_shape(deck)
    assert shape is not None
    x, y, _ = shape
    sizes = dict(zip(TP_SUB_AXES, shape))
    e = BYTES[tr.precision]
    tokens, h, f = tr.micro_batch * m.seq_len, m.hidden, m.ffn
    lins = linears3d(m, shape)
    gemms = [dev.linear(tokens, lin.n, lin.k, e) for lin in lins]
    fwd_gemm = sum(g[0] for g in gemms)
    dgrad, wgrad = [g[1] for g in gemms], [g[2] for g in gemms]
    attn_fwd, attn_bwd, _ = _attention(deck, dev, y)  # heads / Y, replicated over X
    # Element-wise bytes per token of one forward: the four bias adds after the all-reduces (each on
    # its Linear's output), two residual adds on h/X, the attention output's transpose copy (h/Y),
    # dropout (p > 0) x 2 on h/X with its mask; GELU on f/Y.
    per_token = sum(2 * lin.n for lin in lins) * e + (3 + 3) * (h // x) * e + 2 * (h // y) * e
    if m.dropout > 0:
        per_token += 2 * (2 * (h // x) * e + (h // x))
    # LayerNorm3D (X > 1) runs eager fp32 ops per element: the copy to fp32 (e + 4, none in fp32), the
    # mean's sum (4), x - mean (8), its square (8) and sum (4), the scaling by rsqrt (8), by the weight
    # (8), the bias add (8), the copy back (4 + e); with X = 1 it is F.layer_norm (2 e, as in 1D).
    ln = 2 * e if x == 1 else 48 + (0 if e == 4 else 2 * (e + 4))
    layernorm, gelu = tokens * 2 * ln * (h // x), tokens * 2 * f * e / y
    elem_fwd = dev.stream(tokens * per_token) + dev.stream(layernorm, "layernorm") + dev.stream(gelu, "gelu")
    fresh = dev.fresh(tokens * f * e / y)  # the MLP activation and its gradient (CPUs; as in 1D)
    lists = _tp3d_lists(deck)

    def forward_comm(items: list[tuple[str, str, float]], compute: float) -> tuple[float, float, float]:
        costs = _exposed3d(items, links, sizes)
        cx, cy, cz = _by_axis(items, costs)
        if ov.all_gather:  # the gathers prefetched: the first waited for, the rest behind the compute
            gathers = [c for (_, op, _), c in zip(items, costs) if op == "all_gather"]
            cz = max(gathers[0], cz - compute) if gathers else cz
        return cx, cy, cz

    compute_f = fwd_gemm + attn_fwd + elem_fwd
    tp_fwd = forward_comm(lists["layer_forward"], compute_f)
    tp_rec = forward_comm(lists["layer_recompute"], compute_f)
    items_b = lists["layer_backward"]
    costs_b = _exposed3d(items_b, links, sizes)
    if ov.all_reduce:  # OAR: each dx all-reduce (items 1, 4, 7, 10) behind its Linear's dW GEMM
        for i in range(len(lins)):
            costs_b[3 * i + 1] = max(0.0, costs_b[3 * i + 1] - wgrad[i])
    if ov.gather_backward:  # OAG in backward: mlp.proj's gather waited for, each other one behind the
        for i in range(len(lins) - 1):  # GEMMs of the Linear after it (which backward runs first)
            costs_b[3 * i] = max(0.0, costs_b[3 * i] - dgrad[i + 1] - wgrad[i + 1])
    bx, by, bz = _by_axis(items_b, costs_b)
    if ov.reduce_scatter:  # ORS: behind the block's remaining backward; the last one waited for
        rs = [costs_b[3 * i + 2] for i in range(len(lins))]
        bz = max(rs[-1], bz - (sum(dgrad) + sum(wgrad[:-1]) + attn_bwd))
    host_f, host_b = OPS["layer_forward"] * dev.op_seconds, OPS["layer_backward"] * dev.op_seconds
    forward = _Pass(fwd_gemm, attn_fwd, elem_fwd + fresh, host=host_f) + _comm_pass(tp_fwd)
    backward = _Pass(sum(dgrad) + sum(wgrad), attn_bwd, BACKWARD_BYTES * elem_fwd + fresh, host=host_b) + _comm_pass(
        (bx, by, bz)
    )
    recompute = _Pass(fwd_gemm, attn_fwd, elem_fwd + fresh, host=host_f) + _comm_pass(tp_rec)
    return forward, backward, recompute


def _head_passes3d(deck: Deck, dev: Device, links: dict[str, Link]) -> tuple[_Pass, _Pass]:
    """(forward, backward) of the 3D head (the A layout's (V/Y, h/X) block) and the cross-entropy."""
    m, tr = deck.model, deck.train
    shape = tensor_shape(deck)
    assert shape is not None
    x, y, _ = shape
    sizes = dict(zip(TP_SUB_AXES, shape))
    e, tokens, v, k = BYTES[tr.precision], tr.micro_batch * m.seq_len, m.vocab_size // y, m.hidden // x
    lists = _tp3d_lists(deck)
    comm_f = _by_axis(lists["head_forward"], _exposed3d(lists["head_forward"], links, sizes))
    comm_b = _by_axis(lists["head_backward"], _exposed3d(lists["head_backward"], links, sizes))
    host_f, host_b = OPS["other_forward"] * dev.op_seconds, OPS["other_backward"] * dev.op_seconds
    head, head_dgrad, head_wgrad = dev.linear(tokens, v, k, e)
    fresh = dev.fresh(tokens * v * 4)  # the fp32 log-probabilities, and their gradient
    fwd = _Pass(head, 0.0, dev.stream(tokens * v * (e + 12), "softmax") + fresh, host=host_f)
    bwd_gemm = head_dgrad + head_wgrad
    bwd = _Pass(bwd_gemm, 0.0, dev.stream(tokens * v * (4 + 2 * e), "softmax") + fresh, host=host_b)
    return fwd + _comm_pass(comm_f), bwd + _comm_pass(comm_b)


def _embedding_passes3d(deck: Deck, dev: Device, links: dict[str, Link]) -> tuple[_Pass, _Pass]:
    m, tr = deck.model, deck.train
    shape = tensor_shape(deck)
    assert shape is not None
    sizes = dict(zip(TP_SUB_AXES, shape))
    xb = tr.micro_batch * m.seq_len * (m.hidden // shape[0]) * BYTES[tr.precision]
    lists = _tp3d_lists(deck)
    comm_f = _by_axis(lists["embedding_forward"], _exposed3d(lists["embedding_forward"], links, sizes))
    comm_b = _by_axis(lists["embedding_backward"], _exposed3d(lists["embedding_backward"], links, sizes))
    # Token rows (masked to this Y rank's range) + positions, on h/X; backward scatter-adds.
    return _Pass(elementwise=dev.stream(4 * xb)) + _comm_pass(comm_f), _Pass(
        elementwise=dev.stream(6 * xb)
    ) + _comm_pass(comm_b)


def _start_of(
    a: Action, stage: int, pp: int, last: int, done: dict, clock: float, post: float, p2p: float
) -> tuple[int, Optional[float]]:
    """The global chunk of `stage`'s action `a`, and the earliest it can start: when the stage is
    free (`clock`) and the pass whose output it receives (the previous chunk's forward, the next
    chunk's backward; none at the ends) has arrived, `p2p` after both its end (`done`) and the
    receive's posting (`post`: when the previous action began, with prefetch). None: that pass
    has not been simulated yet."""
    chunk = a.virtual * pp + stage
    if a.kind == "F":
        dep = ("F", a.micro, chunk - 1) if chunk > 0 else None
    else:
        dep = ("B", a.micro, chunk + 1) if chunk < last else None
    if dep is None:
        return chunk, clock
    if dep not in done:
        return chunk, None
    return chunk, max(clock, max(done[dep], post) + p2p)


def _simulate(
    pp: int, virtual: int, micro: int, fwd: list[float], bwd: list[float], p2p: float, prefetch: bool
) -> list[float]:
    """Finish time of every stage running its schedule; `fwd[c]`/`bwd[c]` per global chunk."""
    schedules = [build_schedule(pp, s, micro, virtual) for s in range(pp)]
    done: dict[tuple[str, int, int], float] = {}  # (kind, micro, chunk) -> end time
    clock, position, posted = [0.0] * pp, [0] * pp, [0.0] * pp
    last = pp * virtual - 1
    remaining = sum(len(s) for s in schedules)
    while remaining:
        progressed = False
        for s in range(pp):
            while position[s] < len(schedules[s]):
                a = schedules[s][position[s]]
                chunk, start = _start_of(a, s, pp, last, done, clock[s], posted[s] if prefetch else clock[s], p2p)
                if start is None:
                    break
                posted[s] = start
                end = start + (fwd[chunk] if a.kind == "F" else bwd[chunk])
                done[(a.kind, a.micro, chunk)] = end
                clock[s] = end
                position[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError("pipeline simulation deadlocked (schedule.simulate should have caught it)")
    return clock


def _simulate_shared(
    pp: int,
    virtual: int,
    micro: int,
    fwd: list[float],
    bwd: list[float],
    p2p: float,
    prefetch: bool,
    speed: Callable[[int], float],
) -> list[float]:
    """`_simulate` for ranks that share a node's cores (processor sharing). A pass's time is its
    work with every rank busy; with `n` stages busy it runs `speed(n)` times as fast (a stage
    waiting for its input blocks in gloo and leaves its cores to the busy ones). speed = 1:
    the same finish times as `_simulate` (tested)."""
    schedules = [build_schedule(pp, s, micro, virtual) for s in range(pp)]
    done: dict[tuple[str, int, int], float] = {}  # (kind, micro, chunk) -> end time
    clock, position, posted = [0.0] * pp, [0] * pp, [0.0] * pp
    running: dict[int, list] = {}  # stage -> [work left, (kind, micro, chunk)]
    pending: dict[int, tuple[float, float, tuple[str, int, int]]] = {}  # stage -> (start, work, pass)
    last, now = pp * virtual - 1, 0.0
    remaining = sum(len(x) for x in schedules)
    while remaining:
        for s in range(pp):
            if s in running or s in pending or position[s] >= len(schedules[s]):
                continue
            a = schedules[s][position[s]]
            chunk, start = _start_of(a, s, pp, last, done, clock[s], posted[s] if prefetch else clock[s], p2p)
            if start is None:
                continue
            posted[s] = start
            pending[s] = (start, fwd[chunk] if a.kind == "F" else bwd[chunk], (a.kind, a.micro, chunk))
        for s, (start, work, key) in list(pending.items()):
            if start <= now:
                running[s] = [work, key]
                del pending[s]
        if not running:
            if not pending:
                raise RuntimeError("pipeline simulation deadlocked (schedule.simulate should have caught it)")
            now = min(start for start, _, _ in pending.values())
            continue
        rate = speed(len(running))
        least = min(work for work, _ in running.values())
        step = least / rate
        next_start = min((start for start, _, _ in pending.values()), default=math.inf)
        if next_start - now < step:
            step, least = next_start - now, -1.0  # a pass starts before any ends
        now += step
        for s in list(running):
            work, key = running[s]
            if work <= least * (1 + 1e-12):
                done[key], clock[s] = now, now
                position[s] += 1
                remaining -= 1
                del running[s]
            else:
                running[s][0] = work - step * rate
    return clock


def core_sharing(machine: Machine, pp: int) -> Optional[Callable[[int], float]]:
    """On a CPU node with more ranks than cores, the speed-up of a pass when `n` of the `pp`
    stages are busy, relative to its time with every rank busy (the calibrated rates): a rank
    gets min(1, cores / busy ranks) of a core. None where ranks do not share cores."""
    ranks, cores = machine.devices_per_node, machine.cpu_cores_per_node
    if machine.device_name != "cpu" or ranks <= cores or pp <= 1:
        return None
    share = cores / ranks

    def speed(n: int) -> float:
        return min(1.0, cores * pp / (ranks * n)) / share

    return speed


def param_tensors(layers: int, first: bool, last: bool, m: ModelConfig) -> tuple[int, int]:
    """(parameter tensors, weight matrices) of a stage (its architecture's list): the optimizer and
    the norm run a few framework ops per each."""
    before, after = m.spec.end_params(m, first, last)
    block = m.spec.block_params(m)

    def counts(params: list[ParamSpec]) -> tuple[int, int]:
        return len(params), sum(len(p.shape) == 2 for p in params)

    (end_tensors, end_matrices), (block_tensors, block_matrices) = counts([*before, *after]), counts(block)
    return end_tensors + layers * block_tensors, end_matrices + layers * block_matrices


def step_collectives(deck: Deck, machine: Machine, layout: GridLayout, links: dict[str, Link]) -> float:
    """The small all-reduces every step makes after the backward: the gradient norm's (over tp
    and pp, and dp under ZeRO-1 or with experts split over ep), the non-finite check's (over tp,
    pp and dp), one group at a time (ProcessGrid.all_reduce), and the stop-signal vote (one MPI
    all-reduce over all ranks). Latency-bound: a few bytes each."""
    sizes = {"tp": deck.parallel.tp, "pp": deck.parallel.pp, "dp": deck.dp}
    # Over dp too where its ranks hold different values: ZeRO's shards, experts split over ep.
    experts = deck.parallel.ep > 1 and deck.model.moe_experts > 0
    norm_axes = AXES if deck.optim.zero or experts else ("tp", "pp")
    seconds = sum(_cost(links[a], sizes[a], "all_reduce", 8) for a in norm_axes)
    seconds += sum(_cost(links[a], sizes[a], "all_reduce", 8) for a in AXES)
    world = sizes["tp"] * sizes["pp"] * sizes["dp"]
    return seconds + _cost(group_link(machine, 1, world), world, "all_reduce", 8)


@dataclass(frozen=True)
class Placement:
    """A deck (resolved for a world size) placed on a machine, worked out once for its prediction:
    the grid's layout on the machine's nodes, the device's constants, each axis's link (and each 3D
    tp sub-axis's), and with optim.offload the rank's offload rates. `place` makes it and is where
    the machine file is checked; the dry run shows its links, `predict` reads all of it."""

    machine: Machine
    layout: GridLayout
    device: Device
    links: dict[str, Link]  # by axis, and expert parallelism's ep and edp (`axis_links`)
    links3: dict[str, Link]  # 3D tensor parallelism's tp_x, tp_y, tp_z; empty for 1D
    offload: Optional[OffloadRates]


def place(deck: Deck, machine: Machine, layout: Optional[GridLayout] = None) -> Placement:
    """`deck` (resolved for a world size) on `machine`, the grid laid out on its nodes unless `layout`
    is given; a `MachineError` names the keys the machine file lacks for a prediction."""
    tr, par = deck.train, deck.parallel
    machine.require_prediction(tr.precision, deck.optim.offload)
    if layout is None:
        layout = GridLayout.from_order_string(par.tp, par.pp, deck.dp, par.order, machine.devices_per_node, par.cp)
    shape = tensor_shape(deck)
    world = par.tp * par.cp * par.pp * deck.dp
    return Placement(
        machine=machine,
        layout=layout,
        device=device_of(machine, tr.precision, deck.run.malloc_mmap_threshold_kb),
        links=axis_links(machine, layout, par.ep),
        links3={} if shape is None else axis_links3d(machine, layout, shape, par.tensor_order),
        offload=None
        if deck.optim.offload == "none"
        else offload_rates(deck, machine, min(machine.devices_per_node, world)),
    )


def predict(
    deck: Deck,
    machine: Machine,
    layout: Optional[GridLayout] = None,
    simulate: bool = True,
    placement: Optional[Placement] = None,
) -> Prediction:
    """The step time of a deck resolved for a world size (`resolve_for_world`) on `machine` (laid
    out as `layout`, or as `placement` when the caller has placed it already; `place`).
    `simulate=False` takes the pipeline's steady state plus its bubble instead of simulating
    every pass (the search ranks thousands of grids so, then simulates the best)."""
    placed = placement if placement is not None else place(deck, machine, layout)
    dev, rates, layout, links = placed.device, placed.offload, placed.layout, placed.links
    counted = step_flops(deck, not uses_gloo(machine))  # the model's FLOPs, whatever the split
    cp = deck.parallel.cp
    if cp > 1:  # each rank's share, as a grid without cp sees it (`context_view`); the ring added below
        deck = context_view(deck)
    m, par, tr, opt = deck.model, deck.parallel, deck.train, deck.optim
    tp, pp, dp, v = par.tp, par.pp, deck.dp, par.virtual_stages
    requested = deck.parallel  # the overlap the deck asks for (gloo's dp reductions, below)
    if uses_gloo(machine):
        # CPU ranks: gloo's copies and reductions run on the same cores as the compute, so nothing
        # overlaps; every collective and transfer is charged in full.
        par = dataclasses.replace(par, overlap_tp_comm=False, overlap_pp_comm=False, overlap_grad_reduce=False,
                                  overlap_param_gather=False)  # fmt: skip
        deck = dataclasses.replace(deck, parallel=par)
    deck = as_run_on(deck, machine)
    e = BYTES[tr.precision]
    g = BYTES[reduce_precision(tr.precision, tr.grad_reduce_dtype)]
    micro = deck.num_micro_batches

    shape = tensor_shape(deck)
    links3 = placed.links3
    moe = moe_chunk_layers(deck)  # blocks whose MLP is a mixture of experts, by chunk
    # A MoE block: a dense block's passes but for its tp collectives (`moe_tp_collectives`), plus
    # expert parallelism's all-to-alls (exposed, but for what the shared experts hide).
    expert_f = expert_b = expert_r = _Pass()
    if shape is None:
        msgs = tp_collectives(deck)
        layer_f, layer_b, layer_r = _layer_passes(deck, dev, links["tp"], msgs)
        ring_f = ring_b = _Pass()  # context parallelism's: every block's attention, MoE blocks' too
        if cp > 1:
            ring_f, ring_b = _ring_passes(deck, dev, links["cp"], cp, layer_f, layer_b, uses_gloo(machine))
            layer_f, layer_b, layer_r = layer_f + ring_f, layer_b + ring_b, layer_r + ring_f
        head_f, head_b = _head_passes(deck, dev, links["tp"], msgs)
        emb_f, emb_b = _embedding_passes(deck, dev, links["tp"], msgs)
        if any(moe):
            moe_msgs = {**msgs, **moe_tp_collectives(deck)}
            expert_f, expert_b, expert_r = _layer_passes(deck, dev, links["tp"], moe_msgs, moe=True)
            a2a = _expert_passes(deck, dev, links.get("ep"), not uses_gloo(machine))
            ring = (ring_f, ring_b, ring_f)
            expert_f, expert_b, expert_r = (p + q + r for p, q, r in zip((expert_f, expert_b, expert_r), a2a, ring))
    else:  # 3D: each collective on its sub-axis's link (axis_links3d)
        layer_f, layer_b, layer_r = _layer_passes3d(deck, dev, links3, overlap3d(deck))
        head_f, head_b = _head_passes3d(deck, dev, links3)
        emb_f, emb_b = _embedding_passes3d(deck, dev, links3)
    if tr.recompute == "full":
        layer_b = layer_b + layer_r  # the forward again, just before each block's backward
        expert_b = expert_b + expert_r
    elif tr.recompute == "selective":
        # The attention core again before its backward (`_attention`: a fused kernel whole, the math
        # kernel up to its saved scores); context parallelism's ring attention whole, its hops too.
        core = layer_f.attention if cp > 1 else _attention(deck, dev, None if shape is None else shape[1])[2]
        layer_b = layer_b + _Pass(attention=core, host=dev.op_seconds)  # one op
        expert_b = expert_b + _Pass(attention=core, host=dev.op_seconds)
    chunks = [len(c) for c in deck.chunks]
    last = pp * v - 1

    def blocks(dense: _Pass, experts: _Pass, c: int) -> _Pass:
        """Chunk c's blocks: its dense ones and its MoE ones."""
        return dense.scaled(chunks[c] - moe[c]) + experts.scaled(moe[c]) if moe[c] else dense.scaled(chunks[c])

    fwd_parts = [blocks(layer_f, expert_f, c) + (emb_f if c == 0 else _Pass()) + (head_f if c == last else _Pass())
                 for c in range(pp * v)]  # fmt: skip
    bwd_parts = [blocks(layer_b, expert_b, c) + (emb_b if c == 0 else _Pass()) + (head_b if c == last else _Pass())
                 for c in range(pp * v)]  # fmt: skip

    # Gradient accumulation: after each backward a hook adds every parameter's gradient (compute
    # dtype) into the fp32 (or compute-dtype) buffer: read both, write the buffer.
    stage_layers = [sum(chunks[s + c * pp] for c in range(v)) for s in range(pp)]
    if shape is None:
        block = block_params(m, tp, ep=par.ep)
        params = [stage_params(m, tp, stage_layers[s], s == 0, s == pp - 1, block=block) for s in range(pp)]
        replicated = [0] * pp
    else:
        params, replicated = map(list, zip(*(stage_params3d(m, shape, stage_layers[s], s == 0, s == pp - 1)
                                             for s in range(pp))))  # fmt: skip
    # The buffer, as large as the stage's parameters, comes from memory and goes back each time; a
    # step's first gradient is copied in (`DataParallel.fresh`: the buffer written, not read), so a
    # micro-batch moves g / micro fewer bytes on average. ZeRO-2/3's per-bucket buffers start zeroed.
    first = 0.0 if opt.zero >= 2 and dp > 1 else g / micro
    # train.fuse_grad_accumulation (1D; on GPUs by default): a Linear weight's gradient GEMM writes the
    # accumulator itself (g bytes instead of its own e) and reads it back after the first micro-batch;
    # no gradient of e bytes is read again, no pass of its own (charged as passes, not hidden in the GEMM).
    fused = [0] * pp
    if shape is None and tr.fuses_grad_accumulation(not uses_gloo(machine)):
        fused = [linear_weight_params(m, tp, stage_layers[s], s == 0, s == pp - 1) for s in range(pp)]
    accumulate = [
        dev.stream((p - f) * (e + 2 * g - first) + f * (2 * g - e - first)) + dev.from_memory(p * (2 * g - first))
        for p, f in zip(params, fused)
    ]
    per_stage_chunks = {c: c % pp for c in range(pp * v)}
    fwd = [p.total for p in fwd_parts]
    bwd = [p.total + accumulate[per_stage_chunks[c]] / v for c, p in enumerate(bwd_parts)]
    # ZeRO-3: the parameter all-gathers exposed in each pass (they delay the pipeline like compute).
    gathers = [(0.0, 0.0)] * (pp * v)
    if deck.zero3:
        gathers = zero3_gathers(deck, links["dp"], chunks, fwd, bwd, requested.overlap_param_gather, links.get("edp"))
        fwd = [t + f for t, (f, _) in zip(fwd, gathers)]
        bwd = [t + b for t, (_, b) in zip(bwd, gathers)]
    p2p = links["pp"].p2p(p2p_bytes(deck)) + links["pp"].busy_p2p if pp > 1 else 0.0
    sharing = core_sharing(machine, pp)
    if simulate and pp * v * micro <= MAX_SIMULATED_PASSES and sharing is not None:
        finish = _simulate_shared(pp, v, micro, fwd, bwd, p2p, par.overlap_pp_comm, sharing)
    elif simulate and pp * v * micro <= MAX_SIMULATED_PASSES:
        finish = _simulate(pp, v, micro, fwd, bwd, p2p, par.overlap_pp_comm)
    else:  # the steady state dominates: busy time plus the interleaved 1F1B bubble, (pp - 1) / v chunks
        per_stage = [sum(fwd[c] + bwd[c] for c in range(s, pp * v, pp)) for s in range(pp)]
        bubble = (pp - 1) / v * max(per_stage) + 2 * (pp - 1) * p2p
        finish = [micro * busy + bubble for busy in per_stage]

    # Data parallelism, per stage: bucketed reductions of the stage's gradients. Under expert
    # parallelism the experts' buckets (E/ep of the experts) go to the expert-data group's dp/ep ranks.
    bucket = par.dp_bucket_mb * 1e6
    ep = par.ep if m.moe_experts else 1
    experts_per_block = block_expert_params(m, ep) if ep > 1 else 0
    dp_exposed, tied, norm, optimizer, offloaded, z_sum = [], 0.0, [], [], [], []
    unit_kinds: dict[tuple[bool, bool], dict[str, list[int]]] = {}  # ZeRO-3: (first, last) -> unit_buckets
    # Weight matrices per stage (the optimizer's per-tensor ops): the ends' own, plus each block's.
    end_matrices = {(f, e): param_tensors(0, f, e, m)[1] for f in (False, True) for e in (False, True)}
    block_matrices = param_tensors(1, False, False, m)[1] - end_matrices[False, False]
    for s in range(pp):
        experts = stage_layers[s] * experts_per_block
        # (link, ranks, parameters, buckets): the dense parameters over dp, the experts over dp / ep.
        groups = [(links["dp"], dp, params[s] - experts, 0)]
        if experts:
            groups.append((links["edp"], dp // ep, experts, 0))
        if deck.zero3:  # its buckets are cut at the gather units
            ends = (s == 0, s == pp - 1)
            if ends not in unit_kinds:
                unit_kinds[ends] = unit_buckets(deck, *ends)
            units = unit_kinds[ends]
            dense = stage_layers[s] * len(units["block"]) + len(units.get("embed", ())) + len(units.get("head", ()))
            counts = [dense, stage_layers[s] * len(units.get("block_experts", ()))]
            groups = [(link, n, p, counts[i]) for i, (link, n, p, _) in enumerate(groups)]
        # ZeRO-2 reduce-scatters every micro-batch's gradients, each during that micro-batch's backward.
        reductions = micro if opt.zero >= 2 else 1
        reduce = gather = last_bucket = hidden_reduce = hidden_gather = 0.0
        buckets = 0
        op = "reduce_scatter" if opt.zero else "all_reduce"
        for i, (link, n, p, count) in enumerate(groups):
            grads = p * g
            count = count or max(1, math.ceil(grads / bucket))
            per_bucket = grads / count
            if opt.zero:
                part = reductions * count * link.reduce_scatter(n, per_bucket)
                # ZeRO-3 gathers during the passes (above), not after the step.
                gather += count * link.all_gather(n, per_bucket / g * e) if opt.zero < 3 else 0.0
            else:
                part = count * link.all_reduce(n, per_bucket)
            if i == 0:  # the last bucket the backward fills holds the first parameters (dense)
                last_bucket = part / (reductions * count)
            reduce += part
            buckets += count
            # Gloo (below): every bucket's waits for its peers hide but the last one's.
            first = 1 if i == 0 else 0
            hidden_reduce += (reductions * count - first) * link.latency_part(op, n)
            hidden_gather += (count - first) * link.latency_part("all_gather", n)
        # Overlap: the reductions start as the last micro-batch's backward produces each bucket;
        # the last bucket cannot be hidden. The ZeRO-1 gather overlaps the next forward likewise.
        window = reductions * sum(bwd[c] for c in range(s, pp * v, pp)) if par.overlap_grad_reduce else 0.0
        exposed = max(last_bucket, reduce - window) if par.overlap_grad_reduce else reduce
        if gather:
            first_fwd = sum(fwd[c] for c in range(s, pp * v, pp))
            exposed += max(gather / buckets, gather - first_fwd) if par.overlap_param_gather else gather
        if uses_gloo(machine):
            # Gloo runs each bucket's collective on its own thread while the backward (the next
            # forward, for the gather) computes: its copies and sums take the shared cores, charged
            # in full, but its waits for the peers hide, all but the last bucket's.
            hidden = hidden_reduce if requested.overlap_grad_reduce else 0.0
            if gather and requested.overlap_param_gather:
                hidden += hidden_gather
            exposed = reduce + gather - hidden
        # The elements this rank updates: 1/dp of the dense ones, 1/(dp/ep) of its experts (ZeRO).
        shard = sum(p / n for _, n, p, _ in groups) if opt.zero and dp > 1 else params[s]
        if shape is not None and shape[2] > 1:
            # 3D: after the dp reduction, the gradients of the parameters replicated over Z (this rank's
            # share of them under ZeRO) are summed over Z, one blocking all-reduce (finish_grad_reduce).
            z_sum.append(_cost(links3["tp_z"], shape[2], "all_reduce", replicated[s] * g * shard / params[s]))
            exposed += z_sum[-1]
        else:
            z_sum.append(0.0)
        # Sequence parallelism: the MoE blocks' router, experts and shared experts act on the rank's
        # sequence shard, so their gradients (this rank's share under ZeRO) are summed over tp after the
        # dp reduction, one blocking all-reduce (finish_grad_reduce; the norms' few h are left out).
        exposed += _cost(links["tp"], tp, "all_reduce", moe_sp_sum(deck, s) * g)
        dp_exposed.append(exposed)
        matrices = end_matrices[s == 0, s == pp - 1] + stage_layers[s] * block_matrices
        # The norm's first pass reads the reduced gradients from memory (they outgrew the cache).
        norm.append(dev.stream(shard * grad_norm_bytes(g)) + dev.from_memory(shard * g))
        if rates is None:
            fused = not machine.host_is_device  # GPUs run the fused kernel, CPU ranks the eager passes
            optimizer.append(
                dev.stream(shard * optimizer_bytes(deck, fused))
                + dev.from_memory(shard * optimizer_state_bytes(deck))
                + optimizer_ops(deck, buckets, fused) * dev.op_seconds
            )
            offloaded.append(0.0)
        else:  # the state lives in host memory or the rank's file: the update runs on the CPU
            optimizer.append(0.0)
            # The delayed update hides behind the next step's forward and backward (`finish`).
            offload = offload_time(deck, dev, rates, shard, buckets, matrices, machine.host_is_device)
            offloaded.append(offload.waited(finish[s]))
    if m.tie_embeddings and pp > 1:
        tied_link = group_link(machine, layout.stride("pp") * (pp - 1), 2)
        tied = _cost(tied_link, 2, "all_reduce", (m.vocab_size // tp) * m.hidden * g)
    # Every stage waits for the slowest at the gradient norm's and the non-finite check's
    # all-reduces; then the update, and the stop-signal vote over all ranks.
    after = [finish[s] + dp_exposed[s] + (tied if s in (0, pp - 1) else 0.0) + norm[s] for s in range(pp)]
    slowest = max(range(pp), key=lambda s: after[s])
    collectives = step_collectives(deck, machine, layout, links)
    step = after[slowest] + optimizer[slowest] + offloaded[slowest] + collectives

    # Breakdown of the slowest stage's step by kind.
    mine = [c for c in range(pp * v) if c % pp == slowest]
    busy_f = sum((fwd_parts[c] for c in mine), _Pass()).scaled(micro)
    busy_b = sum((bwd_parts[c] for c in mine), _Pass()).scaled(micro)
    recompute = 0.0
    if tr.recompute == "full":
        experts = sum(moe[c] for c in mine)
        recompute = layer_r.scaled((sum(chunks[c] for c in mine) - experts) * micro).total
        recompute += expert_r.scaled(experts * micro).total if experts else 0.0
    zero3 = micro * sum(sum(gathers[c]) for c in mine)
    busy = busy_f.total + busy_b.total + accumulate[slowest] * micro + zero3
    breakdown = {
        "gemm": busy_f.gemm + busy_b.gemm,
        "attention": busy_f.attention + busy_b.attention,
        "elementwise": busy_f.elementwise + busy_b.elementwise,
        "grad_accumulation": accumulate[slowest] * micro,
        "recompute": recompute,  # included in the gemm/attention/elementwise/tp lines above
        "tp_exposed": busy_f.tp + busy_b.tp,
        "ep_exposed": busy_f.ep + busy_b.ep,  # expert parallelism's all-to-alls (0 without)
        "host_overhead": busy_f.host + busy_b.host,
        "pp_bubble_and_p2p": finish[slowest] - busy,
        "zero3_gathers": zero3,  # the parameter all-gathers the passes wait for
        "dp_exposed": dp_exposed[slowest],
        "tied_embedding": tied if slowest in (0, pp - 1) else 0.0,
        "grad_norm": norm[slowest],
        "step_collectives": collectives,
        "optimizer": optimizer[slowest],  # on the device
        "optimizer_offload": offloaded[slowest],  # optim.offload: copies, the CPU update, the file
    }
    flops, hardware = counted["model"], counted["hardware"]
    devices = tp * pp * dp
    levels = {axis: links[axis].level for axis in links}
    tensor3d: dict[str, float] = {}
    if shape is not None:
        levels.update({axis: links3[axis].level for axis in TP_SUB_AXES})
        axes = [a + b for a, b in zip(busy_f.axes, busy_b.axes)]
        tensor3d = {**dict(zip(TP_SUB_AXES, axes)), "tp_z_grad_sum": z_sum[slowest]}
    return Prediction(
        step_time_s=step,
        tokens_per_s=tr.global_batch * m.seq_len / step,
        tflops_per_device=flops / step / devices / 1e12,
        hardware_tflops_per_device=hardware / step / devices / 1e12,
        mfu=flops / step / devices / dev.peak_flops,
        breakdown=breakdown,
        levels=levels,
        stage_times=after,
        tensor3d=tensor3d,
    )


def predict_step_time(
    deck: Deck, machine: Union[Machine, str, Path], world_size: Optional[int] = None, simulate: bool = True
) -> float:
    """Seconds of one optimizer step of `deck` on `machine` (a `Machine`, or a machine file's name
    under inputs/machines/ or its path), as the dry run predicts it (`predict`). The deck resolved
    for a world size (`app.deck.resolve_for_world`), or give `world_size` to resolve it here. A
    `MachineError` names the constants the machine file lacks (inputs/machines/local.yaml has
    none: calibrate it first, `python -m app.plan.calibrate`, and pass `local_calibrated`)."""
    if world_size is not None:
        deck = resolve_for_world(deck, world_size)
    loaded = machine if isinstance(machine, Machine) else load_machine(machine)
    return predict(deck, loaded, simulate=simulate).step_time_s

"""The dry run: `python -m app DECK --dry-run [--world-size N | --nodes N --machine M] [--json]`.

No MPI launch: the deck is resolved for the world size, the ranks are placed on nodes with
the same pure mapping a real run uses (`GridLayout`), and every stage's parameters, memory
per device and work are estimated (`app.plan.estimate`). The plan names what makes the run
impossible — it does not fit in device memory, a tensor-parallel group spans nodes, the
pipeline stages are unbalanced — each with its fix, and the CLI exits 2 when there is any.
"""

from __future__ import annotations

import json
import math
import time
from contextlib import suppress
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional

from app.deck import Deck, resolve_for_world, validate
from app.errors import GridlmError
from app.metrics.flops import step_flops
from app.names import SCHEDULES, schedule_key, strides3d
from app.plan.estimate import LayoutCache, StageEstimate, Stages, checkpoint_bytes, estimate_stages, model_params
from app.plan.machine import Machine, MachineError
from app.plan.perf import (
    Link,
    Placement,
    Prediction,
    as_run_on,
    axis_links,
    expert_exchange,
    place,
    predict,
    tensor_shape,
    uses_gloo,
)
from app.runtime.grid import GridLayout
from app.sharding.layout import SUB_AXES, ZERO3_PREFETCH

GiB = 2.0**30
USABLE_FRACTION = 0.9  # of device memory; the rest for the CUDA context, NCCL buffers, fragmentation
# Of a node's host memory, for the offloaded optimizer state: the rest for the OS, the ranks' own
# processes (Python, torch, CUDA's host allocations: a few GiB each) and the data loader's pages.
HOST_USABLE_FRACTION = 0.8
NVME_USABLE_FRACTION = 0.9  # of the node's drive: the file system's own, the logs
MAX_IMBALANCE = 1.25  # slowest stage's work / mean stage work
MAX_NODE_SCAN = 1 << 16  # ranks scanned for the node that keeps the most off the device (`_fullest_node`)


class PlanError(GridlmError):
    """The dry run cannot be set up (no world size, no node shape)."""


@dataclass
class Plan:
    deck: Deck
    world_size: int
    machine: Optional[Machine]
    ranks_per_node: Optional[int]
    layout: GridLayout
    stages: Stages
    flops: dict[str, float]
    node_span: dict[str, Optional[int]]
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    alternatives: dict[str, float] = field(default_factory=dict)
    links: dict[str, Link] = field(default_factory=dict)  # axis -> its groups' link, given a machine
    predicted: Optional[Prediction] = None  # the step-time model (app.plan.perf), given a machine
    unpredicted: str = ""  # why there is no prediction
    seconds: float = 0.0

    @property
    def nodes(self) -> Optional[int]:
        return None if self.ranks_per_node is None else math.ceil(self.world_size / self.ranks_per_node)

    @property
    def usable_bytes(self) -> Optional[float]:
        return None if self.machine is None else self.machine.memory_per_device_bytes * USABLE_FRACTION

    @property
    def host_is_device(self) -> bool:
        """A CPU machine: host memory is the device's, so offloading to the host saves nothing."""
        return self.machine is not None and self.machine.host_is_device

    def stage_total(
        self,
        s: StageEstimate,
        zero: Optional[int] = None,
        recompute: Optional[str] = None,
        offload: Optional[str] = None,
    ) -> float:
        """Device bytes of stage `s` under the deck's settings, or the ones given."""
        deck = self.deck
        return s.total(
            deck.optim.zero if zero is None else zero,
            deck.train.recompute if recompute is None else recompute,
            deck.optim.offload if offload is None else offload,
            self.host_is_device,
        )

    def peak_stage(self) -> StageEstimate:
        deck = self.deck
        return self.stages.peak(deck.optim.zero, deck.train.recompute, deck.optim.offload, self.host_is_device)

    def imbalance(self) -> float:
        work = [s.flops_per_micro_batch for s in self.stages]
        return max(work) / (sum(work) / len(work))

    def bubble(self) -> float:
        """Pipeline bubble as a fraction of the ideal step: (pp - 1) / (virtual x micro-batches)."""
        par = self.deck.parallel
        return (par.pp - 1) / (par.virtual_stages * self.deck.num_micro_batches)


def world_for(
    deck: Deck, world_size: Optional[int], nodes: Optional[int], machine: Optional[Machine]
) -> tuple[int, Optional[int]]:
    """(world size, ranks per node) from the command line, the machine and the deck."""
    rpn = machine.devices_per_node if machine is not None else deck.parallel.gpus_per_node
    if world_size is not None and nodes is not None:
        raise PlanError("give either --world-size or --nodes, not both")
    if nodes is not None:
        if rpn is None:
            raise PlanError(
                "--nodes needs a node shape: pass --machine NAME (inputs/machines/) or set parallel.gpus_per_node"
            )
        return nodes * rpn, rpn
    if world_size is not None:
        return world_size, rpn
    par = deck.parallel
    if isinstance(par.dp, int):
        return par.tp * par.cp * par.pp * par.dp, rpn
    shape = f"tp x cp x pp = {par.tp * par.cp * par.pp}" if par.cp > 1 else f"tp x pp = {par.tp * par.pp}"
    raise PlanError(
        f"no world size: parallel.dp is auto; pass --world-size N, or --nodes N with a machine, or set "
        f"parallel.dp ({shape})"
    )


def make_plan(
    deck: Deck,
    world_size: int,
    machine: Optional[Machine] = None,
    ranks_per_node: Optional[int] = None,
    max_imbalance: float = MAX_IMBALANCE,
    simulate: bool = True,
    layouts: Optional[LayoutCache] = None,
    predict_step: bool = True,
) -> Plan:
    """Resolve `deck` for `world_size` (a DeckError if impossible) and plan it (`simulate`: see
    `app.plan.perf.predict`; `layouts`: see `estimate.LayoutCache`; `predict_step` False: the
    memory and placement only, no step time)."""
    start = time.perf_counter()
    deck = resolve_for_world(deck, world_size)
    if machine is not None:  # auto keys as its ranks run them (CPU: math attention with dropout)
        deck = as_run_on(deck, machine)
    par = deck.parallel
    rpn = ranks_per_node if ranks_per_node is not None else (machine.devices_per_node if machine else None)
    layout = GridLayout.from_order_string(par.tp, par.pp, deck.dp, par.order, rpn, par.cp)
    plan = Plan(
        deck=deck,
        world_size=world_size,
        machine=machine,
        ranks_per_node=rpn,
        layout=layout,
        stages=estimate_stages(deck, layouts),
        flops=step_flops(deck),
        node_span={axis: _node_span(layout, axis) for axis in layout.axes},
    )
    if par.tensor3d is not None:
        plan.node_span.update(_sub_axis_spans(layout, par.tensor3d, par.tensor_order))
    if par.ep > 1:  # expert groups: ep consecutive dp ranks (ProcessGrid.expert_groups)
        plan.node_span["ep"] = _group_span(layout, layout.stride("dp"), par.ep)
    _check_placement(plan)
    _check_memory(plan)
    _check_capacity(plan)
    _check_balance(plan, max_imbalance)
    if machine is None or not predict_step:
        plan.unpredicted = "no machine: pass --machine NAME for a predicted step time" if machine is None else ""
        plan.seconds = time.perf_counter() - start
        return plan
    # Placed once, and only for a plan to predict (the search rejects most of its candidates): the
    # links shown and the prediction's inputs; its check of the machine file is the only one.
    placement: Optional[Placement] = None
    if not plan.problems:
        with suppress(MachineError):  # the machine lacks a constant: worded below
            placement = place(deck, machine, layout)
    plan.links = placement.links if placement is not None else axis_links(machine, layout, par.ep)
    if plan.problems:
        plan.unpredicted = "the plan has problems (below): nothing to predict"
    elif placement is None:
        missing = machine.missing_for_prediction(deck.train.precision, deck.optim.offload)
        plan.unpredicted = f"machine {machine.name} lacks {', '.join(missing)} (docs/PERFORMANCE_MODEL.md)"
    else:
        plan.predicted = predict(deck, machine, simulate=simulate, placement=placement)
    plan.seconds = time.perf_counter() - start
    return plan


# GPT-3's widths (d_model, heads; Brown et al. 2020, Table 2.1; 1.3B's 24 heads made 16, which divide
# 2048), the shapes `largest_gpt` tries.
GPT_WIDTHS = ((768, 12), (1024, 16), (1536, 16), (2048, 16), (2560, 32), (4096, 32), (5120, 40), (6144, 48),
              (8192, 64), (12288, 96))  # fmt: skip
MAX_LAYERS = 256


@dataclass(frozen=True)
class Shape:
    """A GPT shape `largest_gpt` found: the most layers at this width that plan without problems."""

    hidden: int
    heads: int
    layers: int
    params: int


def largest_gpt(
    deck: Deck,
    world_size: int,
    machine: Optional[Machine],
    ranks_per_node: Optional[int] = None,
    max_imbalance: float = MAX_IMBALANCE,
) -> list[Shape]:
    """For each of GPT_WIDTHS, the most layers (up to MAX_LAYERS) with which `deck`'s model at that
    width plans without problems on `world_size` ranks of `machine` (its memory, and the offloaded
    state's host memory or drive: `optim.offload`); widths at which not even one layer fits are
    left out. Every other key (batch, sequence, grid, ZeRO, recompute, offload) is the deck's (its
    parallel.stage_layers excepted: each trial takes the default split of its layers); a
    shape fits as the dry run with `max_imbalance` would accept it (the stages' default split of its
    layers: a count they split unevenly may be unbalanced below one that is not, so the layers are
    bisected by memory alone, then the balanced count at or below that bound is taken)."""
    from app.plan.estimate import model_params

    found = []
    chunks = deck.parallel.pp * deck.parallel.virtual_stages
    for hidden, heads in GPT_WIDTHS:

        def plan(layers: int, hidden: int = hidden, heads: int = heads) -> Optional[Plan]:
            """The plan of `layers` at this width with the stages' balance left unchecked (None: a shape
            the grid cannot take, e.g. heads over tp)."""
            model = replace(deck.model, hidden=hidden, heads=heads, layers=layers)
            try:
                # The default split of the trial's layers: the deck's stage_layers are for its own count.
                trial = replace(deck, model=model, parallel=replace(deck.parallel, stage_layers=None))
                validate(trial)  # e.g. fewer layers than pipeline stages: a DeckError, not make_plan's ValueError
                return make_plan(trial, world_size, machine, ranks_per_node, math.inf, predict_step=False)
            except GridlmError:
                return None

        # Memory (the device's, the host's, the drive's) grows with the layers, the balance does not: a
        # count the stages split unevenly may be refused below one that fits. So the bisection finds the
        # most layers that fit in memory, and the count below it that is balanced (within one of each
        # remainder mod the chunks: fewer layers only let the head outweigh a stage more).
        lo, hi = chunks - 1, MAX_LAYERS + 1  # fewer layers than chunks: no plan, and no bound; not roomy(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            p = plan(mid)
            lo, hi = (mid, hi) if p is not None and not p.problems else (lo, mid)

        def balanced(layers: int) -> bool:
            p = plan(layers)
            return p is not None and (len(p.stages) == 1 or p.imbalance() <= max_imbalance)

        layers = next((n for n in range(lo, max(chunks, lo - chunks + 1) - 1, -1) if balanced(n)), 0)
        if layers:
            model = replace(deck.model, hidden=hidden, heads=heads, layers=layers)
            found.append(Shape(hidden, heads, layers, model_params(model)))
    return found


def _node_span(layout: GridLayout, axis: str) -> Optional[int]:
    """The most nodes one group along `axis` spans (None without a node shape)."""
    return _group_span(layout, layout.stride(axis), layout.size(axis))


def _sub_axis_spans(layout: GridLayout, tensor: tuple[int, int, int], order: str) -> dict[str, Optional[int]]:
    """3D tensor parallelism: the most nodes one group of each tp sub-axis spans (within tp the
    strides of parallel.tensor_order, `strides3d`: 1, X and X Y for the default xyz)."""
    tp_stride = layout.stride("tp")
    strides = strides3d(tensor, order)
    return {a: _group_span(layout, tp_stride * inner, n) for a, inner, n in zip(SUB_AXES, strides, tensor)}


def _group_span(layout: GridLayout, stride: int, n: int) -> Optional[int]:
    """The most nodes one group of `n` ranks `stride` apart spans, groups tiling the world as an
    axis's do (None without a node shape)."""
    rpn = layout.ranks_per_node
    if rpn is None:
        return None
    if n == 1:
        return 1  # without sampling: a world of 2^20 ranks has 2^20 groups of one
    # Groups start at multiples of stride x n (plus an offset < stride). Aligned cases in closed form:
    if stride % rpn == 0:
        return n  # each member on a node of its own
    if rpn % (stride * n) == 0:
        return 1  # the group's stride x n positions lie inside one node
    if (stride * n) % rpn == 0 and rpn % stride == 0:
        return stride * n // rpn  # whole nodes, rpn / stride members on each
    return max(len({r // rpn for r in g}) for g in _sample_groups(layout, stride, n))


def _sample_groups(layout: GridLayout, stride: int, n: int) -> list[list[int]]:
    """One group (of `n` ranks `stride` apart) per residue mod ranks per node of the first ranks
    of the groups in the first lcm(ranks per node, stride x n) positions.

    A group is base + i x stride; shifting its base by ranks_per_node shifts its nodes by one,
    so its node count depends on base mod ranks_per_node only, and every residue occurs there.
    """
    rpn = layout.ranks_per_node or 1
    period = math.lcm(rpn, stride * n)
    bases: dict[int, int] = {}  # residue -> the first base with it
    for b in range(min(period, layout.world_size)):
        if (b // stride) % n == 0 and b % rpn not in bases:
            bases[b % rpn] = b
            if len(bases) == rpn:
                break
    return [[b + i * stride for i in range(n)] for b in bases.values()]


def _check_placement(plan: Plan) -> None:
    par, rpn = plan.deck.parallel, plan.ranks_per_node
    if rpn is None:
        plan.warnings.append("no node shape: placement not checked; pass --machine NAME or set parallel.gpus_per_node")
        return
    if plan.world_size % rpn:
        plan.warnings.append(f"{plan.world_size} ranks do not fill nodes of {rpn}: the last node is partly empty")
    if par.tensor3d is not None:  # 3D: Z may cross nodes (it moves weights); X and Y had better not
        for axis in ("tp_x", "tp_y"):
            span = plan.node_span[axis]
            if span and span > 1:
                plan.warnings.append(
                    f"3D tensor parallelism: {axis} groups span {span} nodes (parallel.tensor = {par.tensor}, {rpn} "
                    f"devices per node, parallel.tensor_order {par.tensor_order}): they all-reduce activations in "
                    "every Linear; put the node-crossing factor in z (the weight all-gathers) where the heads and "
                    "hidden allow, and keep z outermost in parallel.tensor_order (xyz or yxz)"
                )
    elif plan.node_span["tp"] and plan.node_span["tp"] > 1:
        if par.tp > rpn or rpn % par.tp:
            fix = f"use a tp that divides the {rpn} devices per node (e.g. {math.gcd(par.tp, rpn)}) and more pp"
        else:
            fix = "keep tp innermost: parallel.order: tp-dp-pp"
        plan.problems.append(
            f"tensor-parallel groups span {plan.node_span['tp']} nodes (parallel.tp = {par.tp}, {rpn} devices per "
            f"node, order {par.order}); tp communicates in every layer and would run over the network: {fix}"
        )


def _check_memory(plan: Plan) -> None:
    deck, usable = plan.deck, plan.usable_bytes
    zero, recompute, offload = deck.optim.zero, deck.train.recompute, deck.optim.offload
    peak = plan.peak_stage()
    need = plan.stage_total(peak)
    # What the usual memory switches would give, on the stage that needs the most: each alone, then
    # a ZeRO stage with full recompute (keys: the --set overrides, space-separated).
    options = [(f"optim.zero={z}", z, recompute, offload) for z in (1, 2, 3)]
    if deck.model.attention_kernel == "math" and recompute == "none":  # the scores it keeps: selective drops them
        options.append(("train.recompute=selective", zero, "selective", offload))
    options.append(("train.recompute=full", zero, "full", offload))
    if recompute != "full":
        options += [(f"optim.zero={z} train.recompute=full", z, "full", offload) for z in (1, 2, 3) if z > zero]
    # Offload: host only where the host is not the device; nvme where the deck allows it (not with
    # LAMB, nor with an asynchronous checkpoint: app.deck).
    targets = [] if plan.host_is_device else ["host"]
    if deck.optim.name != "lamb" and not deck.checkpoint.async_:
        targets.append("nvme")
    options += [(f"optim.offload={o}", zero, recompute, o) for o in targets]
    for key, z, r, o in options:
        if (z, r, o) != (zero, recompute, offload) and (z == zero or deck.replicas > 1):
            plan.alternatives[key] = plan.stage_total(plan.stages.peak(z, r, o, plan.host_is_device), z, r, o)
    if usable is None:
        plan.warnings.append("no machine: device memory not checked; pass --machine NAME (inputs/machines/)")
        return
    if need <= usable:
        return
    assert plan.machine is not None

    def sets(key: str) -> str:
        return " ".join(f"--set {k}" for k in key.split())

    fits = [(k, v) for k, v in plan.alternatives.items() if v <= usable]
    # An offload that frees the device but overfills the host memory or the drive is no fix: said apart.
    over = {k: _over(plan, k.split("=")[1]) for k, _ in fits if k.startswith("optim.offload=")}
    blocked = [f"{k} fits the device ({v / GiB:.1f} GiB) but not " + " nor ".join(map(_over_words, over[k]))
               for k, v in fits if over.get(k)]  # fmt: skip
    fits = [(k, v) for k, v in fits if not over.get(k)]
    # One switch where one is enough, else the cheapest pair (the lowest ZeRO stage) that fits.
    fixes = [f"{sets(k)} ({v / GiB:.1f} GiB)" for k, v in fits if " " not in k]
    fixes = fixes or [f"{sets(k)} ({v / GiB:.1f} GiB)" for k, v in fits][:1]
    fixes.append("more pipeline stages or a larger tp (fewer parameters per device)")
    if deck.train.micro_batch > 1:
        fixes.append("a smaller train.micro_batch (fewer activations)")
    plan.problems.append(
        f"does not fit: stage {peak.stage} needs {need / GiB:.1f} GiB per device, {plan.machine.name} has "
        f"{usable / GiB:.1f} GiB usable ({int(USABLE_FRACTION * 100)}% of {plan.machine.memory_per_device_gib:g} "
        f"GiB); try " + "; or ".join(fixes) + "".join(f"; {b}" for b in blocked)
    )


@dataclass(frozen=True)
class Store:
    """Where a node's ranks keep what leaves the device: its host memory or its drive."""

    what: str
    key: str  # the machine file's capacity key
    fraction: float  # of the capacity usable
    unit: float  # bytes of the key's unit
    label: str


HOST = Store("host memory", "host_memory_gib", HOST_USABLE_FRACTION, GiB, "GiB")
NVME = Store("node-local NVMe", "nvme_gb", NVME_USABLE_FRACTION, 1e9, "GB")


@dataclass(frozen=True)
class Need:
    """What the ranks of the node that keeps the most in `store` keep there: `stages`, each of its
    ranks' pipeline stage; `parts`, the node's bytes by what they are."""

    store: Store
    stages: tuple[int, ...]
    parts: dict[str, float]
    capacity: Optional[float]  # the machine file's, in the store's unit (None: not given)

    @property
    def bytes(self) -> float:
        return sum(self.parts.values())

    @property
    def usable(self) -> float:
        return math.inf if self.capacity is None else self.capacity * self.store.unit * self.store.fraction

    def amounts(self) -> str:
        """'8 ranks per node x 74.9 GiB (stage 0) = 599.0 GiB' (ranks of one stage; of several: '8 ranks
        per node (stages 0-7) = ...'), with the parts where there are two."""
        unit, label, ranks = self.store.unit, self.store.label, len(self.stages)
        one = len(set(self.stages)) == 1  # then the parts per rank
        parts = ", ".join(f"{what} {_amount(n / (ranks if one else 1) / unit)}" for what, n in self.parts.items())
        parts = f": {parts}" if len(self.parts) > 1 else ""
        total = f"= {_amount(self.bytes / unit)} {label}"
        if one:
            each = f"{_amount(self.bytes / ranks / unit)} {label}"
            return f"{ranks} ranks per node x {each} (stage {self.stages[0]}{parts}) {total}"
        return f"{ranks} ranks per node (stages {_span(sorted(set(self.stages)))}{parts}) {total}"


def _fullest_node(plan: Plan, need: Callable[[StageEstimate], float]) -> tuple[int, ...]:
    """The pipeline stage of each rank of the node whose ranks `need` the most in all (each its stage's),
    from the placement (`GridLayout`: rank r is on stage (r // stride) mod pp)."""
    assert plan.machine is not None
    rpn = min(plan.world_size, plan.ranks_per_node or plan.machine.devices_per_node)
    pp, stride = len(plan.stages), plan.layout.stride("pp")
    per = [need(s) for s in plan.stages]
    if pp == 1 or stride % rpn == 0:  # a node's ranks on one stage: the stage that needs the most
        return (max(range(pp), key=per.__getitem__),) * rpn
    # Nodes repeat every lcm(rpn, stride x pp) ranks; beyond a bound, every rank counted as the most.
    period = min(plan.world_size, math.lcm(rpn, stride * pp))
    if period > MAX_NODE_SCAN:
        return (max(range(pp), key=per.__getitem__),) * rpn
    world = plan.world_size
    nodes = (tuple((r // stride) % pp for r in range(b, min(b + rpn, world))) for b in range(0, period, rpn))
    return max(nodes, key=lambda stages: sum(per[s] for s in stages))


# What a node's ranks keep off the device (`Need.parts`' names).
OFFLOADED = "the offloaded optimizer state and the gradients' copy"
STREAMED = "nvme's stream buffers and the gradients' copy"
STATE_FILE = "the optimizer state file"
SNAPSHOT = "checkpoint.async's copy"
SUBJECTS = {OFFLOADED: "the offloaded optimizer state", STREAMED: "the offloaded optimizer's stream buffers",
            STATE_FILE: "the offloaded optimizer state", SNAPSHOT: "checkpoint.async's host copy of the checkpoint"}  # fmt: skip


def _amount(x: float) -> str:
    """A capacity figure with enough digits to tell it from 0 (a small state's 0.0043 GB)."""
    return f"{x:,.1f}" if abs(x) >= 10 or x == 0 else f"{x:.3g}"


def _needs(plan: Plan, offload: str) -> list[Need]:
    """What the node's ranks keep in host memory and on the drive under `offload` (the deck's ZeRO
    stage): the offloaded optimizer's host part (its state, or nvme's stream buffers, and the
    gradients' copies) and checkpoint.async's copy, in host memory on GPU machines (on CPU machines
    the device check counts them); nvme's state files on the drive, on any machine."""
    machine = plan.machine
    if machine is None:
        return []
    zero = plan.deck.optim.zero
    out = []

    def need(store: Store, parts: Callable[[StageEstimate], dict[str, float]], capacity: Optional[float]) -> None:
        stages = _fullest_node(plan, lambda s: sum(parts(s).values()))
        node = {what: sum(parts(plan.stages[s])[what] for s in stages) for what in parts(plan.stages[0])}
        kept = {what: n for what, n in node.items() if n > 0}
        if kept:
            out.append(Need(store, stages, kept, capacity))

    if not plan.host_is_device:
        state = OFFLOADED if offload == "host" else STREAMED
        need(HOST, lambda s: {state: s.host(zero, offload), SNAPSHOT: s.snapshot(zero)}, machine.host_memory_gib)
    if offload == "nvme":
        need(NVME, lambda s: {STATE_FILE: s.disk(zero, offload)}, machine.nvme_gb)
    return out


def _over_words(n: Need) -> str:
    """'the host memory: 1 ranks per node x 147.3 GiB (stage 0) = 147.3 GiB of 102.4 usable'."""
    usable = f"{_amount(n.usable / n.store.unit)} {n.store.label}"
    return f"the {n.store.what}: {n.amounts()} of {usable} usable ({n.store.key})"


def _over(plan: Plan, offload: str) -> list[Need]:
    """The needs of `_needs` over their store's usable capacity."""
    return [n for n in _needs(plan, offload) if n.bytes > n.usable]


def _check_capacity(plan: Plan) -> None:
    """What the node's ranks keep in host memory or on the drive against the machine file's
    capacities (`_needs`); a capacity it does not give is warned about."""
    deck, machine = plan.deck, plan.machine
    if machine is None:
        return
    zero, offload = deck.optim.zero, deck.optim.offload
    for n in _needs(plan, offload):
        store, offloaded, snapshot = n.store, any(what != SNAPSHOT for what in n.parts), SNAPSHOT in n.parts
        subject = " and ".join(SUBJECTS[what] for what in n.parts)
        if n.capacity is None:
            plan.warnings.append(
                f"machine {machine.name} gives no {store.key}: {subject} ({n.amounts()}) is not checked against "
                f"its {store.what}"
            )
            continue
        if n.bytes <= n.usable:
            continue
        fixes = []
        if store is HOST and offload == "host" and deck.optim.name != "lamb" and not deck.checkpoint.async_:
            drive = [d for d in _over(plan, "nvme") if d.store is NVME]
            fixes.append(
                "--set optim.offload=nvme ("
                + (f"on a larger drive: its state files do not fit {_over_words(drive[0])}" if drive
                   else "the state in a file per rank on node-local disk")
                + ")"
            )  # fmt: skip
        if store is HOST and snapshot:
            fixes.append("--set checkpoint.async=false (no copy kept while training goes on)")
        if offloaded and (zero == 0 or deck.replicas == 1):
            fixes.append("more data-parallel ranks with optim.zero >= 1 (each holds 1/dp of the state)")
        fixes.append(
            "more pipeline stages or a larger tp (fewer parameters per rank)"
            + (", or fewer ranks per node" if len(n.stages) > 1 else "")
        )
        verb = "do" if len(n.parts) > 1 or STREAMED in n.parts else "does"
        plan.problems.append(
            f"{subject} {verb} not fit the {store.what}: {n.amounts()}, {machine.name} has "
            f"{_amount(n.usable / store.unit)} {store.label} usable ({int(store.fraction * 100)}% of "
            f"{n.capacity:g} {store.label}, {store.key}); try " + "; or ".join(fixes)
        )


def _check_balance(plan: Plan, max_imbalance: float) -> None:
    if len(plan.stages) == 1:
        return
    ratio = plan.imbalance()
    if ratio <= max_imbalance:
        return
    slow = max(plan.stages, key=lambda s: s.flops_per_micro_batch)
    par, layers = plan.deck.parallel, plan.deck.model.layers
    problem = (
        f"pipeline stages unbalanced: stage {slow.stage} does {ratio:.2f}x the mean stage's work (limit "
        f"{max_imbalance:.2f}), so every other stage waits for it; "
    )
    split = balanced_layers(plan)
    even = split_imbalance(plan, split)
    if even <= max_imbalance:
        plan.problems.append(
            problem + f"set parallel.stage_layers (e.g. {split}, {even:.2f}x) or a pp that divides model.layers = "
            f"{layers}"
        )
        return
    # The balanced split fails too (few layers, or a large head): suggesting it would repeat the problem.
    ranks = plan.world_size // (par.tp * par.cp)
    pps = [
        pp
        for pp in range(1, min(layers, ranks) + 1)
        if ranks % pp == 0 and layers % (pp * par.virtual_stages) == 0 and _even_imbalance(plan, pp) <= max_imbalance
    ]
    fixes = [f"parallel.pp to one that divides model.layers = {layers} and the {ranks} ranks and balances them "
             f"(here: {', '.join(map(str, pps))})"] if pps else []  # fmt: skip
    fixes += [f"--max-imbalance {math.ceil(even * 100) / 100:.2f}"]
    plan.problems.append(
        problem
        + f"the balanced split, parallel.stage_layers = {split}, still does {even:.2f}x; set "
        + " or ".join(fixes)
    )


def _work_per_layer_and_head(plan: Plan) -> tuple[float, float]:
    """(FLOPs of one layer, FLOPs of the head) per micro-batch, from the plan's stages (a stage's work is
    its layers' and, on the last, the head's: `estimate.estimate_stages`)."""
    first, last = plan.stages[0], plan.stages[-1]
    per_layer = first.flops_per_micro_batch / sum(first.layers)
    return per_layer, last.flops_per_micro_batch - sum(last.layers) * per_layer


def split_imbalance(plan: Plan, chunk_layers: list[int]) -> float:
    """The slowest / mean stage work of the plan's grid with `chunk_layers` (as parallel.stage_layers:
    chunk c of stage s is entry s + c x pp), without planning it again."""
    pp = plan.deck.parallel.pp
    per_layer, head = _work_per_layer_and_head(plan)
    work = [sum(chunk_layers[s::pp]) * per_layer + (head if s == pp - 1 else 0.0) for s in range(pp)]
    return max(work) / (sum(work) / pp)


def _even_imbalance(plan: Plan, pp: int) -> float:
    """The slowest / mean stage work with `pp` stages of model.layers / pp layers each (the head on the
    last)."""
    per_layer, head = _work_per_layer_and_head(plan)
    layers = plan.deck.model.layers
    return (layers / pp * per_layer + head) / ((layers * per_layer + head) / pp)


def balanced_layers(plan: Plan) -> list[int]:
    """stage_layers that even out the work, counting the head as its weight in layers on the last chunk."""
    deck = plan.deck
    chunks = deck.parallel.pp * deck.parallel.virtual_stages
    layers = deck.model.layers
    last = plan.stages[-1]
    per_layer = plan.stages[0].flops_per_micro_batch / sum(plan.stages[0].layers)
    head = (last.flops_per_micro_batch - sum(last.layers) * per_layer) / per_layer
    target = (layers + head) / chunks
    counts = [max(1, round(target))] * chunks
    counts[-1] = max(1, min(round(target - head), layers - (chunks - 1)))
    # Spread the difference over the other chunks, the earliest first (in one pass: a large
    # head can make it thousands of layers).
    diff = layers - sum(counts)
    rounds, extra = divmod(abs(diff), chunks - 1)
    for c in range(chunks - 1):
        counts[c] += (1 if diff > 0 else -1) * (rounds + (1 if c < extra else 0))
    return counts


# ---- output ----------------------------------------------------------------------------------


def _gib(x: float) -> float:
    return round(x / GiB, 3)


def to_json(plan: Plan, all_ranks: bool = False) -> dict[str, Any]:
    deck, m, par, tr = plan.deck, plan.deck.model, plan.deck.parallel, plan.deck.train
    zero, offload = deck.optim.zero, deck.optim.offload
    peak_tflops = plan.machine.peak(tr.precision) if plan.machine is not None else None
    hw = plan.flops["hardware"]
    ideal = hw / (plan.world_size * peak_tflops * 1e12) if peak_tflops else None
    out: dict[str, Any] = {
        "world_size": plan.world_size,
        "machine": None if plan.machine is None else plan.machine.name,
        "nodes": plan.nodes,
        "ranks_per_node": plan.ranks_per_node,
        "grid": {
            "tp": par.tp,
            "pp": par.pp,
            "dp": deck.dp,
            **({"cp": par.cp, "cp_kind": par.cp_kind} if par.cp > 1 else {}),
            "order": par.order,
            "virtual_stages": par.virtual_stages,
            # 3D tensor parallelism's [x, y, z] (null: 1D); the ranks of a stage with different samples.
            "tensor": list(par.tensor3d) if par.tensor3d else None,
            "tensor_order": par.tensor_order if par.tensor3d else None,
            "data_ranks": deck.data_ranks,
            # Expert parallelism (a mixture of experts): ranks of dp that split the experts (1: none).
            "ep": par.ep,
        },  # fmt: skip
        "parameters": model_params(m),
        "micro_batches": deck.num_micro_batches,
        "placement": {
            "node_span": plan.node_span,
            "link_level": {a: link.level for a, link in plan.links.items()} if plan.links else None,
            "within_node": {a: (None if s is None else s == 1) for a, s in plan.node_span.items()},
            "first_node": _node_ranks(plan, 0),
        },
        "stages": [
            {
                "stage": s.stage,
                "layers": s.layers,
                "embedding": s.first,
                "head": s.last,
                "params_per_rank": s.params,
                # A mixture of experts: the stacked experts' share of params_per_rank (E/ep of them),
                # and expert parallelism's all-to-alls per step: calls and bytes this rank sends.
                "expert_params_per_rank": s.expert_params,
                "all_to_all_per_step": dict(zip(("calls", "bytes_sent"), expert_exchange(deck, s.stage))),
                "memory_gib": {
                    "weights": _gib(s.weights_for(deck.optim.zero)),
                    # ZeRO-3: the bound on the gathered units included in weights (0 otherwise).
                    "gathered_weights": _gib(s.gathered if deck.optim.zero == 3 else 0.0),
                    "gradients": _gib(s.grads(deck.optim.zero)),
                    # On the device by ZeRO stage, without offload; "optimizer_on_device": the column
                    # that `total` counts (offloaded: the gradient shard, plus the host part on CPUs).
                    "optimizer": {k: _gib(v) for k, v in s.optimizer.items()},
                    "optimizer_on_device": _gib(s.optimizer_for(zero, offload, plan.host_is_device)),
                    "activations": {k: _gib(v) for k, v in s.activations.items()},
                    "total": _gib(plan.stage_total(s)),
                    "host": _gib(s.host(zero, offload)),
                    # checkpoint.async's host copy of the rank's checkpoint slices (in `total` on CPU machines).
                    "checkpoint_copy": _gib(s.snapshot(zero)),
                    "nvme_disk": _gib(s.disk(zero, offload)),
                },
                "flops_per_micro_batch": s.flops_per_micro_batch,
            }
            for s in plan.stages
        ],
        "memory": {
            "peak_gib": _gib(plan.stage_total(plan.peak_stage())),
            "peak_stage": plan.peak_stage().stage,
            "offload": offload,
            # Offloaded bytes in host memory are counted in the totals only where host = device.
            "host_in_total": plan.host_is_device,
            "usable_gib": None if plan.usable_bytes is None else _gib(plan.usable_bytes),
            "device_gib": None if plan.machine is None else plan.machine.memory_per_device_gib,
            "alternatives_gib": {k: _gib(v) for k, v in plan.alternatives.items()},
        },
        "flops": {
            "model_per_step": plan.flops["model"],
            "hardware_per_step": hw,
            "convention": "Megatron SC21 eq. 3 (2 FLOPs per multiply-add, backward = 2 x forward, full "
            "(not causally halved) attention); hardware adds what train.recompute re-executes"
            + (
                "; mixture of experts: the router and the top-k experts a token is routed to"
                if plan.deck.model.moe_experts
                else ""
            ),
            "peak_tflops_per_device": peak_tflops,
            "ideal_step_s": ideal,
            "bubble_fraction": plan.bubble(),
            "ideal_step_with_bubble_s": None if ideal is None else ideal * (1 + plan.bubble()),
        },
        "predicted": None if plan.predicted is None else plan.predicted.to_dict(),
        "unpredicted": plan.unpredicted or None,
        "checkpoint": checkpoint_time(plan),
        "imbalance": plan.imbalance(),
        "problems": plan.problems,
        "warnings": plan.warnings,
        "seconds": plan.seconds,
    }
    if all_ranks:
        out["ranks"] = [[r, *_where(plan, r)] for r in range(plan.world_size)]
    return out


def _where(plan: Plan, rank: int) -> tuple[Optional[int], int, int, int]:
    c = plan.layout.coords(rank)
    node = None if plan.ranks_per_node is None else rank // plan.ranks_per_node
    return node, c["tp"], c["pp"], c["dp"]


def _node_ranks(plan: Plan, node: int) -> list[dict[str, int]]:
    rpn = plan.ranks_per_node or plan.world_size
    ranks = range(node * rpn, min(plan.world_size, (node + 1) * rpn))
    return [{"rank": r, **plan.layout.coords(r)} for r in ranks]


def format_text(plan: Plan, deck_path: str, all_ranks: bool = False) -> str:
    j = to_json(plan, all_ranks)
    deck, m, par, tr = plan.deck, plan.deck.model, plan.deck.parallel, plan.deck.train
    zero, offload = deck.optim.zero, deck.optim.offload
    lines = []
    where = f"on {plan.machine.name} ({plan.machine.description})" if plan.machine is not None else "(no machine given)"
    shape = f"{plan.nodes} node(s) x {plan.ranks_per_node}" if plan.ranks_per_node else "ranks"
    lines.append(f"gridlm dry run: {deck_path} {where}")
    lines.append(f"  world      {plan.world_size:,} ranks = {shape}")
    lines.append(
        f"  model      {_count(j['parameters'])} parameters ({j['parameters']:,}): "
        f"{m.arch_words + ', ' if m.arch_words else ''}{m.layers} layers, hidden "
        f"{m.hidden}, {m.heads} heads, MLP {m.ffn}, seq {m.seq_len}, vocab {m.vocab_size}, "
        f"{'tied' if m.tie_embeddings else 'untied'} embeddings"
    )
    lines.append(
        f"  grid       tp {par.tp}{f' x cp {par.cp} ({par.cp_kind})' if par.cp > 1 else ''} x pp {par.pp} x dp "
        f"{deck.dp}, order {'-'.join(plan.layout.order) if par.cp > 1 else par.order} (innermost first); "
        f"{deck.num_micro_batches} micro-batch(es) of {tr.micro_batch} per "
        f"{'data rank (dp x z)' if deck.data_ranks != deck.dp else 'dp rank'} per step, global batch {tr.global_batch}"
    )
    if m.moe_experts:
        lines.append(
            f"             mixture of experts: {m.moe_experts} experts, ep {par.ep}: each rank holds "
            f"{m.moe_experts // par.ep} of them"
            + (
                f" (expert groups of {par.ep} consecutive dp ranks exchange tokens by all-to-all; the "
                f"{deck.dp // par.ep} ranks holding the same experts reduce their gradients)"
                if par.ep > 1
                else " (all; parallel.ep splits them over dp ranks)"
            )
        )
    if par.tensor3d is not None:
        x, y, z = par.tensor3d
        lines.append(
            f"             3D tensor parallelism: tp {par.tp} = x {x} (in-features of qkv/fc, hidden) x y {y} "
            f"(out-features, heads, vocab) x z {z} (weight shards, batch), {par.tensor_order[0]} innermost "
            f"(parallel.tensor_order {par.tensor_order})"
        )
    lines.append(f"  placement  {_placement_line(plan)}")
    for node in range(min(2, plan.nodes or 1)):
        lines.append(f"             node {node}: {_describe_node(plan, node)}")
    if plan.nodes and plan.nodes > 2:
        lines.append(f"             ... node {plan.nodes - 1}: {_describe_node(plan, plan.nodes - 1)}")
    schedule = SCHEDULES[schedule_key(par.virtual_stages)]
    lines.append(
        f"  pipeline   {schedule}, {par.pp} stage(s) x {par.virtual_stages} chunk(s); bubble "
        f"{100 * plan.bubble():.1f}% of the ideal step ((pp - 1) / (virtual x micro-batches)); stage work "
        f"max/mean {plan.imbalance():.3f}"
    )
    lines.append(
        f"  memory     per device, GiB (precision {tr.precision}, optim.zero {zero}, recompute "
        f"{tr.recompute}, micro_batch {tr.micro_batch}"
        + (f", optim.offload {offload}" if offload != "none" else "")
        + ")"
    )
    lines.append(
        f"    {'stage':<10} {'layers':<12} {'params/rank':>15} {'weights':>9} {'grads':>9} {'optimizer':>10} "
        f"{'activations':>12} {'total':>9}"
    )
    runs = _stage_runs(plan.stages, deck)
    if len(runs) > 8:  # deep pipelines: the first and last stages; --json lists every stage
        hidden = runs[3:-2]
        totals = [plan.stage_total(s) / GiB for s in plan.stages[hidden[0][0] : hidden[-1][1] + 1]]
        skipped = (
            f"    {f'{hidden[0][0]}-{hidden[-1][1]}':<10} ... totals {min(totals):.2f} to {max(totals):.2f} (--json)"
        )
        runs = runs[:3] + [None] + runs[-2:]
    for run in runs:
        if run is None:
            lines.append(skipped)
            continue
        first, last, s = run
        name = str(first) if first == last else f"{first}-{last}"
        extra = ("+emb " if s.first else "") + ("+head" if s.last else "")
        lines.append(
            f"    {name:<10} {'+'.join(map(str, s.layers)) + ' ' + extra:<12} {s.params:>15,} "
            f"{s.weights_for(zero) / GiB:>9.2f} {s.grads(zero) / GiB:>9.2f} "
            f"{s.optimizer_for(zero, offload, plan.host_is_device) / GiB:>10.2f} "
            f"{s.activations[tr.recompute] / GiB:>12.2f} {plan.stage_total(s) / GiB:>9.2f}"
        )
    mem = j["memory"]
    fit = (
        f"of {mem['usable_gib']:.1f} usable ({int(USABLE_FRACTION * 100)}% of {mem['device_gib']:g}): "
        + ("fits" if mem["peak_gib"] <= mem["usable_gib"] else "DOES NOT FIT")
        if mem["usable_gib"] is not None
        else "(device memory not checked: no machine)"
    )
    lines.append(f"    peak {mem['peak_gib']:.2f} GiB on stage {mem['peak_stage']} {fit}")
    peak = plan.peak_stage()
    if m.moe_experts:
        lines += _expert_lines(plan, peak)
    if zero == 3 and peak.gathered:
        lines.append(
            f"    ZeRO-3 weights: a {peak.weight_shard / GiB:.2f} GiB shard + {peak.gathered / GiB:.2f} GiB for "
            f"{2 + ZERO3_PREFETCH} gathered units at the largest unit's size (a bound)"
        )
    if offload != "none":
        where = "counted in the totals: host memory is the device's" if plan.host_is_device else "not in the totals"
        if offload == "host":
            lines.append(
                f"    host       {peak.host(zero, offload) / GiB:.2f} GiB per rank on stage {peak.stage}: the offloaded "
                f"fp32 master shard and two moments (12 bytes per shard element) and the gradient shard's host "
                f"copy ({where})"
            )
        else:
            lines.append(
                f"    nvme disk  {peak.disk(zero, offload) / GiB:.2f} GiB per rank on stage {peak.stage}: the fp32 master "
                f"shard and two moments (12 bytes per shard element) in its file under optim.offload_dir"
            )
            lines.append(
                f"    host       {peak.host(zero, offload) / GiB:.3f} GiB per rank of stream buffers "
                f"(optim.offload_buffer_mb) and the gradient shard's host copy ({where})"
            )
    copy = max(plan.stages, key=lambda s: s.snapshot(zero))
    if copy.snapshot(zero):
        where = "counted in the totals: host memory is the device's" if plan.host_is_device else "in host memory"
        lines.append(
            f"    ckpt copy  {copy.snapshot(zero) / GiB:.2f} GiB per rank on stage {copy.stage}: checkpoint.async's "
            f"copy of the rank's checkpoint slices (parameters, fp32 masters where apart, two moments), held while "
            f"training goes on ({where})"
        )
    # Each switch alone; of the pairs with full recompute only the one that needs the least (--json: all).
    shown = {k: v for k, v in plan.alternatives.items() if " " not in k or k.startswith("optim.zero=3 ")}
    if shown:
        alts = ", ".join(f"{k.replace(' ', ' + ')}: {v / GiB:.2f}" for k, v in shown.items())
        lines.append(f"    with {alts} GiB")
    f = j["flops"]
    lines.append(
        f"  flops      model {f['model_per_step']:.3e} per step (MFU basis), hardware {f['hardware_per_step']:.3e} "
        f"(recompute {tr.recompute}); {f['convention']}"
    )
    if f["ideal_step_s"] is not None:
        lines.append(
            f"             at peak ({f['peak_tflops_per_device']:g} TFLOP/s {tr.precision} per device) a step takes "
            f">= {f['ideal_step_s']:.3f} s, {f['ideal_step_with_bubble_s']:.3f} s with the bubble"
        )
    else:
        lines.append("             no peak for this device: no ideal step time (MFU would be null)")
    lines += _predicted_lines(plan)
    lines.append(f"  checkpoint {_checkpoint_line(j['checkpoint'])}")
    if all_ranks:
        lines.append("  ranks      rank node tp pp dp")
        lines += [f"             {r} {n} {t} {p} {d}" for r, n, t, p, d in j["ranks"]]
    for w in plan.warnings:
        lines.append(f"  warning    {w}")
    if plan.problems:
        for p in plan.problems:
            lines.append(f"  PROBLEM    {p}")
    else:
        lines.append(f"  ok         no problems found ({plan.seconds:.2f} s)")
    return "\n".join(lines)


def checkpoint_time(plan: Plan) -> dict[str, Any]:
    """One checkpoint's tensor bytes (`estimate.checkpoint_bytes`) and, where the machine file gives
    its file system's bandwidth (`filesystem_write_gbs`, `filesystem_read_gbs`), the least time a
    save and a load can take: the bytes over the lesser of that and the job's nodes x network
    injection (`inter_node_gbs`), each node's share passing its NICs. A floor: metadata, checksums
    and other jobs' I/O come on top (docs/CHECKPOINT.md has the measured overheads)."""
    nbytes = checkpoint_bytes(plan.deck)
    out: dict[str, Any] = {"bytes": nbytes, "filesystem": None, "write_gbs": None, "read_gbs": None,
                           "save_s": None, "load_s": None}  # fmt: skip
    m = plan.machine
    if m is None or m.filesystem_write_gbs is None:
        return out
    nic = (plan.nodes or 1) * m.inter_node_gbs
    write = min(m.filesystem_write_gbs, nic)
    read = min(m.filesystem_read_gbs or m.filesystem_write_gbs, nic)
    out.update(filesystem=m.filesystem, write_gbs=write, read_gbs=read, save_s=nbytes / (write * 1e9),
               load_s=nbytes / (read * 1e9))  # fmt: skip
    return out


def _checkpoint_line(c: dict[str, Any]) -> str:
    size = f"{c['bytes'] / 1e9:,.1f} GB of tensors (parameters, fp32 masters where apart, two fp32 moments)"
    if c["save_s"] is None:
        return f"{size}; no time: the machine file gives no filesystem_write_gbs"
    return (
        f"{size}: a save takes >= {c['save_s']:,.1f} s at {c['write_gbs']:,.0f} GB/s, a load >= {c['load_s']:,.1f} s "
        f"at {c['read_gbs']:,.0f} GB/s ({c['filesystem'] or 'the file system'}; the lesser of its peak and the "
        "job's nodes x inter_node_gbs)"
    )


def _expert_lines(plan: Plan, peak: StageEstimate) -> list[str]:
    """A mixture of experts: the experts' parameters per rank of the peak stage and, under expert
    parallelism, the all-to-alls of the stage that sends the most."""
    deck = plan.deck
    ep = deck.parallel.ep
    out = [
        f"    experts    {peak.expert_params:,} of the {peak.params:,} parameters per rank on stage {peak.stage} "
        f"({deck.model.moe_experts // ep} of {deck.model.moe_experts} experts per block, parallel.ep {ep})"
    ]
    if ep > 1:
        calls, sent = max(expert_exchange(deck, s.stage) for s in plan.stages)
        link = plan.links.get("ep")
        where = f" over {link.level}" if link is not None else ""
        out.append(
            f"    all-to-all {calls:,} per step per rank{where}, sending {sent / 1e6:,.2f} MB (and receiving as many): "
            f"the token rows to their experts' ranks and back, (ep - 1)/ep of each, and the counts"
        )
    return out


def _predicted_lines(plan: Plan) -> list[str]:
    p = plan.predicted
    if p is None:
        return [f"  predicted  none: {plan.unpredicted}"]
    assert plan.machine is not None
    b = p.breakdown
    parts = [("gemm", "gemm"), ("attention", "attention"), ("elementwise", "element-wise"),
             ("grad_accumulation", "grad accumulation"), ("tp_exposed", "tp exposed"),
             ("ep_exposed", "ep all-to-all"),
             ("pp_bubble_and_p2p", "pp bubble + p2p"), ("zero3_gathers", "ZeRO-3 gathers"), ("dp_exposed", "dp exposed"),
             ("tied_embedding", "tied embedding"), ("grad_norm", "grad norm"),
             ("step_collectives", "step collectives"), ("optimizer", "optimizer"),
             ("optimizer_offload", "optimizer offload")]  # fmt: skip
    # Lines of features the deck does not use are left out (ZeRO-3's gathers, the offloaded update;
    # with offload the device's optimizer line is 0 and left out).
    optional = {"zero3_gathers", "optimizer_offload", "ep_exposed"}
    optional |= {"optimizer"} if plan.deck.optim.offload != "none" else set()
    if tensor_shape(plan.deck) is None and plan.deck.train.fuses_grad_accumulation(not uses_gloo(plan.machine)):
        parts = [(k, "grad accumulation (fused into the GEMMs)" if k == "grad_accumulation" else v) for k, v in parts]
    b = {key: rounded_to_zero(value, p.step_time_s) for key, value in b.items()}
    return [
        f"  predicted  step {p.step_time_s:.3g} s on {plan.machine.name}; "
        f"{tflops_text(p.hardware_tflops_per_device)} TFLOP/s per device counting recompute, "
        f"{tflops_text(p.tflops_per_device)} model (MFU {100 * p.mfu:.1f}%); {p.tokens_per_s:,.0f} tokens/s",
        "             slowest stage: "
        + ", ".join(f"{label} {b[key]:.3g} s" for key, label in parts if b[key] or key not in optional)
        + (f" (recompute {b['recompute']:.3g} s of these)" if b["recompute"] else ""),
        "             links: "
        + ", ".join(f"{axis} {level}" for axis, level in p.levels.items())
        + "; model and its limits: docs/PERFORMANCE_MODEL.md",
    ]


def tflops_text(tflops: float) -> str:
    """TFLOP/s as text: one decimal from 1 up (a GPU's 158.6), three significant digits below (a CPU
    rank's 0.0123 would read 0.0)."""
    return f"{tflops:.1f}" if tflops >= 1 or tflops == 0 else f"{tflops:.3g}"


def rounded_to_zero(seconds: float, step: float) -> float:
    """A breakdown term as shown: a negative within rounding of the step (a difference of equal sums,
    -1.1e-16 s) is 0; a larger one is left, to be seen."""
    return 0.0 if -1e-9 * max(step, 1e-30) < seconds < 0 else seconds


def _count(n: int) -> str:
    return f"{n / 1e9:,.1f}B" if n >= 1e9 else f"{n / 1e6:,.1f}M"


def _stage_runs(stages: list[StageEstimate], deck: Deck) -> list[tuple[int, int, StageEstimate]]:
    """Consecutive stages with identical figures, merged: (first stage, last stage, estimate)."""
    runs: list[tuple[int, int, StageEstimate]] = []
    for s in stages:
        key = (s.layers, s.first, s.last, s.params, s.total(deck.optim.zero, deck.train.recompute, deck.optim.offload))
        if runs:
            a, b, prev = runs[-1]
            if key == (
                prev.layers,
                prev.first,
                prev.last,
                prev.params,
                prev.total(deck.optim.zero, deck.train.recompute, deck.optim.offload),
            ):
                runs[-1] = (a, s.stage, prev)
                continue
        runs.append((s.stage, s.stage, s))
    return runs


def _placement_line(plan: Plan) -> str:
    if plan.ranks_per_node is None:
        return "no node shape (pass --machine or set parallel.gpus_per_node)"
    parts = []
    for axis in plan.layout.axes:
        span, size = plan.node_span[axis], plan.layout.size(axis)
        if size == 1:
            continue
        where = _span_words(span)
        if axis in plan.links:  # the outermost link level the groups cross (machine file's links)
            link = plan.links[axis]
            where += f" (link: {link.level}, {link.bandwidth / 1e9:g} GB/s per group)"
        parts.append(f"{axis} groups ({size}) {where}")
    if plan.deck.parallel.ep > 1:
        where = _span_words(plan.node_span.get("ep"))
        if "ep" in plan.links:
            link = plan.links["ep"]
            where += f" (link: {link.level}, {link.bandwidth / 1e9:g} GB/s per group)"
        parts.append(f"ep groups ({plan.deck.parallel.ep}) {where}")
    if plan.deck.parallel.tensor3d is not None:
        subs = [
            f"{a} ({n}) {_span_words(plan.node_span[a])}"
            for a, n in zip(SUB_AXES, plan.deck.parallel.tensor3d)
            if n > 1
        ]
        parts.append("tp sub-axes: " + ", ".join(subs))
    return f"{plan.ranks_per_node} ranks per node; " + ("; ".join(parts) if parts else "one rank per grid cell")


def _span_words(span: Optional[int]) -> str:
    return "inside one node" if span == 1 else f"span {span} nodes"


def _describe_node(plan: Plan, node: int) -> str:
    ranks = _node_ranks(plan, node)
    axes = {a: sorted({r[a] for r in ranks}) for a in plan.layout.axes}
    desc = ", ".join(f"{a} {_span(v)}" for a, v in axes.items())
    return f"ranks {ranks[0]['rank']}-{ranks[-1]['rank']}: {desc}"


def _span(values: list[int]) -> str:
    return (
        str(values[0])
        if len(values) == 1
        else f"{values[0]}-{values[-1]}"
        if values == list(range(values[0], values[-1] + 1))
        else ",".join(map(str, values))
    )


def dump_json(plan: Plan, all_ranks: bool = False) -> str:
    return json.dumps(to_json(plan, all_ranks), indent=1)

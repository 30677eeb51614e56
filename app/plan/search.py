"""The grid search: `python -m app DECK --search --machine M --nodes N [--top K] [--json]`.

For the deck's model and global batch on N nodes of machine M, every combination of tp
(dividing the devices of a node), pp, micro-batch size, virtual stages, sequence
parallelism, recompute mode and ZeRO stage is checked like a deck (`app.deck.validate`,
`resolve_for_world`) and planned like a dry run (memory, placement, balance). Each invalid
one is rejected with its reason; the rest are ranked by the predicted step time
(`app.plan.perf`, with the pipeline's steady state plus bubble), and the best `top` are
predicted again with the schedule simulated pass by pass. The deck's own configuration goes
through the same path, so the two can be compared.

Optimizer offload (`optim.offload`) is tried only where it must be: a configuration that does
not fit in device memory, and would fit with the state off the device by its dry run's own
figure, is planned once more offloaded, as one more candidate ranked with the rest. Not as a
fallback for the whole search (offload only where nothing fits without it): a grid that fits
only offloaded may still be faster than the grids that fit with full recomputation or deep
pipelines, and the ranking should see it. Not for every configuration either: offload only
adds time to a configuration that fits (the copies and the CPU update replace the device's
update, `app.plan.optimizer_time`), so those twins would never be ranked first, and the search
would plan twice as many (on Frontier, gpt_640b's 32,768-GCD search plans 120 more, not 14,448).
The kind tried is the one that frees device memory on the machine: host on GPU machines; nvme on
CPU machines, whose host memory is the device's, and only where the deck allows it (not with LAMB
nor an asynchronous checkpoint, `app.deck.validate`). On a GPU machine nvme frees the same device
memory as host and only adds the drive's time, so it is tried only where the host-offloaded
candidate is refused for the node's host memory (`host_memory_gib`) and the machine file gives the
drive's capacity and rates (`_spill_kind`): its state is then on the drive and only its stream
buffers and the gradients' copies in host memory. A machine file that lacks the offload's
constants (`Machine.missing_for_prediction`) gets no offloaded candidates of that kind.

Expert parallelism (`parallel.ep`) is searched for a mixture of experts: every ep that divides
both dp and `model.moe_experts` (`expert_degrees`), each a configuration of its own (its memory:
E/ep of the experts per rank; its time: the all-to-alls against the experts' smaller reduction and
update, `app.plan.perf`). Dense decks keep ep = 1 and their candidates carry no ep key.

3D tensor parallelism (`parallel.tensor: [x, y, z]`, AxoNN's) is searched next to 1D (`tensor`:
"both", the default; "1d" or "3d" for one kind): tp any divisor of the world up to
TENSOR3D_MAX_RANKS (a 3D group may span nodes: its Z sub-axis is meant to), never with SP. For
each tp, pp and micro-batch, every (x, y, z) with x y z = tp that the deck rules allow
(`app.deck.validate`: the splits of hidden, heads, MLP and vocabulary, and the batch over dp x z)
is ranked by one transformer block's predicted forward and backward per sample, (F + B) / z
(`perf._layer_passes3d` on the sub-axes' links with tp innermost: the only part of the step the
factorisation changes, besides memory and the small Z sum), and the SHAPES_PER_TP best are
planned with every virtual stage, recompute and ZeRO choice: AxoNN picks its grid by the same
kind of ranking of its communication model. All of them would be 28 to 45 shapes per tp of 64
to 256 GCDs, each as many plans as a 1D tp.
"""

from __future__ import annotations

import itertools
import json
import math
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Optional

from app.deck import MAX_RANKS, Deck, replaced, validate
from app.errors import GridlmError
from app.names import RECOMPUTE
from app.plan.dryrun import MAX_IMBALANCE, GiB, Plan, PlanError, make_plan, tflops_text
from app.plan.estimate import LayoutCache
from app.plan.machine import Machine

MICRO_BATCHES = (1, 2, 4, 8)
# 3D tensor parallelism (module docstring): the largest tp searched, and the (x, y, z) planned per
# (tp, pp, micro-batch), best first by one block's predicted time per sample.
TENSOR3D_MAX_RANKS = 512
SHAPES_PER_TP = 3
TENSOR_KINDS = ("both", "1d", "3d")
VIRTUAL_STAGES = (1, 2, 4)
ZERO_STAGES = (0, 1, 2, 3)  # with dp > 1; at dp = 1 every stage is ZeRO 0


@dataclass
class Candidate:
    """One configuration: its `--set` overrides, and its plan or why it was rejected."""

    sets: dict[str, Any]
    plan: Optional[Plan] = None
    rejected: str = ""
    own: bool = False  # the deck's own configuration: planned with the deck's parallel.stage_layers

    @property
    def step(self) -> float:
        return self.plan.predicted.step_time_s if self.plan and self.plan.predicted else float("inf")

    def overrides(self) -> str:
        """The --set line that plans this configuration from the deck, to paste: its keys, and dp and
        stage_layers as `_apply` planned them (dp from the world size, a balanced split), which a deck
        that sets them would otherwise keep (then refused: tp x pp x dp no longer the world size). The
        deck's own keeps its stage_layers, as `_apply` planned it."""
        sets = {**self.sets, "parallel.dp": "auto", **({} if self.own else {"parallel.stage_layers": None})}
        return " ".join(f"--set {k}={_text(v)}" for k, v in sets.items())


def _text(value: Any) -> str:
    """A --set value as the shell takes it: booleans lower-case, a 3D shape [x,y,z] without spaces."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (tuple, list)):
        return "[" + ",".join(str(v) for v in value) + "]"
    return "null" if value is None else str(value)


@dataclass
class SearchResult:
    world_size: int
    machine: Machine
    best: list[Candidate]
    own: Candidate
    tried: int
    rejected: Counter = field(default_factory=Counter)  # reason -> count
    examples: dict[str, str] = field(default_factory=dict)  # reason -> one full message
    seconds: float = 0.0
    # Configurations that fit only offloaded, not planned so: the machine file cannot time that offload.
    unplanned_offload: int = 0
    unplanned_why: str = ""


def _divisors(n: int) -> list[int]:
    """The divisors of n, ascending, in O(sqrt n) (n may be a world of a million ranks)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def expert_degrees(deck: Deck, dp: int) -> list[int]:
    """The ep a configuration with `dp` data ranks may take: the divisors of dp that divide
    model.moe_experts (a mixture of experts; [1] for a dense deck)."""
    experts = deck.model.moe_experts
    return _divisors(math.gcd(dp, experts)) if experts else [1]


# Axis orders tried (innermost first) besides the deck's: dp or pp next to tp on the node.
ORDERS = ("tp-dp-pp", "tp-pp-dp")
# Context parallelism is tried from this sequence length on (or wherever the deck sets parallel.cp):
# shorter sequences fit a rank, and cp only adds the ring's messages to them.
CP_MIN_SEQ = 8192


def context_degrees(deck: Deck, ranks: int, sets: dict[str, Any]) -> list[int]:
    """The cp a configuration with `ranks` = world / (tp x pp) may take: 1, and for long sequences
    (CP_MIN_SEQ) or a deck that sets cp, every divisor of `ranks` that splits the sequence into 2 cp
    chunks (cp x tp shards under SP), on a 1D grid, for a mixture of experts without a capacity (what
    `app.deck` allows with cp; its experts then stay whole on every rank, ep 1)."""
    m, par = deck.model, deck.parallel
    refused = (m.moe_experts and m.moe_capacity_factor is not None) or sets.get("parallel.tensor") is not None
    if refused or (m.seq_len < CP_MIN_SEQ and par.cp == 1):
        return [1]
    sp = sets["parallel.tp"] if sets.get("parallel.sequence_parallel") else 1  # SP splits a rank's positions
    return [1] + [cp for cp in _divisors(ranks)[1:] if m.seq_len % (2 * cp) == 0 and (m.seq_len // cp) % sp == 0]


def _configurations(deck: Deck, world: int, machine: Machine, tensor: str = "both") -> Iterator[dict[str, Any]]:
    orders = list(dict.fromkeys((deck.parallel.order, *ORDERS)))
    # Offload is tried where a configuration does not fit (`search`); the deck's own is not inherited,
    # nor its keys that only offload takes (refused without it: the pasted line must plan).
    opt, offload = deck.optim, {}
    if opt.offload != "none":
        offload = {"optim.offload": "none", **({"optim.offload_delay": 0} if opt.offload_delay else {}),
                   **({"optim.offload_dir": None} if opt.offload_dir else {})}  # fmt: skip
    grids = _grids(deck, world, machine) if tensor != "3d" else iter(())
    if tensor != "1d":
        grids = itertools.chain(grids, _grids3d(deck, world, machine))
    for sets in grids:
        ranks = world // (sets["parallel.tp"] * sets["parallel.pp"])
        for cp in context_degrees(deck, ranks, sets):
            dp = ranks // cp
            # The key where cp is tried (a deck without it keeps its candidates' keys as they were).
            context = {"parallel.cp": cp} if cp > 1 or deck.parallel.cp > 1 else {}
            # A mixture of experts: every expert-parallel degree dp and the experts allow (1D only: 3D has
            # no experts, `app.deck.validate`); dense decks carry no ep key.
            degrees = (
                ([1] if cp > 1 else expert_degrees(deck, dp))
                if deck.model.moe_experts and sets.get("parallel.tensor") is None
                else [None]
            )
            # With pp or dp of 1 every order places the ranks alike: try the deck's only.
            for order in orders if sets["parallel.pp"] > 1 and dp > 1 else orders[:1]:
                for ep in degrees:
                    yield {"parallel.order": order, **sets, **context, **offload,
                           **({} if ep is None else {"parallel.ep": ep})}  # fmt: skip


def _grids(deck: Deck, world: int, machine: Machine) -> Iterator[dict[str, Any]]:
    m = deck.model
    # A 3D deck's 1D candidates drop its parallel.tensor (1D decks' candidates stay as they were).
    flat = {"parallel.tensor": None, "parallel.tensor_order": "xyz"} if deck.parallel.tensor is not None else {}
    for tp in _divisors(machine.devices_per_node):
        for pp in [p for p in _divisors(world // tp) if p <= m.layers] if world % tp == 0 else []:
            for mb in sorted({*MICRO_BATCHES, deck.train.micro_batch}):
                for v in VIRTUAL_STAGES if pp > 1 else (1,):
                    for sp in (False, True) if tp > 1 else (False,):
                        for rc in RECOMPUTE:
                            for zero in ZERO_STAGES if world // (tp * pp) > 1 else (0,):
                                yield {
                                    "parallel.tp": tp, "parallel.pp": pp, "parallel.virtual_stages": v,
                                    "parallel.sequence_parallel": sp, "train.micro_batch": mb,
                                    "train.recompute": rc, "optim.zero": zero, **flat,
                                }  # fmt: skip


def _grids3d(deck: Deck, world: int, machine: Machine) -> Iterator[dict[str, Any]]:
    """The 3D candidates (module docstring): tp up to TENSOR3D_MAX_RANKS dividing the world, and per
    (tp, pp, micro-batch) the SHAPES_PER_TP best (x, y, z) the deck rules allow."""
    m = deck.model
    ranked: dict[tuple[int, int], list[tuple[float, tuple[int, int, int]]]] = {}  # (tp, mb) -> (key, shape)
    unfused = _unfused(deck)
    for tp in [t for t in _divisors(world) if 2 <= t <= TENSOR3D_MAX_RANKS]:
        for pp in [p for p in _divisors(world // tp) if p <= m.layers]:
            dp = world // (tp * pp)
            for mb in sorted({*MICRO_BATCHES, deck.train.micro_batch}):
                if (tp, mb) not in ranked:
                    ranked[tp, mb] = _rank_shapes(deck, machine, tp, mb)
                fits = [s for _, s in ranked[tp, mb] if deck.train.global_batch % (mb * dp * s[2]) == 0]
                for shape in fits[:SHAPES_PER_TP]:
                    for v in VIRTUAL_STAGES if pp > 1 else (1,):
                        for rc in RECOMPUTE:
                            for zero in ZERO_STAGES if dp > 1 else (0,):
                                yield {
                                    "parallel.tp": tp, "parallel.pp": pp, "parallel.virtual_stages": v,
                                    "parallel.sequence_parallel": False, "train.micro_batch": mb,
                                    "train.recompute": rc, "optim.zero": zero, "parallel.tensor": shape,
                                    **unfused,
                                }  # fmt: skip


def _unfused(deck: Deck) -> dict[str, Any]:
    """What a 3D candidate changes of a deck that asks for gradient accumulation fusion: the key back
    to its default (nothing fuses under 3D, and the deck refuses true there; found in review: every
    3D candidate of such a deck was dropped uncounted)."""
    return {"train.fuse_grad_accumulation": None} if deck.train.fuse_grad_accumulation else {}


def _shapes(tp: int) -> Iterator[tuple[int, int, int]]:
    for x in _divisors(tp):
        for y in _divisors(tp // x):
            yield x, y, tp // (x * y)


def _rank_shapes(deck: Deck, machine: Machine, tp: int, mb: int) -> list[tuple[float, tuple[int, int, int]]]:
    """Every (x, y, z) of `tp` that the model's splits allow, by one block's predicted forward and
    backward time per sample, (F + B) / z, on the sub-axes' links with tp innermost (best first)."""
    from app.plan.device import device_of
    from app.plan.perf import _layer_passes3d, axis_links3d, overlap3d
    from app.runtime.grid import GridLayout

    dev = device_of(machine, deck.train.precision, deck.run.malloc_mmap_threshold_kb)
    layout = GridLayout.from_order_string(tp, 1, 1, "tp-dp-pp", machine.devices_per_node)
    out = []
    for shape in _shapes(tp):
        par = replaced(deck.parallel, tp=tp, pp=1, dp="auto", virtual_stages=1, stage_layers=None,
                       sequence_parallel=False, tensor=list(shape))  # fmt: skip
        train = replaced(deck.train, micro_batch=mb, **{k.split(".")[1]: v for k, v in _unfused(deck).items()})
        variant = replaced(deck, parallel=par, train=train)
        try:
            validate(variant)
        except GridlmError:
            continue
        links = axis_links3d(machine, layout, shape, par.tensor_order)
        f, b, _ = _layer_passes3d(variant, dev, links, overlap3d(variant))
        out.append(((f.total + b.total) / shape[2], shape))
    return sorted(out)


def _own(deck: Deck) -> dict[str, Any]:
    par, tr = deck.parallel, deck.train
    tensor = {"parallel.tensor": tuple(par.tensor)} if par.tensor is not None else {}
    if par.tensor_order != "xyz":
        tensor["parallel.tensor_order"] = par.tensor_order
    return {
        "parallel.order": par.order,
        "parallel.tp": par.tp, "parallel.pp": par.pp, "parallel.virtual_stages": par.virtual_stages,
        "parallel.sequence_parallel": par.sequence_parallel, "train.micro_batch": tr.micro_batch,
        "train.recompute": tr.recompute, "optim.zero": deck.optim.zero,
        **({"optim.offload": deck.optim.offload} if deck.optim.offload != "none" else {}), **tensor,
        **({"parallel.ep": par.ep} if deck.model.moe_experts else {}),
        **({"parallel.cp": par.cp} if par.cp > 1 else {}),
    }  # fmt: skip


def _offload_to_try(deck: Deck, machine: Machine) -> Optional[str]:
    """The offload the search tries on a configuration that does not fit (module docstring): host
    on a GPU machine, nvme on a CPU machine where the deck allows it."""
    if machine.host_is_device:
        return "nvme" if deck.optim.name != "lamb" and not deck.checkpoint.async_ else None
    return "host"


def offload_kind(deck: Deck, machine: Machine) -> Optional[str]:
    """`_offload_to_try`, or None where the machine file cannot predict it."""
    kind = _offload_to_try(deck, machine)
    return kind if kind and not machine.missing_for_prediction(deck.train.precision, kind) else None


def _spill_kind(deck: Deck, machine: Machine, offload: Optional[str]) -> Optional[str]:
    """nvme, where the search offloads to the host of a GPU machine, the deck allows nvme, and the
    machine file gives the drive's capacity and can time it: tried on a configuration whose
    host-offloaded twin overfills the host memory (module docstring)."""
    if offload != "host" or deck.optim.name == "lamb" or deck.checkpoint.async_ or machine.nvme_gb is None:
        return None
    return None if machine.missing_for_prediction(deck.train.precision, "nvme") else "nvme"


def _over_host_memory(candidate: Optional[Candidate]) -> bool:
    """Whether a candidate's only problems are the node's host memory (`dryrun._check_capacity`)."""
    plan = candidate.plan if candidate is not None else None
    return plan is not None and bool(plan.problems) and all("not fit the host memory" in p for p in plan.problems)


def _untimed_offload(deck: Deck, machine: Machine) -> Optional[tuple[str, list[str]]]:
    """The offload the search would try (`_offload_to_try`) and the keys the machine file lacks to
    predict it, where it lacks some (None otherwise)."""
    kind = _offload_to_try(deck, machine)
    missing = machine.missing_for_prediction(deck.train.precision, kind) if kind else []
    return (kind, missing) if kind and missing else None


def _offload_keys(deck: Deck, kind: str) -> dict[str, Any]:
    """The deck's own offload keys that an offloaded candidate of `kind` keeps: its delayed update
    (where the deck offloads), its nvme directory (nvme)."""
    opt, keys = deck.optim, {}
    if opt.offload != "none" and opt.offload_delay:
        keys["optim.offload_delay"] = opt.offload_delay
    if kind == "nvme" and opt.offload_dir:
        keys["optim.offload_dir"] = opt.offload_dir
    return keys


def _apply(deck: Deck, sets: dict[str, Any], own: bool = False) -> Deck:
    """The deck with `sets` in place; `own`: the deck's own configuration, which keeps its split."""
    sections: dict[str, dict[str, Any]] = {}
    for key, value in sets.items():
        section, name = key.split(".")
        sections.setdefault(section, {})[name] = list(value) if isinstance(value, tuple) else value
    changes = {s: replaced(getattr(deck, s), **kv) for s, kv in sections.items()}
    # dp follows from the world size; a candidate gets a balanced split (the deck's stage_layers fit
    # its own pp only), the deck's own configuration its own split, so that its line is the deck's.
    split = deck.parallel.stage_layers if own else None
    changes["parallel"] = replaced(changes["parallel"], dp="auto", stage_layers=split)
    if changes.get("optim", deck.optim).offload != "nvme":  # the deck's nvme directory goes with nvme
        changes["optim"] = replaced(changes.get("optim", deck.optim), offload_dir=None)
    return replaced(deck, **changes)


def _evaluate(
    deck: Deck,
    sets: dict[str, Any],
    world: int,
    machine: Machine,
    simulate: bool,
    layouts: LayoutCache,
    max_imbalance: float = MAX_IMBALANCE,
    own: bool = False,
) -> Candidate:
    candidate = Candidate(sets, own=own)
    try:
        variant = _apply(deck, sets, own)
        validate(variant)
        plan = make_plan(variant, world, machine, max_imbalance=max_imbalance, simulate=simulate, layouts=layouts)
    except GridlmError as err:
        candidate.rejected = str(err)
        return candidate
    if plan.problems:
        candidate.rejected = plan.problems[0]
    elif plan.predicted is None:  # the machine file lacks what this configuration needs (offload)
        candidate.rejected = plan.unpredicted
    candidate.plan = plan
    return candidate


def _fits_offloaded(candidate: Candidate, kind: str) -> bool:
    """Whether a configuration whose only problem is device memory fits with `kind` offload, by its
    dry run's own alternative (`dryrun._check_memory`): the others are not planned again."""
    plan = candidate.plan
    if plan is None or plan.usable_bytes is None or len(plan.problems) != 1:
        return False
    if _reason(plan.problems[0]) != "does not fit in device memory":
        return False
    return plan.alternatives.get(f"optim.offload={kind}", math.inf) <= plan.usable_bytes


def _reason(message: str) -> str:
    """A short category for counting rejections."""
    for words, label in (("stages unbalanced", "unbalanced stages"),
                         ("host copy of the checkpoint does not fit", "checkpoint.async's copy does not fit the host"),
                         ("not fit the host memory", "offloaded state does not fit the host or drive"),
                         ("not fit the node-local NVMe", "offloaded state does not fit the host or drive"),
                         ("does not fit", "does not fit in device memory"), ("span", "tp spans nodes"),
                         ("multiple of", "indivisible"),
                         ("must divide", "indivisible"), ("at least", "too few layers for the chunks")):  # fmt: skip
        if words in message:
            return label
    return message.split(":")[0][:60]


def search(
    deck: Deck,
    world: int,
    machine: Machine,
    top: int = 5,
    tensor: str = "both",
    max_imbalance: float = MAX_IMBALANCE,
) -> SearchResult:
    """Rank every valid configuration of `deck` on `world` ranks of `machine`; `tensor`: "both"
    (1D and 3D tensor parallelism), "1d" or "3d" (module docstring); `max_imbalance`: the largest
    slowest-stage / mean-stage work accepted, as the dry run's --max-imbalance."""
    if tensor not in TENSOR_KINDS:
        raise ValueError(f"tensor={tensor!r}: expected one of {', '.join(TENSOR_KINDS)}")
    # Before enumerating: every candidate would be refused for it (resolve_for_world), one by one.
    if not 1 <= world <= MAX_RANKS:
        raise PlanError(
            f"search: a world of {world:,} ranks; gridlm runs on 1 .. {MAX_RANKS:,}: pass a smaller --world-size "
            "or --nodes"
        )
    start = time.perf_counter()
    missing = machine.missing_for_prediction(deck.train.precision)
    if missing:
        from app.plan.machine import MachineError

        raise MachineError(
            f"machine {machine.name}: the search needs predicted step times; missing {', '.join(missing)}"
        )
    ranked: list[Candidate] = []
    result = SearchResult(world, machine, [], Candidate(_own(deck), own=True), 0)
    fits_without_recompute: set[tuple] = set()
    layouts: LayoutCache = {}  # shared by every plan of this search

    def consider(sets: dict[str, Any]) -> Optional[Candidate]:
        """Plan one configuration and file it as ranked or rejected (None: dominated, not planned)."""
        result.tried += 1
        # Recomputation only adds work: where a configuration fits without it, its recomputing
        # twins are slower by construction and are not planned (they are counted).
        twin = tuple(v for k, v in sets.items() if k != "train.recompute")
        if sets["train.recompute"] != "none" and twin in fits_without_recompute:
            result.rejected["dominated: fits without recompute"] += 1
            result.examples.setdefault("dominated: fits without recompute", "the same grid fits with recompute none")
            return None
        candidate = _evaluate(deck, sets, world, machine, False, layouts, max_imbalance)
        if not candidate.rejected and sets["train.recompute"] == "none":
            fits_without_recompute.add(twin)
        if candidate.rejected:
            reason = _reason(candidate.rejected)
            result.rejected[reason] += 1
            result.examples.setdefault(reason, candidate.rejected)
        else:
            ranked.append(candidate)
        return candidate

    offload = offload_kind(deck, machine)
    spill = _spill_kind(deck, machine, offload)
    # The kind the machine would take but cannot time (missing keys): counted and said, not silently dropped.
    untimed = None if offload else _untimed_offload(deck, machine)
    for sets in _configurations(deck, world, machine, tensor):
        candidate = consider(sets)
        # Offloaded where it does not fit without, and the dry run's figure says it fits with.
        if offload and candidate is not None and _fits_offloaded(candidate, offload):
            offloaded = consider({**sets, "optim.offload": offload, **_offload_keys(deck, offload)})
            if spill and _over_host_memory(offloaded):  # the state on the drive instead
                consider({**sets, "optim.offload": spill, **_offload_keys(deck, spill)})
        elif untimed and candidate is not None and _fits_offloaded(candidate, untimed[0]):
            result.unplanned_offload += 1
    if untimed and result.unplanned_offload:
        kind, missing = untimed
        result.unplanned_why = (
            f"{result.unplanned_offload:,} configuration(s) that fit only with optim.offload={kind} were not planned: "
            f"machine {machine.name} lacks {', '.join(missing)} to time an offloaded step "
            "(docs/PERFORMANCE_MODEL.md); the dry run of one with --set optim.offload=" + kind + " plans its memory"
        )
    ranked.sort(key=lambda c: c.step)
    # The leaders again with the schedule simulated pass by pass (one more than shown, since the
    # simulation can reorder close ones).
    best = [_evaluate(deck, c.sets, world, machine, True, layouts, max_imbalance) for c in ranked[: top + 1]]
    result.own = _evaluate(deck, _own(deck), world, machine, True, layouts, max_imbalance, own=True)
    if not result.own.rejected and all(c.sets != result.own.sets for c in best):
        best.append(result.own)  # so the best shown is never slower than the deck's own
    result.best = sorted(best, key=lambda c: c.step)[:top]
    result.seconds = time.perf_counter() - start
    return result


def _row(c: Candidate) -> str:
    s, p = c.sets, c.plan
    assert p is not None and p.predicted is not None
    q = p.predicted
    peak = p.stage_total(p.peak_stage()) / GiB
    shape = s.get("parallel.tensor")
    tp = f"tp {s['parallel.tp']}" + (f" 3d {_text(shape)}" if shape else "")
    ep = f" ep {s['parallel.ep']}" if "parallel.ep" in s else ""
    tp += f" cp {s['parallel.cp']}" if s.get("parallel.cp", 1) > 1 else ""
    return (
        f"{q.step_time_s:9.3g} s {tflops_text(q.hardware_tflops_per_device):>7} {100 * q.mfu:5.1f}%  {tp} pp "
        f"{s['parallel.pp']} dp {p.deck.dp}{ep} v {s['parallel.virtual_stages']} mb {s['train.micro_batch']} sp "
        f"{'y' if s['parallel.sequence_parallel'] else 'n'} recompute {s['train.recompute']} zero {s['optim.zero']}"
        f"{'' if s.get('optim.offload', 'none') == 'none' else ' offload ' + s['optim.offload']} {s['parallel.order']}  "
        f"{peak:.1f} GiB"
    )


def format_text(result: SearchResult, deck_path: str) -> str:
    r = result
    lines = [
        f"gridlm search: {deck_path} on {r.world_size:,} ranks of {r.machine.name}: {r.tried:,} configurations, "
        f"{sum(r.rejected.values()):,} rejected, {r.seconds:.1f} s",
        "  step time  TFLOP/s   MFU  configuration (TFLOP/s counts recompute; memory: the peak stage per device)",
    ]
    lines += [f"  {_row(c)}" for c in r.best]
    if r.best:
        lines.append(f"  best:  {r.best[0].overrides()}")
    own = r.own
    if own.rejected:
        lines.append(f"  deck:  rejected: {own.rejected}")
    else:
        lines.append(f"  deck:{_row(own)[1:]}")
        if r.best and r.best[0].step < own.step:
            lines.append(f"         the best is {own.step / r.best[0].step:.2f}x faster: {_why(r.best[0], own)}")
    for reason, count in r.rejected.most_common():
        lines.append(f"  rejected {count:,}: {reason}, e.g. {r.examples[reason][:160]}")
    if r.unplanned_why:
        lines.append(f"  not planned: {r.unplanned_why}")
    return "\n".join(lines)


def _why(best: Candidate, own: Candidate) -> str:
    """Where the best configuration's step differs most from the deck's, by breakdown line."""
    assert best.plan and own.plan and best.plan.predicted and own.plan.predicted
    a, b = best.plan.predicted.breakdown, own.plan.predicted.breakdown
    gains = sorted(((b.get(k, 0.0) - a[k], k) for k in a if k != "recompute"), reverse=True)[:2]
    return ", ".join(f"{k} {b[k]:.3g} -> {a[k]:.3g} s" for gain, k in gains if gain > 0)


def to_json(result: SearchResult) -> dict[str, Any]:
    def one(c: Candidate) -> dict[str, Any]:
        predicted = c.plan.predicted.to_dict() if c.plan and c.plan.predicted else None
        return {"sets": c.sets, "overrides": c.overrides(), "predicted": predicted, "rejected": c.rejected or None}

    return {
        "world_size": result.world_size,
        "machine": result.machine.name,
        "tried": result.tried,
        "best": [one(c) for c in result.best],
        "deck": one(result.own),
        "rejected": dict(result.rejected),
        "not_planned": result.unplanned_why or None,
        "seconds": result.seconds,
    }


def dump_json(result: SearchResult) -> str:
    return json.dumps(to_json(result), indent=1)

"""The tensor x context x pipeline x data process grid.

Two layers:

* `GridLayout` is pure: a function of (world size, shape, order, ranks per node) that maps
  every rank to its (tp, cp, pp, dp) coordinates and lists the rank groups of each axis. It is
  what the 32,768-rank tests exercise, without launching anything.
* `ProcessGrid` binds a layout to a running job: an MPI sub-communicator and a
  torch.distributed group per axis, and the dp x cp group that reduces the gradients.

Context parallelism (cp, parallel.cp) is the fourth axis: its ranks hold the same samples and
parameters and split every sequence. At cp = 1 it is invisible: the outputs name tp, pp and dp
only (`GridLayout.axes`), and an order without cp places it right after tp.

Order: `order` lists the axes from innermost to outermost, so with the default `tp-dp-pp`
tp neighbours are adjacent ranks (inside a node when tp divides the ranks per node) and
pp stages are furthest apart. Layout positions are numbered node by node; `ProcessGrid`
renumbers the job's ranks by (node, local rank) so that this holds whatever order the
launcher gave them.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Optional

from app.errors import LaunchError
from app.names import AXES, GRID_AXES, TP_SUB_AXES, strides3d

if TYPE_CHECKING:
    from app.runtime.mpi import Runtime


@dataclass(frozen=True)
class GridLayout:
    """Pure position <-> (tp, cp, pp, dp) mapping.

    Positions are node-major: position r lives on node r // ranks_per_node.
    """

    tp: int
    pp: int
    dp: int
    order: tuple[str, ...] = ("tp", "dp", "pp")
    ranks_per_node: Optional[int] = None
    cp: int = 1

    def __post_init__(self) -> None:
        order = tuple(self.order)
        if "cp" not in order and "tp" in order:  # tp-dp-pp -> tp-cp-dp-pp
            at = order.index("tp") + 1
            order = (*order[:at], "cp", *order[at:])
        if sorted(order) != sorted(GRID_AXES):
            raise ValueError(f"order {self.order} must be a permutation of {AXES} (and cp, else after tp)")
        object.__setattr__(self, "order", order)  # frozen: normalised once, here
        if min(self.tp, self.pp, self.dp, self.cp) < 1:
            raise ValueError(f"grid degrees must be >= 1, got tp={self.tp} cp={self.cp} pp={self.pp} dp={self.dp}")

    @classmethod
    def from_order_string(
        cls, tp: int, pp: int, dp: int, order: str = "tp-dp-pp", ranks_per_node: Optional[int] = None, cp: int = 1
    ) -> GridLayout:
        return cls(tp, pp, dp, tuple(order.split("-")), ranks_per_node, cp)

    @property
    def axes(self) -> tuple[str, ...]:
        """The axes the outputs name: tp, pp, dp, and cp where cp > 1."""
        return GRID_AXES if self.cp > 1 else AXES

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    def size(self, axis: str) -> int:
        return getattr(self, axis)

    def stride(self, axis: str) -> int:
        """Distance between neighbours along `axis` (product of the inner axes' sizes)."""
        stride = 1
        for inner in self.order[: self.order.index(axis)]:
            stride *= self.size(inner)
        return stride

    def coords(self, rank: int) -> dict[str, int]:
        """The (tp, pp, dp) coordinates of `rank`, and cp's where cp > 1."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside a world of {self.world_size}")
        return {axis: (rank // self.stride(axis)) % self.size(axis) for axis in self.axes}

    def rank(self, tp: int, pp: int, dp: int, cp: int = 0) -> int:
        """The rank at coordinates (tp, cp, pp, dp)."""
        return tp * self.stride("tp") + cp * self.stride("cp") + pp * self.stride("pp") + dp * self.stride("dp")

    def group_of(self, rank: int, axis: str) -> list[int]:
        """The ranks sharing every coordinate of `rank` but `axis`, ordered along `axis`."""
        base = rank - self._coord(rank, axis) * self.stride(axis)
        return [base + i * self.stride(axis) for i in range(self.size(axis))]

    def _coord(self, rank: int, axis: str) -> int:
        return (rank // self.stride(axis)) % self.size(axis)

    def replica_group_of(self, rank: int) -> list[int]:
        """The ranks holding the same parameters as `rank` (every coordinate but dp and cp), in
        ascending order: they reduce the gradients together, and ZeRO's shards go by the place in
        this list, which is the place torch gives a rank in their group (it sorts a group's ranks;
        dp-major order differs where dp is inner to cp in parallel.order)."""
        return sorted(r for d in self.group_of(rank, "dp") for r in self.group_of(d, "cp"))

    def groups(self, axis: str) -> list[list[int]]:
        """All groups along `axis`; together they partition the world."""
        stride, n = self.stride(axis), self.size(axis)
        return [self.group_of(base, axis) for base in range(self.world_size) if (base // stride) % n == 0]

    def node_of(self, rank: int) -> int:
        return 0 if self.ranks_per_node is None else rank // self.ranks_per_node

    def axis_within_node(self, axis: str) -> bool:
        """Whether every group along `axis` lies inside one node."""
        if self.ranks_per_node is None or self.size(axis) == 1:
            return True
        return all(self.node_of(g[0]) == self.node_of(g[-1]) for g in self.groups(axis))

    def describe(self) -> dict[str, Any]:
        return {
            "tp": self.tp,
            **({"cp": self.cp} if self.cp > 1 else {}),
            "pp": self.pp,
            "dp": self.dp,
            "order": "-".join(a for a in self.order if a in self.axes),
            "within_node": {axis: self.axis_within_node(axis) for axis in self.axes},
        }


def placement_warnings(
    within_node: dict[str, bool], ranks_per_node: int, gpus_per_node: Optional[int] = None
) -> list[str]:
    """What rank 0 should warn about in a placement: a tp group spanning nodes, or a node
    shape different from the one the deck planned for (`parallel.gpus_per_node`)."""
    warnings = []
    if not within_node["tp"]:
        warnings.append(
            "tensor-parallel groups span nodes; tp communicates in every layer and is slow over the "
            "network. Use a tp that divides the ranks per node and keep tp innermost in parallel.order"
        )
    if gpus_per_node is not None and gpus_per_node != ranks_per_node:
        warnings.append(
            f"parallel.gpus_per_node = {gpus_per_node} but MPI placed {ranks_per_node} ranks per node; "
            "the grid follows the real placement"
        )
    return warnings


# The groups whose collectives put their members' pieces in order (all-gathers, reduce-scatters,
# all-to-alls): tp always (sequence parallelism, the vocabulary's logits); cp (its exchanges); dp and
# the dp x cp replicas under ZeRO (shards) or expert parallelism (its all-to-alls within dp).
# pp's point-to-point messages name their peers, and dp's plain all-reduce sums in any order.
def order_sensitive_axes(tp: int, cp: int, zero: int, ep: int) -> frozenset[str]:
    """The groups (`unordered_group`'s names) whose member order a run of this shape relies on."""
    axes = {"tp"} if tp > 1 else set()
    axes |= {"cp", "dp x cp"} if cp > 1 else set()
    axes |= {"dp", "dp x cp"} if zero >= 1 or ep > 1 else set()
    return frozenset(axes)


def unordered_group(layout: GridLayout, torch_of: list[int], axes: Optional[Collection[str]] = None) -> Optional[str]:
    """Why the grid cannot run on this placement (`torch_of`: grid rank -> torch rank), or None.
    torch numbers the members of a group by ascending rank and its collectives (all-gather,
    reduce-scatter) put the pieces in that order, while the grid gives each rank its coordinate
    along the axis: the two must agree in every group of `axes` (None: every group;
    `order_sensitive_axes`). They do where the launcher numbers each node's ranks consecutively
    (blocks); dealing ranks round-robin over nodes breaks the groups that span nodes with several
    members on each, and their results would be silently wrong."""
    groups = [(axis, group) for axis in layout.axes for group in layout.groups(axis)]
    if layout.cp > 1:  # the dp x cp replicas (`replica_group_of`): one per rank at dp 0 and cp 0
        bases = [g[0] for axis, g in groups if axis == "dp" and layout.coords(g[0])["cp"] == 0]
        groups += [("dp x cp", layout.replica_group_of(base)) for base in bases]
    for axis, group in groups if axes is None else [(a, g) for a, g in groups if a in axes]:
        ranks = [torch_of[r] for r in group]
        if any(a > b for a, b in zip(ranks, ranks[1:])):
            return (
                f"the launcher's rank order does not fit the grid: the {axis} group of grid ranks "
                f"{_few(group)} holds launcher ranks {_few(ranks)}, not in ascending order, so its collectives "
                "would put their pieces in another order than the grid's; place ranks in blocks per node "
                "(srun --distribution=block, mpirun --map-by slot or core: the defaults), not round-robin "
                "(--distribution=cyclic, --map-by node)"
            )
    return None


def _few(ranks: list[int], most: int = 8) -> str:
    return ", ".join(map(str, ranks[:most])) + (", ..." if len(ranks) > most else "")


class Replicas(NamedTuple):
    """The dp x cp ranks that hold the same parameters (`ProcessGrid.replicas`): gradients are
    averaged and ZeRO shards over them. At cp = 1 the dp group itself."""

    rank: int
    size: int
    group: Any
    ranks: list[int]


class ProcessGrid:
    """A `GridLayout` bound to a running job: per-axis torch groups.

    Attributes: `layout`; `rank` (this process's layout position); `coords`;
    `group[axis]` (torch ProcessGroup, made by `runtime.groups`:
    the axes of size 1 share this rank's own group, app/runtime/groups.py), `ranks[axis]`
    (torch ranks of this process's group along `axis`) and `within_node[axis]` (whether
    every group along `axis` lies inside one node, measured on the real placement).
    The runtime's communicator may be a sub-communicator of the job, so several grids can
    live in one process (their runtimes should share one `Groups`).
    """

    def __init__(
        self, runtime: Runtime, tp: int, pp: int, dp: int, order: str = "tp-dp-pp", cp: int = 1,
        ordered: Optional[Collection[str]] = None,
    ) -> None:  # fmt: skip
        if tp * cp * pp * dp != runtime.world_size:
            shape = f"tp={tp}" + (f" x cp={cp}" if cp > 1 else "") + f" x pp={pp} x dp={dp}"
            raise LaunchError(f"grid {shape} does not match the {runtime.world_size} ranks launched")
        uniform = len(set(runtime.ranks_per_node_list)) == 1
        self.layout = GridLayout.from_order_string(tp, pp, dp, order, runtime.ranks_per_node if uniform else None, cp)
        node_major = sorted(range(runtime.world_size), key=lambda r: runtime.placement[r])
        torch_of = [runtime.global_ranks[r] for r in node_major]  # grid rank -> torch rank
        unordered = unordered_group(self.layout, torch_of, ordered)  # `ordered`: order_sensitive_axes
        if unordered is not None:  # every rank finds the same: all stop, none waits
            raise LaunchError(unordered)
        self.rank = node_major.index(runtime.rank)
        self.coords = self.layout.coords(self.rank)
        self.group: dict[str, Any] = {}
        self._groups, self._backend = runtime.groups, runtime.backend
        self.ranks: dict[str, list[int]] = {}
        for axis in self.layout.axes:
            mine = self.layout.group_of(self.rank, axis)
            self.ranks[axis] = [runtime.global_ranks[node_major[r]] for r in mine]
            # Local synchronisation: only a group's members create it, so set-up costs O(group)
            # per rank instead of a world-wide barrier per group (32k ranks, thousands of groups).
            self.group[axis] = self._groups.new(self.ranks[axis], runtime.backend, runtime.watchdog, axis)
        self.replicas = Replicas(self.coords["dp"], dp, self.group["dp"], self.ranks["dp"])
        if cp > 1:
            mine = self.layout.replica_group_of(self.rank)
            ranks = [torch_of[r] for r in mine]  # ascending, as the grid ranks are (`unordered_group`)
            group = self._groups.new(ranks, runtime.backend, runtime.watchdog, "dp")
            self.replicas = Replicas(mine.index(self.rank), dp * cp, group, ranks)
        self.watchdog = runtime.watchdog
        self.watchdog.set_groups(self.ranks)
        self._pipeline_groups: dict[Any, Any] = {}
        self._tensor3d_groups: dict[tuple[tuple[int, int, int], str], dict[str, tuple[int, Any, list[int]]]] = {}
        self._expert_groups: dict[tuple[str, int], dict[str, tuple[int, Any, list[int]]]] = {}
        # From the measured placement (MPI's shared-memory split), not the layout's assumption:
        # do all members of every group of an axis share a node?
        node_of = [runtime.placement[r][0] for r in node_major]  # grid rank -> node
        self.within_node = {axis: _groups_within_node(self.layout, axis, node_of) for axis in self.layout.axes}

    def size(self, axis: str) -> int:
        return self.layout.size(axis)

    def coord(self, axis: str) -> int:
        """This rank's coordinate on `axis` (0 on cp where cp = 1, which `coords` leaves out)."""
        return self.coords.get(axis, 0)

    def tensor3d(self, shape: tuple[int, int, int], order: str = "xyz") -> dict[str, tuple[int, Any, list[int]]]:
        """The tp group as an X x Y x Z grid laid out `order` (innermost first, `names.strides3d`;
        `app.tensor_parallel.tensor3d`): `{sub-axis: (this rank's coordinate, torch group, torch
        ranks)}` for tp_x, tp_y, tp_z.

        Made on first use by every rank of the tp group (each makes its three groups, so every
        rank holds as many groups as its peers) and kept, like `pipeline_groups`'."""
        x, y, z = shape
        if x * y * z != self.size("tp"):
            raise LaunchError(f"tensor [{x}, {y}, {z}] is not the tp degree {self.size('tp')}")
        if (shape, order) not in self._tensor3d_groups:
            r = self.coords["tp"]
            strides = dict(zip(TP_SUB_AXES, strides3d(shape, order)))
            sizes = dict(zip(TP_SUB_AXES, shape))
            mine = {a: (r // strides[a]) % sizes[a] for a in TP_SUB_AXES}
            out = {}
            for axis in TP_SUB_AXES:
                base = r - mine[axis] * strides[axis]
                ranks = [self.ranks["tp"][base + i * strides[axis]] for i in range(sizes[axis])]
                group = self._groups.new(ranks, self._backend, self.watchdog, axis)
                out[axis] = (mine[axis], group, ranks)
            self._tensor3d_groups[(shape, order)] = out
        return self._tensor3d_groups[(shape, order)]

    def expert_groups(self, ep: int) -> dict[str, tuple[int, Any, list[int]]]:
        """Expert parallelism's split of the dp group (mixture of experts, `parallel.ep`): `ep`
        consecutive dp ranks form an expert group ("ep": they hold different experts and exchange
        tokens), and the dp ranks at the same place in every expert group an expert-data group
        ("edp": they hold the same experts and reduce their gradients). `{axis: (this rank's
        coordinate, torch group, torch ranks)}`. Made on first use by every rank of the dp group
        and kept, like `tensor3d`'s."""
        dp = self.size("dp")
        if ep < 1 or dp % ep:
            raise LaunchError(f"expert parallelism ep = {ep} must divide dp = {dp}")
        key = ("expert", ep)
        if key not in self._expert_groups:
            r = self.coords["dp"]
            block, place = r // ep, r % ep
            ep_ranks = [self.ranks["dp"][block * ep + i] for i in range(ep)]
            edp_ranks = [self.ranks["dp"][b * ep + place] for b in range(dp // ep)]
            self._expert_groups[key] = {
                "ep": (place, self._groups.new(ep_ranks, self._backend, self.watchdog, "dp"), ep_ranks),
                "edp": (block, self._groups.new(edp_ranks, self._backend, self.watchdog, "dp"), edp_ranks),
            }
        return self._expert_groups[key]

    def all_reduce(self, tensor: Any, axes: Sequence[str], op: Any = None) -> None:
        """In place: reduce `tensor` (sum by default) over each of `axes` in turn (a reduction
        over several axes = over their product group); axes of size 1 cost nothing. dp and cp
        together are one collective over their product group (`replicas`)."""
        import torch.distributed as dist

        op = op if op is not None else dist.ReduceOp.SUM
        if self.size("cp") > 1 and {"dp", "cp"} <= set(axes):
            with self.watchdog.blocking("all_reduce", "dp"):
                dist.all_reduce(tensor, op=op, group=self.replicas.group)
            axes = [a for a in axes if a not in ("dp", "cp")]
        for axis in axes:
            if self.size(axis) > 1:
                with self.watchdog.blocking("all_reduce", axis):
                    dist.all_reduce(tensor, op=op, group=self.group[axis])

    def describe(self) -> dict[str, Any]:
        return {**self.layout.describe(), "within_node": dict(self.within_node)}

    def pipeline_groups(self, wrap_around: bool) -> tuple[dict[tuple[str, bool], Any], Any]:
        """The pp axis's point-to-point groups, `{(F | B, wrap): group}` (one per message stream,
        see app/parallel/pipeline.py; the wrap-around streams only if `wrap_around`), and the
        tied-embedding group of the first and last stage (None on the other stages).

        Made on first use, collectively over the pp group, and kept: every pipeline built on
        this grid reuses them, so a process that builds many trainers on one grid (the tests)
        holds a fixed number of groups instead of a growing one.
        """
        pp, stage, ranks = self.size("pp"), self.coords["pp"], self.ranks["pp"]
        if pp == 1:
            return {}, None
        groups = self._pipeline_groups
        wraps = (False, True) if wrap_around else (False,)
        for key in [(kind, wrap) for wrap in wraps for kind in "FB"]:
            if key not in groups:
                groups[key] = self._groups.new(ranks, self._backend, self.watchdog, "pp")
        if "tied" not in groups:
            # torch names a locally synchronised group after its ranks and the number of groups
            # the process already has, so every rank must create as many groups as its peers:
            # the middle stages create a group of their own instead of the first-last group.
            ends = stage in (0, pp - 1)
            tied = self._groups.new(
                [ranks[0], ranks[-1]] if ends else [ranks[stage]],
                self._backend,
                self.watchdog,
                "pp",
                alone_shared=False,
            )
            groups["tied"] = tied if ends else None
        return {key: g for key, g in groups.items() if key != "tied" and (wrap_around or not key[1])}, groups["tied"]


def _groups_within_node(layout: GridLayout, axis: str, node_of: Sequence[int]) -> bool:
    """Whether every group of `axis` lies on one node (`node_of[r]`: grid rank r's node); one
    pass over the ranks, a group known by the coordinates of the other axes."""
    seen: dict[tuple[int, ...], int] = {}
    for r, node in enumerate(node_of):
        coords = layout.coords(r)
        key = tuple(coords[a] for a in layout.axes if a != axis)
        if seen.setdefault(key, node) != node:
            return False
    return True

"""Where every element of a rank's parameters lives: one pure, tensor-free answer.

A rank's parameters (its tp shard of its pipeline stage's layers) live in one flat buffer in
reverse registration order, roughly the order backward produces gradients. The buffer is cut
into dp buckets of whole parameters of about `parallel.dp_bucket_mb`, each padded to a
multiple of dp; the tied embedding gets a bucket of its own, so its shards line up between
the first and the last pipeline stage. Each rank updates a shard of every bucket: all of it
without ZeRO, its 1/dp slice under ZeRO-1. The segments say which parameter elements a
shard holds, the decay runs which of its elements weight decay applies to, and the owned runs
which it counts once (the gradient norm).

Each parameter is described by its `ParamMeta`: its tp box (the global tensor, this rank's
offset and shape in it, the axis it is split along) and whether it is this rank's to count
(`owned`: every tp shard, tp rank 0 of a tensor replicated over tp, never the tied head copy),
so norms and checkpoints count each element of the 1-rank model once.

`DataParallel` allocates its buffers and views from this layout; the optimizer, the
gradient norm, LAMB, checkpoint I/O and the dry run read it; none of them works it out
again. It holds no tensors, so it can be built and checked for any grid (32,768 ranks).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Optional

from app.archs.spec import A_SPLITS, B_SPLITS
from app.names import TP_SUB_AXES, strides3d

# ZeRO-2: bucket reductions in flight at once; launching one more first waits for the oldest,
# so a rank holds at most this many bucket buffers being reduced (DataParallel, estimate.py).
ZERO2_IN_FLIGHT = 2
# 3D tensor parallelism's ORS: weight-gradient reduce-scatters over Z in flight before the oldest is
# waited for. Each keeps a Linear's whole (x y) gradient block alive, so a few: enough to hide one
# behind the next Linears' backward GEMMs, not a stage's worth of blocks (tensor3d, estimate.py).
ORS_IN_FLIGHT = 4
# ZeRO-3: units (a transformer block, the embedding, the head) whose parameter all-gathers are
# in flight ahead of the unit computing, in execution order (forward and backward).
ZERO3_PREFETCH = 1


@dataclass(frozen=True)
class ParamMeta:
    """Where a local parameter sits in its global tensor (its tp box), and how it is treated.

    `global_shape`: the 1-rank shape; `offset`: start of this shard along each dim; `shape`:
    the shard's shape (empty: the global shape); `split`: grid axis -> dim it is split along;
    along every other axis of tp and dp the parameter is replicated (pp is different: each
    parameter lives on the stage that runs its layer; "ep": a mixture of experts' stacked experts,
    split along dim 0 over the expert-parallel ranks of dp and replicated over the others).
    `init`: 'normal' | 'zeros' | 'ones'; `std`: for 'normal'; `decay`: weight decay applies. `sequence_parallel`: replicated over
    tp, but it acts on a sequence shard, so each tp rank holds a partial gradient that must be
    summed over tp (under 3D tensor parallelism: replicated over tp_z, where the batch is split,
    summed over tp_z). `tied`: the last pipeline stage's copy of the tied embedding; its gradient
    is summed with the first stage's, and it is counted once (there) in norms and checkpoints.
    """

    global_shape: tuple[int, ...]
    init: str = "normal"
    std: float = 0.0
    decay: bool = True
    offset: tuple[int, ...] = ()
    split: dict[str, int] = field(default_factory=dict)
    sequence_parallel: bool = False
    tied: bool = False
    shape: tuple[int, ...] = ()
    tensor3d: tuple[int, ...] = ()  # (X, Y, Z) under 3D tensor parallelism; split names tp_x/y/z
    tensor_order: str = "xyz"  # 3D: the sub-axes' order in the tp group, innermost first (`strides3d`)

    @property
    def local_shape(self) -> tuple[int, ...]:
        """This rank's shard's shape."""
        return self.shape or self.global_shape

    @property
    def local_offset(self) -> tuple[int, ...]:
        """This rank's shard's start along each dim."""
        return self.offset or (0,) * len(self.global_shape)

    @property
    def numel(self) -> int:
        """Elements of this rank's shard."""
        return math.prod(self.local_shape)

    def replicated_over(self, axis: str) -> bool:
        """Whether every rank along `axis` holds this same tensor (tp and dp only)."""
        return axis not in self.split

    def owned_by(self, tp_rank: int) -> bool:
        """Whether this copy stands for its elements when each logical element must count
        once (norms, gathering, checkpoints): tp shards are disjoint and all count; a tensor
        replicated over tp counts on tp rank 0; the tied head copy never (the first stage's
        counts). dp replicas are for the caller to skip."""
        return not self.tied and self.counts_on(tp_rank)

    def counts_on(self, tp_rank: int) -> bool:
        """Whether tp rank `tp_rank`'s copy is the one of its tp replicas that counts: every tp
        shard; a tensor replicated over tp on tp rank 0; under 3D tensor parallelism, the copy
        at coordinate 0 of every sub-axis it is replicated over."""
        if self.tensor3d:
            coords = dict(zip(SUB_AXES, coords3d(tp_rank, self.tensor3d, self.tensor_order)))
            return all(a in self.split or coords[a] == 0 for a in SUB_AXES)
        return not self.replicated_over("tp") or tp_rank == 0


SUB_AXES = TP_SUB_AXES  # 3D tensor parallelism's sub-axes of tp, innermost first


def coords3d(tp_rank: int, shape: Sequence[int], order: str = "xyz") -> tuple[int, int, int]:
    """(x, y, z) of tp rank `tp_rank` (its place in the tp group) in an X x Y x Z tensor grid laid
    out `order` (`strides3d`)."""
    x, y, z = ((tp_rank // stride) % n for stride, n in zip(strides3d(shape, order), shape))
    return x, y, z


def box3d(
    meta: ParamMeta, shape: Sequence[int], tp_rank: int, splits: Sequence[tuple[str, int]], order: str = "xyz"
) -> ParamMeta:
    """`meta` for tp rank `tp_rank`'s block under 3D tensor parallelism of `shape` (X, Y, Z) laid
    out `order`: `splits` are (sub-axis, dim) in order, each cutting the current block along
    `dim` into equal parts (the second cut of a dim splits the first's part: rows over Y, then Z)."""
    coords = dict(zip(SUB_AXES, coords3d(tp_rank, shape, order)))
    sizes = dict(zip(SUB_AXES, shape))
    extent, offset = list(meta.global_shape), [0] * len(meta.global_shape)
    split = {}
    for axis, dim in splits:
        if sizes[axis] > 1:
            extent[dim] //= sizes[axis]
            offset[dim] += coords[axis] * extent[dim]
            split[axis] = dim
    # Replicated over Z, where the batch is split: each Z rank holds a partial gradient, summed over
    # tp_z like a sequence-parallel parameter's over tp (`DataParallel.finish_grad_reduce`).
    partial = "tp_z" not in split and sizes["tp_z"] > 1
    return dataclasses.replace(
        meta,
        offset=tuple(offset),
        shape=tuple(extent),
        split=split,
        tensor3d=tuple(shape),
        tensor_order=order,
        sequence_parallel=partial,
    )


def weight_splits(transposed: bool) -> list[tuple[str, int]]:
    """A (out, in) weight's cuts under 3D tensor parallelism (`box3d`): rows over the out axis (Y,
    or X in the `transposed` B layout) and then Z, columns over the in axis (`app/archs/spec.py`)."""
    return list(B_SPLITS if transposed else A_SPLITS)


def tp_box(meta: ParamMeta, tp: int, tp_rank: int, dim: int) -> ParamMeta:
    """`meta` for tp rank `tp_rank`'s shard of `tp` equal parts along `dim` (whole when tp = 1)."""
    shape = list(meta.global_shape)
    offset = [0] * len(shape)
    if tp > 1:
        shape[dim] //= tp
        offset[dim] = tp_rank * shape[dim]
    split = {"tp": dim} if tp > 1 else {}
    return dataclasses.replace(meta, offset=tuple(offset), shape=tuple(shape), split=split)


def ep_box(meta: ParamMeta, ep: int, ep_rank: int) -> ParamMeta:
    """`meta` of stacked experts (E, ...) for place `ep_rank` of an expert group of `ep` ranks: its
    E/ep experts along dim 0, split {"ep": 0} (whole when ep = 1; `app.model.moe.ExpertParallel`)."""
    if ep == 1:
        return meta
    shape = list(meta.global_shape)
    shape[0] //= ep
    offset = (ep_rank * shape[0],) + (0,) * (len(shape) - 1)
    return dataclasses.replace(meta, shape=tuple(shape), offset=offset, split={"ep": 0})


@dataclass(frozen=True)
class Segment:
    """The part of parameter `param` (index in buffer order) inside a bucket's shard: shard
    elements [lo, hi) are the parameter's flat elements [param_lo, param_lo + hi - lo)."""

    param: int
    lo: int
    hi: int
    param_lo: int


@dataclass(frozen=True)
class Bucket:
    """[start, end) of the flat buffers (end - start a multiple of dp), its whole parameters,
    and the shard [shard_lo, shard_hi) this rank updates. `expert`: its parameters are experts
    split over ep (`ParamMeta.split["ep"]`), held alike only by the dp/ep ranks of the expert-data
    group, over which the bucket is reduced and sharded."""

    start: int
    end: int
    params: tuple[int, ...]
    shard_lo: int
    shard_hi: int
    expert: bool = False


def _sharing(dp: int, dp_rank: int, ep: int, expert: bool) -> tuple[int, int]:
    """(ranks holding a bucket alike, this rank's place among them): dp and the dp rank, or for
    experts split over ep the expert-data group, dp rank r at place r // ep of dp / ep
    (`ProcessGrid.expert_groups`)."""
    return (dp // ep, dp_rank // ep) if expert else (dp, dp_rank)


def _merged(segments: Iterable[Segment]) -> tuple[tuple[int, int], ...]:
    """The [lo, hi) ranges of `segments` (in shard order), adjacent ones merged."""
    runs: list[tuple[int, int]] = []
    for s in segments:
        if runs and runs[-1][1] == s.lo:
            runs[-1] = (runs[-1][0], s.hi)
        else:
            runs.append((s.lo, s.hi))
    return tuple(runs)


@dataclass(frozen=True)
class ParamLayout:
    """The flat layout of one rank's parameters over its dp group (see the module docstring).
    A shard's segments and decay runs are worked out when first asked for (the dry run and the
    search need only the sizes, for thousands of grids)."""

    metas: tuple[ParamMeta, ...]  # each parameter's tp box, in buffer order
    owned: tuple[bool, ...]  # this rank counts its elements once (`ParamMeta.owned_by`)
    numels: tuple[int, ...]  # elements of each parameter
    decay: tuple[bool, ...]  # weight decay applies to it
    offsets: tuple[int, ...]  # its first element in the flat buffers
    buckets: tuple[Bucket, ...]
    dp: int
    dp_rank: int
    zero: bool  # each rank updates only its 1/dp slice of every bucket (ZeRO-1)
    ep: int = 1  # expert parallelism: expert buckets are shared by dp / ep ranks (`Bucket.expert`)
    _shard_parts: dict[int, tuple[tuple[Segment, ...], tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]]] = (
        field(default_factory=dict, compare=False, repr=False)
    )

    @classmethod
    def build(
        cls,
        metas: Sequence[ParamMeta],
        *,
        tp_rank: int,
        dp: int,
        dp_rank: int,
        zero: bool,
        bucket_elements: float,
        alone: Optional[int] = None,
        units: Optional[Sequence[str]] = None,
        ep: int = 1,
    ) -> ParamLayout:
        """The parameters `metas` (buffer order) of tp rank `tp_rank` in buckets of whole
        parameters of at least `bucket_elements` (the last may be smaller), parameter `alone`
        (the tied embedding) in a bucket of its own. `zero` takes effect only when dp > 1.
        `units` (ZeRO-3: each parameter's gather unit, see `GPT.param_units`): a bucket never
        holds parameters of two units, so a unit's gather moves only its own buckets. Experts
        (split over `ep`) never share a bucket with other parameters: theirs is sharded over the
        expert-data group (`expert_group`)."""
        zero = zero and dp > 1
        numels = [m.numel for m in metas]
        experts = [ep > 1 and "ep" in m.split for m in metas]
        offsets: list[int] = []
        buckets: list[Bucket] = []
        current: list[int] = []
        start = size = 0

        def close() -> None:
            nonlocal start, size, current
            if current:
                expert = experts[current[0]]
                n, r = _sharing(dp, dp_rank, ep, expert)
                end = start + -(-size // dp) * dp
                shard = (end - start) // n
                lo, hi = (start + r * shard, start + (r + 1) * shard) if zero else (start, end)
                buckets.append(Bucket(start, end, tuple(current), lo, hi, expert))
                start, size, current = end, 0, []

        for i, n in enumerate(numels):
            cut = i > 0 and (experts[i] != experts[i - 1] or (units is not None and units[i] != units[i - 1]))
            if i == alone or cut:
                close()
            offsets.append(start + size)
            current.append(i)
            size += n
            if i == alone or size >= bucket_elements:
                close()
        close()
        owned = tuple(m.owned_by(tp_rank) for m in metas)
        decay = tuple(m.decay for m in metas)
        return cls(tuple(metas), owned, tuple(numels), decay, tuple(offsets), tuple(buckets), dp, dp_rank, zero, ep)

    def local_range(self, i: int, span: tuple[int, int]) -> tuple[int, int]:
        """Buffer range `span` intersected with parameter i, in the parameter's local flat
        indices; (0, 0) where they do not meet."""
        lo = max(span[0], self.offsets[i]) - self.offsets[i]
        hi = min(span[1], self.offsets[i] + self.numels[i]) - self.offsets[i]
        return (lo, hi) if lo < hi else (0, 0)

    def _parts(self, b: int) -> tuple[tuple[Segment, ...], tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]]:
        if b not in self._shard_parts:
            bucket = self.buckets[b]
            segments = []
            for i in bucket.params:
                p_lo, p_hi = self.local_range(i, (bucket.shard_lo, bucket.shard_hi))
                if p_lo < p_hi:
                    shard_lo = self.offsets[i] + p_lo - bucket.shard_lo
                    segments.append(Segment(i, shard_lo, shard_lo + p_hi - p_lo, p_lo))
            decayed = _merged(s for s in segments if self.decay[s.param])
            owned = _merged(s for s in segments if self.owned[s.param])
            self._shard_parts[b] = (tuple(segments), decayed, owned)
        return self._shard_parts[b]

    def segments(self, b: int) -> tuple[Segment, ...]:
        """The parameter parts in this rank's shard of bucket b."""
        return self._parts(b)[0]

    def decay_runs(self, b: int) -> tuple[tuple[int, int], ...]:
        """Shard-relative [lo, hi) ranges of bucket b's shard that weight decay applies to,
        adjacent segments merged."""
        return self._parts(b)[1]

    def owned_runs(self, b: int) -> tuple[tuple[int, int], ...]:
        """Shard-relative [lo, hi) ranges of bucket b's shard this rank counts once (`owned`: the
        gradient norm's elements), adjacent segments merged."""
        return self._parts(b)[2]

    @property
    def size(self) -> int:
        """Elements of the flat buffers, padding included."""
        return self.buckets[-1].end if self.buckets else 0

    def bucket_of(self) -> dict[int, int]:
        """Parameter index -> its bucket."""
        return {i: k for k, b in enumerate(self.buckets) for i in b.params}

    def sharing(self, b: int) -> tuple[int, int]:
        """(the ranks holding bucket b alike, this rank's place among them): the dp group, or for an
        expert bucket the expert-data group (dp / ep ranks)."""
        return _sharing(self.dp, self.dp_rank, self.ep, self.buckets[b].expert)

    def dp_slice(self, b: int) -> tuple[int, int]:
        """This rank's slice of bucket b among the ranks holding it alike (`sharing`; buffer
        offsets): the ZeRO-1 shard, held or not. Checkpoints split their I/O of replicated state
        over those ranks this way."""
        bucket = self.buckets[b]
        n, r = self.sharing(b)
        shard = (bucket.end - bucket.start) // n
        return bucket.start + r * shard, bucket.start + (r + 1) * shard

    @property
    def has_experts(self) -> bool:
        """Some bucket holds experts split over ep > 1."""
        return any(b.expert for b in self.buckets)

    def shard_elements(self) -> int:
        """Elements of the shards this rank updates (its fp32 master and optimizer moments)."""
        return sum(b.shard_hi - b.shard_lo for b in self.buckets)

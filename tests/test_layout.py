"""ParamLayout (app/sharding/layout.py): pure, so checked at any dp size without tensors.

Serial. The layouts of real trainers are exercised by every training test under mpirun (they
allocate from it); here the invariants are checked directly, up to dp = 32,768.
"""

from __future__ import annotations

import random

import pytest

from app.sharding.layout import ParamLayout, ParamMeta

pytestmark = pytest.mark.timeout(120)


def _params(seed: int, count: int = 30) -> tuple[list[int], list[bool]]:
    rng = random.Random(seed)
    numels = [rng.choice([1, 7, 64, 1000, 4096, 65_536]) for _ in range(count)]
    return numels, [rng.random() < 0.6 for _ in numels]


def _metas(numels, decay) -> list[ParamMeta]:
    """Flat parameters replicated over tp (the buckets only see their sizes)."""
    return [ParamMeta((n,), decay=d) for n, d in zip(numels, decay)]


def _layouts(numels, decay, dp, zero, bucket, alone=None):
    metas = _metas(numels, decay)
    return [
        ParamLayout.build(metas, tp_rank=0, dp=dp, dp_rank=r, zero=zero, bucket_elements=bucket, alone=alone)
        for r in range(dp)
    ]


@pytest.mark.parametrize("dp", [1, 2, 3, 8])
@pytest.mark.parametrize("zero", [False, True])
@pytest.mark.parametrize("alone", [None, 0, 17])
def test_buckets_hold_whole_parameters_padded_to_dp_and_the_shards_cover_each_once(dp, zero, alone):
    numels, decay = _params(dp + 10 * zero)
    layouts = _layouts(numels, decay, dp, zero, bucket=5000, alone=alone)
    first = layouts[0]
    # Parameters sit back to back inside buckets; buckets tile the buffer; each is padded to dp.
    assert first.buckets[0].start == 0
    for a, b in zip(first.buckets, first.buckets[1:]):
        assert a.end == b.start
    for b in first.buckets:
        assert (b.end - b.start) % dp == 0
        assert b.end - b.start - sum(numels[i] for i in b.params) < dp
        for i in b.params:
            assert b.start <= first.offsets[i] and first.offsets[i] + numels[i] <= b.end
    assert sorted(i for b in first.buckets for i in b.params) == list(range(len(numels)))
    if alone is not None:  # the tied embedding in a bucket of its own
        assert [b.params for b in first.buckets if alone in b.params] == [(alone,)]
    # Every parameter element is held by exactly one dp rank under ZeRO, by every rank without.
    held = [0] * len(numels)
    for layout in layouts:
        assert layout.offsets == first.offsets and [b.params for b in layout.buckets] == [
            b.params for b in first.buckets
        ]
        for k, b in enumerate(layout.buckets):
            for s in layout.segments(k):
                assert 0 <= s.lo < s.hi <= b.shard_hi - b.shard_lo
                assert s.param_lo >= 0 and s.param_lo + s.hi - s.lo <= numels[s.param]
                assert layout.offsets[s.param] + s.param_lo == b.shard_lo + s.lo  # the same element
                held[s.param] += s.hi - s.lo
    copies = 1 if zero and dp > 1 else dp
    assert held == [n * copies for n in numels]
    # dp_slice: the ZeRO shard whether or not ZeRO is on; the slices tile each bucket.
    for k, b in enumerate(first.buckets):
        slices = sorted(layout.dp_slice(k) for layout in layouts)
        assert slices[0][0] == b.start and slices[-1][1] == b.end
        assert all(x[1] == y[0] for x, y in zip(slices, slices[1:]))
        if zero and dp > 1:
            assert all((lay.buckets[k].shard_lo, lay.buckets[k].shard_hi) == lay.dp_slice(k) for lay in layouts)


def test_decay_runs_are_the_decayed_segments_merged():
    numels, decay = _params(5)
    for layout in _layouts(numels, decay, 4, True, 3000):
        for k in range(len(layout.buckets)):
            want = [i for s in layout.segments(k) if decay[s.param] for i in range(s.lo, s.hi)]
            runs = layout.decay_runs(k)
            assert [i for lo, hi in runs for i in range(lo, hi)] == want
            assert all(x[1] < y[0] for x, y in zip(runs, runs[1:]))  # merged: never adjacent


def test_a_layout_at_32768_ranks_is_built_without_tensors():
    """gpt_1t-like shapes on the last dp rank of 32,768 under ZeRO-1: every bucket's shard is
    1/dp of it, and the shards over the dp ranks add up to the buffer."""
    hidden, layers, dp = 25_600, 4, 32_768
    numels = [hidden * 3 * hidden // 8, 3 * hidden // 8, hidden * hidden // 8, hidden, hidden, hidden] * layers
    decay = [True, False, True, False, False, False] * layers
    layout = ParamLayout.build(
        _metas(numels, decay), tp_rank=0, dp=dp, dp_rank=dp - 1, zero=True, bucket_elements=25e6 / 4
    )
    assert layout.size >= sum(numels) and layout.size % dp == 0
    assert layout.shard_elements() * dp == layout.size
    for k, b in enumerate(layout.buckets):
        assert (b.shard_lo, b.shard_hi) == layout.dp_slice(k) and b.shard_hi == b.end


def test_ownership_counts_each_element_of_the_1_rank_model_once_over_tp():
    """The layout says which copies count (norms, checkpoints): over the tp ranks of a stage, the
    owned boxes of each parameter cover its global tensor exactly once; replicated tensors count
    on tp rank 0 and the tied head copy on none."""
    import itertools
    from collections import Counter

    from app.sharding.layout import tp_box

    tp = 4
    base = [ParamMeta((8, 6)), ParamMeta((6,), decay=False), ParamMeta((12, 6), tied=True), ParamMeta((6, 8))]
    splits = [0, None, 0, 1]  # column-parallel, replicated, the tied copy, row-parallel
    layouts = []
    for r in range(tp):
        metas = [m if d is None else tp_box(m, tp, r, d) for m, d in zip(base, splits)]
        layouts.append(ParamLayout.build(metas, tp_rank=r, dp=1, dp_rank=0, zero=False, bucket_elements=100))
    for i, meta in enumerate(base):
        counted: Counter = Counter()
        for layout in layouts:
            box = layout.metas[i]
            assert layout.numels[i] == box.numel
            if layout.owned[i]:
                counted.update(itertools.product(*(range(o, o + n) for o, n in zip(box.local_offset, box.local_shape))))
        everything = set(itertools.product(*(range(n) for n in meta.global_shape)))
        if meta.tied:
            assert not counted, i
        else:
            assert set(counted) == everything and set(counted.values()) == {1}, i
    assert [layout.owned[1] for layout in layouts] == [True, False, False, False]

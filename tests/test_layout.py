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


@pytest.mark.parametrize("dp, ep", [(4, 2), (4, 4), (8, 2), (6, 3)])
@pytest.mark.parametrize("zero", [False, True])
def test_expert_buckets_are_apart_and_each_expert_element_is_held_once_per_expert_data_group(dp, ep, zero):
    """Experts split over ep (`ParamMeta.split["ep"]`) never share a bucket with dense parameters; a
    dense element is held by every dp rank (ZeRO: by one), an expert element by the dp / ep ranks at
    the same place of every expert group (ZeRO: by one of them), and the write slices (`dp_slice`) of
    those ranks tile each expert bucket."""
    numels, decay = _params(ep + dp)
    expert = [i % 3 == 1 for i in range(len(numels))]
    metas = [
        ParamMeta((ep * n,), decay=d, shape=(n,), split={"ep": 0}) if e else ParamMeta((n,), decay=d)
        for n, d, e in zip(numels, decay, expert)
    ]
    layouts = [
        ParamLayout.build(metas, tp_rank=0, dp=dp, dp_rank=r, zero=zero, bucket_elements=5000, ep=ep) for r in range(dp)
    ]
    first = layouts[0]
    assert first.has_experts
    for b in first.buckets:
        assert {expert[i] for i in b.params} == {b.expert}  # never mixed
    for place in range(ep):  # the expert-data group at this place of the expert groups
        group = [layouts[r] for r in range(dp) if r % ep == place]
        held = [0] * len(numels)
        for layout in group:
            for k in range(len(layout.buckets)):
                for s in layout.segments(k):
                    held[s.param] += s.hi - s.lo
        for i, n in enumerate(numels):
            copies = (1 if zero else dp // ep) if expert[i] else (dp // ep if not zero else None)
            if copies is not None:
                assert held[i] == n * copies, (i, held[i], n, copies)
        for k, b in enumerate(first.buckets):
            if b.expert:
                slices = sorted(lay.dp_slice(k) for lay in group)
                assert slices[0][0] == b.start and slices[-1][1] == b.end
                assert all(x[1] == y[0] for x, y in zip(slices, slices[1:]))
    dense = [0] * len(numels)  # dense elements: over all dp ranks, once each under ZeRO
    for layout in layouts:
        for k, b in enumerate(layout.buckets):
            for s in layout.segments(k):
                dense[s.param] += (s.hi - s.lo) * (not b.expert)
    assert [dense[i] for i in range(len(numels)) if not expert[i]] == [
        n * (1 if zero else dp) for n, e in zip(numels, expert) if not e
    ]

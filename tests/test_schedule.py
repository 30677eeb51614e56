"""Pipeline schedules without tensors: every pass once, no deadlock, FIFO-consistent messages."""

from __future__ import annotations

import pytest

from app.deck import partition_layers
from app.parallel import schedule
from app.parallel.schedule import Action, build_schedule, simulate


def test_layers_are_balanced_by_count_with_extras_first():
    assert partition_layers(8, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert [len(c) for c in partition_layers(10, 4)] == [3, 3, 2, 2]
    assert partition_layers(5, 2, [1, 4]) == [range(0, 1), range(1, 5)]
    with pytest.raises(ValueError):
        partition_layers(5, 2, [2, 2])


GRIDS = [(pp, v) for pp in range(1, 9) for v in range(1, 5) if v == 1 or pp > 1]


@pytest.mark.parametrize("pp, virtual", GRIDS, ids=[f"pp{pp}-v{v}" for pp, v in GRIDS])
def test_every_stage_runs_one_forward_and_one_backward_per_micro_batch_and_chunk_without_deadlock(pp, virtual):
    counts = [pp, 2 * pp, 3 * pp] + ([1, pp + 1] if virtual == 1 else [])
    for micro_batches in counts:
        for stage in range(pp):
            actions = build_schedule(pp, stage, micro_batches, virtual)
            for kind in "FB":
                passes = sorted((a.micro, a.virtual) for a in actions if a.kind == kind)
                assert passes == [(m, v) for m in range(micro_batches) for v in range(virtual)]
        result = simulate(pp, micro_batches, virtual)  # raises on deadlock or mismatched messages
        if virtual == 1:
            assert result["max_in_flight"] <= min(pp, micro_batches)  # 1F1B bounds activation memory


def test_1f1b_warms_up_with_one_forward_fewer_per_later_stage():
    first = build_schedule(4, 0, 8)
    assert [a.kind for a in first[:5]] == ["F", "F", "F", "F", "B"]
    last = build_schedule(4, 3, 8)
    assert [a.kind for a in last[:4]] == ["F", "B", "F", "B"]


def test_the_simulator_catches_a_deadlocking_schedule(monkeypatch):
    def backwards_first_on_the_last_stage(pp, stage, micro_batches, virtual=1):
        actions = build_schedule(pp, stage, micro_batches, virtual)
        if stage == pp - 1:  # wait for a gradient nobody can send yet: B before F is caught first
            actions = [a for a in actions if a.kind == "B"] + [a for a in actions if a.kind == "F"]
        return actions

    monkeypatch.setattr(schedule, "build_schedule", backwards_first_on_the_last_stage)
    with pytest.raises(RuntimeError, match="before its forward"):
        simulate(2, 4)


def test_the_simulator_catches_receives_out_of_send_order(monkeypatch):
    def swapped(pp, stage, micro_batches, virtual=1):
        actions = build_schedule(pp, stage, micro_batches, virtual)
        if stage == 1:  # run micro-batch 1's forward before micro-batch 0's
            i, j = actions.index(Action("F", 0, 0)), actions.index(Action("F", 1, 0))
            actions[i], actions[j] = actions[j], actions[i]
        return actions

    monkeypatch.setattr(schedule, "build_schedule", swapped)
    with pytest.raises(RuntimeError, match="expects"):
        simulate(2, 4)


def test_the_simulator_catches_a_wait_cycle(monkeypatch):
    def cycle(pp, stage, micro_batches, virtual=1):
        # Stage 0 wants micro-batch 0's gradient before sending micro-batch 1; stage 1 wants
        # micro-batch 1's activation before sending that gradient.
        fb = [Action(k, m, 0) for m in range(micro_batches) for k in "FB"]
        ff_bb = [Action("F", m, 0) for m in range(micro_batches)] + [Action("B", m, 0) for m in range(micro_batches)]
        return fb if stage == 0 else ff_bb

    monkeypatch.setattr(schedule, "build_schedule", cycle)
    with pytest.raises(RuntimeError, match="deadlock"):
        simulate(2, 4)


def test_interleaving_needs_micro_batches_divisible_by_pp():
    with pytest.raises(ValueError, match="divisible by pp"):
        build_schedule(4, 0, 6, 2)

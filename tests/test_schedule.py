"""Pipeline schedules without tensors: every pass once, no deadlock, FIFO-consistent messages;
which receipt proves which send delivered. Under MPI (2 ranks): the executor frees its sends at
those receipts and posts its receives inside the watchdog's region."""

from __future__ import annotations

import weakref
from contextlib import contextmanager

import pytest
import torch

from app.deck import partition_layers
from app.parallel import schedule
from app.parallel.schedule import Action, build_schedule, held_sends, messages, send_proofs, simulate
from app.runtime.watchdog import NullWatchdog
from conftest import grid_trainer, settle


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


def _sends(actions: list[Action], stage: int, pp: int, virtual: int) -> list:
    return [send for a in actions if (send := messages(a, stage, pp, virtual)[1]) is not None]


def _positions(schedules: list, pp: int, virtual: int) -> tuple[dict, dict]:
    """(where each message is received, where it is sent): (stage, index in its list) by message."""
    received, sent = {}, {}
    for stage, actions in enumerate(schedules):
        for i, action in enumerate(actions):
            recv, send = messages(action, stage, pp, virtual)
            received[recv], sent[send] = (stage, i), (stage, i)
    return received, sent


@pytest.mark.parametrize("pp, virtual", [g for g in GRIDS if g[0] > 1], ids=[f"pp{p}-v{v}" for p, v in GRIDS if p > 1])
def test_each_proof_is_a_message_the_peer_sends_after_receiving_the_send_it_proves(pp, virtual):
    """Found in review: every send's buffer lived to the end of the step (~2 x micro-batches x
    virtual messages per stage, 54-107 GB more than planned on gpt_1t). A send may go once a
    message proves it delivered: the peer sent that message after the action that received it,
    and this stage receives it after sending. Then a stage holds a bound independent of the
    micro-batch count (about the forwards in flight), and only the last few wait for the end."""
    for micro_batches in [pp, 2 * pp, 4 * pp, 8 * pp] + ([1, pp + 1, 3 * pp + 1] if virtual == 1 else []):
        schedules = [build_schedule(pp, s, micro_batches, virtual) for s in range(pp)]

        received_at, sent_at = _positions(schedules, pp, virtual)
        for stage in range(pp):
            proofs = send_proofs(schedules, stage, pp, virtual)
            proven = [s for sent in proofs.values() for s in sent]
            mine = _sends(schedules[stage], stage, pp, virtual)
            assert len(proven) == len(set(proven)) and set(proven) <= set(mine)
            for answer, sent in proofs.items():
                peer = answer.route(pp)[0]
                assert answer.route(pp)[1] == stage
                for s in sent:
                    assert s.route(pp)[1] == peer
                    assert received_at[s] <= sent_at[answer]  # the peer sent it back after receiving s
                    assert sent_at[s] < received_at[answer]  # and this stage receives it after sending s
            bound = pp * (virtual + 1)
            assert len(mine) - len(proven) <= bound, (stage, micro_batches)  # waited at the end of the step
            assert held_sends(schedules, stage, pp, virtual) <= bound
        if micro_batches == 8 * pp:  # no growth with the micro-batch count
            half = [build_schedule(pp, s, 4 * pp, virtual) for s in range(pp)]
            assert [held_sends(schedules, s, pp, virtual) for s in range(pp)] == [
                held_sends(half, s, pp, virtual) for s in range(pp)
            ]


def test_in_1f1b_a_gradient_proves_its_activation_delivered():
    schedules = [build_schedule(2, s, 4) for s in range(2)]
    proofs = send_proofs(schedules, 0, 2)
    assert proofs[schedule.Message("B", 1, 1)] == (schedule.Message("F", 1, 0),)
    assert held_sends(schedules, 0, 2) == 1 and held_sends(schedules, 1, 2) == 1


# ---- the executor under MPI: 2 ranks, pp = 2 ------------------------------------------------

PIPE = (
    "model.vocab_size=64", "model.seq_len=16", "model.layers=4", "model.hidden=32", "model.heads=2",
    "train.global_batch=16", "train.micro_batch=1", "run.timers=false",
)  # fmt: skip


def _pipeline_trainer(runtime, grids, run_dir, virtual: int):
    """A pp = 2 trainer on the last two ranks (16 micro-batches of one sample), None on the others;
    its run.dir a test's own (the default, runs/gpt_tiny in the repository, may be another's)."""
    grid = grids.grid(1, 2, 1)
    if not grids.trains(2):
        grids.stand_by(grid, virtual)
        return None
    return grid_trainer(grids, 1, 2, 1, (*PIPE, f"parallel.virtual_stages={virtual}", f"run.dir={run_dir}"))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("virtual", [1, 2])
def test_the_pipeline_holds_a_bounded_number_of_sends_not_every_message_of_the_step(
    runtime, grids, monkeypatch, shared_tmp, virtual
):
    """Every send's buffer (a weak reference to the tensor handed to isend) is counted at each
    pass: at most `schedule.held_sends` (1 with 1F1B, 3 interleaved, of 16 and 48 messages) while
    training, at most pp while evaluating. Before, all of them lived to the end of the step."""
    from app.parallel import pipeline as pipeline_module

    trainer = _pipeline_trainer(runtime, grids, shared_tmp, virtual)
    problems = []
    if trainer is not None:
        pipe, model = trainer.pipeline, trainer.model
        buffers: list[weakref.ref] = []
        most = {"run": 0, "evaluate": 0}
        phase = ["run"]
        isend = pipeline_module.dist.isend

        def counting_isend(tensor, *args, **kwargs):
            buffers.append(weakref.ref(tensor))
            return isend(tensor, *args, **kwargs)

        def count() -> None:
            most[phase[0]] = max(most[phase[0]], sum(ref() is not None for ref in buffers))

        forward_chunk, finish_backward = model.forward_chunk, model.finish_backward

        def counted_forward(*args, **kwargs):
            count()
            return forward_chunk(*args, **kwargs)

        def counted_backward(*args, **kwargs):
            count()
            return finish_backward(*args, **kwargs)

        monkeypatch.setattr(pipeline_module.dist, "isend", counting_isend)
        monkeypatch.setattr(model, "forward_chunk", counted_forward)
        monkeypatch.setattr(model, "finish_backward", counted_backward)
        loss = trainer.step()[0]
        n = trainer.deck.num_micro_batches
        schedules = [build_schedule(2, s, n, virtual) for s in range(2)]
        bound = held_sends(schedules, pipe.stage, 2, virtual)
        sent = len(_sends(schedules[pipe.stage], pipe.stage, 2, virtual))
        if not most["run"] <= bound < sent // 4:
            problems.append(f"stage {pipe.stage} held {most['run']} of its {sent} sends (bound {bound})")
        phase[0] = "evaluate"
        generator = torch.Generator().manual_seed(5)
        micro = [(torch.randint(0, 64, (1, 16), generator=generator),) * 2 for _ in range(n)]
        model.eval()
        pipe.evaluate(model, micro)
        model.train()
        if most["evaluate"] > 2:
            problems.append(f"stage {pipe.stage} held {most['evaluate']} sends evaluating {n} micro-batches")
        if pipe.last and not torch.isfinite(loss):
            problems.append(f"loss {loss}")
    settle(runtime.comm)
    problems = sum(runtime.comm.allgather(problems), [])
    assert not problems, "\n".join(problems)


class RecordingWatchdog(NullWatchdog):
    """Records, at each irecv, the innermost watched call and the micro-batch it would be named with."""

    def __init__(self) -> None:
        self.open: list[tuple[str, str | None]] = []
        self.micro: int | None = None
        self.seen: list[tuple[str | None, str | None, int | None]] = []

    def at(self, step: int | None = None, micro: int | None = None) -> None:
        self.micro = micro if micro is not None else self.micro

    @contextmanager
    def blocking(self, op: str, axis: str | None = None):
        self.open.append((op, axis))
        try:
            yield
        finally:
            self.open.pop()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("prefetch", [True, False])
def test_a_receive_is_posted_inside_the_watchdogs_region_named_with_its_own_micro_batch(
    runtime, grids, monkeypatch, shared_tmp, prefetch
):
    """Found in review: irecv was posted outside any watched call (on NCCL the first p2p call
    between two ranks blocks creating their communicator: a hang there had no watchdog line), and
    a peer lost while posting was named "on axis world during a collective" with the previous
    action's micro-batch (the prefetched receive is posted before the action says where it is)."""
    from app.parallel import pipeline as pipeline_module

    trainer = _pipeline_trainer(runtime, grids, shared_tmp, 1)
    problems = []
    if trainer is not None:
        pipe = trainer.pipeline
        pipe.prefetch = prefetch
        dog = RecordingWatchdog()
        monkeypatch.setattr(trainer.timers, "watchdog", dog)
        irecv = pipeline_module.dist.irecv

        def recording_irecv(*args, **kwargs):
            top = dog.open[-1] if dog.open else (None, None)
            dog.seen.append((*top, dog.micro))
            return irecv(*args, **kwargs)

        monkeypatch.setattr(pipeline_module.dist, "irecv", recording_irecv)
        trainer.step()
        peer = 1 - pipe.stage
        n = trainer.deck.num_micro_batches
        want = [
            (f"irecv from stage {peer}", "pp", a.micro)
            for a in build_schedule(2, pipe.stage, n)
            if messages(a, pipe.stage, 2, 1)[0] is not None
        ]
        if dog.seen != want:
            problems.append(f"stage {pipe.stage}: irecvs posted in {dog.seen}, not {want}")
    settle(runtime.comm)
    problems = sum(runtime.comm.allgather(problems), [])
    assert not problems, "\n".join(problems)

"""A checkpoint written on one grid loads on any other and training continues as if
uninterrupted. Run under `mpirun -n 8`.

All 8 ranks train tp2 x pp2 x dp2 (sequence parallel, ZeRO-1, tied embeddings split
between the first and last stage) for SAVE_AT steps and write one checkpoint. Each case
then splits the 8 ranks into sub-communicators of the case's grid size; the last of them
loads it (every rank reads the hyperslabs of its new shards, optimizer moments included)
and trains to STEPS, the others stand by; world rank 0 trains the same deck straight
through on one rank as the reference. The continued losses and the final parameter shards
must match the reference's.

Tolerance (fp32): as in tests/test_parallel_equivalence.py — the grids differ from the
1-rank run only in summation order (~1e-7 relative per operation); there the worst
measured errors over 5 steps were 1.2e-7 relative on the loss and 4.7e-6 absolute on a
parameter, and we allow 1e-5 and 2e-5. A wrong slab (a shard read from the wrong offset,
a moment of another parameter, a missing ZeRO shard) moves the loss at the 1e-3 level
and parameters by ~lr = 3e-3 within a step.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from app.checkpoint.io import load
from app.train import Trainer
from conftest import grid_trainer, reference_run, settle, shard_errors, train_steps

STEPS, SAVE_AT = 5, 2
LOSS_RTOL, PARAM_ATOL = 1e-5, 2e-5
TINY = (
    "model.vocab_size=64", "model.seq_len=16", "model.layers=4", "model.hidden=32", "model.heads=4",
    f"train.steps={STEPS}", "train.global_batch=16", "train.micro_batch=2", "optim.lr=3.0e-3",
    "optim.warmup_steps=2", "data.noise=0.1", "run.log_every=100", "parallel.dp_bucket_mb=0.02",
    "run.resume=none", "checkpoint.at_exit=false",
)  # fmt: skip
# Written with collective MPI-IO, read with the default (independent).
SAVED_GRID = (2, 2, 2, ("parallel.sequence_parallel=true", "optim.zero=1", "checkpoint.io=collective"))
# (tp, pp, dp, extra): one rank; dp 4 with ZeRO-1; tp 4 with SP; pp 4; interleaved stages; ZeRO-1
# off; ZeRO-3 (each rank loads only its shard of the parameters) with the optimizer offloaded to
# host memory and to a file (fp32: the offloaded masters are set from the loaded parameters).
LOADS = [
    (1, 1, 1, ()),
    (1, 1, 4, ("optim.zero=1",)),
    (4, 1, 1, ("parallel.sequence_parallel=true",)),
    (1, 4, 1, ()),
    (1, 2, 2, ("parallel.virtual_stages=2",)),
    (2, 2, 2, ("optim.zero=0",)),
    (2, 1, 4, ("optim.zero=3", "optim.offload=host")),
    (1, 1, 2, ("optim.zero=3", "optim.offload=nvme", "optim.offload_buffer_mb=0.05")),
]


def _trainer(grids, tp: int, pp: int, dp: int, extra: tuple[str, ...], run_dir: str) -> Trainer:
    return grid_trainer(grids, tp, pp, dp, (*TINY, *extra, f"run.dir={run_dir}"))


_train = train_steps


_CACHE: dict = {}


def _reference(grids, run_dir: Path) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The 1-rank run straight through (every rank computes it once)."""
    return reference_run(grids, (*TINY, f"run.dir={run_dir}"), STEPS, _CACHE)


def _checkpoint(grids, run_dir: str) -> Path:
    """The tp2 x pp2 x dp2 checkpoint at step SAVE_AT (written once, by all 8 ranks)."""
    if "checkpoint" not in _CACHE:
        tp, pp, dp, extra = SAVED_GRID
        trainer = _trainer(grids, tp, pp, dp, extra, run_dir)
        _CACHE["losses"] = _train(trainer, SAVE_AT)
        _CACHE["checkpoint"] = trainer.save("test").path
    return _CACHE["checkpoint"]  # type: ignore[return-value]


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("load_grid", LOADS, ids=[f"tp{t}-pp{p}-dp{d}" + "".join(
    "-" + e.split(".")[-1].replace("=", "") for e in x) for t, p, d, x in LOADS])  # fmt: skip
def test_a_checkpoint_reshards_to_another_grid_and_training_continues(runtime, grids, tmp_path, load_grid):
    ref_losses, ref_params = _reference(grids, tmp_path / "solo")
    path = _checkpoint(grids, runtime.comm.bcast(str(tmp_path / "saved"), root=0))
    assert _CACHE["losses"] == pytest.approx(ref_losses[:SAVE_AT], rel=LOSS_RTOL)
    tp, pp, dp, extra = load_grid
    sub = grids.runtime(tp * pp * dp)
    run_dir = sub.comm.bcast(str(tmp_path / "loaded"), root=0)
    info, losses, problems = None, None, []
    if grids.trains(tp * pp * dp):
        trainer = _trainer(grids, tp, pp, dp, extra, run_dir)
        info = load(trainer, path)
        losses = _train(trainer, STEPS - SAVE_AT)
        with trainer.dp.gathered():
            problems, _ = shard_errors(trainer.model, ref_params, PARAM_ATOL, runtime.rank)
    else:
        grids.stand_by(grids.grid(tp, pp, dp), 2 if "parallel.virtual_stages=2" in extra else 1)
    settle(runtime.comm)  # the copies that stood by wait for the one that trains
    problems = sum(runtime.comm.allgather(problems), [])
    info, losses = next(x for x in runtime.comm.allgather((info, losses)) if x[0] is not None)  # the loading copy's
    assert info["resharded"] and info["step"] == SAVE_AT
    assert losses == pytest.approx(ref_losses[SAVE_AT:], rel=LOSS_RTOL), f"{losses} vs {ref_losses[SAVE_AT:]}"
    assert not problems, "\n".join(problems)


@pytest.mark.mpi(min_size=8)
def test_a_zero3_offloaded_checkpoint_loads_on_one_rank(runtime, grids, tmp_path):
    """Written by tp2 x pp2 x dp2 under ZeRO-3 with the optimizer offloaded to NVMe files (each
    rank writes its parameter shard; bf16, so the fp32 masters, read from the files, are their
    own datasets), loaded on one rank: training continues as the 1-rank run of the same
    precision does (tolerances of the bf16 cases in test_parallel_equivalence: loss 5e-4
    relative, an element 2e-2)."""
    bf16 = ("train.precision=bf16",)
    ref_losses, ref_params = reference_run(grids, (*TINY, *bf16, f"run.dir={tmp_path / 'solo'}"), STEPS, _CACHE)
    saved = runtime.comm.bcast(str(tmp_path / "zero3"), root=0)
    offload = ("optim.offload=nvme", "optim.offload_buffer_mb=0.05")  # a few KB: many chunks per step
    trainer = _trainer(grids, 2, 2, 2, (*bf16, "optim.zero=3", *offload, "parallel.sequence_parallel=true"), saved)
    first = _train(trainer, SAVE_AT)
    path = trainer.save("test").path
    assert trainer.dp.shard_params and first == pytest.approx(ref_losses[:SAVE_AT], rel=5e-4)
    sub = grids.runtime(1)
    run_dir = sub.comm.bcast(str(tmp_path / "one"), root=0)
    losses, problems = None, []
    if grids.trains(1):
        solo = _trainer(grids, 1, 1, 1, bf16, run_dir)
        info = load(solo, path)
        assert info["resharded"] and info["step"] == SAVE_AT
        losses = _train(solo, STEPS - SAVE_AT)
        problems, _ = shard_errors(solo.model, ref_params, 2e-2, runtime.rank)
    else:
        grids.stand_by(grids.grid(1, 1, 1), 1)
    settle(runtime.comm)
    problems = sum(runtime.comm.allgather(problems), [])
    losses = next(x for x in runtime.comm.allgather(losses) if x is not None)
    assert losses == pytest.approx(ref_losses[SAVE_AT:], rel=5e-4), f"{losses} vs {ref_losses[SAVE_AT:]}"
    assert not problems, "\n".join(problems)


# 3D tensor parallelism <-> 1D: the (2, 2, 2) tensor grid (each weight's (Y, X) block Z-sharded along
# its rows, `layout.box3d`) and tp4 x pp2 with sequence parallelism (8 ranks each) write and read the
# same global tensors; each direction continues the uninterrupted 1-rank losses. So does the same
# split with its sub-axes in another order (parallel.tensor_order zyx: other blocks on each rank).
GRIDS_3D_1D = {
    "3d": (8, 1, 1, ("parallel.tensor=[2, 2, 2]",)),
    "1d": (4, 2, 1, ("parallel.sequence_parallel=true",)),
    "3d-zyx": (8, 1, 1, ("parallel.tensor=[2, 2, 2]", "parallel.tensor_order=zyx")),
}


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize(
    "saved, loaded",
    # The sub-axes in another order in the full tier (the quick one trains zyx in the any-grid matrix).
    [("3d", "1d"), ("1d", "3d"), pytest.param("3d", "3d-zyx", marks=pytest.mark.full)],
    ids=["tp2x2x2-to-tp4-pp2", "tp4-pp2-to-tp2x2x2", "tp2x2x2-to-zyx"],
)
def test_a_3d_tensor_checkpoint_loads_on_a_1d_grid_and_back(runtime, grids, tmp_path, saved, loaded):
    ref_losses, ref_params = _reference(grids, tmp_path / "solo")
    grids.runtime(8)
    run_dir = runtime.comm.bcast(str(tmp_path / saved), root=0)
    tp, pp, dp, extra = GRIDS_3D_1D[saved]
    writer = _trainer(grids, tp, pp, dp, extra, run_dir)
    first = _train(writer, SAVE_AT)
    path = writer.save("test").path
    tp, pp, dp, extra = GRIDS_3D_1D[loaded]
    trainer = _trainer(grids, tp, pp, dp, extra, runtime.comm.bcast(str(tmp_path / loaded), root=0))
    info = load(trainer, path)
    three_d = loaded.startswith("3d")
    assert (trainer.tp.shape if three_d else trainer.tp.size) == ((2, 2, 2) if three_d else 4)
    assert not three_d or trainer.tp.order == ("zyx" if loaded == "3d-zyx" else "xyz")
    losses = _train(trainer, STEPS - SAVE_AT)
    with trainer.dp.gathered():
        problems, _ = shard_errors(trainer.model, ref_params, PARAM_ATOL, runtime.rank)
    problems = sum(runtime.comm.allgather(problems), [])
    assert info["resharded"] and info["step"] == SAVE_AT and not info["rng_restored"]
    assert first == pytest.approx(ref_losses[:SAVE_AT], rel=LOSS_RTOL), f"{first} vs {ref_losses[:SAVE_AT]}"
    assert losses == pytest.approx(ref_losses[SAVE_AT:], rel=LOSS_RTOL), f"{losses} vs {ref_losses[SAVE_AT:]}"
    assert not problems, "\n".join(problems)


# Context parallelism: a checkpoint of cp 4 x dp 2 (ZeRO-1 sharded over the 8 dp x cp ranks) loads on
# one rank and on cp 2 x dp 2 (ZeRO-1 over 4), and training continues as the 1-rank run does.
CP_SAVED = ("parallel.cp=4", "optim.zero=1")
CP_LOADS = [(1, ()), (2, ("parallel.cp=2", "optim.zero=1"))]


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("load_grid", CP_LOADS, ids=["cp1", "cp2-dp2-zero1"])
def test_a_context_parallel_checkpoint_resumes_on_another_cp(runtime, grids, tmp_path, load_grid):
    ref_losses, ref_params = _reference(grids, tmp_path / "solo")
    if "cp_checkpoint" not in _CACHE:
        trainer = _trainer(grids, 1, 1, 2, CP_SAVED, runtime.comm.bcast(str(tmp_path / "cp4"), root=0))
        _CACHE["cp_losses"] = _train(trainer, SAVE_AT)
        _CACHE["cp_checkpoint"] = trainer.save("test").path
    assert _CACHE["cp_losses"] == pytest.approx(ref_losses[:SAVE_AT], rel=LOSS_RTOL)
    dp, extra = load_grid
    cp = 2 if extra else 1
    sub = grids.runtime(cp * dp)
    run_dir = sub.comm.bcast(str(tmp_path / "loaded"), root=0)
    info, losses, problems = None, None, []
    if grids.trains(cp * dp):
        trainer = _trainer(grids, 1, 1, dp, extra, run_dir)
        info = load(trainer, _CACHE["cp_checkpoint"])
        losses = _train(trainer, STEPS - SAVE_AT)
        problems, _ = shard_errors(trainer.model, ref_params, PARAM_ATOL, runtime.rank)
    else:
        grids.stand_by(grids.grid(1, 1, dp, "tp-dp-pp", cp), 1)
    settle(runtime.comm)
    problems = sum(runtime.comm.allgather(problems), [])
    info, losses = next(x for x in runtime.comm.allgather((info, losses)) if x[0] is not None)
    assert info["resharded"] and info["step"] == SAVE_AT
    assert losses == pytest.approx(ref_losses[SAVE_AT:], rel=LOSS_RTOL), f"{losses} vs {ref_losses[SAVE_AT:]}"
    assert not problems, "\n".join(problems)

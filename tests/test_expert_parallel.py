"""Expert parallelism (`parallel.ep`, issue 42) end to end: the gradient norm and the checkpoint. Run
under `mpirun -n 8`.

A mixture-of-experts gpt_tiny (4 experts, top-2, a shared expert, a capacity factor of 1 so that
some assignments drop) trains on tp2 x dp4 with ep4 (one expert per rank; ZeRO-1: the dense buckets
sharded over dp, each expert bucket held by one rank) for SAVE_AT steps and writes a checkpoint; it
loads on one rank (ep1) and on pp2 x dp4 with ep2 (no ZeRO: each expert bucket held whole by the 2
ranks of its expert-data group) and training continues. World rank 0 trains the same deck straight
through on one rank.

Checked against that reference: every step's share of assignments dropped, exactly (each source
rank applies the capacity to its own micro-batch, as one rank does); its loss and global gradient
norm (the norm sums the dense parts over tp and pp and the expert parts over ep as well; an expert
counted once per expert-data replica too many or too few moves it by a factor of 2 or more) within
1e-5 relative; and the final parameter shards within 2e-5 absolute: the tolerances of tests/test_parallel_equivalence.py, where
the grids differ from one rank only in summation order (~1e-7 relative per operation). Adam's epsilon
is 1e-6 here, not 1e-8: an element whose gradient is far below epsilon moves by about lr / eps times
its gradient, which would turn a 1e-10 summation difference in a rarely used embedding row into 3e-5.
"""

from __future__ import annotations

import pytest
import torch

from app.checkpoint.io import load
from app.parallel.loss import global_loss
from conftest import grid_trainer, settle, shard_errors

STEPS, SAVE_AT = 5, 2
RTOL, PARAM_ATOL = 1e-5, 2e-5
TINY = (
    "model.vocab_size=64", "model.seq_len=16", "model.layers=4", "model.hidden=32", "model.heads=4",
    "model.moe_experts=4", "model.moe_top_k=2", "model.moe_ffn_hidden=32", "model.moe_shared_experts=1",
    "model.moe_z_loss_coef=0.001", "model.moe_capacity_factor=1.0", f"train.steps={STEPS}", "train.global_batch=16", "train.micro_batch=2",
    "optim.lr=3.0e-3", "optim.warmup_steps=2", "optim.grad_clip=0.5", "optim.eps=1e-6", "data.noise=0.1", "run.log_every=100",
    "parallel.dp_bucket_mb=0.02", "run.resume=none", "checkpoint.at_exit=false",
)  # fmt: skip
SAVED = (2, 1, 4, ("parallel.ep=4", "optim.zero=1"))
LOADS = {"ep1": (1, 1, 1, ()), "pp2-dp4-ep2": (1, 2, 4, ("parallel.ep=2",))}
_CACHE: dict = {}


def _steps(trainer, n: int) -> list[tuple[float, float, float]]:
    """(global-batch loss, global gradient norm, share of the assignments dropped) of `n` steps."""
    trainer.model.train()
    out = []
    for _ in range(n):
        loss, _, norm = trainer.step()
        out.append((global_loss(loss, trainer.grid, trainer.tp), norm, trainer.router_losses()["moe_dropped"]))
    trainer.dp.wait_params()
    return out


def _reference(grids, runtime, tmp_path) -> tuple[list[tuple[float, float, float]], dict[str, torch.Tensor]]:
    """The 1-rank run straight through, on world rank 0, broadcast (every rank makes the 1-rank grid)."""
    if "reference" not in _CACHE:
        grids.grid(1, 1, 1)
        result = None
        if runtime.rank == 0:
            trainer = grid_trainer(grids, 1, 1, 1, (*TINY, f"run.dir={tmp_path / 'solo'}"))
            result = (_steps(trainer, STEPS), {n: p.detach().clone() for n, p in trainer.model.named_parameters()})
        settle(runtime.comm)
        _CACHE["reference"] = runtime.comm.bcast(result, root=0)
    return _CACHE["reference"]


def _close(got: list[tuple[float, float, float]], want: list[tuple[float, float, float]]) -> bool:
    """Losses and norms within RTOL, the dropped shares equal."""
    return len(got) == len(want) and all(
        g[:2] == pytest.approx(w[:2], rel=RTOL) and g[2] == w[2] for g, w in zip(got, want)
    )


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("loaded", list(LOADS))
def test_an_ep4_checkpoint_resumes_on_ep1_and_ep2_with_the_one_rank_losses_and_norms(runtime, grids, tmp_path, loaded):
    ref, ref_params = _reference(grids, runtime, tmp_path)
    assert max(norm for _, norm, _ in ref) > 0.5  # the clip acts: a wrong norm changes the update
    assert all(0 < dropped < 0.5 for *_, dropped in ref)  # the capacity drops some assignments
    if "checkpoint" not in _CACHE:
        tp, pp, dp, extra = SAVED
        grids.runtime(8)
        grid = grids.grid(tp, pp, dp)
        grid.expert_groups(4)
        writer = grid_trainer(grids, tp, pp, dp, (*TINY, *extra, f"run.dir={runtime.comm.bcast(str(tmp_path), 0)}"))
        assert [b.expert for b in writer.dp.buckets].count(True) >= 4 and writer.dp.layout.ep == 4
        _CACHE["written"] = _steps(writer, SAVE_AT)
        _CACHE["checkpoint"] = writer.save("test").path
    assert _close(_CACHE["written"], ref[:SAVE_AT]), f"ep4 wrote {_CACHE['written']} vs {ref[:SAVE_AT]}"
    tp, pp, dp, extra = LOADS[loaded]
    size = tp * pp * dp
    sub = grids.runtime(size)
    grid = grids.grid(tp, pp, dp)
    if "parallel.ep=2" in extra:
        grid.expert_groups(2)
    run_dir = sub.comm.bcast(str(tmp_path / loaded), root=0)
    info, steps, problems = None, None, []
    if grids.trains(size):
        trainer = grid_trainer(grids, tp, pp, dp, (*TINY, *extra, f"run.dir={run_dir}"))
        info = load(trainer, _CACHE["checkpoint"])
        steps = _steps(trainer, STEPS - SAVE_AT)
        problems, _ = shard_errors(trainer.model, ref_params, PARAM_ATOL, runtime.rank)
    else:
        grids.stand_by(grid, 1)
    settle(runtime.comm)
    problems = sum(runtime.comm.allgather(problems), [])
    info, steps = next(x for x in runtime.comm.allgather((info, steps)) if x[0] is not None)
    assert info["resharded"] and info["step"] == SAVE_AT
    assert _close(steps, ref[SAVE_AT:]), f"{loaded}: {steps} vs {ref[SAVE_AT:]}"
    assert not problems, "\n".join(problems)


@pytest.mark.mpi(min_size=4)
def test_a_stage_without_experts_sums_the_norm_like_the_others(runtime, grids, tmp_path):
    """pp2 x dp2 with ep2 and no ZeRO, the experts in layer 0 only (`model.moe_every=4`): stage 1 holds
    no expert bucket, yet every rank must reduce the norm alike (found in review: stage 1 summed its
    dense part over tp and pp only, undivided, and stage 0 over the whole grid divided by dp, so rank 0
    logged 0.713 where one rank has 0.582, and the stages clipped by different coefficients)."""
    sets = (*TINY, "model.moe_every=4", "train.steps=3")
    grids.grid(1, 1, 1)
    ref = None
    if runtime.rank == 0:
        solo = grid_trainer(grids, 1, 1, 1, (*sets, f"run.dir={tmp_path / 'solo'}"))
        ref = _steps(solo, 3)
    settle(runtime.comm)
    ref = runtime.comm.bcast(ref, root=0)
    assert max(norm for _, norm, _ in ref) > 0.5  # the clip acts: a wrong norm changes the update
    sub = grids.runtime(4)
    grid = grids.grid(1, 2, 2)
    grid.expert_groups(2)
    run_dir = sub.comm.bcast(str(tmp_path / "pp2-dp2-ep2"), root=0)
    steps, held = None, None
    if grids.trains(4):
        trainer = grid_trainer(grids, 1, 2, 2, (*sets, "parallel.ep=2", f"run.dir={run_dir}"))
        held = [b.expert for b in trainer.dp.buckets].count(True)
        steps = _steps(trainer, 3)
    else:
        grids.stand_by(grid, 1)
    settle(runtime.comm)
    results = [x for x in runtime.comm.allgather((steps, held, grid.coords["pp"])) if x[0] is not None]
    assert {pp: n > 0 for _, n, pp in results} == {0: True, 1: False}  # the case under test: one dense stage
    for got, _, pp in results:  # every rank's norm, both stages
        assert _close(got, ref), f"stage {pp}: {got} vs {ref}"

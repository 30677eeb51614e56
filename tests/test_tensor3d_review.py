"""Review of 3D tensor parallelism and the 1D layers beside it: faults found, each shown failing first.

Run under mpirun (2 or 4 ranks); each test says what it checks and why its tolerance.
"""

from __future__ import annotations

import pytest

from conftest import grid_trainer, settle

# -- gradient accumulation fusion where saved-tensor hooks unpack the weight (layers.py) -------------
TINY = (
    "model.vocab_size=64", "model.seq_len=16", "model.layers=2", "model.hidden=32", "model.heads=4",
    "train.global_batch=4", "train.micro_batch=2", "run.log_every=100",
)  # fmt: skip


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize(
    "dp, extra", [(1, ()), (1, ("train.recompute=full",)), (2, ("optim.zero=3",))], ids=["plain", "recompute", "zero3"]
)
def test_fused_weight_gradients_reach_the_accumulators_under_recompute_and_zero3(
    grids, tmp_path, monkeypatch, dp, extra
):
    """train.fuse_grad_accumulation: each fusable weight's gradient GEMM goes into its accumulator
    (`DataParallel.wgrad_into`) once per micro-batch, also where autograd hands backward the saved
    weight through saved-tensor hooks, which unpack another tensor than the parameter: a full
    recomputation's (torch.utils.checkpoint) and ZeRO-3's (`DataParallel.saving`). Before the fix
    both lost the fusion without a word (no call: the unpacked tensor has no `wgrad_into`), and on
    GPUs each weight gradient went through a bf16 tensor again.

    The fused step's gradient norm equals the unfused one's: an addmm into the accumulator rounds
    once where mm-then-add rounds twice, ~1e-7 relative (fp32): rtol 1e-6, where a lost or doubled
    micro-batch of a weight's gradient moves the norm by percents."""
    from app.parallel.data import DataParallel

    calls: list[int] = []
    original = DataParallel.wgrad_into

    def counted(self, p, grad_t, inputs):
        calls.append(id(p))
        return original(self, p, grad_t, inputs)

    monkeypatch.setattr(DataParallel, "wgrad_into", counted)
    grid = grids.grid(1, 1, dp)
    results = []
    for fuse in ("false", "true"):
        calls.clear()
        if grids.trains(dp):
            sets = (*TINY, *extra, f"train.fuse_grad_accumulation={fuse}", f"run.dir={tmp_path / fuse}")
            trainer = grid_trainer(grids, 1, 1, dp, sets)
            loss, _, norm = trainer.step()
            trainer.dp.wait_params()
            results.append((float(loss), norm, trainer.dp.fused_wgrads, trainer.sampler.num_micro_batches, len(calls)))
        else:
            grids.stand_by(grid, 1)
        settle(grids.world.comm)
    if results:
        (loss0, norm0, *_), (loss1, norm1, fused, micro, called) = results
        assert fused == 8  # qkv, attn.proj, mlp.fc, mlp.proj of 2 blocks (the tied table is not fusable)
        assert called == fused * micro, f"{called} fused GEMMs, expected {fused} weights x {micro} micro-batches"
        assert loss1 == loss0  # the forward is the same
        assert norm1 == pytest.approx(norm0, rel=1e-6)

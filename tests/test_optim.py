"""The optimizer on flat (sharded) master weights: AdamW equals torch's, LAMB equals a plain
per-tensor LAMB, and an fp16 overflow on one rank skips the step on every rank.

(The sharded updates on tp/pp/dp grids with ZeRO-1 equal the 1-rank ones: see the AdamW
and LAMB cases of tests/test_parallel_equivalence.py.)
"""

from __future__ import annotations

import math

import pytest
import torch

from app.deck import OptimConfig, load_deck, resolve_for_world
from app.model.init import ParamMeta
from app.optim.optimizer import ShardedOptimizer
from app.parallel.data import DataParallel
from app.runtime.grid import ProcessGrid
from app.train import Trainer
from conftest import REPO


def _solo_grid():
    from mpi4py import MPI

    from app.runtime.mpi import bind_device, init_mpi

    solo = init_mpi(MPI.COMM_SELF)
    bind_device(solo, "cpu")
    return ProcessGrid(solo, 1, 1, 1)


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 9), torch.nn.Tanh(), torch.nn.Linear(9, 4))
    for name, p in model.named_parameters():
        p.meta = ParamMeta(tuple(p.shape), decay=name.endswith("weight"))
    return model


def _backward(model: torch.nn.Module, step: int) -> None:
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(100 + step))
    model(x).pow(3).sum().backward()


CFG = OptimConfig(lr=1e-2, weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8)


@pytest.mark.mpi
def test_flat_adamw_is_torch_adamw(runtime):
    """Same arithmetic as torch.optim.AdamW's single-tensor loop: equal to 1 ulp-level
    (1e-7 relative; the flat buffer changes no operation, only where values live)."""
    grid = _solo_grid()
    ours, ref = _model(0), _model(0)
    dp = DataParallel(ours, grid, bucket_mb=0.0001)  # several buckets
    opt = ShardedOptimizer(dp, CFG, grid)
    groups = [
        {"params": [p for p in ref.parameters() if p.meta.decay], "weight_decay": CFG.weight_decay},
        {"params": [p for p in ref.parameters() if not p.meta.decay], "weight_decay": 0.0},
    ]
    torch_opt = torch.optim.AdamW(groups, lr=CFG.lr, betas=(CFG.beta1, CFG.beta2), eps=CFG.eps, foreach=False)
    for step in range(4):
        dp.start_step(1)
        _backward(ours, step)
        dp.finish_grad_reduce()
        opt.step(CFG.lr)
        torch_opt.zero_grad()
        _backward(ref, step)
        torch_opt.step()
    for p, q in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-7, atol=0)


@pytest.mark.mpi
def test_the_update_and_the_norm_reuse_their_scratch_and_the_norm_is_the_float64_sum(runtime, monkeypatch):
    """The scaled gradient, the denominator and the norm's float64 squares live in buffers kept
    from step to step (no fresh temporaries to page-fault in on a CPU): the second step uses the
    same memory as the first. The norm is sqrt of the float64 sum of squares: exactly, in one
    chunk; chunked (NORM_CHUNK = 7 here), to 1e-15 relative (only the grouping of the sum moves)."""
    import app.optim.optimizer as optimizer

    grid = _solo_grid()
    model = _model(1)
    dp = DataParallel(model, grid, bucket_mb=0.0001)  # several buckets
    opt = ShardedOptimizer(dp, CFG, grid)
    pointers = []
    for step in range(2):
        dp.start_step(1)
        _backward(model, step)
        dp.finish_grad_reduce()
        norm = optimizer.grad_norm(dp, grid, opt.scratch)
        local = torch.zeros((), dtype=torch.float64)
        for _, _, g in dp.held_grads():  # the norm as it was written before the scratch buffers
            local += g.double().pow(2).sum()
        expected = float(local.sqrt())
        assert norm == expected
        opt.step(CFG.lr, grad_scale=0.5)
        pointers.append(sorted((k[0], b.data_ptr()) for k, b in opt.scratch._buffers.items()))
    assert [name for name, _ in pointers[0]] == ["denom", "grad", "norm"]
    assert pointers[0] == pointers[1]
    monkeypatch.setattr(optimizer, "NORM_CHUNK", 7)
    chunked = optimizer.grad_norm(dp, grid, opt.scratch)
    assert chunked == pytest.approx(expected, rel=1e-15)


def _lamb_reference(params: list[torch.Tensor], grads: list[torch.Tensor], state: list, step: int, lr: float) -> None:
    """LAMB (You et al. 2020, with Adam bias correction), one tensor at a time."""
    for p, g, s in zip(params, grads, state):
        s["m"].mul_(CFG.beta1).add_(g, alpha=1 - CFG.beta1)
        s["v"].mul_(CFG.beta2).addcmul_(g, g, value=1 - CFG.beta2)
        m_hat, v_hat = s["m"] / (1 - CFG.beta1**step), s["v"] / (1 - CFG.beta2**step)
        update = m_hat / (v_hat.sqrt() + CFG.eps) + (CFG.weight_decay * p if p.meta.decay else 0.0)
        w_norm, u_norm = p.norm().item(), update.norm().item()
        ratio = w_norm / u_norm if w_norm > 0 and u_norm > 0 else 1.0
        p.sub_(lr * ratio * update)


@pytest.mark.mpi
def test_flat_lamb_is_per_tensor_lamb(runtime):
    """Within 1e-6 relative: the reference computes the same formula with differently
    rounded intermediates (m / bc1 vs m_hat, a float64 norm vs a float32 one)."""
    grid = _solo_grid()
    cfg = OptimConfig(name="lamb", lr=1e-2, weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8)
    ours, ref = _model(1), _model(1)
    dp = DataParallel(ours, grid, bucket_mb=0.0001)
    opt = ShardedOptimizer(dp, cfg, grid)
    ref_params = list(ref.parameters())
    state = [{"m": torch.zeros_like(p), "v": torch.zeros_like(p)} for p in ref_params]
    for step in range(1, 5):
        dp.start_step(1)
        _backward(ours, step)
        dp.finish_grad_reduce()
        opt.step(cfg.lr)
        for p in ref_params:
            p.grad = None
        _backward(ref, step)
        with torch.no_grad():
            _lamb_reference(ref_params, [p.grad for p in ref_params], state, step, cfg.lr)
    for p, q in zip(ours.parameters(), ref_params):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-7)


@pytest.mark.mpi(min_size=2)
def test_fp16_overflow_on_one_rank_skips_the_step_on_every_rank(runtime, shared_tmp):
    """An inf in one rank's (ZeRO-1 shard of the) reduced gradient: every rank skips the
    update, keeps its parameters bit for bit, halves the loss scale; the next step trains."""
    tp = 2 if runtime.world_size % 4 == 0 else 1
    deck = resolve_for_world(
        load_deck(
            REPO / "inputs/gpt_tiny.yaml",
            (
                "model.vocab_size=64", "model.seq_len=16", "model.layers=2", "model.hidden=32", "model.heads=4",
                "train.global_batch=8", "train.micro_batch=2", "train.precision=fp16", "optim.zero=1",
                f"parallel.tp={tp}", "train.loss_scale=1024", f"run.dir={shared_tmp}",
            ),
        ),
        runtime.world_size,
    )  # fmt: skip
    grid = ProcessGrid(runtime, tp, 1, runtime.world_size // tp)
    trainer = Trainer(deck, runtime, grid)
    trainer.model.train()
    # ZeRO-1 memory: fp32 moments (2 x 4 bytes) and fp32 master (4 bytes) for 1/dp of the buffer.
    dp = grid.size("dp")
    assert trainer.optimizer.state_bytes() == 12 * trainer.dp.param_buffer.numel() // dp
    assert trainer.dp.param_buffer.dtype == torch.float16
    _, _, norm = trainer.step()
    assert math.isfinite(norm) and trainer.scaler.scale == 1024
    trainer.dp.wait_params()
    before = [p.detach().clone() for p in trainer.model.parameters()]
    master_before = [m.clone() for m in trainer.dp.master]
    trainer.forward_backward()
    if runtime.rank == runtime.world_size - 1:
        trainer.dp.finish_grad_reduce(trainer.sp_group)  # reduce first, then poison this rank's shard
        trainer.dp.grads(0)[0] = float("inf")
        norm = trainer.update(1e-3)
    else:
        norm = trainer.update(1e-3)
    trainer.dp.wait_params()
    assert norm == math.inf
    assert trainer.scaler.scale == 512 and trainer.scaler.skipped == 1
    assert all(torch.equal(p.detach(), q) for p, q in zip(trainer.model.parameters(), before))
    assert all(torch.equal(m, q) for m, q in zip(trainer.dp.master, master_before))
    _, _, norm = trainer.step()
    trainer.dp.wait_params()
    assert math.isfinite(norm) and trainer.scaler.skipped == 1
    assert any(not torch.equal(p.detach(), q) for p, q in zip(trainer.model.parameters(), before))

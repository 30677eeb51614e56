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
from app.optim.optimizer import ShardedOptimizer
from app.parallel.data import DataParallel
from app.sharding.init import ParamMeta
from app.train import Trainer
from conftest import ONE_RANK_GROUP, REPO


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


def _torch_adamw(model: torch.nn.Module, **kind) -> torch.optim.Optimizer:
    groups = [
        {"params": [p for p in model.parameters() if p.meta.decay], "weight_decay": CFG.weight_decay},
        {"params": [p for p in model.parameters() if not p.meta.decay], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=CFG.lr, betas=(CFG.beta1, CFG.beta2), eps=CFG.eps, **kind)


@pytest.mark.mpi
@pytest.mark.parametrize("overlap", [True, False])
def test_each_step_s_first_gradient_is_copied_in_and_a_missing_one_is_zero(grids, overlap):
    """The gradient buffer is not zeroed at start_step: each accumulator's first gradient of a step
    is copied in, later ones added, and what got none is zeroed when its bucket's reduction starts.
    Three Linears and a parameter no micro-batch uses; the middle Linear only in the second of two
    micro-batches. The buffer is filled with NaN before each step (what a zeroing pass would have
    hidden): every accumulator equals the sum of autograd's gradients over the micro-batches, the
    unused one is exactly zero, over two steps (the second starting from the first's sums)."""
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))
    unused = torch.nn.Parameter(torch.ones(3))
    model = torch.nn.Module()
    model.layers, model.unused = layers, unused
    for name, p in model.named_parameters():
        p.meta = ParamMeta(tuple(p.shape), decay=name.endswith("weight"))
    ref = {name: torch.zeros_like(p) for name, p in model.named_parameters()}
    dp = DataParallel(model, grids.grid(1, 1, 1), bucket_mb=0.00005, overlap_grad_reduce=overlap)  # buckets
    assert len(dp.buckets) > 1

    def forward(x: torch.Tensor, micro: int) -> torch.Tensor:
        for i, layer in enumerate(layers):
            if i != 1 or micro == 1:
                x = torch.tanh(layer(x))
        return x.pow(2).sum()

    for step in range(2):
        dp.grad_buffer.fill_(float("nan"))
        dp.start_step(2)
        for name in ref:
            ref[name].zero_()
        for micro in range(2):
            x = torch.randn(5, 4, generator=torch.Generator().manual_seed(10 * step + micro))
            grads = torch.autograd.grad(forward(x, micro), [p for _, p in model.named_parameters()], allow_unused=True)
            for (name, _), g in zip(model.named_parameters(), grads):
                if g is not None:
                    ref[name] += g
            forward(x, micro).backward()
        dp.finish_grad_reduce()
        for name, p in model.named_parameters():
            assert torch.equal(p.main_grad, ref[name]), (step, name)
        assert torch.equal(unused.main_grad, torch.zeros(3))


@pytest.mark.mpi
@pytest.mark.parametrize("fused", [False, True], ids=["cpu-eager", "gpu-fused"])
def test_flat_adamw_is_torch_adamw(runtime, monkeypatch, fused, grids):
    """CPU ranks: torch.optim.AdamW's single-tensor arithmetic on the flat shards, equal to 1
    ulp-level (1e-7 relative over 4 steps: the flat buffer changes no operation). GPU ranks (the
    fused path, forced here on CPU tensors): torch's fused kernel over views of the shards, bit for
    bit torch.optim.AdamW(fused=True) where each weight-decay run is one parameter (as here), and
    within 1e-5 of the single-tensor loop after 20 steps (measured 2.8e-6, near zero)."""
    grid = grids.grid(1, 1, 1)
    ours, ref = _model(0), _model(0)
    dp = DataParallel(ours, grid, bucket_mb=0.0001)  # several buckets
    opt = ShardedOptimizer(dp, CFG, grid)
    monkeypatch.setattr(opt, "fused", lambda: fused)
    refs = [(ref, _torch_adamw(ref, fused=True) if fused else _torch_adamw(ref, foreach=False))]
    if fused:
        single = _model(0)
        refs.append((single, _torch_adamw(single, foreach=False)))
    steps = 20 if fused else 4
    for step in range(steps):
        dp.start_step(1)
        _backward(ours, step)
        dp.finish_grad_reduce()
        opt.step(CFG.lr)
        for model, torch_opt in refs:
            torch_opt.zero_grad()
            _backward(model, step)
            torch_opt.step()
    assert (opt._adamw is not None) == fused
    for p, q in zip(ours.parameters(), refs[0][0].parameters()):
        if fused:
            assert torch.equal(p.detach(), q.detach())
        else:
            torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-7, atol=0)
    if fused:
        for p, r in zip(ours.parameters(), refs[1][0].parameters()):
            torch.testing.assert_close(p.detach(), r.detach(), rtol=1e-5, atol=1e-8)


@pytest.mark.mpi
def test_the_norm_is_within_1e_7_of_the_float64_sum_and_its_views_and_buffers_are_kept(runtime, grids):
    """The gradient norm is one multi-tensor norm over views built once: float32 norms of pieces
    of at most CPU_NORM_PIECE elements, their squares summed in float64, within 1e-7 relative of
    sqrt of the float64 sum of squares (measured 1e-8 on 4M elements). The second step reuses the
    views, the fused kernel's lists and LAMB's scratch (no fresh temporaries to page-fault in)."""
    import app.optim.multi_tensor as multi_tensor
    from app.optim.optimizer import step_verdict

    grid = grids.grid(1, 1, 1)
    for name in ("adamw", "lamb"):
        cfg = OptimConfig(name=name, lr=1e-2, weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8)
        model = _model(1)
        dp = DataParallel(model, grid, bucket_mb=0.0001)  # several buckets
        opt = ShardedOptimizer(dp, cfg, grid)
        kept = []
        for step in range(2):
            dp.start_step(1)
            _backward(model, step)
            dp.finish_grad_reduce()
            norm, loss_bad, norm_bad = step_verdict(opt.grad_squares(), torch.tensor(1.0), dp, grid)
            local = torch.zeros((), dtype=torch.float64)
            for _, _, g in dp.held_grads():
                local += g.double().pow(2).sum()
            assert norm == pytest.approx(float(local.sqrt()), rel=1e-7) and not loss_bad and not norm_bad
            opt.step(cfg.lr, grad_scale=0.5)
            views = opt._norm_views.views + (opt._lamb_views.norms.views if opt._lamb_views else [])
            calls = opt._adamw or []
            kept.append(([v.data_ptr() for v in views], [id(c) for c in calls],
                         sorted((k[0], b.data_ptr()) for k, b in opt.scratch._buffers.items())))  # fmt: skip
        assert kept[0] == kept[1]
    # A long gradient is cut into pieces on a CPU: the sum stays the float64 one.
    x = torch.randn(3 * multi_tensor.CPU_NORM_PIECE + 5, generator=torch.Generator().manual_seed(0))
    views = multi_tensor.NormViews(1, x.device)
    views.add(x, [(0, x.numel())])
    assert len(views.views) == 4
    assert float(views.sum_squares()[0].sqrt()) == pytest.approx(float(x.double().square().sum().sqrt()), rel=1e-7)


@pytest.mark.mpi
def test_an_optimizer_step_dispatches_as_many_operations_for_24_layers_as_for_4(
    runtime, capsys, tmp_path, monkeypatch, grids
):
    """The CPU guard of the GPU kernels: the aten operations one `Trainer.update` dispatches (the
    norm, the grid-wide verdict, clipping, AdamW, publishing) on gpt_tiny at hidden 128 with 4 and with
    24 layers (0.86M and 4.8M elements; at hidden 256 the same counts and three times the CPU), in one
    bucket and in buckets of 1 MB (4 and 19). GPU ranks' fused path
    (forced here on the CPU): the same few dozen for all four. CPU ranks' eager path: the same for
    both sizes in one bucket, and 14 more per bucket: never a count that grows with the
    elements or the parameters. Printed (pytest -s). Counted in the one-rank group only: a bigger
    group would count the same operations on one of its ranks while the others wait."""
    import sys

    if runtime.world_size > 1:
        pytest.skip(ONE_RANK_GROUP)
    sys.path.insert(0, str(REPO / "benchmarks"))
    from optimizer_bench import count_ops

    counts: dict[tuple[bool, int, int], int] = {}
    for fused in (True, False):
        for layers in (4, 24):
            for bucket_mb in (1000, 1):
                deck = resolve_for_world(load_deck(REPO / "inputs/gpt_tiny.yaml", (
                    f"model.layers={layers}", "model.hidden=128", "model.seq_len=16", "train.global_batch=2", "train.micro_batch=2",
                    f"parallel.dp_bucket_mb={bucket_mb}", "optim.grad_clip=1e-6", "run.resume=none",
                    "checkpoint.at_exit=false", f"run.dir={tmp_path / str(layers)}")), 1)  # fmt: skip
                trainer = Trainer(deck, grids.runtime(1), grids.grid(1, 1, 1))
                monkeypatch.setattr(trainer.optimizer, "fused", lambda f=fused: f)
                trainer.forward_backward()
                trainer.update(deck.optim.lr)  # the first step builds the views
                trainer.forward_backward()  # fresh gradients: the update unscaled the last ones in place
                ops = count_ops(lambda t=trainer, lr=deck.optim.lr: t.update(lr))  # clipped: the unscaling too
                buckets = len(trainer.dp.buckets)
                counts[fused, layers, buckets] = sum(ops.values())
                with capsys.disabled():
                    print(f"\n{'fused' if fused else 'eager'}: {layers} layers, "
                          f"{trainer.dp.layout.shard_elements():,} elements, {buckets} buckets: "
                          f"{sum(ops.values())} operations {dict(ops)}")  # fmt: skip
    assert sorted(b for f, _, b in counts if f) == [1, 1, 4, 19]
    fused_counts = {n for (f, _, _), n in counts.items() if f}
    assert len(fused_counts) == 1 and next(iter(fused_counts)) < 40, counts
    one = counts[False, 4, 1]
    assert counts[False, 24, 1] == one, counts
    for (fused, _, buckets), n in counts.items():
        assert fused or n <= one + 16 * (buckets - 1), counts


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
def test_flat_lamb_is_per_tensor_lamb(runtime, grids):
    """Within 1e-6 relative: the reference computes the same formula with differently
    rounded intermediates (m / bc1 vs m_hat, a float64 norm vs a float32 one)."""
    grid = grids.grid(1, 1, 1)
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
def test_fp16_overflow_on_one_rank_skips_the_step_on_every_rank(runtime, shared_tmp, grids):
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
    grid = grids.grid(tp, 1, runtime.world_size // tp)
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

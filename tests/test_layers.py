"""Tensor-parallel collectives and layers over a tp group of all the job's ranks.

Each mapping's forward and backward is checked against what it must compute; the
vocab-parallel cross-entropy and the parallel linears against their 1-rank forms.
Tolerance: fp32 sums in a different order, ~1e-6 on values of order 1.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from app.deck import ModelConfig
from app.model.gpt import GPT
from app.runtime.timers import StepTimers
from app.sharding.init import ParamMeta, counter_normal
from app.tensor_parallel import mappings as c
from app.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)
from conftest import assert_recompute_is_bitwise

ATOL = 1e-5


@pytest.fixture
def tp(grids):
    grid = grids.grid(grids.world.world_size, 1, 1)  # made once per session (conftest.GridPool)
    yield c.TensorParallel.from_grid(grid)


def _same_on_every_rank(shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _rank_tensor(shape, rank):
    return torch.randn(shape, generator=torch.Generator().manual_seed(100 + rank))


@pytest.mark.mpi
def test_copy_and_reduce_are_each_others_transpose(runtime, tp):
    x = _rank_tensor((2, 4, 3), runtime.rank).requires_grad_()
    total = sum(_rank_tensor((2, 4, 3), r) for r in range(tp.size))
    y = c.reduce_from_tp(x, tp)
    torch.testing.assert_close(y, total, atol=ATOL, rtol=0)
    y.backward(torch.ones_like(y))
    torch.testing.assert_close(x.grad, torch.ones_like(x))  # backward of an all-reduce: identity
    x.grad = None
    z = c.copy_to_tp(x, tp)
    assert torch.equal(z, x)
    z.backward(torch.full_like(z, float(runtime.rank)))
    torch.testing.assert_close(x.grad, torch.full_like(x, float(sum(range(tp.size)))))


@pytest.mark.mpi
def test_sequence_mappings_gather_scatter_and_reduce_scatter_along_the_sequence(runtime, tp):
    seq = 2 * tp.size
    full = _same_on_every_rank((3, seq, 5)).requires_grad_()
    mine = c.scatter_to_sequence(full, tp)
    assert torch.equal(mine, full[:, 2 * tp.rank : 2 * tp.rank + 2])
    gathered = c.gather_from_sequence(mine, tp)
    torch.testing.assert_close(gathered, full)
    # gather's backward reduce-scatters (the consumers are tp-parallel), scatter's all-gathers.
    gathered.backward(torch.ones_like(gathered))
    torch.testing.assert_close(full.grad, torch.full_like(full, float(tp.size)))

    partial = _rank_tensor((3, seq, 5), runtime.rank).requires_grad_()
    total = sum(_rank_tensor((3, seq, 5), r) for r in range(tp.size))
    shard = c.reduce_scatter_to_sequence(partial, tp)
    torch.testing.assert_close(shard, total[:, 2 * tp.rank : 2 * tp.rank + 2], atol=ATOL, rtol=0)
    shard.backward(torch.ones_like(shard))
    torch.testing.assert_close(partial.grad, torch.ones_like(partial))


@pytest.mark.mpi
def test_vocab_parallel_cross_entropy_equals_the_full_one(runtime, tp):
    vocab = 6 * tp.size
    logits = _same_on_every_rank((2, 5, vocab)) * 3
    targets = torch.randint(0, vocab, (2, 5), generator=torch.Generator().manual_seed(1))
    full = logits.clone().requires_grad_()
    want = F.cross_entropy(full.reshape(-1, vocab), targets.reshape(-1))
    want.backward()
    local = logits[..., 6 * tp.rank : 6 * (tp.rank + 1)].clone().requires_grad_()
    got = vocab_parallel_cross_entropy(local, targets, tp)
    got.backward()
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    torch.testing.assert_close(local.grad, full.grad[..., 6 * tp.rank : 6 * (tp.rank + 1)], atol=ATOL, rtol=0)


@pytest.mark.mpi
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_column_then_row_parallel_linear_equals_the_dense_mlp(runtime, tp, sequence_parallel):
    import dataclasses

    tp = dataclasses.replace(tp, sequence_parallel=sequence_parallel)
    n, hidden, seq = 4 * tp.size, 6, 2 * tp.size
    cpu = torch.device("cpu")
    fc, proj = ColumnParallelLinear(hidden, n, 0.5, tp, cpu), RowParallelLinear(n, hidden, 0.5, tp, cpu)
    for name, p in (("fc.weight", fc.weight), ("proj.weight", proj.weight)):
        p.data = counter_normal(7, name, p.meta, tuple(p.shape), cpu)
    w1 = counter_normal(7, "fc.weight", ParamMeta((n, hidden), std=0.5), (n, hidden), cpu)
    w2 = counter_normal(7, "proj.weight", ParamMeta((hidden, n), std=0.5), (hidden, n), cpu)
    for p in (fc.bias, proj.bias):
        p.data.zero_()
    x = _same_on_every_rank((2, seq, hidden))
    want = F.linear(torch.tanh(F.linear(x, w1)), w2)
    inp = c.scatter_to_sequence(x, tp) if sequence_parallel else x
    got = proj(torch.tanh(fc(inp)))
    expected = want[:, 2 * tp.rank : 2 * tp.rank + 2] if sequence_parallel else want
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def _accumulated(tp, grid, fuse: bool, dtype: torch.dtype = torch.float32, mixed: bool = False) -> list[dict]:
    """A column- and a row-parallel Linear (bias on; tp = the group's size, the `_Linear` path at
    tp 1) under DataParallel in `dtype` (fp32 accumulators), 2 steps of 2 micro-batches, the gradient
    buffer filled with NaN before each step: each step's accumulators. `mixed`: what the probe
    (`mixed_gemm_works`) must find, a bf16 GEMM into fp32 (the caller stands one in on this CPU)."""
    from app.parallel.data import DataParallel

    cpu = torch.device("cpu")
    model = torch.nn.Module()
    model.fc, model.proj = (
        ColumnParallelLinear(6, 4 * tp.size, 0.5, tp, cpu),
        RowParallelLinear(4 * tp.size, 6, 0.5, tp, cpu),
    )
    for name, p in model.named_parameters():
        p.data = counter_normal(7, name, dataclasses.replace(p.meta, std=0.5), tuple(p.shape), cpu)
    dp = DataParallel(model, grid, compute_dtype=dtype, bucket_mb=0.00005, fuse_wgrad=fuse)
    assert dp.fused_wgrads == (2 if fuse else 0) and dp.mixed_gemm == mixed  # the probe's verdict
    out = []
    for step in range(2):
        dp.grad_buffer.fill_(float("nan"))
        dp.start_step(2)
        for micro in range(2):
            x = _same_on_every_rank((2, 3, 6), seed=20 + 2 * step + micro).to(dtype)
            model.proj(torch.tanh(model.fc(x))).float().pow(2).sum().backward()
            assert all(p.grad is None for p in model.parameters())  # the hooks took every gradient
        dp.finish_grad_reduce()
        out.append({name: p.main_grad.clone() for name, p in model.named_parameters()})
    return out


@pytest.mark.mpi
def test_fused_weight_gradients_go_into_the_accumulators_and_equal_autograd_s(runtime, tp, grids, monkeypatch):
    """Gradient accumulation fusion (train.fuse_grad_accumulation), fp32 (`_accumulated`): with fusion
    each weight's gradient GEMM writes (first micro-batch) or adds (second) into its accumulator — 2
    weights x 2 micro-batches x 2 steps calls, autograd's placeholder never reaching the buffer — and
    every accumulator equals the unfused run's (autograd's gradient, then the hook's copy and add). An
    addmm into the accumulator rounds once where mm-then-add rounds twice, ~1e-7 relative on values of
    order 1-10: rtol 1e-6 (a lost or doubled micro-batch is off by 50-100%)."""
    from app.parallel.data import DataParallel, mixed_gemm_works

    grid = grids.grid(tp.size, 1, 1)
    calls = []
    wgrad_into = DataParallel.wgrad_into

    def counted(self, p, grad_t, inputs):
        calls.append(id(p))
        return wgrad_into(self, p, grad_t, inputs)

    monkeypatch.setattr(DataParallel, "wgrad_into", counted)
    unfused = _accumulated(tp, grid, False)
    assert calls == []
    # The probe for a GPU's bf16 GEMM into an fp32 accumulator: no such kernel on this CPU (its
    # error caught), nothing to probe between equal dtypes.
    cpu = torch.device("cpu")
    assert not mixed_gemm_works(cpu, torch.bfloat16, torch.float32) and not mixed_gemm_works(cpu, *[torch.float32] * 2)
    fused = _accumulated(tp, grid, True)
    assert len(calls) == 8
    for step, (want, got) in enumerate(zip(unfused, fused)):
        for name in want:
            assert torch.isfinite(got[name]).all(), (step, name)
            torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=1e-6, msg=f"step {step} {name}")


@pytest.mark.mpi
def test_the_gpu_s_bf16_gemms_into_fp32_accumulators_write_then_add(runtime, tp, grids, monkeypatch):
    """The CUDA branch of `wgrad_into` (bf16 weights, fp32 accumulators, `torch.mm`/`addmm` with
    out_dtype), run on this CPU with those two calls stood in for by fp32 GEMMs of the bf16 inputs:
    the probe finds them, the step's first micro-batch is an mm into the accumulator, the second an
    addmm onto it (2 weights x 2 steps each), and the accumulators equal the unfused bf16 run's within
    the unfused run's rounding of each micro-batch's weight gradient to bf16: 8 significant bits, up
    to 2^-9 of the largest gradient, twice, doubled for margin: 2^-7 of the tensor's largest value
    (measured up to 2^-9; a lost micro-batch is off by about half the largest)."""
    grid = grids.grid(tp.size, 1, 1)
    mm, addmm, used = torch.mm, torch.addmm, []

    def mm_as_gpu(a, b, *, out_dtype=None, out=None):
        if out_dtype is None:
            return mm(a, b, out=out)
        used.append("mm")
        return out.copy_(mm(a.to(out_dtype), b.to(out_dtype)))

    def addmm_as_gpu(c, a, b, *, out_dtype=None, out=None):
        if out_dtype is None:
            return addmm(c, a, b, out=out)
        used.append("addmm")
        return out.copy_(addmm(c, a.to(out_dtype), b.to(out_dtype)))

    unfused = _accumulated(tp, grid, False, torch.bfloat16)
    monkeypatch.setattr(torch, "mm", mm_as_gpu)
    monkeypatch.setattr(torch, "addmm", addmm_as_gpu)
    fused = _accumulated(tp, grid, True, torch.bfloat16, mixed=True)
    assert sorted(used) == ["addmm"] * 5 + ["mm"] * 5  # the probe's pair, then 4 of each
    for step, (want, got) in enumerate(zip(unfused, fused)):
        for name in want:
            assert torch.isfinite(got[name]).all(), (step, name)
            bound = 2.0**-7 * want[name].abs().max().item()  # 2 x (2 micro-batches x 2^-9 of the largest)
            torch.testing.assert_close(got[name], want[name], rtol=0, atol=bound, msg=f"step {step} {name}")


@pytest.mark.mpi
def test_vocab_parallel_embedding_equals_the_full_lookup(runtime, tp):
    cpu = torch.device("cpu")
    emb = VocabParallelEmbedding(4 * tp.size, 3, 1.0, tp, cpu)
    emb.weight.data = counter_normal(1, "wte.weight", emb.weight.meta, tuple(emb.weight.shape), cpu)
    table = counter_normal(1, "wte.weight", ParamMeta((4 * tp.size, 3), std=1.0), (4 * tp.size, 3), cpu)
    tokens = torch.arange(4 * tp.size).reshape(tp.size, 4)
    torch.testing.assert_close(emb(tokens), F.embedding(tokens, table), atol=ATOL, rtol=0)


@pytest.mark.mpi
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_column_parallel_linear_overlap_changes_nothing_and_equals_the_dense_linear(runtime, tp, sequence_parallel):
    n_in, n_out, seq = 6, 4 * tp.size, 2 * tp.size
    rows = slice(4 * tp.rank, 4 * (tp.rank + 1))  # this rank's output features
    w, b = _same_on_every_rank((n_out, n_in), seed=2), _same_on_every_rank((n_out,), seed=3)
    x, grad_y = _same_on_every_rank((2, seq, n_in), seed=4), _same_on_every_rank((2, seq, n_out), seed=5)
    dense = [t.clone().requires_grad_() for t in (x, w, b)]
    want_y = F.linear(*dense)
    want_y.backward(grad_y)

    def run(overlap: bool, timers=None) -> list[torch.Tensor]:
        par = dataclasses.replace(tp, sequence_parallel=sequence_parallel, overlap=overlap, timers=timers)
        layer = ColumnParallelLinear(n_in, n_out, 1.0, par, torch.device("cpu"))
        layer.weight.data, layer.bias.data = w[rows].clone(), b[rows].clone()
        inp = (par.split(x, c.SEQ_DIM) if sequence_parallel else x.clone()).requires_grad_()
        y = layer(inp)
        y.backward(grad_y[..., rows])
        return [y, inp.grad, layer.weight.grad, layer.bias.grad]

    timers = StepTimers(torch.device("cpu"))
    off, on = run(False), run(True, timers)
    # Overlap only reorders the collective and the weight-gradient GEMM: bitwise equal.
    for name, a, z in zip(("output", "input grad", "weight grad", "bias grad"), off, on):
        assert torch.equal(a, z), name
    # The async collective is charged to tp (tp = 1: a plain F.linear, no collective).
    assert (timers.pop()["comm_s"]["tp"] > 0.0) == (tp.size > 1)
    # Against the dense layer: the input gradient is a sum of tp partial products (and the
    # GEMMs have other shapes), so fp32 rounding differs: ATOL on values of order 1-10.
    x_grad = tp.split(dense[0].grad, c.SEQ_DIM) if sequence_parallel else dense[0].grad
    expected = (want_y[..., rows], x_grad, dense[1].grad[rows], dense[2].grad[rows])
    for name, got, want in zip(("output", "input grad", "weight grad", "bias grad"), on, expected):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-6, msg=name)


@pytest.mark.mpi
@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_recomputation_under_tp_and_sp_leaves_loss_and_gradients_bitwise_unchanged(runtime, tp, recompute):
    # Recomputation re-runs the same forward, collectives included, with the RNG restored.
    cfg = ModelConfig(vocab_size=96, seq_len=8, layers=2, hidden=32, heads=4, dropout=0.1)
    par = dataclasses.replace(tp, sequence_parallel=True, overlap=True)
    tokens = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(0))
    targets = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(1))
    assert_recompute_is_bitwise(lambda mode: GPT(cfg, seed=3, tp=par, recompute=mode), tokens, targets, recompute)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("split", ["heads", "sp", "3d"])
def test_a_tp_shard_of_an_activation_draws_its_own_dropout_masks_and_a_replicated_one_the_same(
    runtime, grids, monkeypatch, shared_tmp, split
):
    """Found in review: every tp rank drew its dropout from the same stream, so the shard each holds
    got the same masks: the heads of every tp rank one attention mask (at tp = heads, all heads one),
    under SP positions p and p + S/tp the same residual mask, under 3D features j and j + H/X. Now
    a rank's shard has its own (`gpt.shard_stream`); what the tp ranks hold whole (the residual stream
    without SP, 3D's attention over X) keeps one mask on all of them, as its replicas need."""
    from conftest import grid_trainer

    sets = {"heads": (), "sp": ("parallel.sequence_parallel=true",), "3d": ("parallel.tensor=[2, 1, 1]",)}[split]
    trainer = grid_trainer(grids, 2, 1, 1, ("model.layers=1", "model.dropout=0.5", "model.seq_len=16",
                                            "train.global_batch=2", "train.micro_batch=2", *sets,
                                            f"run.dir={shared_tmp / str(runtime.rank // 2)}"))  # fmt: skip
    sub = trainer.runtime
    residual, attention = [], []
    dropout, sdpa = F.dropout, F.scaled_dot_product_attention

    def recorded_dropout(x, p=0.5, training=True, inplace=False):
        out = dropout(x, p, training, inplace)
        residual.append(((out == 0) & (x != 0)).flatten().tolist())
        return out

    def recorded_sdpa(q, k, v, **kw):  # the kept probabilities, drawn from the state the call draws from
        state = torch.get_rng_state()
        zeros = torch.zeros_like(q)
        eye = torch.eye(q.shape[2]).expand(*q.shape[:2], -1, -1).contiguous()
        probe = sdpa(zeros, zeros, eye, dropout_p=kw["dropout_p"], is_causal=True)
        torch.set_rng_state(state)
        attention.append((probe != 0).flatten().tolist())
        return sdpa(q, k, v, **kw)

    monkeypatch.setattr(F, "dropout", recorded_dropout)
    monkeypatch.setattr(F, "scaled_dot_product_attention", recorded_sdpa)
    trainer.model.train()
    trainer.step()
    monkeypatch.undo()
    masks = sub.comm.allgather((residual, attention))
    same_residual = masks[0][0] == masks[1][0]
    same_attention = masks[0][1] == masks[1][1]
    assert len(residual) == 3 and len(attention) == 1  # embedding, attention's and MLP's outputs; one core
    assert same_residual == (split == "heads"), "residual dropout: sharded under SP and 3D, else replicated"
    assert same_attention == (split == "3d"), "attention dropout: heads split over tp (1D), over Y (3D)"

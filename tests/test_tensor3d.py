"""3D tensor parallelism (AxoNN): the tp ranks as X x Y x Z, each layer against its 1-rank form.

Every factorisation of the launched ranks into (x, y, z) is checked. Tolerance: fp32 sums in a
different order (partial products summed over X or Y, gradients over Z), ~1e-6 on values of
order 1: ATOL 1e-5.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.nn.functional as F

from app.names import strides3d
from app.tensor_parallel.tensor3d import coords3d, embedding3d, layer_norm3d, linear3d, tensor3d_from_grid

ATOL = 1e-5


def factorisations(n: int) -> list[tuple[int, int, int]]:
    return [(x, y, n // (x * y)) for x in range(1, n + 1) for y in range(1, n + 1) if n % (x * y) == 0]


def _keep_shape(shapes: list, t: torch.Tensor) -> torch.Tensor:
    shapes.append(tuple(t.shape))
    return t


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _full(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def test_coordinates_put_x_innermost_and_cover_the_grid():
    for shape in factorisations(8):
        seen = {coords3d(r, shape) for r in range(8)}
        assert len(seen) == 8
        assert coords3d(1, shape) == ((1, 0, 0) if shape[0] > 1 else (0, 1, 0) if shape[1] > 1 else (0, 0, 1))


ORDERS = ("xyz", "xzy", "yxz", "yzx", "zxy", "zyx")


@pytest.mark.parametrize("order", ORDERS)
def test_every_tensor_order_is_a_bijection_with_its_first_sub_axis_innermost(order):
    """parallel.tensor_order: the sub-axis named first has stride 1, the next the first's size,
    the last the product of the other two; every rank gets its own (x, y, z)."""
    for shape in factorisations(12):
        sizes = dict(zip("xyz", shape))
        strides = dict(zip("xyz", strides3d(shape, order)))
        a, b, c = order
        assert (strides[a], strides[b], strides[c]) == (1, sizes[a], sizes[a] * sizes[b])
        coords = [coords3d(r, shape, order) for r in range(12)]
        assert len(set(coords)) == 12
        for r, (x, y, z) in enumerate(coords):
            assert x * strides["x"] + y * strides["y"] + z * strides["z"] == r


def test_a_tensor_order_that_is_not_a_permutation_is_refused():
    for bad in ("xy", "xxz", "xyzw", "abc"):
        with pytest.raises(ValueError, match="not a permutation of x, y, z"):
            strides3d((2, 2, 2), bad)


@pytest.mark.mpi
def test_sub_axis_groups_follow_the_tensor_order(grids):
    """grid.tensor3d(shape, order): each sub-axis's group holds the ranks that differ only in its
    coordinate, `strides3d` apart in the tp group (the first of `order` on neighbouring ranks); the
    coordinate agrees with `coords3d` of this rank's place in tp, a sum over the group proves the
    membership, and Tensor3D.tp_rank gives the place back."""
    import torch.distributed as dist

    n = grids.world.world_size
    grid = grids.grid(n, 1, 1)
    me = grid.coords["tp"]
    shapes = [s for s in factorisations(n) if sum(k > 1 for k in s) >= 2] or factorisations(n)
    for shape in shapes[:3]:
        for order in ("xyz", "zyx", "yzx"):
            groups = grid.tensor3d(shape, order)
            mine = coords3d(me, shape, order)
            for (axis, (coord, group, ranks)), own, stride, size in zip(
                groups.items(), mine, strides3d(shape, order), shape
            ):
                assert coord == own, (shape, order, axis)
                base = me - own * stride
                assert ranks == [grid.ranks["tp"][base + i * stride] for i in range(size)], (shape, order, axis)
                if order[0] == axis[-1] and size > 1:  # innermost: consecutive torch ranks
                    assert ranks == list(range(ranks[0], ranks[0] + size))
                if size > 1:
                    onehot = torch.zeros(size)
                    onehot[coord] = 1.0
                    dist.all_reduce(onehot, group=group)
                    assert onehot.tolist() == [1.0] * size
            assert tensor3d_from_grid(grid, shape, order).tp_rank == me


@pytest.mark.mpi
@pytest.mark.parametrize("overlap", [False, True], ids=["oar-off", "oar-on"])
@pytest.mark.parametrize("transposed", [False, True])
def test_linear3d_equals_the_1_rank_linear_forward_and_backward(grids, transposed, overlap):
    """Forward, dx, dW and the bias gradient against F.linear, with the input gradient's all-reduce
    overlapping the weight-gradient GEMM (OAR) or not. Forward keeps the input and the Z shard
    for backward, never the gathered block (backward gathers it again). Mutation check (by hand,
    2026-11-25): without the wait for the OAR all-reduce, both oar-on cases fail (dx is this
    rank's partial sum) and the oar-off ones pass."""
    n = grids.world.world_size
    grid = grids.grid(n, 1, 1)
    batch, seq, n_in, n_out = 2 * n, 3, 4 * n, 2 * n * n
    w, b, x, g = (
        _full((n_out, n_in), 1),
        _full((n_out,), 2),
        _full((batch, seq, n_in), 3),
        _full((batch, seq, n_out), 4),
    )
    y_ref = F.linear(x, w, b)
    for shape in factorisations(n):
        t3d = tensor3d_from_grid(grid, shape, overlap_all_reduce=overlap)
        in_axis, out_axis = t3d.axes(transposed)
        zs, z = t3d.z.size, t3d.z.rank
        rows, cols = n_out // out_axis.size, n_in // in_axis.size
        r0, c0 = out_axis.rank * rows, in_axis.rank * cols
        shard_rows = rows // zs
        shard = w[r0 + z * shard_rows : r0 + (z + 1) * shard_rows, c0 : c0 + cols].clone().requires_grad_()
        bias = b[r0 : r0 + rows].clone().requires_grad_()
        mb = batch // zs  # the batch is split over Z
        xs = x[z * mb : (z + 1) * mb, :, c0 : c0 + cols].clone().requires_grad_()
        saved: list[tuple[int, ...]] = []
        with torch.autograd.graph.saved_tensors_hooks(partial(_keep_shape, saved), _same):
            y = linear3d(xs, shard, bias, t3d, transposed)
        assert (rows, cols) not in saved or zs == 1, (shape, saved)  # the gathered block is not kept
        torch.testing.assert_close(y, y_ref[z * mb : (z + 1) * mb, :, r0 : r0 + rows], atol=ATOL, rtol=0)
        y.backward(g[z * mb : (z + 1) * mb, :, r0 : r0 + rows])
        # The reference: the loss sum(y * g) over the whole batch, computed once.
        xr, wr, br = x.clone().requires_grad_(), w.clone().requires_grad_(), b.clone().requires_grad_()
        F.linear(xr, wr, br).backward(g)
        torch.testing.assert_close(xs.grad, xr.grad[z * mb : (z + 1) * mb, :, c0 : c0 + cols], atol=ATOL, rtol=0)
        ref_shard = wr.grad[r0 + z * shard_rows : r0 + (z + 1) * shard_rows, c0 : c0 + cols]
        torch.testing.assert_close(shard.grad, ref_shard, atol=ATOL, rtol=0)
        # The bias acts after the reduction: its gradient here is this Z rank's batch part only
        # (summed over Z with the other replicated parameters' gradients, after dp).
        ref_bias = g[z * mb : (z + 1) * mb, :, r0 : r0 + rows].sum(dim=(0, 1))
        torch.testing.assert_close(bias.grad, ref_bias, atol=ATOL, rtol=0)


@pytest.mark.mpi
def test_layer_norm_over_a_hidden_split_equals_the_1_rank_layer_norm(grids):
    n = grids.world.world_size
    t3d = tensor3d_from_grid(grids.grid(n, 1, 1), (n, 1, 1))
    hidden = 4 * n
    x, w, b, g = _full((2, 3, hidden), 5) * 3 + 1, _full((hidden,), 6), _full((hidden,), 7), _full((2, 3, hidden), 8)
    cols = slice(t3d.x.rank * 4, t3d.x.rank * 4 + 4)
    xs, ws, bs = (t[..., cols].clone().requires_grad_() for t in (x, w, b))
    y = layer_norm3d(xs, ws, bs, 1e-5, t3d.x)
    xr, wr, br = (t.clone().requires_grad_() for t in (x, w, b))
    y_ref = F.layer_norm(xr, (hidden,), wr, br, 1e-5)
    torch.testing.assert_close(y, y_ref[..., cols], atol=ATOL, rtol=0)
    y.backward(g[..., cols])
    y_ref.backward(g)
    for mine, ref in ((xs, xr), (ws, wr), (bs, br)):
        torch.testing.assert_close(mine.grad, ref.grad[..., cols], atol=ATOL, rtol=0)


@pytest.mark.mpi
def test_embedding3d_and_the_tied_head_equal_the_1_rank_lookup_and_loss(grids):
    """The table's (vocab / Y, hidden / X) block, Z-sharded, serves both the lookup and the tied
    head; the loss is the vocab-parallel cross-entropy over Y."""
    from app.tensor_parallel.layers import vocab_parallel_cross_entropy

    n = grids.world.world_size
    grid = grids.grid(n, 1, 1)
    vocab, hidden, batch, seq = 4 * n, 2 * n, 2 * n, 3
    table = _full((vocab, hidden), 9)
    tokens = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(10))
    targets = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(11))
    tr = table.clone().requires_grad_()
    h_ref = F.embedding(tokens, tr)
    loss_ref = F.cross_entropy(F.linear(h_ref, tr).reshape(-1, vocab), targets.reshape(-1), reduction="sum")
    loss_ref.backward()
    for shape in factorisations(n):
        t3d = tensor3d_from_grid(grid, shape)
        z, zs = t3d.z.rank, t3d.z.size
        rows, cols = vocab // t3d.y.size, hidden // t3d.x.size
        r0, c0 = t3d.y.rank * rows, t3d.x.rank * cols
        sr = rows // zs
        shard = table[r0 + z * sr : r0 + (z + 1) * sr, c0 : c0 + cols].clone().requires_grad_()
        mb = batch // zs
        mine = slice(z * mb, (z + 1) * mb)
        h = embedding3d(tokens[mine], shard, r0, t3d)
        torch.testing.assert_close(h, h_ref[mine, :, c0 : c0 + cols].detach(), atol=ATOL, rtol=0)
        logits = linear3d(h, shard, None, t3d, transposed=False)
        loss = vocab_parallel_cross_entropy(logits, targets[mine], t3d.y) * (mb * seq)  # this Z rank's sum
        loss.backward()
        ref_shard = tr.grad[r0 + z * sr : r0 + (z + 1) * sr, c0 : c0 + cols]
        torch.testing.assert_close(shard.grad, ref_shard, atol=ATOL, rtol=0)


@pytest.mark.mpi
@pytest.mark.parametrize("overlap", [False, True], ids=["overlaps-off", "overlaps-on"])
@pytest.mark.parametrize("tie", [True, False])
def test_a_3d_gpt_gives_the_1_rank_loss_and_gradients(grids, tie, overlap, monkeypatch):
    """The whole model (blocks, tied or untied head) on every (x, y, z) of the launched ranks:
    each Z rank runs its share of the batch; the mean of their losses is the 1-rank loss, and
    each parameter's gradient, summed over Z where the parameter is replicated over Z (what
    DataParallel does after dp), is the 1-rank gradient's block.

    With the overlaps on (OAR, ORS, OAG) the results are the same, and each overlap is seen to
    run: every block Linear's weight gradient goes through a deferred reduce-scatter (ORS: 4 per
    block), retired by `finish_backward` (without it the gradients are missing), and every Linear
    after a block's first prefetches its gather, in forward and in backward (OAG: 3 + 3 per block).
    Mutation checks (by hand, 2026-11-25, 4 ranks): with the prefetch calls removed the OAG count
    fails; with `finish_backward` not flushing, the in-flight check fails; with `GatherSlot.take`
    not waiting for the prefetched gather, the loss check fails."""
    from app.deck import ModelConfig
    from app.model.gpt import GPT
    from app.tensor_parallel.mappings import TensorParallel
    from app.tensor_parallel.tensor3d import ZGradients

    counts = {"gather": 0, "reduce_scatter": 0}

    def counted(name, original):
        def call(*args, **kwargs):
            counts[name] += 1
            return original(*args, **kwargs)

        return call

    monkeypatch.setattr(
        TensorParallel, "all_gather_rows_async", counted("gather", TensorParallel.all_gather_rows_async)
    )
    monkeypatch.setattr(ZGradients, "launch", counted("reduce_scatter", ZGradients.launch))

    n = grids.world.world_size
    grid = grids.grid(n, 1, 1)
    cfg = ModelConfig(vocab_size=16 * n, seq_len=8, layers=2, hidden=8 * n, heads=n, tie_embeddings=tie)
    batch = 2 * n
    tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), generator=torch.Generator().manual_seed(12))
    targets = torch.roll(tokens, -1, dims=1)
    ref = GPT(cfg, seed=5)
    ref_loss = ref.loss(tokens, targets)
    ref_loss.backward()
    ref_grads = dict(ref.named_parameters())
    for shape in factorisations(n):
        t3d = tensor3d_from_grid(
            grid, shape, overlap_all_reduce=overlap, overlap_reduce_scatter=overlap, overlap_all_gather=overlap
        )
        model = GPT(cfg, seed=5, tp=t3d)
        zs, z = t3d.z.size, t3d.z.rank
        mb = batch // zs
        counts.update(gather=0, reduce_scatter=0)
        loss = model.loss(tokens[z * mb : (z + 1) * mb], targets[z * mb : (z + 1) * mb])
        mean = t3d.z.all_reduce(loss.detach()) / zs if zs > 1 else loss.detach()
        torch.testing.assert_close(mean, ref_loss.detach(), atol=ATOL, rtol=0)
        (loss / zs).backward()
        model.finish_backward()
        assert not t3d.grads.in_flight and all(slot.pending is None for slot in t3d.slots)
        busy = overlap and zs > 1
        assert counts == {"gather": 6 * cfg.layers * busy, "reduce_scatter": 4 * cfg.layers * busy}, (shape, counts)
        for name, p in model.named_parameters():
            grad = p.grad
            if "tp_z" not in p.meta.split and zs > 1:
                grad = t3d.z.all_reduce(grad)
            box = tuple(slice(o, o + s) for o, s in zip(p.meta.local_offset, p.meta.local_shape))
            torch.testing.assert_close(p.detach(), ref_grads[name].detach()[box], atol=0, rtol=0, msg=name)
            torch.testing.assert_close(grad, ref_grads[name].grad[box], atol=ATOL, rtol=0, msg=f"{name} {shape}")

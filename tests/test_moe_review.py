"""Review of the mixture of experts (`app/model/moe.py`): what the experts keep under a capacity
that drops nothing, and expert parallelism's exchange at the edges of routing (every token to one
expert, so that the other experts, and the rank holding them, receive nothing; top-k = E; a capacity
that drops), each equal to the layer on one rank. Serial, and under mpirun -n 2."""

from __future__ import annotations

from typing import Optional

import pytest
import torch
import torch.nn.functional as F

from app.model.moe import NO_EP, ExpertParallel, MoE, RouterStats
from app.sharding.init import init_parameters
from app.tensor_parallel.mappings import TensorParallel

HIDDEN, EXPERTS, FFN = 8, 4, 12
# Layers on one rank and split over ranks differ only in summation order (~1e-7 relative per
# operation on values of order 1-10): 1e-5 relative, 1e-6 absolute; a token sent to the wrong expert
# or a gradient missing or counted twice moves them by 1e-2 or more.
RTOL, ATOL = 1e-5, 1e-6


def _gelu(h: torch.Tensor) -> torch.Tensor:
    return F.gelu(h, approximate="tanh")


def _layer(k: int, capacity: Optional[float], ep: ExpertParallel = NO_EP) -> MoE:
    """A gpt2-style MoE layer (GELU experts with biases, no shared expert), its values from a seed:
    the same global tensors whatever `ep` (each rank its slice of the experts)."""
    m = MoE(HIDDEN, EXPERTS, k, FFN, FFN, True, 0.5, 0.5, capacity, 0, (0.1, 0.01), _gelu, RouterStats(),
            TensorParallel(), None, ep)  # fmt: skip
    with torch.no_grad():
        init_parameters(m, 5)
    return m


def _largest_saved(m: MoE, x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(the layer's training output on x, the elements of the largest tensor its backward keeps)."""
    sizes = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = m(x)
    return y, max(sizes)


def test_a_capacity_that_drops_nothing_pads_the_experts_no_more_than_dropless():
    """Found in review: on one rank (ep 1) the experts ran over an (E, C, h) buffer of the capacity's
    width C = ceil(F T k / E) even when no expert got that many, so model.moe_capacity_factor: 1000 (a
    valid deck that drops nothing) made the buffer and the experts' activations ~500x the dropless
    layer's here (on a real model, an out-of-memory crash where dropless fits), and F = 2 twice. Each
    expert now runs on exactly the rows it kept (no buffer at all since 2026-12-02); the output
    equals dropless's (nothing dropped: the same rows through the same experts, RTOL/ATOL)."""
    x = torch.randn(2, 6, HIDDEN, generator=torch.Generator().manual_seed(1))
    dropless, roomy = _layer(2, None).train(), _layer(2, 1000.0).train()
    want, want_saved = _largest_saved(dropless, x)
    got, got_saved = _largest_saved(roomy, x)
    assert float(roomy.stats.dropped) == 0
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    assert got_saved <= want_saved, f"the capacity's layer keeps {got_saved} elements, dropless {want_saved}"


def test_top1_routing_gives_the_router_no_gradient_from_the_output_and_is_warned_of():
    """Found in review: `route` renormalises the chosen weights (Mixtral's rule), so at top-1 every
    token's weight is exactly 1 and the output's loss leaves the router untrained (its gradient is
    rounding, against order 1 at top-2); the log says so at top-1 only."""
    from app.model.moe import top1_warning

    x = torch.randn(2, 6, HIDDEN, generator=torch.Generator().manual_seed(3))
    norms = {}
    for k in (1, 2):
        # No balancing or z-loss (coefficients 0): the router's gradient is the output's alone.
        m = MoE(HIDDEN, EXPERTS, k, FFN, FFN, True, 0.5, 0.5, None, 0, (0.0, 0.0), _gelu, RouterStats(),
                TensorParallel(), None, NO_EP)  # fmt: skip
        with torch.no_grad():
            init_parameters(m, 5)
        m.train()(x).square().sum().backward()
        norms[k] = float(m.router.weight.grad.norm())
    # Top-1's is fp32 rounding of d(p/p)/dp = 0 (~1e-7 of top-2's here); a trained router's is order 1.
    assert norms[1] < 1e-5 * norms[2] and norms[2] > 1e-2, norms
    assert "model.moe_top_k = 1" in top1_warning(EXPERTS, 1) and "moe_top_k >= 2" in top1_warning(EXPERTS, 1)
    assert top1_warning(EXPERTS, 2) is None and top1_warning(0, 1) is None


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize(
    "k,capacity,skewed",
    [(EXPERTS, None, False), (2, 0.5, False), (1, None, True), (2, 0.5, True)],
    ids=["top-k=E", "capacity", "one-expert", "one-expert-capacity"],
)
def test_ep2_equals_one_rank_at_the_edges_of_routing(runtime, grids, k, capacity, skewed):
    """Dp ranks 0 and 1 as one expert group (2 experts each), each routing its own tokens, against the
    whole layer on each rank's tokens: outputs, input and router gradients equal, each rank's expert
    gradients the slice of the whole layer's summed over the two ranks (what the expert-data reduction
    then averages), the same assignments dropped, and evaluation (dropless) alike. `skewed`: the router
    sends every token to expert 0 first (the second choice, if any, is expert 1-3 by the tie order), so
    with k = 1 experts 1-3 get no token on any rank and rank 1 receives nothing: their gradient must be
    zero, not missing (the dp reduction waits for every parameter's)."""
    grid = grids.grid(1, 1, runtime.world_size)
    place, group, _ = grid.expert_groups(2)["ep"]
    me = grid.coords["dp"]
    whole, split = _layer(k, capacity), _layer(k, capacity, ExpertParallel(2, place, group))
    gen = torch.Generator().manual_seed(11 + me)
    x = torch.randn(2, 6, HIDDEN, generator=gen)
    if skewed:
        x[..., 0] = x[..., 0].abs() + 0.5
        with torch.no_grad():
            for m in (whole, split):
                m.router.weight.zero_()
                m.router.weight[0, 0] = 5.0
    xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    ys = [m(v) for m, v in zip((whole, split), xs)]
    torch.testing.assert_close(ys[1], ys[0], rtol=RTOL, atol=ATOL)
    probe = torch.randn(ys[0].shape, generator=gen)
    for y in ys:
        (y * probe).sum().backward()
    torch.testing.assert_close(xs[1].grad, xs[0].grad, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(split.router.weight.grad, whole.router.weight.grad, rtol=RTOL, atol=ATOL)
    for name in ("fc.weight", "fc.bias", "proj.weight", "proj.bias"):
        summed = whole.get_parameter(name).grad.clone()
        torch.distributed.all_reduce(summed, group=group)
        mine = split.get_parameter(name).grad
        assert mine is not None, name
        torch.testing.assert_close(mine, summed[place * 2 : place * 2 + 2], rtol=RTOL, atol=ATOL, msg=name)
        if skewed and k == 1 and place == 1:
            assert not mine.any(), name  # experts 2 and 3 ran on no token
    assert float(split.stats.dropped) == float(whole.stats.dropped)
    whole.eval()
    split.eval()
    with torch.no_grad():
        torch.testing.assert_close(split(x), whole(x), rtol=RTOL, atol=ATOL)

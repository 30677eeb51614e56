"""Pieces of expert parallelism (issue 42, `parallel.ep`): the grid's split of the dp group into expert
groups and expert-data groups, and the differentiable all-to-all with variable splits that carries
tokens to their experts' ranks and back (the whole: tests/test_expert_parallel.py and the ep cases of
tests/test_parallel_equivalence.py). Run under mpirun -n 2 and 4."""

from __future__ import annotations

import pytest
import torch

from app.tensor_parallel.mappings import all_to_all, all_to_all_start


@pytest.mark.mpi(min_size=2)
def test_expert_groups_split_dp_into_consecutive_expert_groups_and_strided_data_groups(runtime, grids):
    """dp = world: for each ep dividing it, this rank's expert group is the `ep` consecutive dp ranks
    of its block and its expert-data group the dp ranks at its place in every block; a sum over
    each group adds exactly those ranks' values."""
    world = runtime.world_size
    grid = grids.grid(1, 1, world)
    me = grid.coords["dp"]
    for ep in [e for e in (1, 2, 4) if world % e == 0]:
        groups = grid.expert_groups(ep)
        place, ep_group, ep_ranks = groups["ep"]
        block, edp_group, edp_ranks = groups["edp"]
        assert (place, block) == (me % ep, me // ep)
        assert ep_ranks == [grid.ranks["dp"][(me // ep) * ep + i] for i in range(ep)]
        assert edp_ranks == [grid.ranks["dp"][b * ep + me % ep] for b in range(world // ep)]
        assert grid.expert_groups(ep) is groups  # kept
        for group, dp_ranks in ((ep_group, [(me // ep) * ep + i for i in range(ep)]),
                                (edp_group, [b * ep + me % ep for b in range(world // ep)])):  # fmt: skip
            value = torch.tensor([float(2**me)])
            torch.distributed.all_reduce(value, group=group)
            assert value.item() == sum(2**r for r in dp_ranks)
    with pytest.raises(Exception, match="must divide dp"):
        grid.expert_groups(world + 1)


@pytest.mark.mpi(min_size=2)
def test_all_to_all_moves_variable_row_counts_and_sends_the_gradients_back(runtime, grids):
    """Rank r sends (r + i) % 3 + 1 rows to rank i, each row tagged (r, i, j): every rank receives its
    rows in rank order, and the gradient of sum(out x w) reaching each sent row is the weight its
    receiver gave it, so the exchange reversed."""
    world = runtime.world_size
    grid = grids.grid(1, 1, world)
    group, me = grid.group["dp"], grid.coords["dp"]
    send = [(me + i) % 3 + 1 for i in range(world)]
    recv = [(i + me) % 3 + 1 for i in range(world)]
    rows = [[float(me), float(i), float(j)] for i in range(world) for j in range(send[i])]
    # Blocking, and launched with work in between (all_to_all_start): the same rows and gradients.
    for exchange in (all_to_all, lambda *a: all_to_all_start(*a)()):
        x = torch.tensor(rows, requires_grad=True)
        out = exchange(x, send, recv, group)
        expect = [[float(i), float(me), float(j)] for i in range(world) for j in range(recv[i])]
        assert out.tolist() == expect
        weights = out.detach()[:, :1] * 10 + out.detach()[:, 2:] + 100 * me  # sender, row, receiver
        (out * weights).sum().backward()
        # The row (me, i, j) went to rank i, which weighted it 10 me + j + 100 i in all three columns.
        want = torch.tensor([[10.0 * me + j + 100 * i] * 3 for i in range(world) for j in range(send[i])])
        torch.testing.assert_close(x.grad, want, rtol=0, atol=0)

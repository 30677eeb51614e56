"""Not collected by the suite (not test_*.py): tests/test_structure.py runs it under mpirun -n 2 to
show that a test failing on one rank only ends the group (conftest.PeerGuard)."""

import pytest


@pytest.mark.mpi(min_size=2)
def test_fails_on_rank_1_only():
    from mpi4py import MPI

    if MPI.COMM_WORLD.rank == 1:
        raise AssertionError("planted: only rank 1 fails")
    MPI.COMM_WORLD.Barrier()  # rank 0 waits in the test for a peer that has left it


@pytest.mark.mpi(min_size=2)
def test_next():
    from mpi4py import MPI

    MPI.COMM_WORLD.Barrier()  # without the guard, rank 1's barrier here would free rank 0's above

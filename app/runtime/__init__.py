"""Runtime: MPI start-up, the process grid, communication primitives."""

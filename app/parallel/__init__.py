"""Parallelism over the grid: data-parallel gradient sync (pipeline and overlap later)."""

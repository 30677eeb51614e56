"""Parallelism over the grid: the parameter layout, data-parallel buffers and reductions, the
pipeline schedule and its runner, and gathering shards to whole tensors."""

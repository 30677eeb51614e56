"""Tensor (and sequence) parallelism in one place, after Megatron-Core's tensor_parallel:
`mappings` holds the tp group (`TensorParallel`) and the collectives as autograd functions,
`layers` the column/row-parallel linears, the vocab-parallel embedding and cross-entropy,
and LayerNorm under sequence parallelism."""

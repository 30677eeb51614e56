"""The blocks' element-wise chains fused by torch.compile (`run.compile: true`).

Eagerly every element-wise op is its own kernel that reads its operands from memory and writes
its result back: llama's RMSNorm is five (cast, square, mean, rsqrt, two products and the cast
back), the rotary embedding about ten per q and k (angles, cos, sin, the rotated half's slices,
negation and concatenation, two products, a sum), SwiGLU two over strided halves of the fc
output; backward about doubles each. On a GPU, where a block's GEMMs are compute-bound, these
memory-bound passes are what kept the Llama deck at 25% MFU on an H100 (issue 38). torch.compile
(inductor) turns each chain into one generated kernel forward and one backward.

What is compiled are pure functions of tensors (`rms_norm`, `rotary`, `swiglu`): no collectives,
hooks or custom autograd functions inside, so they compose with tp, sequence parallelism, the
pipeline, ZeRO-3's gathers and activation recompute as the eager ones do. Shapes are static
(a run's micro-batches all have one shape); decoding and evaluation at other shapes use the
eager functions or recompile (`torch._dynamo`'s cache). GPT-2's chains are already single
kernels (F.layer_norm, F.gelu) or GEMM epilogues, so only llama's are swapped. Compiled
results equal eager ones to rounding (inductor may order a reduction differently): the tests
compare trainings within 1e-5.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from app.model.gpt import rotary, swiglu
from app.tensor_parallel.layers import rms_norm


@dataclass(frozen=True)
class Kernels:
    """The element-wise functions a model's blocks call: eager, or compiled once per model."""

    rms_norm: Callable[..., torch.Tensor]
    rotary: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    swiglu: Callable[[torch.Tensor], torch.Tensor]

    @classmethod
    def eager(cls) -> Kernels:
        return cls(rms_norm, rotary, swiglu)

    @classmethod
    def compiled(cls) -> Kernels:
        """Each function under torch.compile (inductor, static shapes, no graph breaks allowed:
        a function that cannot compile whole fails at its first call, not silently)."""
        return cls(*(torch.compile(f, dynamic=False, fullgraph=True) for f in (rms_norm, rotary, swiglu)))

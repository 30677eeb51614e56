"""The blocks' element-wise chains fused by torch.compile (`run.compile: true`).

Eagerly every element-wise op is its own kernel that reads its operands from memory and writes
its result back: llama's RMSNorm is five (cast, square, mean, rsqrt, two products and the cast
back), the rotary embedding about ten per q and k (angles, cos, sin, the rotated half's slices,
negation and concatenation, two products, a sum), SwiGLU two over strided halves of the fc
output; backward about doubles each. On a GPU, where a block's GEMMs are compute-bound, these
memory-bound passes are what kept the Llama deck at 25% MFU on an H100 (issue 38). torch.compile
(inductor) turns each chain into one generated kernel forward and one backward.

Two chains cross a block's modules (`Block._chained`): the attention's row-parallel output bias,
the residual add and the second norm (`add_norm`: eagerly three passes, reading the projection's
output and the residual stream twice and writing two new tensors between), and the MLP's output
bias with the second residual add (`bias_residual`: two passes). The Linears then leave their
bias out (`RowParallelLinear.forward(add_bias=False)`). For GPT-2, whose LayerNorm and GELU are
single kernels already, these are the chains left: 5 of the block's forward passes over its
hidden-wide activations (the performance model's `_chains_saved`). They need 1D tensor
parallelism and dropout 0 (`GPT.fuse`).

What is compiled are pure functions of tensors (`rms_norm`, `rotary`, `swiglu`, `add_norm`, `bias_residual`): no collectives,
hooks or custom autograd functions inside, so they compose with tp, sequence parallelism, the
pipeline, ZeRO-3's gathers and activation recompute as the eager ones do. Shapes are static
(a run's micro-batches all have one shape); decoding and evaluation at other shapes use the
eager functions or recompile (`torch._dynamo`'s cache). A mixture of experts' stacked experts
keep the eager SwiGLU: their buffers change width with every micro-batch's routing (`GPT.fuse`). Compiled
results equal eager ones to rounding (inductor may order a reduction differently): the tests
compare trainings within 1e-5.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from app.errors import DeckError, RankFatal
from app.model.gpt import add_norm, bias_residual, rotary, swiglu
from app.tensor_parallel.layers import rms_norm


@dataclass(frozen=True)
class Kernels:
    """The element-wise functions a model's blocks call: eager, or compiled once per model."""

    rms_norm: Callable[..., torch.Tensor]
    rotary: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    swiglu: Callable[[torch.Tensor], torch.Tensor]
    # The chains across a block's modules; None (eager): the block runs those ops one by one, as it
    # always has (the same values as `add_norm` and `bias_residual` eagerly, and the same op counts).
    add_norm: Optional[Callable[..., tuple[torch.Tensor, torch.Tensor]]] = None
    bias_residual: Optional[Callable[..., torch.Tensor]] = None

    @classmethod
    def eager(cls) -> Kernels:
        return cls(rms_norm, rotary, swiglu)

    @classmethod
    def compiled(cls, setting: object = True) -> Kernels:
        """Each function under torch.compile (inductor, static shapes, no graph breaks allowed:
        a function that cannot compile whole fails at its first call, not silently). A failure
        to build a kernel (no working C++ compiler or Triton on the node) is a DeckError naming
        run.compile (its `setting`) and the fix, not torch's traceback from inside the step."""
        return cls(*(_guarded(torch.compile(f, dynamic=False, fullgraph=True), f.__name__, setting)
                     for f in (rms_norm, rotary, swiglu, add_norm, bias_residual)))  # fmt: skip


def _compile_failure(err: BaseException) -> bool:
    """An error of torch.compile's own machinery (dynamo, inductor, Triton, the C++ compiler it
    runs), not of the computation (an out-of-memory error passes through)."""
    return type(err).__module__.startswith(("torch._dynamo", "torch._inductor", "triton")) or isinstance(
        err, subprocess.CalledProcessError
    )


def _guarded(fn: Callable[..., Any], name: str, setting: object) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as err:
            if not _compile_failure(err):
                raise
            first = (str(err).strip().splitlines() or [""])[0][:200]
            # This rank's failure, mid-step (found in review: as a DeckError, said by rank 0 alone, a
            # failure on another rank printed nothing and its peers waited in a collective until the
            # watchdog blamed a dead rank): RankFatal, said by this rank, ends the job at once.
            raise RankFatal(str(DeckError(
                "run.compile", setting,
                f"torch.compile could not build {name} on this node ({type(err).__name__}: {first}); set "
                "run.compile: false (the eager chains, slower on GPUs) or give the node a working C++ compiler "
                "and Triton",
            ))) from err  # fmt: skip

    return call

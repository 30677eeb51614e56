"""The names every part of gridlm shares, each declared once (pure: no torch, no MPI).

The deck accepts these values, the runtime and the planner use them, and the reports print
them; a new precision, recompute mode or schedule is added here first.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

AXES = ("tp", "pp", "dp")  # the grid's axes, innermost-first in the default order tp-dp-pp
# With context parallelism (parallel.cp > 1) a fourth: cp splits every sequence. An order that omits it
# places it right after tp (Megatron-Core's tp-cp-dp-pp); the outputs name it only where cp > 1.
GRID_AXES = ("tp", "cp", "pp", "dp")
CP_KINDS = ("ring", "all_to_all")  # parallel.cp_kind: app/tensor_parallel/context.py
# 3D tensor parallelism's sub-axes of tp, innermost first: timed apart, and within tp's total.
TP_SUB_AXES = ("tp_x", "tp_y", "tp_z")
# Communication timed apart and within its axis's total: 3D tensor parallelism's sub-axes of tp, and
# expert parallelism's token all-to-all ("ep", within dp: the ep ranks are dp ranks).
SUB_AXES = {**dict.fromkeys(TP_SUB_AXES, "tp"), "ep": "dp"}
# Grid axes beyond AXES that the timers and reports name only where they communicated (cp > 1).
USED_AXES = ("cp",)
PRECISIONS = ("fp32", "bf16", "fp16")  # train.precision
BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}  # bytes per element of each precision
RECOMPUTE = ("none", "full", "selective")  # train.recompute
# Pipeline schedules: the key summary.json and the reports use -> the name the logs print.
SCHEDULES = {"1f1b": "1F1B", "interleaved-1f1b": "interleaved 1F1B"}

# optim.offload's state per element (fp32 master, exp_avg, exp_avg_sq) and its nvme stream's
# buffers (read-ahead, update, write-behind): app/optim/offload.py allocates them, the planner
# (which does not import torch) counts them.
OFFLOAD_STATE_TENSORS, OFFLOAD_FP32 = 3, 4
OFFLOAD_SLOTS = 3
OFFLOAD_ALIGN = 4096  # bytes: the nvme file's regions and its O_DIRECT transfers are whole blocks


def offload_chunk(buffer_bytes: int, largest: Optional[int] = None) -> int:
    """Elements of one slot of the nvme offload's stream (`NvmeStore`): optim.offload_buffer_mb's
    bytes over SLOTS slots of the state tensors, in whole OFFLOAD_ALIGN blocks (one at least), and
    no more than the `largest` shard it streams, padded to a block: more buffer than state holds
    nothing (a large optim.offload_buffer_mb would only fail to allocate, or claim memory it never uses)."""
    block = OFFLOAD_ALIGN // OFFLOAD_FP32
    chunk = max(block, buffer_bytes // (OFFLOAD_SLOTS * OFFLOAD_STATE_TENSORS * OFFLOAD_FP32) // block * block)
    return chunk if largest is None else min(chunk, offload_padded(largest) or block)


def offload_padded(n: int) -> int:
    """n fp32 elements rounded up to whole OFFLOAD_ALIGN blocks (the nvme file's regions)."""
    block = OFFLOAD_ALIGN // OFFLOAD_FP32
    return -(-n // block) * block


def strides3d(shape: Sequence[int], order: str = "xyz") -> tuple[int, int, int]:
    """The tp-rank strides of the X, Y and Z sub-axes of an X x Y x Z tensor grid whose sub-axes
    are laid out `order` (parallel.tensor_order: a permutation of "xyz", innermost first). The
    default "xyz" puts X innermost: tp rank r = x + X (y + Y z). Read by the grid's groups,
    `layout.coords3d`, the planner's node spans and links."""
    check_tensor_order(order)
    sizes = dict(zip("xyz", shape))
    strides, inner = {}, 1
    for axis in order:
        strides[axis], inner = inner, inner * sizes[axis]
    return strides["x"], strides["y"], strides["z"]


def check_tensor_order(order: str) -> None:
    """Raise ValueError unless `order` is a permutation of "xyz" (parallel.tensor_order)."""
    if sorted(order) != ["x", "y", "z"]:
        raise ValueError(f"tensor order {order!r} is not a permutation of x, y, z (innermost first, e.g. xyz)")


def reduce_precision(precision: str, grad_reduce_dtype: str) -> str:
    """The precision gradients are accumulated and reduced in: train.precision when
    train.grad_reduce_dtype is `compute`, else fp32."""
    return precision if grad_reduce_dtype == "compute" else "fp32"


def schedule_key(virtual_stages: int) -> str:
    """The pipeline schedule a run with `virtual_stages` chunks per stage uses (a SCHEDULES key)."""
    return "interleaved-1f1b" if virtual_stages > 1 else "1f1b"


def torch_dtype(precision: str) -> Any:
    """The torch dtype of a PRECISIONS name (torch imported only here, on first use)."""
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


def rank_ranges(ranks: Sequence[int]) -> str:
    """Ranks as the short list a log line can carry: [0, 1, 2, 3, 6, 8, 9] -> "0-3, 6, 8-9"."""
    parts: list[str] = []
    ordered = sorted(set(ranks))
    start = prev = None
    for r in [*ordered, None]:
        if start is not None and (r is None or r != prev + 1):
            parts.append(str(start) if start == prev else f"{start}-{prev}")
            start = None
        if r is not None and start is None:
            start = r
        prev = r
    return ", ".join(parts)


# Variables a launcher (mpirun / mpiexec, srun, a PMI or PMIx launcher) gives the ranks it starts:
# a process without any of them is one rank started by hand (`python -m app`, `python -m app.data.prepare`).
LAUNCHER_RANK = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID")

# The subset that wires Open MPI itself (its mpirun, or a PMIx server such as srun --mpi=pmix): without
# them its MPI_Init starts a singleton's runtime daemon, also in a Slurm batch script (SLURM_PROCID=0).
OPEN_MPI_WIRED = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK")

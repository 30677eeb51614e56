"""Checks before the first step that a run can finish: each failure one line naming the cause and
the fix (a `LaunchError`, exit 2 on every rank), never a crash hours later.

- **Parallel HDF5.** Checkpoints are written and read through h5py's mpio driver. A site Python
  whose h5py was built without MPI (the GPU image of issue 38 had one) trained to the end and then
  lost the run at its end-of-training checkpoint; with checkpoints on, such an h5py is refused here.
- **One GPU per rank.** Two ranks of a node on one GPU (mpirun -n 2 on a one-GPU node, a wrong
  --gpus-per-task) made NCCL fail with "invalid usage" a minute in, named as a lost peer. Every
  rank's GPU is identified (its UUID) and the ranks of a node compared.
- **Device memory.** The plan's bytes per rank (app/plan/estimate.py: weights, gradients,
  optimizer state, activations at the deck's micro-batch and recompute) against the GPU's free
  memory: refused above it, a warning above 90%.

The device queries (`h5py_has_mpi`, `gpu_identity`, `gpu_memory`, `host_available`) are the boundary the tests stub;
the checks themselves are pure or collective over the job's MPI communicator.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Optional

from app.errors import LaunchError

if TYPE_CHECKING:
    from app.deck import Deck
    from app.runtime.mpi import Runtime

GIB = 2**30
MEMORY_WARN = 0.9  # of the free memory: warn above, refuse above 1


def h5py_has_mpi() -> bool:
    """Whether this Python's h5py was built against parallel HDF5 (the mpio driver)."""
    import h5py

    return bool(h5py.get_config().mpi)


def gpu_identity(device: Any) -> Optional[str]:
    """This rank's GPU, as one name per physical device (its UUID); None on a CPU."""
    if getattr(device, "type", "cpu") != "cuda":
        return None
    import torch

    props = torch.cuda.get_device_properties(device)
    return f"{props.name} {getattr(props, 'uuid', device.index)}"


def gpu_memory(device: Any) -> Optional[tuple[int, int]]:
    """(free, total) bytes of this rank's GPU now; None on a CPU."""
    if getattr(device, "type", "cpu") != "cuda":
        return None
    import torch

    free, total = torch.cuda.mem_get_info(device)
    return int(free), int(total)


def host_available() -> Optional[int]:
    """Bytes of host memory the kernel could give now (MemAvailable: free plus reclaimable cache);
    None where /proc/meminfo does not say (not Linux)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return None


def checkpoint_io(deck: Deck, has_mpi: bool) -> None:
    """Refuse checkpoints that this h5py cannot write (no MPI), naming both ways out."""
    ck = deck.checkpoint
    if has_mpi or not (ck.every > 0 or ck.at_exit):
        return
    raise LaunchError(
        "this Python's h5py was built without MPI (h5py.get_config().mpi is False), so checkpoints cannot be "
        "written: build h5py against parallel HDF5 (launch/setup.sh does: CC=mpicc HDF5_MPI=ON pip install "
        "--no-binary=h5py h5py), or train without checkpoints (checkpoint.every: 0, checkpoint.at_exit: false)"
    )


def checkpoint_read(path: Any, has_mpi: bool) -> None:
    """Refuse to resume from `path` with an h5py that cannot open it (no MPI)."""
    if not has_mpi:
        raise LaunchError(
            f"cannot resume from {path}: this Python's h5py was built without MPI (h5py.get_config().mpi is "
            "False): build h5py against parallel HDF5 (launch/setup.sh does), or start afresh (run.resume: none)"
        )


def shared_gpus(runtime: Runtime, identity: Optional[str]) -> None:
    """Collective over the job: refuse two ranks of a node on one GPU, naming them, the GPU and the
    binding fix for srun and mpirun. Every rank takes part (an allgather), then all raise alike."""
    everyone = runtime.comm.allgather((runtime.hostname, identity))
    seen: dict[tuple[str, str], list[int]] = {}
    for rank, (host, gpu) in enumerate(everyone):
        if gpu is not None:
            seen.setdefault((host, gpu), []).append(rank)
    shared = [(host, gpu, ranks) for (host, gpu), ranks in seen.items() if len(ranks) > 1]
    if not shared:
        return
    host, gpu, ranks = shared[0]
    more = f" (and {len(shared) - 1} more GPUs shared)" if len(shared) > 1 else ""
    raise LaunchError(
        f"ranks {', '.join(map(str, ranks))} on node {host} all use one GPU ({gpu}){more}: launch one rank per "
        "GPU: srun --ntasks-per-node=<GPUs per node> --gpus-per-task=1 (or --gpu-bind=closest), or mpirun -n "
        "<GPUs> with every GPU visible to every rank (gridlm picks one by local rank)"
    )


def device_memory(deck: Deck, planned: float, memory: Optional[tuple[int, int]], rank: int) -> Optional[str]:
    """Refuse a plan above the GPU's free memory; a warning (returned) above MEMORY_WARN of it."""
    if memory is None:
        return None
    free, total = memory
    tr = deck.train
    what = (
        f"the plan needs {planned / GIB:.2f} GiB on rank {rank} (train.micro_batch {tr.micro_batch}, "
        f"train.recompute {tr.recompute}, optim.zero {deck.optim.zero}); its GPU has {free / GIB:.2f} GiB free "
        f"of {total / GIB:.2f}"
    )
    fix = (
        "lower train.micro_batch, set train.recompute: full, raise optim.zero (1-3) or optim.offload, or spread "
        "the model over more tp/pp ranks (python -m app DECK --dry-run shows the plan)"
    )
    if planned > free:
        raise LaunchError(f"{what}: it does not fit: {fix}")
    if planned > MEMORY_WARN * free:
        return f"warning: {what}: above {MEMORY_WARN:.0%} of it, fragmentation may not leave room: {fix}"
    return None


def preflight(deck: Deck, runtime: Runtime, planned: Callable[[], float]) -> Optional[str]:
    """The checks of this module on this rank (call through `agree`, on every rank); `planned()`:
    the plan's device bytes of this rank (`app.plan.estimate.rank_device_bytes`). A warning to
    log, or None. The collective check runs first, so a local refusal cannot strand a peer in it."""
    shared_gpus(runtime, gpu_identity(runtime.device))
    checkpoint_io(deck, h5py_has_mpi())
    memory = gpu_memory(runtime.device)
    if memory is None:
        return None
    return device_memory(deck, planned(), memory, runtime.rank)

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
from pathlib import Path
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


def host_available(root: Path = Path("/")) -> Optional[int]:
    """Bytes of host memory this process could be given now: MemAvailable (free plus reclaimable
    cache), or less where its cgroup leaves less (Slurm's --mem, a container's limit: found in review,
    the node's memory was taken); None where neither says (not Linux). `root`: where /proc and /sys
    are (tests give a directory of such files)."""
    sources = [_mem_available(root / "proc/meminfo"), cgroup_room(root)]
    known = [bytes_ for bytes_ in sources if bytes_ is not None]
    return min(known) if known else None


def _mem_available(meminfo: Path) -> Optional[int]:
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return None


NO_LIMIT = 2**60  # cgroup v1 writes "no limit" as the largest page count in bytes (about 2**63)
CGROUP_FILES = {  # version: (limit, usage, the reclaimable file cache's key in memory.stat)
    1: ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"),
    2: ("memory.max", "memory.current", "inactive_file"),
}


def cgroup_room(root: Path = Path("/")) -> Optional[int]:
    """Bytes this process's memory cgroup can still be charged before its limit: the least over its
    cgroup and those above it (a limit may sit on a Slurm job above its step's cgroup) of limit -
    usage + inactive file cache (reclaimed first); None where no level has a limit. v2 (memory.max,
    "max": none) and v1 (memory.limit_in_bytes, a huge value: none), at their usual mount points; a
    file missing or odd drops that level."""
    try:
        lines = (root / "proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    rooms = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            version, mount = 2, root / "sys/fs/cgroup"
        elif "memory" in controllers.split(","):
            version, mount = 1, root / "sys/fs/cgroup/memory"
        else:
            continue
        leaf = mount / path.strip().lstrip("/")
        # In a container the mount is often the container's own cgroup, not the path the kernel names.
        level = leaf if leaf.is_dir() else mount
        while True:
            room = _cgroup_level_room(level, version)
            if room is not None:
                rooms.append(room)
            if level == mount or mount not in level.parents:
                break
            level = level.parent
    return min(rooms) if rooms else None


def _cgroup_level_room(directory: Path, version: int) -> Optional[int]:
    limit_file, usage_file, cache_key = CGROUP_FILES[version]
    try:
        limit_text = (directory / limit_file).read_text().strip()
        if limit_text == "max":
            return None
        limit, usage = int(limit_text), int((directory / usage_file).read_text().strip())
    except (OSError, ValueError):
        return None
    if limit >= NO_LIMIT or limit <= 0 or usage < 0:
        return None
    cache = 0
    try:
        for line in (directory / "memory.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == cache_key:
                cache = max(0, min(int(value), usage))
    except (OSError, ValueError):
        cache = 0
    return max(0, limit - usage + cache)


MEMORY_FILESYSTEMS = ("tmpfs", "ramfs")  # a file there is memory, not a drive


def filesystem_type(directory: Path) -> str:
    """The type of the file system holding `directory` (the longest mount point above it in
    /proc/mounts), or "" where Linux does not say."""
    try:
        mounts = [line.split()[1:3] for line in Path("/proc/mounts").read_text().splitlines()]
    except OSError:
        return ""
    target = str(directory.resolve())
    above = [(point, kind) for point, kind in mounts if target == point or target.startswith(point.rstrip("/") + "/")]
    return max(above, key=lambda m: len(m[0]), default=("", ""))[1]


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

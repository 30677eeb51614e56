"""MPI start-up: world, node discovery, device binding, torch.distributed bootstrap.

MPI is the launcher and control plane (srun / mpirun / mpiexec, no torchrun); torch
collectives run over gloo (CPU) or nccl (GPU) groups bootstrapped from MPI: rank 0
opens a TCPStore on a free port and broadcasts its address and port over MPI.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import sys
import time
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, TypeVar

from app.errors import GridlmError, LaunchError
from app.names import OPEN_MPI_WIRED
from app.runtime.groups import Groups
from app.runtime.watchdog import FILES_HEADROOM, STORE_FILES_PER_RANK, AnyWatchdog, NullWatchdog, open_files_needed

if TYPE_CHECKING:
    import torch

T = TypeVar("T")


@dataclass
class Runtime:
    """What one rank knows about the job. Built by `init_mpi`, passed explicitly.

    `comm` is the job's communicator (COMM_WORLD, or a sub-communicator such as COMM_SELF
    for a 1-rank reference run inside a bigger job); `rank`/`world_size` refer to it.
    `placement[r]` is (node index, local rank) of rank r; nodes are numbered by the lowest
    rank they hold, and `node_hosts[n]` is node n's hostname. `global_ranks[r]` is the
    torch.distributed rank of rank r (torch ranks are COMM_WORLD ranks).
    """

    comm: Any
    rank: int
    world_size: int
    local_rank: int
    local_size: int
    node: int
    nodes: int
    hostname: str
    placement: list[tuple[int, int]]
    ranks_per_node_list: list[int]
    global_ranks: list[int]
    node_hosts: list[str] = field(default_factory=list)
    node_cpus: int = 0  # the CPUs the ranks of this rank's node may run on (their affinities' union); 0: unknown
    device: Optional[torch.device] = None  # set by bind_device (torch is imported only then)
    backend: str = "gloo"
    watchdog: AnyWatchdog = field(default_factory=NullWatchdog)  # app.runtime.watchdog; a no-op until started
    store_address: Optional[tuple[str, int]] = None  # the TCPStore (host, port), once torch is bootstrapped
    store_prefix: str = ""  # the job's keys' random prefix in it (the ranks learn it over MPI)
    store: Any = None  # the job's view of the store (a PrefixStore), once torch is bootstrapped
    store_source: str = ""  # where its host came from: GRIDLM_MASTER_ADDR, hostname or loopback
    groups: Groups = field(default_factory=Groups)  # the torch groups its grids make (share with sub-runtimes)
    # Objects that must outlive everything else, e.g. an HDF5 file whose close failed (HDF5 1.10
    # crashes when such a file is released again).
    keep_alive: list[Any] = field(default_factory=list)

    @property
    def ranks_per_node(self) -> int:
        return max(self.ranks_per_node_list)

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    def log(self, *args: Any) -> None:
        """Print on rank 0 only, flushed so job logs follow progress."""
        if self.rank == 0:
            print(*args, flush=True)


def singleton_rsh_agent(environ: MutableMapping[str, str]) -> Optional[str]:
    """Set Open MPI's rsh agent for a process started without a launcher (`python -m app deck`),
    where it is needed; the value set, or None. Such a process's MPI_Init starts a runtime daemon
    whose rsh launcher aborts it ("Local abort before MPI_INIT completed") when neither ssh nor rsh
    is on PATH, as in a bare GPU container (measured on an H200 image, 2026-11-29). Any program on
    PATH satisfies the check; none is run for one local process. Ranks Open MPI's own launcher wired
    and a site's own setting are left as they are; a Slurm batch script's process (SLURM_PROCID=0) or
    one with another MPI's PMI_RANK is still a singleton to Open MPI (found in review); other MPIs
    ignore the variable."""
    if any(key in environ for key in OPEN_MPI_WIRED) or "OMPI_MCA_plm_rsh_agent" in environ:
        return None
    path = environ.get("PATH", os.defpath)
    if shutil.which("ssh", path=path) or shutil.which("rsh", path=path) or not shutil.which("false", path=path):
        return None
    environ["OMPI_MCA_plm_rsh_agent"] = "false"
    return "false"


# Where a launcher says how many tasks it started: Open MPI's mpirun, a PMI-1/2 launcher (MPICH's
# hydra, srun --mpi=pmi2), and Slurm's srun step (last: an mpirun inside an allocation runs its own
# daemons as a step of as many tasks as nodes, and says its own size first).
LAUNCHER_SIZES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_STEP_NUM_TASKS")


def unwired_launch(environ: Mapping[str, str], world_size: int) -> Optional[str]:
    """Why this rank is alone in a job its launcher started several tasks of, or None: each task an
    MPI world of its own (srun without --mpi=pmix, or an mpi4py built against another MPI than the
    launcher's), which would train N copies of one rank, or refuse the grid, or say the run
    directory is in use by the job itself (found in review)."""
    name = next((v for v in LAUNCHER_SIZES if environ.get(v, "").strip()), None)
    if world_size != 1 or name is None:
        return None
    try:
        tasks = int(environ[name])
    except ValueError:
        return None
    if tasks <= 1:
        return None
    return (
        f"the launcher started {tasks} tasks ({name}={tasks}) but MPI sees 1 rank in each: the MPI library "
        "that mpi4py uses is not wired to this launcher. With Slurm: srun --mpi=pmix (srun --mpi=list shows "
        "the plugins); or launch with that MPI's own mpirun; or build mpi4py against the site's MPI "
        "(docs/RUNNING.md)"
    )


def init_mpi(comm: Any = None) -> Runtime:
    """Discover rank, size and the node layout with `Split_type(COMM_TYPE_SHARED)`."""
    singleton_rsh_agent(os.environ)  # before mpi4py's import initialises MPI
    from mpi4py import MPI

    comm = comm if comm is not None else MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    node_comm = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    local_rank, local_size = node_comm.Get_rank(), node_comm.Get_size()
    # A node is named by the lowest world rank it holds; everyone learns everyone's placement.
    node_first = node_comm.allreduce(rank, op=MPI.MIN)
    # A bit per CPU: the node's ranks may share a cpuset smaller than the machine (set_threads).
    node_cpus = bin(node_comm.allreduce(sum(1 << cpu for cpu in usable_cpus()), op=MPI.BOR)).count("1")
    node_comm.Free()
    hostname = socket.gethostname()
    everyone = comm.allgather((node_first, local_rank, hostname))
    node_ids = {r0: i for i, r0 in enumerate(sorted({first for first, _, _ in everyone}))}
    placement = [(node_ids[first], local) for first, local, _ in everyone]
    node_hosts = [""] * len(node_ids)
    for first, _, host in everyone:
        node_hosts[node_ids[first]] = host
    per_node = [0] * len(node_ids)
    for node, _ in placement:
        per_node[node] += 1
    return Runtime(
        comm=comm,
        rank=rank,
        world_size=size,
        local_rank=local_rank,
        local_size=local_size,
        node=placement[rank][0],
        nodes=len(node_ids),
        hostname=hostname,
        placement=placement,
        ranks_per_node_list=per_node,
        global_ranks=comm.allgather(MPI.COMM_WORLD.Get_rank()),
        node_hosts=node_hosts,
        node_cpus=node_cpus,
    )


def node_summary(runtime: Runtime, most: int = 4) -> str:
    """The nodes and their ranks, for a log line: "gridlm-node1 (ranks 0-3), gridlm-node2 (ranks 4-7)";
    the first `most` nodes, then how many more."""
    from app.names import rank_ranges

    ranks: list[list[int]] = [[] for _ in runtime.node_hosts]
    for r, (node, _) in enumerate(runtime.placement):
        ranks[node].append(r)
    shown = [f"{host} (ranks {rank_ranges(rs)})" for host, rs in zip(runtime.node_hosts[:most], ranks)]
    more = len(runtime.node_hosts) - most
    return ", ".join(shown) + (f" and {more} more" if more > 0 else "")


def bind_device(runtime: Runtime, want: str = "auto") -> None:
    """Pick this rank's device: one GPU per rank on the node when GPUs are visible.

    Works both when the launcher gives each rank one GPU (`--gpus-per-task=1`, so a rank
    sees device 0) and when every rank sees all of the node's GPUs (local rank picks one).
    Collective over `runtime.comm` unless `want` is cpu: the ranks agree on one device type
    (`devices_agree`), so a node without a visible GPU is named at once on every rank.
    """
    import torch

    has_cuda = want != "cpu" and devices_agree(runtime, torch.cuda.is_available(), want)
    if not has_cuda:
        runtime.device, runtime.backend = torch.device("cpu"), "gloo"
        return
    index = device_index(
        runtime.local_rank, runtime.local_size, torch.cuda.device_count(), runtime.hostname,
        os.environ.get(GPU_ORDER_VAR),
    )  # fmt: skip
    torch.cuda.set_device(index)
    runtime.device, runtime.backend = torch.device("cuda", index), "nccl"


def devices_agree(runtime: Runtime, has_cuda: bool, want: str = "auto", most: int = 4) -> bool:
    """Collective: whether the job's ranks use GPUs, given whether this rank sees one (`has_cuda`)
    and run.device (`want`: auto or cuda). Some ranks with a GPU and some without would each pick
    their own backend (nccl, gloo) and wait for each other in init_process_group until the watchdog
    named them stuck (found in review); that, or cuda with none visible, is a LaunchError on every
    rank naming the nodes without a GPU (the first `most`, then how many more) and the fix."""
    import numpy as np
    from mpi4py import MPI

    from app.names import rank_ranges

    # One allreduce when the ranks agree; the ranks' answers only when they do not.
    seen = np.array([int(has_cuda), int(not has_cuda)], dtype=np.int32)
    with runtime.watchdog.blocking("MPI_Allreduce (devices)", axis="world"):
        runtime.comm.Allreduce(MPI.IN_PLACE, seen, op=MPI.MAX)
    if not seen[1]:
        return True
    if not seen[0] and want != "cuda":
        return False
    with runtime.watchdog.blocking("MPI_Allgather (devices)", axis="world"):
        everyone = runtime.comm.allgather(has_cuda)
    without: dict[int, list[int]] = {}
    for rank, gpu in enumerate(everyone):
        if not gpu:
            without.setdefault(runtime.placement[rank][0], []).append(rank)
    where = [
        f"rank{'s' if len(ranks) > 1 else ''} {rank_ranges(ranks)} on {runtime.node_hosts[node]}"
        for node, ranks in without.items()
    ]
    more = f" and {len(where) - most} more nodes" if len(where) > most else ""
    blind = ", ".join(where[:most]) + more
    if not seen[0]:
        raise LaunchError(f"run.device = cuda but no GPU is visible to {blind}: use run.device: cpu or auto")
    sighted = sum(everyone)
    raise LaunchError(
        f"run.device = {want}: no GPU is visible to {blind}, while {sighted} rank(s) see one; the job cannot mix "
        "CPU (gloo) and GPU (nccl) ranks: give every rank one GPU on every node (--gpus-per-task=1, or check "
        "CUDA_VISIBLE_DEVICES and nvidia-smi on those nodes), or set run.device: cpu"
    )


GPU_ORDER_VAR = "GRIDLM_GPU_ORDER"


def device_index(
    local_rank: int, local_size: int, visible: int, hostname: str = "this node", order: Optional[str] = None
) -> int:
    """The GPU a rank uses among the `visible` ones, under either launch style.

    One device per rank (`srun --gpus-per-task=1`, `--gpu-bind=closest`): every rank sees one
    device and uses it (index 0). All devices visible (`--gpus-per-node`, `mpiexec`): the rank's
    local rank on the node (from MPI's shared-memory communicator) picks one: device `local_rank`,
    or entry `local_rank` of `order` (GRIDLM_GPU_ORDER, e.g. "3,2,1,0" on Polaris, whose GPU 0 is
    next to the cores mpiexec gives local rank 3). More ranks on a node than visible devices would
    put two ranks on one GPU: a launch error.
    """
    if visible == 1:
        return 0
    if local_size > visible:
        raise LaunchError(
            f"{local_size} ranks on node {hostname} share {visible} visible GPUs; launch one rank per GPU "
            "(e.g. srun --ntasks-per-node equal to the GPUs per node, or --gpus-per-task=1)"
        )
    if not order:
        return local_rank
    fix = f"set {GPU_ORDER_VAR} to the GPU of each local rank, e.g. {','.join(map(str, range(visible - 1, -1, -1)))}"
    try:
        devices = [int(word) for word in order.split(",")]
    except ValueError:
        raise LaunchError(f"{GPU_ORDER_VAR}={order!r} is not a comma-separated list of GPU indices; {fix}") from None
    if len(set(devices)) != len(devices) or not all(0 <= d < visible for d in devices):
        raise LaunchError(
            f"{GPU_ORDER_VAR}={order!r} must name distinct GPUs 0 .. {visible - 1} of node {hostname}; {fix}"
        )
    if local_size > len(devices):
        raise LaunchError(
            f"{GPU_ORDER_VAR}={order!r} names {len(devices)} GPUs for {local_size} ranks on node {hostname}; {fix}"
        )
    return devices[local_rank]


def usable_cpus() -> set[int]:
    """The logical CPUs this process may run on (its affinity), or all of the machine's where the OS
    does not say."""
    return os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, where the OS tells it)."""
    return len(usable_cpus())


def physical_cores(cpus: Optional[set[int]] = None, sysfs: Path = Path("/sys/devices/system/cpu")) -> int:
    """The physical cores among `cpus` (default: this process's affinity): a core's hardware threads
    count once (Slurm's -c on Perlmutter gives a rank 2 threads of each of its cores), as sysfs says;
    every CPU counts where sysfs does not."""
    if cpus is None:
        cpus = usable_cpus()
    try:
        cores = {
            ((sysfs / f"cpu{cpu}/topology/physical_package_id").read_text().strip(),
             (sysfs / f"cpu{cpu}/topology/core_id").read_text().strip())
            for cpu in cpus
        }  # fmt: skip
    except OSError:
        return max(1, len(cpus))
    return max(1, len(cores))


def threads_per_rank(
    cpus: set[int], node_cpus: int, local_size: int, sysfs: Path = Path("/sys/devices/system/cpu")
) -> int:
    """Torch threads for a rank that may run on `cpus`, beside `local_size` ranks of its node that
    together may run on `node_cpus` CPUs: the physical cores of `cpus` (hardware threads of one core
    share its floating-point units: threads on both gain nothing and contend), at most the node's
    CPUs divided among its ranks. Found in review: the cap was the machine's CPUs, so 8 ranks in a
    cpuset of 8 CPUs on a 128-CPU node took 8 threads each."""
    return max(1, min(physical_cores(cpus, sysfs), node_cpus // max(1, local_size)))


def set_threads(runtime: Runtime, threads: Optional[int]) -> int:
    """Torch intra-op threads per rank: the deck's value, else `threads_per_rank` of the rank's CPU
    set and its node's (the union of the node's ranks' sets, `Runtime.node_cpus`)."""
    if threads is None:
        node_cpus = runtime.node_cpus or os.cpu_count() or 1  # a Runtime not made by init_mpi: the machine's
        threads = threads_per_rank(usable_cpus(), node_cpus, runtime.local_size)
    import torch

    torch.set_num_threads(threads)
    return threads


def _mallopt() -> Optional[Callable[[int, int], bool]]:
    """glibc's `mallopt(param, value)`, or None (not Linux, or a C library without it: musl)."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return None
    return lambda param, value: bool(mallopt(ctypes.c_int(param), ctypes.c_int(value)))


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # malloc.h
GLIBC_TRIM_THRESHOLD = 128 * 1024  # glibc's default M_TRIM_THRESHOLD (bytes)


def set_malloc_mmap_threshold(kib: int) -> bool:
    """Fix glibc's mmap threshold at `kib` KiB (0: leave glibc's default); True if it was set.

    glibc raises its threshold to the size of each mmapped block it frees, up to 32 MiB, and serves
    later blocks below it from the heap, which it trims only from the top. Tensors of a few MiB
    freed in a varying order (initialising a ZeRO-3 shard, gloo's collective temporaries) then stay
    resident: measured 2.0 GB against 0.6 GB per rank when building a 218M-parameter ZeRO-3 model on
    4 ranks. A fixed threshold (glibc `mallopt(M_MMAP_THRESHOLD)`) gives a freed tensor's pages back.
    A user's MALLOC_MMAP_THRESHOLD_ wins; other C libraries are left alone.
    """
    mallopt = _mallopt()
    if kib == 0 or "MALLOC_MMAP_THRESHOLD_" in os.environ or mallopt is None:
        return False
    return mallopt(M_MMAP_THRESHOLD, kib * 1024)


def warm_heap(nbytes: int, piece: int = 64 * 1024) -> bool:
    """Give this process a heap of `nbytes` already-touched free memory, as a training step leaves:
    its many activations below the mmap threshold grow the heap, and later temporaries of a few MiB
    are cut from that free memory instead of being mmapped and page-faulted afresh (measured on this
    machine, threshold 1 MiB: a 2 MiB `double().pow(2)` 64-80 us inside a run, 1.4-1.7 ms in a fresh
    process; after this call 76 us). glibc's trim threshold is raised so the freed top stays;
    `cool_heap` lowers it again. False where glibc's mallopt is not there."""
    mallopt = _mallopt()
    if mallopt is None or not mallopt(M_TRIM_THRESHOLD, 2 * nbytes):
        return False
    import torch

    # Pieces below glibc's smallest default threshold (128 KiB) come from the heap whatever it is set to.
    pieces = [torch.zeros(piece // 4) for _ in range(max(1, nbytes // piece))]
    del pieces
    return True


def cool_heap() -> None:
    """glibc's default trim threshold again (after `warm_heap`): the free top goes back to the system."""
    mallopt = _mallopt()
    if mallopt is not None:
        mallopt(M_TRIM_THRESHOLD, GLIBC_TRIM_THRESHOLD)


def raise_open_files_limit() -> int:
    """Raise this process's soft limit on open files (RLIMIT_NOFILE) to its hard limit, which any
    process may do (a soft limit of 1024 breaks rank 0 from ~490 ranks); the soft limit now (-1:
    unlimited)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == hard:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError):  # an unlimited hard limit above the kernel's nr_open: keep what we have
        return soft
    return hard


def open_files_refusal(world_size: int, limit: int, hostname: str) -> Optional[str]:
    """Why rank 0 cannot serve a job of `world_size` ranks with `limit` open files (its soft limit,
    already raised to the hard one), or None."""
    need = open_files_needed(world_size)
    if limit < 0 or limit >= need:
        return None
    return (
        f"rank 0 on {hostname} may open {limit} files (ulimit -n, its hard limit) but a job of {world_size} ranks "
        f"needs about {need} there ({STORE_FILES_PER_RANK} x world + {FILES_HEADROOM}: it serves every rank the "
        f"TCPStore): raise the limit before the launch (ulimit -n {need} in the job script; a hard limit is the "
        "site's: /etc/security/limits.conf, Slurm's PropagateResourceLimits) or launch fewer ranks"
    )


def init_torch_distributed(
    runtime: Runtime, backend: str = "auto", timeout_s: float = 600.0, connect_s: float = 60.0
) -> None:
    """Bootstrap torch.distributed from MPI: rank 0 hosts the TCPStore, MPI carries its address.

    The store's host is checked on rank 0 and reached by every rank within `connect_s` before any
    rank waits in `init_process_group` (app.runtime.rendezvous); a failure is a LaunchError on
    every rank."""
    import torch.distributed as dist

    from app.runtime.rendezvous import ENV, choose_host, listening_socket, probe, unreachable_message

    if backend != "auto":
        if backend == "nccl" and runtime.device.type != "cuda":
            raise LaunchError("parallel.backend = nccl needs GPUs; use parallel.backend: auto or gloo")
        runtime.backend = backend
    timeout = timedelta(seconds=timeout_s)
    store, chosen = None, None
    files = raise_open_files_limit()  # every rank: gloo connects each to the members of its groups
    if runtime.rank == 0:
        # A single node talks over loopback; across nodes ranks reach rank 0 by hostname, or at
        # GRIDLM_MASTER_ADDR (when the hostname resolves to the wrong interface).
        try:
            # Refused now, on every rank (through the broadcast below), rather than as a peer lost
            # to "Too many open files" in some new_group later.
            refusal = open_files_refusal(runtime.world_size, files, runtime.hostname)
            if refusal is not None:
                raise LaunchError(refusal)
            chosen = choose_host(os.environ.get(ENV), runtime.nodes, runtime.hostname)
            # Served on the chosen address only (loopback for one node), not on every interface.
            fd = listening_socket(chosen.host)
            store = dist.TCPStore(
                chosen.host, 0, runtime.world_size, is_master=True, timeout=timeout, wait_for_workers=False,
                master_listen_fd=fd,
            )  # fmt: skip
            # The job's keys live under a random prefix only its ranks learn (over MPI): a process that
            # connects to the port can neither read nor plant them.
            chosen = (chosen.host, store.port, chosen.source, f"gridlm-{secrets.token_hex(16)}/")
        except LaunchError as err:
            chosen = str(err)
        except (RuntimeError, OSError) as err:  # torch's DistNetworkError, or the socket: no port, address refused
            chosen = f"rank 0 on {runtime.hostname} could not open the TCPStore at {chosen.host}: {err}"
    with runtime.watchdog.blocking("MPI_Bcast (TCPStore address)"):
        chosen = runtime.comm.bcast(chosen, root=0)
    if isinstance(chosen, str):  # rank 0 refused the address: the same error everywhere
        raise LaunchError(chosen)
    host, port, source, prefix = chosen
    # Every rank reaches the store before any waits on it; MPI carries the verdict.
    mine = None if runtime.rank == 0 else probe(host, port, connect_s)
    ifname = os.environ.get("GLOO_SOCKET_IFNAME", "")
    table = interface_table() if runtime.backend == "gloo" else None
    unusable = gloo_interface_problems(ifname, table) if table is not None else []
    here = (runtime.hostname, unusable, usable_interfaces(table)) if unusable else None
    bad = failures(runtime, here, "MPI_Allreduce (GLOO_SOCKET_IFNAME)")
    if bad:
        rank, (node, problems, usable) = bad[0]
        raise LaunchError(
            f"GLOO_SOCKET_IFNAME={ifname!r}: {'; '.join(problems)} on node {node} (rank {rank}; interfaces up with an "
            f"address there: {', '.join(usable) or 'none'}): gloo cannot use it: set it to interfaces every node "
            "has, up with an address (ip -br addr), comma-separated without spaces, or unset it"
        )
    failed = failures(runtime, None if mine is None else (runtime.hostname, mine), "MPI_Allreduce (rendezvous)")
    if failed:
        raise LaunchError(unreachable_message(host, port, source, failed))
    with runtime.watchdog.blocking("init_process_group"):
        if runtime.rank != 0:
            store = dist.TCPStore(host, port, runtime.world_size, is_master=False, timeout=timeout)
        runtime.store = dist.PrefixStore(prefix, store)
        dist.init_process_group(
            runtime.backend, store=runtime.store, rank=runtime.rank, world_size=runtime.world_size, timeout=timeout
        )
    runtime.store_address = (host, port)
    runtime.store_prefix = prefix
    runtime.store_source = source


IFF_UP = 0x1  # <net/if.h>


def interface_table() -> Optional[dict[str, tuple[bool, bool]]]:
    """This host's network interfaces as gloo looks them up (getifaddrs): name -> (up, has an IPv4 or
    IPv6 address); None where that cannot be asked (not Linux, no getifaddrs in the C library)."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    class Sockaddr(ctypes.Structure):
        _fields_ = [("sa_family", ctypes.c_ushort)]  # Linux's layout

    class Ifaddrs(ctypes.Structure):
        pass

    Ifaddrs._fields_ = [  # the leading fields of struct ifaddrs, all this reads
        ("ifa_next", ctypes.POINTER(Ifaddrs)),
        ("ifa_name", ctypes.c_char_p),
        ("ifa_flags", ctypes.c_uint),
        ("ifa_addr", ctypes.POINTER(Sockaddr)),
    ]
    try:
        libc = ctypes.CDLL(None)
        getifaddrs, freeifaddrs = libc.getifaddrs, libc.freeifaddrs
    except (OSError, AttributeError):
        return None
    head = ctypes.POINTER(Ifaddrs)()
    if getifaddrs(ctypes.byref(head)) != 0:
        return None
    table = {name: (False, False) for _, name in socket.if_nameindex()}
    try:
        entry = head
        while entry:
            ifa = entry.contents
            name = ifa.ifa_name.decode(errors="replace")
            up, addressed = table.get(name, (False, False))
            family = ifa.ifa_addr.contents.sa_family if ifa.ifa_addr else None
            table[name] = (up or bool(ifa.ifa_flags & IFF_UP), addressed or family in (socket.AF_INET, socket.AF_INET6))
            entry = ifa.ifa_next
    finally:
        freeifaddrs(head)
    return table


def usable_interfaces(table: Mapping[str, tuple[bool, bool]]) -> list[str]:
    """The interfaces of `table` (`interface_table`) gloo can take: up, with an address."""
    return sorted(name for name, (up, addressed) in table.items() if up and addressed)


def gloo_interface_problems(value: str, table: Mapping[str, tuple[bool, bool]]) -> list[str]:
    """Why gloo cannot use a GLOO_SOCKET_IFNAME value on a host whose interfaces are `table`
    (`interface_table`), one phrase per name, or []. As torch and gloo read it (and app/runtime/groups.py,
    which takes the first name): names split at commas, one trailing comma dropped, each taken as
    written and needing an IPv4 or IPv6 address on an interface that is up. Found in review: an
    interface without an address (ifb0, ib0 without IPoIB) or a space after a comma passed the check,
    and gloo's "Unable to find address" was then read as a lost peer (exit 4)."""
    if value in ("", ","):  # torch ignores a value of one character; groups.py an empty first name
        return []
    names = value.split(",")
    if len(names) > 1 and names[-1] == "":
        names.pop()
    problems = []
    for name in names:
        up, addressed = table.get(name, (False, False))
        if not name:
            problems.append("an empty name (a leading or doubled comma)")
        elif name != name.strip():
            problems.append(f"{name!r} has spaces around it (gloo takes each name as written)")
        elif name not in table:
            problems.append(f"no interface {name}")
        elif not addressed:
            problems.append(f"{name} has no IPv4 or IPv6 address")
        elif not up:
            problems.append(f"{name} is down")
    return problems


def shutdown(runtime: Runtime) -> None:
    """Destroy torch.distributed's groups, if it was ever started: a job that ended before (a deck
    error) does not import torch for this (a second of CPU per rank)."""
    if "torch.distributed" not in sys.modules:
        return
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def abort(runtime: Optional[Runtime], code: int) -> None:
    """End every rank now (a failure on one rank must not leave the others in a collective)."""
    sys.stdout.flush()
    sys.stderr.flush()
    if runtime is not None and runtime.world_size > 1:
        runtime.comm.Abort(code)
    sys.exit(code)


def agree(runtime: Runtime, fn: Callable[[], T]) -> T:
    """Run `fn` on every rank; if it raises a user error on any rank, every rank raises it.

    Rank-local problems (a file one node cannot see, a missing GPU) thus end the job on all
    ranks with the same message instead of leaving the healthy ranks in a collective.
    """
    error: Optional[str] = None
    kind: type = GridlmError
    result = None
    try:
        result = fn()
    except GridlmError as err:
        error, kind = str(err), type(err)
    # One small allreduce when all went well (cheap enough for every step); messages after a failure.
    mine = None if error is None else (error, kind, runtime.hostname)
    failed = failures(runtime, mine, "MPI_Allreduce (agree)")
    if failed:
        rank, (message, kind, host) = failed[0]
        if len(failed) < runtime.world_size:  # rank-local: say where, the other ranks were fine
            message += f" (rank {rank} on {host})"
        _raise(kind, message)
    return result  # type: ignore[return-value]


def _raise(kind: type, message: str) -> None:
    """Raise `kind(message)`; error classes with richer constructors come back as GridlmError."""
    try:
        error = kind(message)
    except TypeError:
        error = GridlmError(message)
    raise error


def settle(comm: Any, interval: float = 0.002, timeout: Optional[float] = None) -> bool:
    """Wait until every rank of `comm` gets here, sleeping `interval` seconds between checks of an
    MPI_Ibarrier: a rank blocked in an Open MPI collective spins, and ranks that wait while others
    compute on the same cores would take those cores' time from them. False if `timeout` seconds
    passed first (the barrier is then left pending: the caller is expected to abort)."""
    request, start = comm.Ibarrier(), time.monotonic()
    while not request.Test():
        if timeout is not None and time.monotonic() - start > timeout:
            return False
        time.sleep(interval)
    return True


def on_root(runtime: Runtime, fn: Callable[[], T]) -> T:
    """Run `fn` on rank 0 only (file-system checks: one rank, not thousands) and broadcast its
    result; a user error there is raised on every rank."""
    result, error, kind = None, None, GridlmError
    if runtime.rank == 0:
        try:
            result = fn()
        except GridlmError as err:
            error, kind = str(err), type(err)
    with runtime.watchdog.blocking("MPI_Bcast (on_root)"):
        result, error, kind = runtime.comm.bcast((result, error, kind), root=0)
    if error is not None:
        _raise(kind, error)
    return result  # type: ignore[return-value]


def failures(runtime: Runtime, mine: Optional[T], op: str = "MPI_Allreduce (failures)") -> list[tuple[int, T]]:
    """Agree whether a step failed anywhere: each rank passes None or a picklable description of
    its own failure; every rank gets [] when none failed, else every (rank, description), in rank
    order. Unlike `agree` it raises nothing, so the caller can first leave a shared resource (an
    MPI-IO file) together. One MPI_Allreduce of one int when all went well (~10 us: affordable
    per dataset of a checkpoint); an allgather more after a failure."""
    import numpy as np
    from mpi4py import MPI

    flag = np.array([0 if mine is None else 1], dtype=np.int32)
    with runtime.watchdog.blocking(op, axis="world"):
        runtime.comm.Allreduce(MPI.IN_PLACE, flag, op=MPI.MAX)
    if not flag[0]:
        return []
    with runtime.watchdog.blocking("MPI_Allgather (failures)", axis="world"):
        everyone = runtime.comm.allgather(mine)
    return [(rank, failure) for rank, failure in enumerate(everyone) if failure is not None]

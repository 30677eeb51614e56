"""Review of a job's start and end on every rank (app/job.py, app/runtime/rendezvous.py,
app/runtime/mpi.py): each case a fault found in review, its test failing before the fix."""

from __future__ import annotations

import os
import socket
import sys

import pytest

from app.errors import LaunchError
from app.runtime.mpi import interface_table
from app.runtime.rendezvous import choose_host
from conftest import fake_cpu_topology, run_mpi

# A user error raised by one rank only, after start-up, while its peer waits for it in a collective
# (a file only its node cannot read, a check that depends on the rank's device).
ONE_RANK_USER_ERROR = """
import sys
from app.errors import DataError
from app.job import deck_file, run_job
from app.runtime.process import exit_now

def body(deck, runtime, grid):
    import torch
    import torch.distributed as dist

    if runtime.rank == 1:
        raise DataError("planted: data file /scratch/x does not exist on this node")
    with runtime.watchdog.blocking("all_reduce", "dp"):
        dist.all_reduce(torch.ones(1), group=grid.group["dp"])

exit_now(run_job(deck_file("inputs/gpt_tiny.yaml", tuple(sys.argv[1:])), body))
"""


def test_a_user_error_raised_on_one_rank_only_is_printed_by_it_and_ends_the_job_with_its_status(tmp_path):
    """Found in review: rank 1's GridlmError was printed by rank 0 only (which never raised it), so
    its message was lost, and rank 0 waited in its all_reduce until its watchdog called rank 1
    stopped or dead (exit 4, after run.comm_timeout_s: 30 minutes by default)."""
    script = tmp_path / "one_rank_error.py"
    script.write_text(ONE_RANK_USER_ERROR)
    out = run_mpi(2, sys.executable, str(script), "run.comm_timeout_s=20", f"run.dir={tmp_path / 'run'}")
    text = out.stdout + out.stderr
    assert out.returncode == 2, text
    assert "gridlm: planted: data file /scratch/x does not exist on this node (rank 1 on " in out.stderr, text
    assert "watchdog" not in text and "Traceback" not in text


@pytest.mark.parametrize("nodes", [2, 64])
def test_rank_0_s_hostname_on_loopback_is_refused_at_once_in_a_multi_node_job(nodes):
    """Found in review: with GRIDLM_MASTER_ADDR unset, a hostname that resolves to loopback on rank
    0's node (Debian's `127.0.1.1 HOST` line in /etc/hosts) was taken; the store then listened on
    loopback only, and every other node's ranks failed to connect a minute later with a fix that
    said to unset the variable, which was not set. `localhost` resolves to loopback everywhere."""
    with pytest.raises(LaunchError) as err:
        choose_host(None, nodes, "localhost")
    message = str(err.value)
    assert "rank 0's hostname localhost resolves to" in message and "a loopback address" in message
    assert f"spans {nodes} nodes" in message and "set GRIDLM_MASTER_ADDR" in message
    # One node keeps loopback; a hostname that does not resolve is left to the store's own message.
    assert choose_host(None, 1, "localhost").host == "127.0.0.1"
    assert choose_host(None, nodes, "no-such-host.invalid").source == "hostname"


@pytest.mark.mpi(min_size=2)
def test_ranks_with_and_without_a_gpu_are_refused_on_every_rank_naming_the_nodes_without(runtime):
    """Found in review: with run.device auto each rank chose cpu/gloo or cuda/nccl by itself, so a node
    without a visible GPU left the job in init_process_group with two backends until the watchdog
    named stuck ranks (30 minutes by default). The ranks now agree first (`devices_agree`, real MPI;
    what a rank sees is the argument)."""
    from app.runtime.mpi import devices_agree

    with pytest.raises(LaunchError) as err:
        devices_agree(runtime, has_cuda=runtime.rank != 0)
    message = str(err.value)
    assert message.startswith(f"run.device = auto: no GPU is visible to rank 0 on {runtime.node_hosts[0]}, ")
    assert f"while {runtime.world_size - 1} rank(s) see one" in message
    assert "one GPU on every node" in message and "run.device: cpu" in message
    # Every rank raised the same line (agree prints it once).
    assert len(set(runtime.comm.allgather(message))) == 1
    assert devices_agree(runtime, True) is True and devices_agree(runtime, False) is False
    with pytest.raises(LaunchError, match=r"run.device = cuda but no GPU is visible to ranks 0-"):
        devices_agree(runtime, False, "cuda")


# Rank 1 sees two GPUs (what torch says of them stubbed: this machine has none), rank 0 none.
ONE_RANK_WITH_GPUS = """
import os, sys
import torch

if os.environ["OMPI_COMM_WORLD_RANK"] == "1":
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 2
    torch.cuda.set_device = lambda index: None
from app.__main__ import run
from app.runtime.process import exit_now

exit_now(run(sys.argv[1:]))
"""


def test_a_node_without_a_visible_gpu_in_a_gpu_job_ends_it_at_once_naming_the_node(tmp_path):
    """The whole job: one line naming the rank and node without a GPU and the fix, exit 2 on every
    rank, no traceback, no watchdog (before the fix: rank 1 went on to nccl, rank 0 to gloo)."""
    script = tmp_path / "one_rank_with_gpus.py"
    script.write_text(ONE_RANK_WITH_GPUS)
    sets = ["run.comm_timeout_s=30", f"run.dir={tmp_path / 'run'}", "train.steps=1", "run.resume=none"]
    out = run_mpi(2, sys.executable, str(script), "inputs/gpt_tiny.yaml", *(a for s in sets for a in ("--set", s)))
    text = out.stdout + out.stderr
    assert out.returncode == 2, text[-3000:]
    lines = [line for line in text.splitlines() if line.startswith("gridlm: ")]
    assert len(lines) == 1 and lines[0].startswith("gridlm: run.device = auto: no GPU is visible to rank 0 on "), text
    assert "while 1 rank(s) see one" in lines[0] and "run.device: cpu" in lines[0]
    assert "Traceback" not in text and "watchdog" not in text


def test_gloo_interface_names_are_checked_as_gloo_reads_them():
    """Found in review: GLOO_SOCKET_IFNAME naming an interface without an address (ifb0 here, ib0 without
    IPoIB) or with a space after its comma passed the check (names were stripped, only existence
    checked); gloo then failed in init_process_group ("Unable to find address for: ifb0"), which the
    watchdog reads as a lost peer (exit 4). The table is this host's as getifaddrs gives it, or made up."""
    from app.runtime.mpi import gloo_interface_problems, interface_table, usable_interfaces

    table = {"lo": (True, True), "eth0": (True, True), "ib0": (True, False), "eth1": (False, True)}
    assert gloo_interface_problems("eth0", table) == [] and gloo_interface_problems("lo,eth0,", table) == []
    assert gloo_interface_problems("", table) == [] and gloo_interface_problems(",", table) == []  # torch ignores
    assert gloo_interface_problems("ib0", table) == ["ib0 has no IPv4 or IPv6 address"]
    assert gloo_interface_problems("lo, eth0", table) == [
        "' eth0' has spaces around it (gloo takes each name as written)"
    ]
    assert gloo_interface_problems("eth0 ", table) == ["'eth0 ' has spaces around it (gloo takes each name as written)"]
    assert gloo_interface_problems("eth1,nosuchif0", table) == ["eth1 is down", "no interface nosuchif0"]
    assert gloo_interface_problems("lo,,eth0", table) == ["an empty name (a leading or doubled comma)"]
    assert usable_interfaces(table) == ["eth0", "lo"]
    here = interface_table()
    assert here is not None and {name for _, name in socket.if_nameindex()} <= set(here)
    assert here["lo"] == (True, True) and gloo_interface_problems("lo", here) == []


NO_ADDRESS = [name for name, (up, addressed) in (interface_table() or {}).items() if not addressed]  # ifb0 here


@pytest.mark.parametrize("case", ["spaces", *(f"no address: {name}" for name in NO_ADDRESS[:1])])
def test_an_unusable_gloo_interface_ends_the_job_with_exit_2_naming_it(tmp_path, case):
    """The whole job under mpirun: one line naming the interface and the fix, exit 2, no lost peer."""
    name = "lo, lo" if case == "spaces" else case.removeprefix("no address: ")
    sets = ["run.comm_timeout_s=30", f"run.dir={tmp_path / 'run'}", "train.steps=1", "run.resume=none"]
    out = run_mpi(2, "-x", f"GLOO_SOCKET_IFNAME={name}", sys.executable, "-m", "app", "inputs/gpt_tiny.yaml",
                  *(a for s in sets for a in ("--set", s)))  # fmt: skip
    text = out.stdout + out.stderr
    assert out.returncode == 2, text[-3000:]
    lines = [line for line in text.splitlines() if line.startswith("gridlm: ")]
    assert len(lines) == 1 and lines[0].startswith(f"gridlm: GLOO_SOCKET_IFNAME={name!r}: "), text[-3000:]
    why = "' lo' has spaces around it" if case == "spaces" else f"{name} has no IPv4 or IPv6 address"
    assert why in lines[0] and "unset it" in lines[0]
    assert "lost its peer" not in text and "Traceback" not in text


def test_threads_share_the_cpus_the_node_s_ranks_may_run_on_not_the_machine_s(monkeypatch):
    """Found in review: the cap on a rank's torch threads was the machine's CPUs / ranks per node, so
    8 ranks in one cpuset of 8 CPUs (Slurm, a container) on a 128-CPU node took 8 threads each: 64
    threads on 8 CPUs. What the OS says (CPU count, affinity) is made up here; the union of the node's
    ranks' sets is `Runtime.node_cpus` (init_mpi, the next test)."""
    import torch

    from app.runtime.mpi import Runtime, set_threads

    monkeypatch.setattr(os, "cpu_count", lambda: 128)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    placement = [(0, r) for r in range(8)]
    runtime = Runtime(None, 0, 8, 0, 8, 0, 1, "n1", placement, [8], list(range(8)), ["n1"], node_cpus=8)
    before = torch.get_num_threads()
    try:
        assert set_threads(runtime, None) == 1 and torch.get_num_threads() == 1
        assert set_threads(runtime, 3) == 3  # run.threads wins
    finally:
        torch.set_num_threads(before)


def test_threads_per_rank_counts_physical_cores_and_splits_the_node_s_cpus(tmp_path):
    from app.runtime.mpi import threads_per_rank

    fake_cpu_topology(tmp_path, 2, 32)  # cpu c and c + 64 are one core's threads
    assert threads_per_rank(set(range(8)), 8, 8, tmp_path) == 1  # 8 ranks in one cpuset of 8 CPUs
    assert threads_per_rank(set(range(8)), 8, 1, tmp_path) == 8  # one rank alone in it
    assert threads_per_rank(set(range(16, 32)), 128, 8, tmp_path) == 16  # bound to 16 cores each
    assert threads_per_rank(set(range(128)), 128, 8, tmp_path) == 16  # every CPU: as before, CPUs / ranks
    assert threads_per_rank(set(range(4)) | set(range(64, 68)), 128, 8, tmp_path) == 4  # 4 cores' 8 threads
    assert threads_per_rank({0}, 128, 256, tmp_path) == 1


@pytest.mark.mpi(min_size=2)
def test_node_cpus_is_the_union_of_the_node_s_ranks_affinities(runtime):
    """Real affinities (sched_setaffinity of this thread, restored after), a real MPI allreduce: the
    world's ranks are on this node."""
    import torch

    from app.runtime.mpi import init_mpi, set_threads

    mine, threads = os.sched_getaffinity(0), torch.get_num_threads()
    everyone = set().union(*runtime.comm.allgather(mine))  # mpirun may have bound each rank to a core
    try:
        assert init_mpi(runtime.comm).node_cpus == len(everyone)
        os.sched_setaffinity(0, {min(everyone)})  # every rank on one CPU
        shared = init_mpi(runtime.comm)
        assert shared.node_cpus == 1 and shared.local_size == runtime.world_size
        assert set_threads(shared, None) == 1
    finally:
        os.sched_setaffinity(0, mine)
        torch.set_num_threads(threads)

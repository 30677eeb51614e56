"""The rendezvous checks of app/runtime/rendezvous.py on their own (no MPI): GRIDLM_MASTER_ADDR
is refused before any rank waits when the other ranks could not use it, and the connection
probe is bounded. The multi-node behaviour is in tests/test_multinode.py."""

from __future__ import annotations

import socket
import time

import pytest

from app.errors import LaunchError
from app.names import rank_ranges
from app.runtime.rendezvous import choose_host, probe, unreachable_message


def test_without_the_variable_one_node_uses_loopback_and_several_rank_0s_hostname():
    assert choose_host(None, 1, "n1").host == "127.0.0.1"
    assert (choose_host("", 4, "n1").host, choose_host(" ", 4, "n1").source) == ("n1", "hostname")


def test_an_address_of_this_host_is_taken():
    chosen = choose_host("127.0.0.1", 1, "n1")
    assert (chosen.host, chosen.source) == ("127.0.0.1", "GRIDLM_MASTER_ADDR")


@pytest.mark.parametrize(
    ("value", "nodes", "words"),
    [
        ("127.0.0.1", 2, "is a loopback address, but the job spans 2 nodes"),
        ("192.0.2.1", 1, "is not an address of rank 0's node n1"),  # TEST-NET-1: nobody's
        ("no-such-host.invalid", 1, "does not resolve on rank 0's node n1"),
        ("a..b", 1, "does not resolve on rank 0's node n1"),  # an empty label: UnicodeError, was a traceback
        ("0.0.0.0", 1, "is the unspecified address"),  # bound on every interface (found in review, 2026-11-30)
        ("::", 2, "is the unspecified address"),
    ],
)
def test_an_address_the_other_ranks_cannot_use_is_refused_with_the_fix(value, nodes, words):
    with pytest.raises(LaunchError) as err:
        choose_host(value, nodes, "n1")
    assert words in str(err.value) and f"GRIDLM_MASTER_ADDR={value}" in str(err.value)
    assert "unset it" in str(err.value)


def test_a_gloo_interface_this_node_lacks_is_named_and_the_rest_are_not():
    """Found in review (2026-11-30): GLOO_SOCKET_IFNAME naming no interface of a node failed inside
    init_process_group and was reported as a lost peer on another node (exit 4); the ranks now check
    the names first (`gloo_interface_problems`, on this host's interfaces) and refuse with the node's
    interfaces."""
    from app.runtime.mpi import gloo_interface_problems, interface_table

    here = interface_table()
    assert here is not None
    assert gloo_interface_problems("", here) == [] and gloo_interface_problems("lo", here) == []
    assert gloo_interface_problems("lo,nosuchif0", here) == ["no interface nosuchif0"]


def test_probe_connects_to_a_listening_port_and_gives_up_on_a_closed_one_in_bounded_time():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        assert probe("127.0.0.1", server.getsockname()[1], 5.0) is None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    started = time.monotonic()
    error = probe("127.0.0.1", closed, 1.5)
    assert error is not None and "ConnectionRefusedError" in error and "for 1.5 s" in error
    assert time.monotonic() - started < 10


def test_the_unreachable_message_names_ranks_hosts_the_store_and_the_fix():
    failed = [(r, ("gridlm-node2", "ConnectionRefusedError: refused (for 60 s)")) for r in range(4, 14)]
    text = unreachable_message("10.0.0.1", 29500, "GRIDLM_MASTER_ADDR", failed)
    assert text.startswith("rank(s) 4, 5, 6, 7, 8, 9, 10, 11 and 2 more on gridlm-node2 cannot reach")
    assert "TCPStore at 10.0.0.1:29500 (GRIDLM_MASTER_ADDR=10.0.0.1)" in text and "unset it" in text


def test_rank_ranges_compresses_runs():
    assert rank_ranges([0, 1, 2, 3, 6, 8, 9]) == "0-3, 6, 8-9"
    assert rank_ranges([3, 1, 2, 2]) == "1-3"
    assert rank_ranges([]) == ""


def _external_address() -> str | None:
    """An IPv4 address of this host that is not loopback (None where there is none)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.254", 9))  # no packet is sent: the route says which address is ours
            address = s.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") else address


@pytest.mark.mpi
def test_a_one_node_job_s_store_is_on_loopback_only_and_its_keys_under_a_secret_prefix(runtime):
    """The TCPStore of a one-node job listens on 127.0.0.1 only (it listened on every interface: a
    client on the node's external address read 17 keys during a run); the job's keys live under a
    random prefix the ranks learned over MPI, so a foreign client that connects cannot read them."""
    import socket
    from datetime import timedelta

    import torch.distributed as dist

    host, port = runtime.store_address
    assert host == "127.0.0.1" and runtime.store_prefix.startswith("gridlm-") and len(runtime.store_prefix) > 30
    assert len(set(runtime.comm.allgather(runtime.store_prefix))) == 1  # every rank has the same prefix
    external = _external_address()
    if external is not None:
        with socket.socket() as probe:
            probe.settimeout(2)
            assert probe.connect_ex((external, port)) != 0, f"the store answers on {external}:{port}"
    key = f"secret-of-rank-{runtime.rank}"
    runtime.store.set(key, "job data")
    runtime.comm.Barrier()
    foreign = dist.TCPStore(host, port, runtime.world_size, is_master=False, timeout=timedelta(seconds=5))
    assert not foreign.check([key])  # the key as the job names it is not where a stranger looks
    assert runtime.store.get(key) == b"job data"
    runtime.comm.Barrier()


def test_tasks_the_launcher_started_that_mpi_does_not_join_are_refused():
    """Found in review (2026-11-30): srun -n 2 without an MPI wiring (no --mpi=pmix, or an mpi4py built
    against another MPI) made each task a world of one rank: task 0 trained alone and task 1 was told
    the run directory was in use by the job itself. A size from the launcher above 1 with an MPI
    world of 1 is refused; Open MPI's own size comes first (mpirun -n 1 inside a 2-node allocation
    runs its daemons as a 2-task step)."""
    from app.runtime.mpi import unwired_launch

    assert "started 2 tasks (SLURM_STEP_NUM_TASKS=2)" in unwired_launch({"SLURM_STEP_NUM_TASKS": "2"}, 1)
    assert "srun --mpi=pmix" in unwired_launch({"PMI_SIZE": "4"}, 1)
    assert unwired_launch({"SLURM_STEP_NUM_TASKS": "2"}, 2) is None  # wired: MPI sees them all
    assert unwired_launch({"OMPI_COMM_WORLD_SIZE": "1", "SLURM_STEP_NUM_TASKS": "2"}, 1) is None
    assert unwired_launch({"SLURM_NTASKS": "8"}, 1) is None  # a batch script's own python: no step
    assert unwired_launch({}, 1) is None and unwired_launch({"PMI_SIZE": "x"}, 1) is None


def test_two_unwired_tasks_each_exit_2_naming_the_launch(tmp_path):
    """Two plain processes that a launcher says are a 2-task step (srun without --mpi=pmix)."""
    import subprocess
    import sys

    from conftest import REPO, app_env

    env = {**app_env(), "SLURM_STEP_NUM_TASKS": "2", "SLURM_JOB_ID": "777"}
    cmd = [sys.executable, "-m", "app", "inputs/gpt_tiny.yaml", "--set", f"run.dir={tmp_path / 'run'}"]
    procs = [subprocess.Popen(cmd, cwd=REPO, env={**env, "SLURM_PROCID": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]  # fmt: skip
    for proc in procs:
        _, err = proc.communicate(timeout=240)
        assert proc.returncode == 2 and "the launcher started 2 tasks" in err, err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()

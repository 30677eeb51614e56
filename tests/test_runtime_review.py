"""Review of a job's start and end on every rank (app/job.py, app/runtime/rendezvous.py): each
case a fault found in review, its test failing before the fix."""

from __future__ import annotations

import sys

import pytest

from app.errors import LaunchError
from app.runtime.rendezvous import choose_host
from conftest import run_mpi

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

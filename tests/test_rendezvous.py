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
    ],
)
def test_an_address_the_other_ranks_cannot_use_is_refused_with_the_fix(value, nodes, words):
    with pytest.raises(LaunchError) as err:
        choose_host(value, nodes, "n1")
    assert words in str(err.value) and f"GRIDLM_MASTER_ADDR={value}" in str(err.value)
    assert "unset it" in str(err.value)


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

"""Where the ranks meet: the host of rank 0's TCPStore, checked before anyone waits on it.

torch.distributed is bootstrapped from rank 0's TCPStore. Its host is 127.0.0.1 on one node,
rank 0's hostname across nodes, or `GRIDLM_MASTER_ADDR` when set (a hostname that resolves to
the wrong interface, a site's high-speed network name). A wrong value must not leave thousands
of ranks retrying a connection for torch's whole timeout, so:

- rank 0 checks the value before it opens the store: it must resolve, be an address of rank 0's
  own host (a socket binds to it), and not be a loopback address when the job spans nodes;
- every other rank then opens one plain TCP connection to the store within `connect_s`
  (retrying a refused one), and the ranks agree over MPI, which does not depend on it, before
  any of them waits in `init_process_group`. A failure names the ranks, their hosts and the fix.
"""

from __future__ import annotations

import ipaddress
import socket
import time
from dataclasses import dataclass
from typing import Optional

from app.errors import LaunchError

ENV = "GRIDLM_MASTER_ADDR"
FIX = (
    f"set {ENV} to an address of rank 0's node on the network the nodes share (its hostname or IP there), "
    "or unset it to use rank 0's hostname"
)


@dataclass(frozen=True)
class StoreHost:
    """The host the ranks reach rank 0's TCPStore at, and where that choice came from."""

    host: str
    source: str  # "GRIDLM_MASTER_ADDR", "hostname" or "loopback"


def choose_host(env_value: Optional[str], nodes: int, hostname: str) -> StoreHost:
    """Rank 0's choice (pure but for name resolution): the environment's value, else loopback on
    one node, else rank 0's hostname. Raises LaunchError for a value the other ranks cannot use."""
    if env_value is None or not env_value.strip():
        if nodes == 1:
            return StoreHost("127.0.0.1", "loopback")
        looped = _loopback_only(hostname)
        if looped:  # the store would listen there, on loopback only (found in review)
            raise LaunchError(
                f"rank 0's hostname {hostname} resolves to {', '.join(looped)} on its node, a loopback address (an "
                f"/etc/hosts line such as Debian's 127.0.1.1), but the job spans {nodes} nodes: the other nodes cannot "
                f"reach the TCPStore there; set {ENV} to an address of rank 0's node on the network the nodes share "
                "(its IP there, e.g. from hostname -I), or map the hostname to that address in /etc/hosts"
            )
        return StoreHost(hostname, "hostname")
    value = env_value.strip()
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(value, None, type=socket.SOCK_STREAM)}
    except (OSError, UnicodeError) as err:  # UnicodeError: a name with an empty or over-long label (a..b)
        raise LaunchError(f"{ENV}={value} does not resolve on rank 0's node {hostname} ({err}); {FIX}") from None
    if nodes > 1 and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses):
        raise LaunchError(
            f"{ENV}={value} is a loopback address, but the job spans {nodes} nodes: the ranks of the other nodes "
            f"would connect to themselves; {FIX}"
        )
    if any(ipaddress.ip_address(a.split("%")[0]).is_unspecified for a in addresses):  # found in review
        raise LaunchError(
            f"{ENV}={value} is the unspecified address: the store would listen on every interface and the other "
            f"ranks would connect to their own host; {FIX}"
        )
    if not any(_is_local(a) for a in addresses):
        raise LaunchError(
            f"{ENV}={value} ({', '.join(sorted(addresses))}) is not an address of rank 0's node {hostname}, "
            f"where the TCPStore runs; {FIX}"
        )
    return StoreHost(value, ENV)


def _loopback_only(hostname: str) -> list[str]:
    """The addresses `hostname` resolves to here when all of them are loopback, else [] (also when it
    does not resolve: opening the store then says so)."""
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(hostname, None, type=socket.SOCK_STREAM)}
    except (OSError, UnicodeError):
        return []
    loopback = all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)
    return sorted(addresses) if addresses and loopback else []


def _is_local(address: str) -> bool:
    """Whether this host owns `address` (a socket can bind to it)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((address, 0))
        except OSError:
            return False
    return True


def probe(host: str, port: int, connect_s: float) -> Optional[str]:
    """Open (and close) one TCP connection to host:port, retrying a refused or failed one until
    `connect_s` have passed; None when it connected, else what went wrong the last time."""
    deadline = time.monotonic() + connect_s
    last = "no attempt"
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=max(0.5, min(5.0, left))):
                return None
        except OSError as err:
            last = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
        if time.monotonic() + 0.5 > deadline:
            return f"{last} (for {connect_s:g} s)"
        time.sleep(0.5)


def unreachable_message(host: str, port: int, source: str, failed: list[tuple[int, tuple[str, str]]]) -> str:
    """The LaunchError text for the ranks (rank, (their host, error)) that could not connect."""
    hosts = sorted({h for _, (h, _) in failed})
    ranks = ", ".join(str(r) for r, _ in failed[:8]) + (f" and {len(failed) - 8} more" if len(failed) > 8 else "")
    chosen = {"GRIDLM_MASTER_ADDR": f"{ENV}={host}", "hostname": f"rank 0's hostname {host}"}.get(source, host)
    return (
        f"rank(s) {ranks} on {', '.join(hosts[:4])}{' ...' if len(hosts) > 4 else ''} cannot reach rank 0's "
        f"TCPStore at {host}:{port} ({chosen}): {failed[0][1][1]}; {FIX}"
    )


def listening_socket(host: str) -> int:
    """A TCP socket listening on `host`'s own address (not every interface), port chosen by the
    system, as a file descriptor for the TCPStore to serve on (`master_listen_fd`; the store owns
    it from then on): a one-node job's store is reachable on loopback only, a multi-node one's
    on the chosen interface only."""
    infos = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)
    local = [info for info in infos if _is_local(info[4][0])] or infos
    family, _, _, _, address = sorted(local, key=lambda info: info[0] != socket.AF_INET)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(address[:2] if family == socket.AF_INET else address)
    sock.listen(1024)
    return sock.detach()

"""Watchdog: no rank waits forever in a blocking operation, and a lost rank is named.

Every call that waits for other ranks — torch.distributed collectives and p2p waits on
each grid axis (through `StepTimers` and `ProcessGrid.all_reduce`), MPI collectives
(`agree`, `on_root`, the stop-signal vote) and the MPI-IO of checkpoints — runs inside

    with runtime.watchdog.blocking("all_reduce", axis="dp"):
        ...

and the train loop says where the rank is (`runtime.watchdog.at(step=5, micro=2)`).
A daemon thread per rank checks, every tick, how long the innermost open call has
waited. Past `run.comm_timeout_s` it prints one line — the operation, the axis and its
ranks, the step and micro-batch, and which ranks look stopped or dead — and calls
`MPI_Abort(4)`, so the launcher ends every rank. Blocking calls release the GIL (torch
c10d, mpi4py and h5py's MPI-IO were checked), so the thread runs while the main thread
waits. As a last resort, should anything hold the GIL while it hangs, `faulthandler`
(a C thread, no GIL needed) dumps every thread's stack and exits the process a minute
after the watchdog itself would have fired; the launcher then ends the job.

Who is stuck: ranks on this node are checked directly (/proc/PID/stat: stopped, zombie,
gone). For the others, every rank's thread writes a heartbeat (a counter, its step and
its innermost open call) to the job's TCPStore each `interval`; a rank whose counter does
not move over 1.5 intervals is stopped, dead or cut off. When a peer's connection drops
(gloo: "Connection closed by peer"), `explain` turns the exception into the same kind of
line ("rank 2 lost its peer on axis dp ... rank 3 died") instead of an internal error.

The store is rank 0's; when rank 0 itself is the stopped one, heartbeat reads time out
and the line says that rank 0 (the store's host) does not answer. The heartbeats looked at are
the blocked call's group and the other ranks of its nodes first; the rest of the job (at most
`LOOKED` in all) only when none of those is silent or out of every call. A rank whose counter
moves but that is in no communication call (computing, or stuck in its own work) is named as such.
"""

from __future__ import annotations

import errno
import faulthandler
import json
import os
import re
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext, suppress
from datetime import timedelta
from typing import Any, Callable, Optional, Protocol, TextIO, Union

from app.names import rank_ranges

EXIT_CODE = 4  # communication timeout or a lost rank (docs/RUNNING.md, "When things go wrong")
HEARTBEAT_KEY = "gridlm/heartbeat/{}"
# Set by a rank that ends the job on purpose after printing why (`announce_end`): {"rank", "code"}.
ENDED_KEY = "gridlm/ended"
MAX_NAMED = 8  # ranks named in one line; a 32k-rank job that lost a switch would print thousands
PROBED_NODES = 3  # silent nodes whose address is probed (2 s each) before the line is printed
STORE_CONNECT_S = 30.0  # the heartbeat client's connection to rank 0's store (a 32k-rank start, a loaded node)
# Heartbeats one firing rank reads: when a node dies nearly every rank fires at once, and rank 0's
# store serves them all.
LOOKED = 4096
BEATS_PER_REQUEST = 512  # heartbeats per store request (multi_get): ~100 bytes each


class WatchedRuntime(Protocol):
    """What the watchdog reads of the rank's `app.runtime.mpi.Runtime` (which holds the watchdog,
    so it is known here by this, not imported)."""

    comm: Any
    rank: int
    world_size: int
    hostname: str
    global_ranks: list[int]
    watchdog: AnyWatchdog  # defined below: the real one or the no-op


class NullWatchdog:
    """The no-op watchdog: same interface, nothing watched (in-process tests, the dry run)."""

    def at(self, step: Optional[int] = None, micro: Optional[int] = None) -> None:
        pass

    def blocking(self, op: str, axis: Optional[str] = None) -> AbstractContextManager:
        return nullcontext()

    def set_groups(self, ranks: dict[str, list[int]]) -> None:
        pass

    def explain(self, err: BaseException) -> Optional[str]:
        return None

    def announce_end(self, code: int) -> None:
        pass

    def ended_by(self) -> Optional[tuple[int, int]]:
        return None

    def stop(self) -> None:
        pass


def _address(hostname: str) -> Optional[str]:
    """The IP address `hostname` resolves to (None when it does not)."""
    try:
        return socket.gethostbyname(hostname)
    except OSError:
        return None


def process_state(pid: int) -> str:
    """One letter from /proc/PID/stat (R, S, D, T stopped, t traced, Z zombie), or 'gone'."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return "gone"
    except OSError:
        return "?"


COMM_FAILURE_WORDS = ("connection closed", "connection reset", "broken pipe", "peer", "timed out", "timeout",
                      "nccl", "gloo", "socket", "mpi_err")  # fmt: skip


def is_comm_failure(err: BaseException) -> bool:
    """Whether an exception is a communication failure (torch's DistError family, an MPI error, or
    a runtime error whose text says so) rather than a bug."""
    names = {cls.__name__ for cls in type(err).__mro__}
    if names & {"DistError", "DistBackendError", "DistNetworkError", "DistStoreError"}:
        return True
    if type(err).__module__.startswith("mpi4py"):
        return True
    text = str(err).lower()
    return isinstance(err, (RuntimeError, OSError)) and any(word in text for word in COMM_FAILURE_WORDS)


def is_descriptor_exhaustion(err: BaseException) -> bool:
    """Whether an exception is this process running out of file descriptors (EMFILE: its limit,
    `ulimit -n`), which gloo and the store report as a socket error."""
    return getattr(err, "errno", None) == errno.EMFILE or "too many open files" in str(err).lower()


def descriptor_text() -> str:
    """This process's limit on open files, for a line that blames it."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return f"too many open files (its limit, ulimit -n, is {'unlimited' if soft < 0 else soft})"


# Rank 0 serves the TCPStore: two connections per rank (its main client and its watchdog's), beside
# its own files, libraries and gloo/MPI connections (measured: 51 descriptors in a 4-rank job).
STORE_FILES_PER_RANK = 2
FILES_HEADROOM = 256


def open_files_needed(world_size: int) -> int:
    """About how many open files rank 0 needs in a job of `world_size` ranks (checked at start by
    app.runtime.mpi.open_files_refusal)."""
    return STORE_FILES_PER_RANK * world_size + FILES_HEADROOM


STATE_WORDS = {"T": "stopped (SIGSTOP)", "t": "stopped by a debugger", "Z": "died", "gone": "died", "X": "died"}


class Watchdog:
    """One per rank, started by `app.__main__` once the deck is read; see the module docstring.

    `procs[r]` is (hostname, pid) of every rank of the runtime's communicator (allgathered at
    start); `torch_ranks` maps those ranks to torch ranks (the axis groups are in torch ranks).
    """

    def __init__(
        self,
        runtime: WatchedRuntime,
        timeout_s: float,
        interval_s: Optional[float] = None,
        out: TextIO = sys.stderr,
        abort: Optional[Callable[[int], None]] = None,
    ) -> None:
        self.rank, self.world, self.host = runtime.rank, runtime.world_size, runtime.hostname
        self.set_timeout(timeout_s, interval_s)
        self.out = out
        # MPI_Abort ends the job; a caller's own `abort` (tests) gets the exit code instead.
        self._abort = abort if abort is not None else runtime.comm.Abort
        self._exit_after_abort = abort is None
        self.procs: list[tuple[str, int]] = runtime.comm.allgather((runtime.hostname, os.getpid()))
        # The address other nodes reach this rank at (gloo names a lost peer by it), if it resolves.
        self.addresses: list[Optional[str]] = runtime.comm.allgather(_address(runtime.hostname))
        self.torch_ranks: list[int] = list(runtime.global_ranks)
        self.groups: dict[str, list[int]] = {}
        self.step: Optional[int] = None
        self.micro: Optional[int] = None
        self._open: list[tuple[str, Optional[str]]] = []  # (op, axis) of the blocking calls, innermost last
        self._since = time.monotonic()  # when the innermost open call began
        self._failed: Optional[tuple[str, Optional[str], Optional[int], Optional[int]]] = None
        self._store: Any = None
        self._seq = 0
        self._looked = 0  # heartbeats the last look read (`_silent_ranks`)
        self._stop = threading.Event()
        self._fired = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gridlm-watchdog", daemon=True)
        self._thread.start()

    # ---- called by the main thread --------------------------------------------------------

    def set_timeout(self, timeout_s: float, interval_s: Optional[float] = None) -> None:
        """The timeout (run.comm_timeout_s: its default at start-up, the deck's once it is read) and the
        heartbeat interval that follows from it, unless given."""
        self.timeout = float(timeout_s)
        # Heartbeats often enough to tell a stopped rank within the timeout, rarely enough that
        # 32k ranks writing to one store stay cheap (60 s: ~550 writes/s at 32k ranks).
        self.interval = interval_s if interval_s is not None else min(max(self.timeout / 4, 0.5), 60.0)
        self.tick = min(1.0, self.interval / 2)

    def at(self, step: Optional[int] = None, micro: Optional[int] = None) -> None:
        """Where this rank is: the step being computed and, in the pipeline, its micro-batch."""
        if step is not None:
            self.step, self.micro = step, None
        if micro is not None:
            self.micro = micro

    @contextmanager
    def blocking(self, op: str, axis: Optional[str] = None) -> Iterator[None]:
        """A call that waits for other ranks: watched for the timeout; a communication failure
        leaving it (a peer's connection dropped) is remembered for `explain`. Nothing else is: an
        error the run survived (checkpoint.on_error: continue) must not be named for a later loss."""
        self._open.append((op, axis))
        self._since = time.monotonic()
        try:
            yield
        except BaseException as err:
            if self._failed is None and is_comm_failure(err):
                self._failed = (op, axis, self.step, self.micro)
            raise
        finally:
            self._open.pop()
            self._since = time.monotonic()

    def set_groups(self, ranks: dict[str, list[int]]) -> None:
        """The torch ranks of this rank's group on each grid axis (ProcessGrid)."""
        self.groups = {axis: list(members) for axis, members in ranks.items()}

    def attach_store(self, host: str, port: int, prefix: str = "") -> None:
        """Heartbeats go to the job's TCPStore (own client: short timeouts, never the main thread's),
        under the job's key prefix (`Runtime.store_prefix`)."""
        import torch.distributed as dist

        try:
            # Connecting may wait for rank 0's store to accept thousands of clients at once (and on a
            # loaded node took over 2 s): patience for that, then short timeouts for the heartbeats.
            store = dist.TCPStore(
                host, port, self.world, is_master=False, timeout=timedelta(seconds=STORE_CONNECT_S),
                wait_for_workers=False,
            )  # fmt: skip
            store.set_timeout(timedelta(seconds=max(2.0, min(10.0, self.interval))))
            self._store = dist.PrefixStore(prefix, store) if prefix else store
        except Exception as err:  # no heartbeats: the /proc check and the timeout still work
            self._store = None
            first = (str(err).strip().splitlines() or [""])[0][:200]
            why = descriptor_text() if is_descriptor_exhaustion(err) else f"{type(err).__name__}: {first}"
            print(
                f"gridlm: rank {self.rank} ({self.host}): warning: the watchdog cannot reach the job's TCPStore at "
                f"{host}:{port} ({why}): this rank sends no heartbeat, so a peer's watchdog may name it as stopped",
                file=self.out, flush=True,
            )  # fmt: skip

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)
        faulthandler.cancel_dump_traceback_later()

    def announce_end(self, code: int) -> None:
        """This rank is about to end the job on purpose, having printed why (a CUDA out-of-memory
        error): a peer that then loses it says nothing more (`ended_by`) instead of calling it dead."""
        if self._store is not None:
            with suppress(Exception):
                self._store.set(ENDED_KEY, json.dumps({"rank": self.rank, "code": code}))

    def ended_by(self) -> Optional[tuple[int, int]]:
        """(rank, exit status) of a rank that announced it ends the job (`announce_end`), or None."""
        if self._store is None:
            return None
        try:
            if not self._store.check([ENDED_KEY]):
                return None
            found = json.loads(self._store.get(ENDED_KEY))
            return int(found["rank"]), int(found["code"])
        except Exception:  # no answer: behave as if nobody announced
            return None

    def explain(self, err: BaseException) -> Optional[str]:
        """One line for a communication failure that left a blocking call (a lost peer), else None."""
        if not is_comm_failure(err):
            return None
        # Outside a watched call (e.g. launching an asynchronous collective): where the rank was.
        op, axis, step, micro = self._failed or (
            (self._open[-1][0], self._open[-1][1], self.step, self.micro)
            if self._open
            else ("a collective", None, self.step, self.micro)
        )
        first = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        if is_descriptor_exhaustion(err):  # this rank's own limit, not a lost peer
            return (
                f"gridlm: rank {self.rank} ({self.host}) ran out of file descriptors during {op} on axis "
                f"{axis or 'world'}{self._where(step, micro)}: {descriptor_text()}: raise it before the launch "
                f"(ulimit -n in the job script; rank 0 of a job of {self.world} ranks needs about "
                f"{open_files_needed(self.world)}) [{type(err).__name__}: {first}]"
            )
        suspects = self._suspects(axis, wait_heartbeats=False) or self._remote_peer(first, axis)
        # A peer on this node closes its sockets while it is still exiting: give /proc a moment.
        deadline = time.monotonic() + 3.0
        while not suspects and time.monotonic() < deadline:
            time.sleep(0.05)
            suspects = self._suspects(axis, wait_heartbeats=False)
        return (
            f"gridlm: rank {self.rank} ({self.host}) lost its peer on axis {axis or 'world'} during {op}"
            f"{self._where(step, micro)}{self._group_text(axis)}: "
            + (suspects or "no rank on this node died; the lost rank is on another node (see the launcher's message)")
            + f" [{type(err).__name__}: {first}]"
        )

    def _remote_peer(self, text: str, axis: Optional[str]) -> str:
        """The ranks at the address in gloo's message ("Connection closed by peer [10.1.2.3]:port"),
        among the axis group (every rank when unknown): the lost peer is one of them."""
        found = re.search(r"\[([0-9A-Fa-f.:]+)\]:\d+", text)
        if found is None or found.group(1).startswith("127."):
            return ""
        members = set(self.groups.get(axis or "", range(self.world)))
        ranks = [r for r in range(self.world) if self.addresses[r] == found.group(1) and self.torch_ranks[r] in members]
        if not ranks:
            return ""
        host = self.procs[ranks[0]][0]
        named = ", ".join(f"rank {r} (pid {self.procs[r][1]})" for r in ranks[:MAX_NAMED])
        return (
            f"the lost peer is on {host} ({found.group(1)}): {named}"
            + (" or another rank there" if len(ranks) > 1 else "")
            + f"; {host} holds ranks {rank_ranges(self._ranks_on(host))}"
        )

    def _ranks_on(self, host: str) -> list[int]:
        return [r for r, (h, _) in enumerate(self.procs) if h == host]

    # ---- the thread -----------------------------------------------------------------------

    def _run(self) -> None:
        last_beat = float("-inf")
        last_arm = float("-inf")
        while not self._stop.wait(self.tick):
            now = time.monotonic()
            if now - last_beat >= self.interval:
                self._beat()
                last_beat = now
            if now - last_arm >= self.interval:
                # Last resort (C thread, no GIL): a minute after this thread should have fired.
                faulthandler.dump_traceback_later(self.timeout + 2 * self.interval + 60, exit=True, file=sys.stderr)
                last_arm = now
            if self._open and now - self._since > self.timeout:
                self._fire(now - self._since)
                return

    def _innermost(self, none: tuple[Any, Any]) -> tuple[Any, Any]:
        """The innermost open call, read from this thread in one step (a slice): the main thread may
        close it between a test and an index, and an IndexError would end this thread silently."""
        top = self._open[-1:]
        return top[0] if top else none

    def _beat(self) -> None:
        if self._store is None:
            return
        op, axis = self._innermost((None, None))
        self._seq += 1
        value = {"seq": self._seq, "step": self.step, "micro": self.micro, "op": op, "axis": axis,
                 "gpu": _on_gpu()}  # fmt: skip
        # The store's host may be the stuck rank: no heartbeat then, and the check names it.
        with suppress(Exception):
            self._store.set(HEARTBEAT_KEY.format(self.rank), json.dumps(value))

    def _fire(self, waited: float) -> None:
        self._fired.set()
        op, axis = self._innermost(("?", None))
        try:
            suspects = self._suspects(axis, wait_heartbeats=True)
        except Exception as err:  # the message must come out whatever happens
            suspects = f"(could not check the other ranks: {err})"
        line = (
            f"gridlm: rank {self.rank} ({self.host}): watchdog: no progress for {waited:.0f} s in {op} on axis "
            f"{axis or 'world'}{self._where(self.step, self.micro)}{self._group_text(axis)}: "
            + (suspects or self._all_waiting())
            + f"; aborting the job (run.comm_timeout_s = {self.timeout:g})"
        )  # fmt: skip
        try:
            print(line, file=self.out, flush=True)
        finally:
            if self._exit_after_abort:  # should MPI_Abort itself hang, end this process at least
                faulthandler.dump_traceback_later(30, exit=True, file=sys.stderr)
            else:
                faulthandler.cancel_dump_traceback_later()
            self._abort(EXIT_CODE)
            if self._exit_after_abort:
                os._exit(EXIT_CODE)  # MPI_Abort returned (no MPI job): end this process at least

    # ---- who is stuck ---------------------------------------------------------------------

    def _where(self, step: Optional[int], micro: Optional[int]) -> str:
        text = "" if step is None else f" at step {step}"
        return text + ("" if micro is None else f", micro-batch {micro}")

    def _group_text(self, axis: Optional[str]) -> str:
        members = self.groups.get(axis or "")
        if not members or len(members) > 16:
            return ""
        return f" (group ranks {members})"

    def _suspects(self, axis: Optional[str], wait_heartbeats: bool) -> str:
        """The ranks that look stopped or dead: this node's by /proc, the others by heartbeat."""
        found: list[str] = []
        for r, (host, pid) in enumerate(self.procs):
            if r != self.rank and host == self.host:
                state = process_state(pid)
                if state in STATE_WORDS:
                    found.append(f"rank {r} (pid {pid} on {host}) {STATE_WORDS[state]}")
        if not found and wait_heartbeats and self._store is not None:
            found = self._silent_ranks(axis)
        if not found:
            return ""
        more = f" and {len(found) - MAX_NAMED} more" if len(found) > MAX_NAMED else ""
        return "; ".join(found[:MAX_NAMED]) + more

    def _all_waiting(self) -> str:
        """The line's end when no rank looked at is silent or out of every call."""
        if self._store is None:  # `attach_store` failed (and said so): no heartbeat was read
            return (
                "this rank reads no heartbeats (it could not reach the job's TCPStore), so the other nodes' ranks "
                "were not checked (a deadlock, a slow file system, or a stopped rank elsewhere)"
            )
        if self._looked >= self.world - 1:
            return "every rank is alive and answering; they wait in other calls (a deadlock or a slow file system)"
        return (
            f"the {self._looked} ranks looked at (of {self.world}: this group's and its nodes' first) are alive and "
            "wait in communication calls (a deadlock or a slow file system)"
        )

    def _look_order(self, axis: Optional[str]) -> tuple[list[int], list[int]]:
        """The ranks whose heartbeats to read: first the blocked call's group and the other ranks of
        its nodes (a lost node is then named as one), then the rest of the job, each from this rank
        onwards (firing ranks spread their looks), at most `LOOKED` in all."""
        around = [(self.rank + k) % self.world for k in range(1, self.world)]
        members = self.groups.get(axis or "")
        if not members:  # the whole job is the group
            return around[:LOOKED], []
        rank_of = {t: r for r, t in enumerate(self.torch_ranks)}  # the groups are in torch ranks
        group = {rank_of[t] for t in members if t in rank_of}
        hosts = {self.procs[r][0] for r in group}
        mates = [r for r in around if r not in group and self.procs[r][0] in hosts]
        first = ([r for r in around if r in group] + mates)[:LOOKED]
        taken = set(first)
        rest = [r for r in around if r not in taken][: LOOKED - len(first)]
        return first, rest

    def _read_beats(self, ranks: list[int]) -> dict[int, Optional[dict[str, Any]]]:
        """The latest heartbeat of each rank (None: it never beat), a few store requests for many ranks."""
        out: dict[int, Optional[dict[str, Any]]] = {}
        try:
            for i in range(0, len(ranks), BEATS_PER_REQUEST):
                chunk = ranks[i : i + BEATS_PER_REQUEST]
                out.update(zip(chunk, self._get_beats(chunk)))
        except Exception:
            raise TimeoutError(
                f"rank 0 on {self.procs[0][0]} (it hosts the TCPStore) does not answer: it is stopped, dead, "
                "or its node is cut off from this one"
            ) from None
        return out

    def _get_beats(self, ranks: list[int]) -> list[Optional[dict[str, Any]]]:
        keys = [HEARTBEAT_KEY.format(r) for r in ranks]
        # A get (and multi_get) waits for a missing key until the store's timeout: find the ranks that
        # never beat by halving the chunk (few requests for a few missing keys).
        if not self._store.check(keys):
            if len(ranks) == 1:
                return [None]
            half = len(ranks) // 2
            return self._get_beats(ranks[:half]) + self._get_beats(ranks[half:])
        multi_get = getattr(self._store, "multi_get", None)  # torch's TCPStore and PrefixStore have it
        raws = multi_get(keys) if multi_get is not None else [self._store.get(key) for key in keys]
        return [json.loads(raw) if raw else None for raw in raws]

    def _silent_ranks(self, axis: Optional[str] = None) -> list[str]:
        """Ranks whose heartbeat counter did not move over 1.5 intervals, else ranks in no
        communication call; the blocked group's nodes first (`_look_order`), the rest only when none
        is found there. A node none of whose ranks beats is named once, as a node, with whether its
        address answers."""
        self._looked = 0
        for ranks in self._look_order(axis):
            if not ranks:
                continue
            try:
                before = self._read_beats(ranks)
                # Keep beating while waiting: the ranks that fire together (a lost node stalls every
                # group it is in) must not take each other for silent.
                for _ in range(3):
                    self._beat()
                    time.sleep(0.5 * self.interval)
                after = self._read_beats(ranks)
            except TimeoutError as err:
                return [str(err)]
            self._looked += len(ranks)
            lines = self._silent_lines(ranks, before, after) or self._idle_lines(ranks, before, after)
            if lines:
                return lines
        return []

    def _silent_lines(self, ranks: list[int], before: dict[int, Any], after: dict[int, Any]) -> list[str]:
        silent: dict[int, str] = {}
        for r in sorted(ranks):
            b, a = before.get(r), after.get(r)
            if a is None or (b is not None and a["seq"] == b["seq"]):
                silent[r] = (
                    "" if a is None else f", last seen{self._where(a.get('step'), a.get('micro'))} in {a.get('op')}"
                )
        lines: list[str] = []
        probed = 0
        for host in dict.fromkeys(self.procs[r][0] for r in silent):
            on_host = self._ranks_on(host)
            if host != self.host and len(on_host) > 1 and all(r in silent for r in on_host):
                # Up to PROBED_NODES probes of 2 s: a lost switch must not delay the line by minutes.
                probed += 1
                answer = address_answers(self.addresses[on_host[0]]) if probed <= PROBED_NODES else "not probed"
                lines.append(
                    f"node {host} sends no heartbeat from any of its ranks ({rank_ranges(on_host)}): the node is down "
                    f"or cut off ({answer}){silent[on_host[0]]}"
                )
                continue
            for r in (r for r in on_host if r in silent):
                pid = self.procs[r][1]
                lines.append(f"rank {r} (pid {pid} on {host}) sends no heartbeat: stopped, dead or cut off{silent[r]}")
        return lines

    def _idle_lines(self, ranks: list[int], before: dict[int, Any], after: dict[int, Any]) -> list[str]:
        """Ranks alive but in no communication call in both reads (1.5 intervals apart) at the same
        step and micro-batch: the ones the others wait for, computing or stuck in their own work."""
        lines: list[str] = []
        for r in sorted(ranks):
            b, a = before.get(r), after.get(r)
            if a is None or b is None or a.get("op") is not None or b.get("op") is not None:
                continue
            if (a.get("step"), a.get("micro")) != (b.get("step"), b.get("micro")):
                continue  # it moves on: not what the others wait for
            host, pid = self.procs[r]
            # On a GPU the host waits for the device outside the watched calls (an NCCL wait() returns at
            # once): such a rank may be blocked behind a hung collective, not the cause (found in review).
            why = (
                "in no watched call (on a GPU: computing, or its host blocked on the device behind a hung collective)"
                if a.get("gpu")
                else "in no communication call (computing, or stuck in its own work)"
            )
            lines.append(f"rank {r} (pid {pid} on {host}) is {why}{self._where(a.get('step'), a.get('micro'))}")
        return lines


def _on_gpu() -> bool:
    """Whether this process computes on a GPU (its heartbeat says so: `_idle_lines`' wording)."""
    import torch

    return torch.cuda.is_available() and torch.cuda.is_initialized()


def address_answers(address: Optional[str], port: int = 9, wait_s: float = 2.0) -> str:
    """Whether a node's address answers on the network: a refused TCP connection (to the discard
    port, closed almost everywhere) proves its kernel and link are up; silence does not prove them
    down (a firewall may drop it), so the words say what was seen."""
    if address is None:
        return "its address is unknown"
    try:
        with socket.create_connection((address, port), timeout=wait_s):
            return f"{address} answers"
    except ConnectionRefusedError:
        return f"{address} answers: its ranks, not its link, are stuck or dead"
    except OSError as err:
        why = "no answer" if isinstance(err, TimeoutError) else (err.strerror or type(err).__name__).lower()
        return f"{address}: {why} within {wait_s:g} s, unreachable"


# What a runtime carries: the real one once started, the no-op one before (and in tests).
AnyWatchdog = Union[Watchdog, NullWatchdog]


def start_watchdog(runtime: WatchedRuntime, timeout_s: float) -> Watchdog:
    """Start this rank's watchdog and hang it on the runtime (every rank calls this)."""
    runtime.watchdog = Watchdog(runtime, timeout_s)
    return runtime.watchdog

"""One MPI job of gridlm, from the deck to a status: the start-up order and the error contract.

`run_job(deck_file(DECK, overrides), body)` reads and resolves the deck on every rank (`agree`)
(or the loader given: `python -m app.generate` takes the deck a checkpoint carries), starts
the watchdog, binds the device, sets threads and the malloc threshold, bootstraps
torch.distributed, builds the `ProcessGrid` and runs `body(deck, runtime, grid)`: training
(`python -m app`), evaluation (`python -m app.eval`) or generation (`python -m app.generate`).
A user mistake (`GridlmError`) raised on every rank is printed once by rank 0 and every rank
returns its `exit_code`; one that some rank does not raise within `user_error_wait_s` (a
rank-local error, its peers waiting for this rank in a collective) is printed by the ranks that
raised it, naming them, and the job aborted with its `exit_code`; a lost peer is named and the
job aborted (4); any other exception is a bug: its traceback, then MPI_Abort(1), so no rank is
left waiting in a collective.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from contextlib import suppress
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from app.deck import Deck
    from app.runtime.grid import ProcessGrid
    from app.runtime.mpi import Runtime


def deck_parser(prog: str, description: str, example: str, deck_help: str, set_example: str) -> argparse.ArgumentParser:
    """The command line an MPI entry point that reads a deck starts with: the deck, and `--set`
    overrides of its keys (`deck_file` applies them)."""
    parser = argparse.ArgumentParser(prog=prog, description=description, epilog=f"Example: {example}")
    parser.add_argument("deck", help=deck_help)
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
        help=f"override one deck key (repeatable), e.g. {set_example}",
    )  # fmt: skip
    return parser


def deck_file(path: str, overrides: tuple[str, ...]) -> Callable[[int], Deck]:
    """The loader of `run_job` for a deck file and its --set overrides: world size -> resolved deck."""

    def load(world: int) -> Deck:
        from app.deck import load_deck, resolve_for_world

        return resolve_for_world(load_deck(path, overrides), world)

    return load


def run_job(load: Callable[[int], Deck], body: Callable[[Deck, Runtime, ProcessGrid], None]) -> int:
    """Start the job, run `body` on every rank, shut down; the exit status (module docstring).
    `load(world_size)` gives the resolved deck (on every rank; `deck_file`)."""
    from app.deck import RunConfig
    from app.errors import GridlmError, LaunchError, RankFatal
    from app.runtime.grid import ProcessGrid, order_sensitive_axes
    from app.runtime.mpi import (
        abort,
        agree,
        bind_device,
        init_mpi,
        init_torch_distributed,
        set_malloc_mmap_threshold,
        set_threads,
        shutdown,
        unwired_launch,
    )
    from app.runtime.process import start_up
    from app.runtime.watchdog import EXIT_CODE as WATCHDOG_EXIT
    from app.runtime.watchdog import is_descriptor_exhaustion, start_watchdog

    runtime = init_mpi()
    # The ranks that raise a user error meet here to agree that all of them did (`ended_alike`): a
    # communicator of its own, so that its barrier never meets a peer's collective on the job's.
    ending = runtime.comm.Dup() if runtime.world_size > 1 else None
    timeout_s = RunConfig.comm_timeout_s  # the deck's once it is read
    try:
        unwired = unwired_launch(os.environ, runtime.world_size)
        if unwired is not None:  # every task alone: each prints this and exits 2
            raise LaunchError(unwired)
        with start_up():  # torch's million objects imported without the collector walking them
            # From here on no rank waits forever: a rank stalled reading the deck (a hung file system)
            # is caught with the default timeout, later calls with the deck's run.comm_timeout_s.
            start_watchdog(runtime, RunConfig.comm_timeout_s)  # the key's default: the deck is not read yet
            deck = agree(runtime, lambda: load(runtime.world_size))
            timeout_s = deck.run.comm_timeout_s
            runtime.watchdog.set_timeout(timeout_s)
            agree(runtime, lambda: bind_device(runtime, deck.run.device))
            set_threads(runtime, deck.run.threads)
            set_malloc_mmap_threshold(deck.run.malloc_mmap_threshold_kb)
            # torch's own timeout comes after the watchdog's, which names the operation and the ranks.
            timeout = deck.run.comm_timeout_s + 60
            # Reaching rank 0's store takes milliseconds; a minute covers a busy 32k-rank start, and
            # a wrong GRIDLM_MASTER_ADDR fails within it rather than after torch's whole timeout.
            connect = min(deck.run.comm_timeout_s, 60.0)
            agree(runtime, lambda: init_torch_distributed(runtime, deck.parallel.backend, timeout, connect))
            runtime.watchdog.attach_store(*runtime.store_address, runtime.store_prefix)
            par = deck.parallel
            ordered = order_sensitive_axes(par.tp, par.cp, deck.optim.zero, par.ep)
            grid = ProcessGrid(runtime, par.tp, par.pp, deck.dp, par.order, par.cp, ordered)
        body(deck, runtime, grid)
        runtime.watchdog.stop()
        shutdown(runtime)
        return 0
    except RankFatal as err:  # this rank only, its peers possibly in a collective: end the job now
        runtime.watchdog.announce_end(err.exit_code)  # so that no peer then calls this rank dead
        print(f"gridlm: {err}", file=sys.stderr, flush=True)
        abort(runtime, err.exit_code)
    except GridlmError as err:
        if not ended_alike(ending, user_error_wait_s(timeout_s)):
            # Raised here but not (yet) on some peer, which may wait for this rank in a collective:
            # the message would be lost with rank 0 not printing it, and the peers' watchdog would
            # call this rank dead after run.comm_timeout_s. This rank says it and ends the job.
            runtime.watchdog.announce_end(err.exit_code)  # so that no peer then calls this rank dead
            print(f"gridlm: {err} (rank {runtime.rank} on {runtime.hostname})", file=sys.stderr, flush=True)
            abort(runtime, err.exit_code)
        # Raised on every rank alike (see `agree`): one message, the same status everywhere.
        if runtime.is_root:
            print(f"gridlm: {err}", file=sys.stderr, flush=True)
        # Join torch's communication threads before Python finalises: a gloo thread that
        # releases a tensor (or runs a completion callback) during finalisation aborts the
        # process (SIGABRT, status 134 instead of this error's). Still watched: it waits on peers.
        with suppress(Exception), runtime.watchdog.blocking("destroy_process_group"):
            shutdown(runtime)
        runtime.watchdog.stop()
        return err.exit_code
    except KeyboardInterrupt:
        abort(runtime, 130)
    except BaseException as err:
        lost = runtime.watchdog.explain(err)
        ended = runtime.watchdog.ended_by() if lost is not None else None
        if ended is not None:  # the peer that ends the job printed why: nothing to add
            abort(runtime, ended[1])
        if lost is not None and is_descriptor_exhaustion(err):  # this rank's own limit: the user's to raise
            runtime.watchdog.announce_end(LaunchError.exit_code)
            print(lost, file=sys.stderr, flush=True)
            abort(runtime, LaunchError.exit_code)
        if lost is not None:  # a peer died or its link broke: not a bug, name it and end the job
            print(lost, file=sys.stderr, flush=True)
            abort(runtime, WATCHDOG_EXIT)
        runtime.watchdog.announce_end(1)  # so that no peer then calls this rank dead
        print(f"gridlm: rank {runtime.rank}: internal error, aborting the job", file=sys.stderr)
        traceback.print_exc()
        abort(runtime, 1)
    return 1


def user_error_wait_s(comm_timeout_s: float) -> float:
    """How long a rank that raised a user error waits for its peers to raise it too: ranks that
    raise one alike (`agree`) arrive within milliseconds of each other; half the watchdog's timeout
    at most, so that this rank ends the job before a waiting peer's watchdog calls it dead."""
    return min(comm_timeout_s / 2, 60.0)


def ended_alike(ending: Any, wait_s: float) -> bool:
    """Whether every rank of the `ending` communicator (None: a job of one rank) gets here within
    `wait_s` seconds, as ranks that all raised a user error do."""
    from app.runtime.mpi import settle

    if ending is None:
        return True
    arrived = settle(ending, timeout=wait_s)
    if arrived:
        ending.Free()
    return arrived

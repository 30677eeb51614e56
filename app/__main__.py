"""`python -m app DECK [--set section.key=value ...]`: train a GPT over the MPI job's ranks.

Launch with srun / mpirun / mpiexec (or plainly, for one rank). A user mistake (deck,
data, launch) is printed once by rank 0 and every rank exits with status 2; any other
error is a bug: its traceback is printed and the whole MPI job is aborted, so no rank
is left waiting in a collective.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from typing import Optional


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m app",
        description="Train a GPT over a tensor x pipeline x data grid of MPI ranks.",
        epilog="Example: mpirun -n 4 python -m app inputs/gpt_tiny.yaml --set train.steps=50",
    )
    parser.add_argument("deck", help="YAML input deck (see README.md, 'Deck reference')")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one deck key (repeatable), e.g. --set train.steps=50 --set run.dir=runs/x",
    )
    return parser.parse_args(argv)


def run(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    # Imported here so that `--help` answers without starting MPI or loading torch.
    from app.deck import load_deck, resolve_for_world
    from app.errors import GridlmError
    from app.runtime.grid import ProcessGrid
    from app.runtime.mpi import abort, agree, bind_device, init_mpi, init_torch_distributed, set_threads, shutdown
    from app.train import train

    runtime = init_mpi()
    try:
        deck = agree(
            runtime, lambda: resolve_for_world(load_deck(args.deck, tuple(args.overrides)), runtime.world_size)
        )
        agree(runtime, lambda: bind_device(runtime, deck.run.device))
        set_threads(runtime, deck.run.threads)
        agree(runtime, lambda: init_torch_distributed(runtime, deck.parallel.backend))
        par = deck.parallel
        grid = ProcessGrid(runtime, par.tp, par.pp, deck.dp, par.order)
        train(deck, runtime, grid)
        grid.free()
        shutdown(runtime)
        return 0
    except GridlmError as err:
        # Raised on every rank alike (see `agree`): one message, status 2 everywhere.
        if runtime.is_root:
            print(f"gridlm: {err}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        abort(runtime, 130)
    except BaseException:
        print(f"gridlm: rank {runtime.rank}: internal error, aborting the job", file=sys.stderr)
        traceback.print_exc()
        abort(runtime, 1)
    return 1


def main() -> None:
    sys.exit(run())


if __name__ == "__main__":
    main()

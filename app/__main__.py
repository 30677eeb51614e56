"""`python -m app DECK [--set section.key=value ...]`: train a GPT over the MPI job's ranks.

Launch with srun / mpirun / mpiexec (or plainly, for one rank). A user mistake (deck,
data, launch, checkpoint) is printed once by rank 0 and every rank exits with its
`exit_code` (2; 3 for non-finite training). A rank blocked past run.comm_timeout_s, or one
that lost a peer, prints one line naming the operation and the ranks and aborts the job
(4, app/runtime/watchdog.py). Any other error is a bug: its traceback is printed and the
whole MPI job is aborted (1), so no rank is left waiting in a collective.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TYPE_CHECKING, Any, Optional

from app.job import deck_parser
from app.runtime.process import exit_now

if TYPE_CHECKING:
    from app.deck import Deck
    from app.runtime.grid import ProcessGrid
    from app.runtime.mpi import Runtime


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    parser = deck_parser(
        "python -m app", "Train a GPT over a tensor x pipeline x data grid of MPI ranks.",
        "mpirun -n 4 python -m app inputs/gpt_tiny.yaml --set train.steps=50",
        "YAML input deck (see docs/DECK.md, the deck reference)", "--set train.steps=50 --set run.dir=runs/x",
    )  # fmt: skip
    plan = parser.add_argument_group("dry run (no MPI launch: grid, placement, memory and FLOPs of the deck)")
    plan.add_argument("--dry-run", action="store_true", help="plan the deck and exit: 0 if it can run, 2 if not")
    plan.add_argument("--world-size", type=int, metavar="N", help="ranks to plan for (default: tp x cp x pp x dp)")
    plan.add_argument("--nodes", type=int, metavar="N", help="nodes to plan for (ranks = N x devices per node)")
    plan.add_argument(
        "--machine", metavar="NAME", help="inputs/machines/NAME.yaml or a path (default: the deck's run.machine)"
    )
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.add_argument("--all-ranks", action="store_true", help="list every rank's node and (tp, pp, dp)")
    plan.add_argument(
        "--max-imbalance", type=float, default=None, metavar="R",
        help="largest accepted slowest-stage / mean-stage work ratio, >= 1 (default 1.25)",
    )  # fmt: skip
    plan.add_argument(
        "--search", action="store_true",
        help="rank every valid grid (tp, pp, micro batch, virtual stages, SP, recompute, ZeRO) of the deck's model "
        "and batch by predicted step time; needs --machine (or run.machine) and --nodes or --world-size",
    )  # fmt: skip
    plan.add_argument(
        "--largest", action="store_true",
        help="the largest GPT of GPT-3's widths (most layers at each) that the deck's grid, batch and settings "
        "(ZeRO, recompute, optim.offload) fit on the allocation; needs --machine (or run.machine)",
    )  # fmt: skip
    plan.add_argument("--top", type=int, default=None, metavar="K", help="--search: configurations shown (default 5)")
    plan.add_argument(
        "--tensor", choices=("both", "1d", "3d"), default=None,
        help="--search: 1D (Megatron) or 3D (AxoNN, parallel.tensor) tensor parallelism, or both (default)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.search and args.largest:
        parser.error("--search and --largest: one at a time")
    if args.search or args.largest:
        args.dry_run = True
    # A planning option without its mode would be ignored: a training run of the whole deck would start instead.
    given = [
        f"--{k.replace('_', '-')}" for k in ("world_size", "nodes", "machine", "all_ranks", "json") if getattr(args, k)
    ]
    given += [f"--{k.replace('_', '-')}" for k in ("max_imbalance", "top", "tensor") if getattr(args, k) is not None]
    searched = [f"--{k}" for k in ("top", "tensor") if getattr(args, k) is not None]
    if searched and not args.search:
        parser.error(f"{', '.join(searched)} only {'go' if len(searched) > 1 else 'goes'} with --search")
    if args.all_ranks and (args.search or args.largest):  # their reports list no ranks
        parser.error(f"--all-ranks goes with a plain --dry-run, not with {'--search' if args.search else '--largest'}")
    if not args.dry_run and given:
        verb = "go" if len(given) > 1 else "goes"
        parser.error(f"{', '.join(given)} only {verb} with --dry-run (or --search, --largest)")
    args.top = 5 if args.top is None else args.top
    args.tensor = args.tensor or "both"
    if args.max_imbalance is None:
        args.max_imbalance = 1.25
    elif not 1.0 <= args.max_imbalance < float("inf"):  # also refuses nan: no ratio is below 1
        parser.error(
            f"--max-imbalance must be a number >= 1 (the slowest stage's work over the mean's), not {args.max_imbalance}"
        )
    if args.top < 1:
        parser.error("--top must be >= 1")
    for key in ("world_size", "nodes"):
        if getattr(args, key) is not None and getattr(args, key) < 1:
            parser.error(f"--{key.replace('_', '-')} must be >= 1")
    return args


def dry_run(args: argparse.Namespace) -> int:
    """Plan the deck for a world size without MPI; print the report; 2 if it cannot run."""
    from app.deck import load_deck
    from app.errors import GridlmError
    from app.plan.dryrun import dump_json, format_text, make_plan, world_for
    from app.plan.machine import load_machine

    try:
        deck = load_deck(args.deck, tuple(args.overrides))
        name = args.machine or deck.run.machine
        machine = load_machine(name) if name else None
        world, rpn = world_for(deck, args.world_size, args.nodes, machine)
        if args.search:
            return _search(args, deck, world, machine)
        if args.largest:
            return _largest(args, deck, world, machine, rpn)
        plan = make_plan(deck, world, machine, rpn, args.max_imbalance)
    except GridlmError as err:
        print(f"gridlm: {err}", file=sys.stderr, flush=True)
        return 2
    _emit(dump_json(plan, args.all_ranks) if args.json else format_text(plan, args.deck, args.all_ranks))
    if plan.problems:
        print(f"gridlm: dry run: {len(plan.problems)} problem(s), the run cannot work as planned", file=sys.stderr)
        return 2
    return 0


def _emit(text: str) -> None:
    """Print a report; a reader that stops early (`| head`) is not an error: the rest is dropped
    (stdout goes to /dev/null, so that Python's final flush does not fail again)."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _search(args: argparse.Namespace, deck: Any, world: int, machine: Any) -> int:
    from app.plan import search

    if machine is None:
        print("gridlm: --search needs a machine: pass --machine NAME (inputs/machines/)", file=sys.stderr)
        return 2
    result = search.search(deck, world, machine, args.top, args.tensor, args.max_imbalance)
    _emit(search.dump_json(result) if args.json else search.format_text(result, args.deck))
    if not result.best:
        why = " (see 'not planned' above)" if result.unplanned_why else ""
        print(f"gridlm: search: no configuration of this deck can run on this allocation{why}", file=sys.stderr)
        return 2
    return 0


def _largest(args: argparse.Namespace, deck: Any, world: int, machine: Any, rpn: Optional[int]) -> int:
    from app.plan.dryrun import GPT_WIDTHS, MAX_LAYERS, largest_gpt

    if machine is None:
        print("gridlm: --largest needs a machine: pass --machine NAME (inputs/machines/)", file=sys.stderr)
        return 2
    shapes = largest_gpt(deck, world, machine, rpn, args.max_imbalance)
    if args.json:
        _emit(json.dumps({"machine": machine.name, "world_size": world, "offload": deck.optim.offload,
                          "shapes": [vars(s) for s in shapes]}, indent=2))  # fmt: skip
    else:
        lines = [f"largest GPT on {world} rank(s) of {machine.name} ({machine.memory_per_device_gib:g} GiB per device"
                 + (f", {machine.host_memory_gib:g} GiB host memory per node" if machine.host_memory_gib else "")
                 + f"), optim.offload {deck.optim.offload}, optim.zero {deck.optim.zero}, train.recompute "
                 f"{deck.train.recompute}, seq {deck.model.seq_len}, micro batch {deck.train.micro_batch}:",
                 "  hidden  heads  layers       params"]  # fmt: skip
        lines += [f"  {s.hidden:>6}  {s.heads:>5}  {s.layers:>6}  {s.params / 1e9:>9.2f}B" for s in shapes]
        widths = ", ".join(str(h) for h, _ in GPT_WIDTHS)
        if shapes:
            best = max(shapes, key=lambda s: s.params)
            lines.append(f"largest: {best.layers} layers x hidden {best.hidden} ({best.heads} heads), "
                         f"{best.params / 1e9:.2f}B parameters (widths {widths}; up to {MAX_LAYERS} layers)")  # fmt: skip
        _emit("\n".join(lines))
    if not shapes:
        print(
            f"gridlm: --largest: not one layer of any width plans without problems on this allocation (at "
            f"--max-imbalance {args.max_imbalance:g}); a --dry-run of the deck names its problems",
            file=sys.stderr,
        )
        return 2
    return 0


def run(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        return dry_run(args)
    from app.job import deck_file, run_job
    from app.runtime.signals import StopSignals

    # SIGTERM / SIGUSR1 recorded from the start (the training loop takes them over: it stops after
    # its first step, with a checkpoint), not the default action that kills a starting rank silently.
    StopSignals().__enter__()

    def body(deck: Deck, runtime: Runtime, grid: ProcessGrid) -> None:
        # torch only once the deck is good: a deck mistake is reported before thousands of ranks
        # read torch's libraries from a parallel file system.
        from app.train import train

        train(deck, runtime, grid)

    return run_job(deck_file(args.deck, tuple(args.overrides)), body)


def main() -> None:
    exit_now(run())


if __name__ == "__main__":
    main()

"""`python -m app.eval DECK --checkpoint CKPT [--set section.key=value ...] [--out FILE]`: the
validation loss of a checkpoint, on any grid.

Launch it like training (one rank, or under srun / mpirun / mpiexec on any grid the deck and
the world size allow): the checkpoint loads resharded onto this grid as a resume does
(`app/checkpoint/io.load`), then `app.eval.evaluate` runs eval.batches global batches of the
held-out data (eval.path, data.split or synthetic) forward only. Rank 0 prints one line and
writes the result as JSON to --out (default `<run.dir>/eval/step_NNNNNNN.json`). The exit status
and the error contract are those of `python -m app` (`app/job.py`): 2 for a user mistake (a bad
deck, no held-out data, a missing or corrupt checkpoint or data file), printed once.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from app.errors import CheckpointError
from app.job import deck_parser
from app.runtime.process import exit_now

if TYPE_CHECKING:
    from app.deck import Deck
    from app.runtime.grid import ProcessGrid
    from app.runtime.mpi import Runtime


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    parser = deck_parser(
        "python -m app.eval",
        "Evaluate a checkpoint's validation loss on held-out data, on any grid (launch like training).",
        "mpirun -n 4 python -m app.eval inputs/gpt_tiny.yaml --checkpoint runs/gpt_tiny/checkpoints",
        "the YAML input deck of the run (its model, eval and data sections)",
        "--set eval.batches=8 --set parallel.tp=2",
    )
    parser.add_argument(
        "--checkpoint", required=True, metavar="CKPT", help="a checkpoint file (.h5), or a directory: its `latest`"
    )
    parser.add_argument("--out", metavar="FILE", help="where to write the result (default <run.dir>/eval/step_N.json)")
    return parser.parse_args(argv)


def checkpoint_file(given: str) -> Path:
    """The checkpoint --checkpoint names (a directory: the one its `latest` names)."""
    from app.checkpoint.store import named_checkpoint

    return named_checkpoint(given, f"--checkpoint {given}", "no such file; give a checkpoint file (.h5) or directory")


def evaluate_checkpoint(
    deck: Deck, runtime: Runtime, grid: ProcessGrid, given: str, out: Optional[str]
) -> dict[str, Any]:
    """Load `given` onto this grid and evaluate it (every rank); rank 0 prints and writes the result."""
    from app.checkpoint.io import load
    from app.eval import evaluate
    from app.metrics.report import dumps_strict, replace_text
    from app.runtime.mpi import on_root
    from app.train import Trainer

    # The held-out data is opened first: its mistakes are the deck's, found before any file is read.
    trainer = Trainer(deck, runtime, grid, evaluate_only=True)
    try:
        path = on_root(runtime, lambda: checkpoint_file(given))
        info = load(trainer, path)
        assert trainer.eval_data is not None
        result = evaluate(trainer, trainer.eval_data)
    finally:
        trainer.close()
    g = info["grid"]
    record = {
        "checkpoint": str(path),
        **result,
        "grid": grid.describe(),
        "written_on": g,
        "resharded": info["resharded"],
        "deck_eval": deck.to_dict()["eval"],
    }
    target = Path(out) if out else Path(deck.run.directory) / "eval" / f"step_{result['step']:07d}.json"

    def write() -> None:
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            # Strict JSON, as metrics.jsonl and summary.json: a NaN loss (or an infinite perplexity) is
            # null, listed under `nonfinite` (found in review: `NaN` / `Infinity` are not JSON).
            replace_text(target, dumps_strict(record, indent=2) + "\n")
        except OSError as err:
            raise CheckpointError(f"cannot write the evaluation to {target}: {err.strerror}; pass --out FILE") from None

    on_root(runtime, write)
    runtime.log(
        f"gridlm: eval | {path} (step {result['step']}, written on tp={g['tp']} pp={g['pp']} dp={g['dp']}"
        f"{', resharded to this grid' if info['resharded'] else ''}) | val loss {result['loss']:.4f} | "
        f"ppl {result['perplexity']:.2f} | {result['samples']:,} samples, {result['tokens']:,} targets from "
        f"{result['source']} | {result['seconds']:.2f} s | {target}"
    )
    return record


def run(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    from app.job import deck_file, run_job

    def body(deck: Deck, runtime: Runtime, grid: ProcessGrid) -> None:
        evaluate_checkpoint(deck, runtime, grid, args.checkpoint, args.out)

    return run_job(deck_file(args.deck, tuple(args.overrides)), body)


def main() -> None:
    exit_now(run())


if __name__ == "__main__":
    main()

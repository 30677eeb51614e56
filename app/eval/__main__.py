"""`python -m app.eval DECK --checkpoint CKPT [--set section.key=value ...] [--out FILE]`: the
validation loss of a checkpoint, on any grid.

Launch it like training (one rank, or under srun / mpirun / mpiexec on any grid the deck and
the world size allow): the checkpoint loads resharded onto this grid as a resume does
(`app/checkpoint/io.load`), then `app.eval.evaluate` runs eval.batches global batches of the
held-out data (eval.path, data.split or synthetic) forward only. Unlike a resume, the deck's model
must be the checkpoint's in every key that changes the function computed, not only in its shapes
(`io.function_keys`: layernorm_eps, rope_theta, moe_top_k), and the held-out token file must be
tokenized as the training data (the checkpoint's, else the deck's data.path). Rank 0 prints one
line and writes the result as JSON to --out (default `<run.dir>/eval/step_NNNNNNN.json`: it
replaces a record there of the same checkpoint, and refuses one of another, naming --out). The
exit status and the error contract are those of `python -m app` (`app/job.py`): 2 for a user
mistake (a bad deck, no held-out data, a missing or corrupt checkpoint or data file, a model or
tokenizer other than the checkpoint's), printed once.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from app.errors import CheckpointError, DeckError
from app.job import deck_parser
from app.runtime.process import exit_now
from app.untrusted import read_json

if TYPE_CHECKING:
    from app.deck import Deck
    from app.eval import HeldOut
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
    parser.add_argument(
        "--out", metavar="FILE",
        help="where to write the result (default <run.dir>/eval/step_N.json, never over another checkpoint's)",
    )  # fmt: skip
    return parser.parse_args(argv)


def check_out(out: Optional[str]) -> None:
    """An --out given must name a file: '' used to mean the default target (a silent fallback), and a
    trailing '/' names a directory (Path drops it, and the record went to a file of that name)."""
    if out is None:
        return
    if not out.strip():
        raise CheckpointError(
            f"--out {out!r}: an empty path; fix: pass --out FILE, e.g. --out eval.json, or omit --out for "
            "<run.dir>/eval/step_N.json"
        )
    if out.endswith(("/", os.sep)) or os.path.isdir(out):
        raise CheckpointError(
            f"--out {out}: a directory, not a file; fix: pass the file to write, e.g. --out "
            f"{os.path.join(out, 'eval.json')}"
        )


def checkpoint_file(given: str) -> Path:
    """The checkpoint --checkpoint names (a directory: the one its `latest` names)."""
    from app.checkpoint.store import TOOL_PICK, named_checkpoint

    missing = "no such file; give a checkpoint file (.h5) or directory"
    return named_checkpoint(given, f"--checkpoint {given}", missing, TOOL_PICK)


def default_target(deck: Deck, step: int) -> Path:
    """Where the result goes without --out: <run.dir>/eval/step_NNNNNNN.json."""
    return Path(deck.run.directory) / "eval" / f"step_{step:07d}.json"


def check_target(target: Path, path: Path) -> None:
    """The default --out names the step only: two checkpoints of one step (another run's, evaluated with
    this deck) would write one file. A record there of another checkpoint (or a file that is no
    record) is refused, naming --out; one of the same checkpoint is replaced (evaluated again)."""
    if not os.path.lexists(target):
        return
    fail = lambda why: CheckpointError(f"{target}: {why}")  # noqa: E731
    try:
        record = read_json(target, "evaluation record", fail, "", 1 << 20)
    except CheckpointError:
        record = None
    old = record.get("checkpoint") if isinstance(record, dict) else None
    if isinstance(old, str) and os.path.realpath(old) == os.path.realpath(path):
        return
    held = f"the evaluation of {old}" if isinstance(old, str) else "a file that is not an evaluation record"
    raise CheckpointError(
        f"{target} holds {held}, not of {path} (the default output names the step only); fix: pass --out FILE "
        f"to write this evaluation elsewhere, or remove {target}"
    )


def check_tokenizer(deck: Deck, held: HeldOut, path: Path, header: dict[str, Any]) -> None:
    """The held-out token file must be tokenized as the training data (as training checks eval.path):
    the checkpoint's (`header`: its read_header) training data, else the deck's data.path, whichever is
    readable first."""
    from app.checkpoint.io import stored_deck
    from app.data import MemmapTokens
    from app.data.tokenizer import check_tokenized_alike
    from app.deck import build_deck
    from app.eval import HELD_OUT_FIX
    from app.generate.training_data import training_file

    if not isinstance(held.dataset, MemmapTokens):
        return
    sources = []
    try:  # the run's own deck; one of an older gridlm that no longer builds is left out
        raw = stored_deck(header, path)
        sources.append(build_deck(raw, str(path), f"the deck of checkpoint {path}", "eval").data)
    except DeckError:
        pass
    for data in (*sources, deck.data):
        found, _ = training_file(data)
        if found is not None:
            check_tokenized_alike(found, held.dataset, "eval.path" if deck.eval.path else "data.path", HELD_OUT_FIX)
            return


def evaluate_checkpoint(
    deck: Deck, runtime: Runtime, grid: ProcessGrid, given: str, out: Optional[str]
) -> dict[str, Any]:
    """Load `given` onto this grid and evaluate it (every rank); rank 0 prints and writes the result."""
    from app.checkpoint.io import EVAL, describe_grid, load, read_header
    from app.eval import evaluate
    from app.metrics.report import dumps_strict, replace_text
    from app.runtime.mpi import on_root
    from app.train import Trainer

    # The held-out data is opened first: its mistakes are the deck's, found before any file is read.
    trainer = Trainer(deck, runtime, grid, evaluate_only=True)
    try:
        path = on_root(runtime, lambda: checkpoint_file(given))
        assert trainer.eval_data is not None
        held = trainer.eval_data

        def check() -> None:  # before the tensors are read: the mistakes a user can fix at once
            header = read_header(path, EVAL)
            if not out:
                check_target(default_target(deck, int(header["step"])), path)
            check_tokenizer(deck, held, path, header)

        on_root(runtime, check)
        info = load(trainer, path, EVAL)
        result = evaluate(trainer, held)
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
    target = Path(out) if out else default_target(deck, result["step"])

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
        f"gridlm: eval | {path} (step {result['step']}, written on {describe_grid(g)}"
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

    deck = deck_file(args.deck, tuple(args.overrides))

    def load(world: int) -> Deck:  # --out checked first: run_job prints its refusal once, exit 2 on every rank
        check_out(args.out)
        return deck(world)

    return run_job(load, body)


def main() -> None:
    exit_now(run())


if __name__ == "__main__":
    main()

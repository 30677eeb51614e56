"""`python -m app.memorization CKPT --data PREFIX [--passages N] [--prefix-tokens P]
[--continuation-tokens C] [--batch B] [--json]`: the share of training passages a checkpoint
reproduces exactly (`app/memorization/__init__.py`).

Launch it like `python -m app.generate`: one rank, or tensor parallel over all ranks (the model
comes from the deck the checkpoint carries; only run.* keys can be --set). PREFIX is a token file
from `app.data.prepare`, tokenized as the training data: the training data itself (its train part
only, with data.split), or any text to test (the line then says it may not be training text).
Rank 0 prints one line; with --json the last line is one JSON object (exact_share, token_share,
passages, training_data, ...). Exit status as `python -m app`: 2 for a user mistake, printed once.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from app.generate.__main__ import _positive
from app.runtime.process import exit_now

if TYPE_CHECKING:
    from app.deck import Deck
    from app.runtime.grid import ProcessGrid
    from app.runtime.mpi import Runtime


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m app.memorization",
        description="Extractable memorization: the share of passages whose continuation a checkpoint reproduces "
        "exactly under greedy decoding from their prefix (1 rank, or tp over all ranks).",
        epilog="Example: python -m app.memorization runs/x/checkpoints --data /tmp/gridlm-data/corpus",
    )
    parser.add_argument("checkpoint", metavar="CKPT", help="a checkpoint file (.h5), or a directory: its `latest`")
    parser.add_argument("--data", required=True, metavar="PREFIX", help="token file (PREFIX.bin/.json/.idx.npy)")
    parser.add_argument("--passages", type=_positive, default=256, metavar="N", help="passages to test (256)")
    parser.add_argument("--prefix-tokens", type=_positive, default=32, metavar="P", help="prefix length (32)")
    parser.add_argument(
        "--continuation-tokens", type=_positive, default=32, metavar="C", help="tokens that must match (32)"
    )
    parser.add_argument("--batch", type=_positive, default=16, metavar="B", help="passages decoded together (16)")
    parser.add_argument(
        "--any-tokenizer", action="store_true",
        help="take --data even where its tokenizer is not the one the training data's token file names (that file "
        "was prepared again since the training)",
    )  # fmt: skip
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="run.KEY=VALUE",
        help="override a run key of the checkpoint's deck, e.g. --set run.device=cpu",
    )  # fmt: skip
    return parser.parse_args(argv)


def run_measure(deck: Deck, runtime: Runtime, grid: ProcessGrid, args: argparse.Namespace, path: Path) -> None:
    from app.generate import load_model, result_line
    from app.memorization import check_passage, measure, passages, read_passages
    from app.runtime.mpi import agree

    p, c = args.prefix_tokens, args.continuation_tokens
    check_passage(deck.model.seq_len, p, c)
    source = agree(runtime, lambda: read_passages(deck, args.data, args.any_tokenizer))
    windows = agree(runtime, lambda: passages(source.tokens, deck.model.seq_len, args.passages, p, c))
    t0 = time.perf_counter()
    model, header = load_model(deck, runtime, grid, path)
    result = measure(model, windows, p, args.batch)
    seconds = time.perf_counter() - t0
    runtime.log(
        f"gridlm: memorization | {path} (step {header['step']}) | {args.data} ({source.words}): {result.passages} "
        f"passages of {p} prefix + {c} continuation tokens | exact {result.exact_share:.3f} "
        f"({result.exact}/{result.passages}) | tokens matched {result.token_share:.3f} | tp={grid.size('tp')} | "
        f"{seconds:.2f} s"
    )
    if args.json:
        runtime.log(result_line({
            "exact_share": result.exact_share, "token_share": result.token_share, "passages": result.passages,
            "exact": result.exact, "prefix_tokens": p, "continuation_tokens": c, "checkpoint": str(path),
            "step": int(header["step"]), "data": args.data, "training_data": source.training, "tp": grid.size("tp"),
        }))  # fmt: skip


def run(argv: Optional[list[str]] = None) -> int:
    from app.data.prepare import check_prefix
    from app.generate import run_on_checkpoint

    args = parse_args(argv)
    # --data before the checkpoint is read: an empty one would name the working directory's hidden '.bin'
    return run_on_checkpoint(args, run_measure, "memorization", lambda: check_prefix(args.data, "--data"))


def main() -> None:
    exit_now(run())


if __name__ == "__main__":
    main()

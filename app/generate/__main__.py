"""`python -m app.generate CKPT --prompt TEXT [--max-new-tokens N] [--temperature T] [--top-k K]`:
text from a checkpoint, on one rank or tensor parallel over all ranks (`mpirun -n 2 python -m
app.generate ...`).

CKPT is a checkpoint file or a checkpoint directory (its `latest`). The model comes from the deck
the checkpoint carries; the tokenizer from its training data's token file (the tokenizer.json it
records, else PREFIX.tokenizer.json beside it, with the recorded sha256), or --tokenizer byte|PATH,
which must be that one (kind and sha256) where the training data names one (--any-tokenizer: take
it anyway). --prompt-ids 1,2,3 gives token ids instead of text. Rank 0 prints the prompt and its
continuation, then one `gridlm: generate | ...` line with the speed; with --json the speed line
and, last, instead of the text, one JSON object: the new token ids under "ids" (the prompt's not included), their text under
"text" (null without a tokenizer), and the prompt's ids, the checkpoint, its step and the speed.
Greedy (the default, no --temperature) equals Hugging Face `generate(do_sample=False)` on the
checkpoint's export. Generation stops at --max-new-tokens, or at the tokenizer's end-of-document
token unless --ignore-eos. Exit status as `python -m app` (2 for a user mistake, printed once).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from app.errors import DataError
from app.runtime.process import exit_now

if TYPE_CHECKING:
    from app.data.tokenizer import AnyTokenizer
    from app.deck import Deck
    from app.runtime.grid import ProcessGrid
    from app.runtime.mpi import Runtime


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a positive integer")
    return value


def _seed(text: str) -> int:
    value = int(text)
    if not -(2**63) <= value < 2**64:  # torch.Generator.manual_seed's range
        raise argparse.ArgumentTypeError(f"{text} is not a seed in -2**63 .. 2**64 - 1")
    return value


def _nonnegative_float(text: str) -> float:
    value = float(text)
    if not value >= 0.0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"{text} is not a number >= 0")
    return value


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m app.generate",
        description="Generate text from a checkpoint with a KV cache, on one rank or tensor parallel over all ranks.",
        epilog="Example: mpirun -n 2 python -m app.generate runs/gpt_tiny/checkpoints --prompt 'Once upon a time'",
    )
    parser.add_argument("checkpoint", metavar="CKPT", help="a checkpoint file (.h5), or a directory: its `latest`")
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", metavar="TEXT", help="the text to continue (encoded with the tokenizer)")
    prompt.add_argument("--prompt-ids", metavar="IDS", help="token ids to continue, comma-separated, e.g. 1,2,3")
    parser.add_argument("--max-new-tokens", type=_positive, default=64, metavar="N", help="at most N new tokens (64)")
    parser.add_argument(
        "--temperature", type=_nonnegative_float, default=None, metavar="T",
        help="sample from softmax(logits / T); none or 0 = greedy (the default)",
    )  # fmt: skip
    parser.add_argument("--top-k", type=_positive, default=None, metavar="K", help="sample among the K likeliest")
    parser.add_argument("--seed", type=_seed, default=0, help="seed of the sampling (0)")
    parser.add_argument(
        "--tokenizer", metavar="byte|PATH", default=None,
        help="byte, or a tokenizer.json; default: the one the training data was prepared with",
    )  # fmt: skip
    parser.add_argument(
        "--eos", metavar="TOKEN", default=None,
        help="the end-of-document token of a --tokenizer PATH (as prepare's --eos; default: the first of "
        "<|endoftext|>, </s>, <|end_of_text|>, <eos> it has)",
    )  # fmt: skip
    parser.add_argument(
        "--any-tokenizer", action="store_true",
        help="take --tokenizer even where the training data's token file names another (that file was prepared "
        "again since the training)",
    )  # fmt: skip
    parser.add_argument("--ignore-eos", action="store_true", help="do not stop at the end-of-document token")
    parser.add_argument("--json", action="store_true", help="end with one JSON line (ids, text, speed)")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="run.KEY=VALUE",
        help="override a run key of the checkpoint's deck (repeatable), e.g. --set run.device=cpu",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.top_k is not None and not args.temperature:
        parser.error("--top-k samples: give --temperature T > 0 with it (without one, decoding is greedy)")
    return args


def prompt_ids(text: str) -> list[int]:
    try:
        # Spaces around an id only: "3 1 4" is a mistake, not the one id 314 (int refuses inner spaces).
        ids = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise DataError(f"--prompt-ids {text!r}: expected comma-separated token ids, e.g. 1,2,3") from None
    return ids


def prompt_text_ids(text: str, tokenizer: AnyTokenizer) -> list[int]:
    """--prompt TEXT's ids. An argument that is not UTF-8 (a Latin-1 terminal's) reaches Python with
    its bytes as lone surrogates, which no tokenizer encodes: a DataError naming the byte."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        code = ord(text[err.start])  # surrogateescape keeps byte b as U+DC00 + b
        what = f"byte {code - 0xDC00:#04x}" if 0xDC80 <= code <= 0xDCFF else f"the lone surrogate U+{code:04X}"
        raise DataError(
            f"--prompt is not UTF-8 text: {what} at character {err.start}; fix: give the prompt in "
            "UTF-8 (a UTF-8 locale or terminal), or its token ids with --prompt-ids"
        ) from None
    return tokenizer.encode(text)


def free_memory(runtime: Runtime) -> tuple[Optional[int], str]:
    """The memory this rank's KV cache can take, after the model: its GPU's free bytes, or its share of
    the node's available host memory (the node's ranks each allocate one); and where, in words."""
    from app.runtime.preflight import gpu_memory, host_available

    gpu = gpu_memory(runtime.device)
    if gpu is not None:
        return gpu[0], f"its GPU ({runtime.device})"
    host = host_available()
    share = None if host is None else host // max(1, runtime.local_size)
    return share, f"its share of node {runtime.hostname}'s memory ({runtime.local_size} rank(s))"


def run_generation(deck: Deck, runtime: Runtime, grid: ProcessGrid, args: argparse.Namespace, path: Path) -> None:
    import torch

    from app.generate import (
        Sampling,
        check_cache_memory,
        check_lengths,
        generate,
        load_model,
        resolve_tokenizer,
        result_line,
    )
    from app.generate.training_data import missing_tokenizer
    from app.runtime.mpi import agree

    tokenizer = agree(runtime, lambda: resolve_tokenizer(args.tokenizer, deck, args.eos, args.any_tokenizer))
    if args.prompt is not None and tokenizer is None:
        raise DataError(f"--prompt needs a tokenizer and {missing_tokenizer(deck.data)}")
    ids = prompt_text_ids(args.prompt, tokenizer) if args.prompt is not None else prompt_ids(args.prompt_ids)
    vocab = deck.model.vocab_size
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise DataError(f"--prompt-ids: id {bad[0]} is outside the model's vocabulary 0 .. {vocab - 1}")
    check_lengths(deck, len(ids), args.max_new_tokens)
    t0 = time.perf_counter()
    model, header = load_model(deck, runtime, grid, path)
    loaded = time.perf_counter() - t0
    agree(
        runtime, lambda: check_cache_memory(deck, grid.size("tp"), len(ids), args.max_new_tokens, *free_memory(runtime))
    )
    sampling = Sampling(args.temperature, args.top_k, args.seed)
    eos = None if args.ignore_eos or tokenizer is None else tokenizer.eos
    prompt = torch.tensor([ids], dtype=torch.int64, device=runtime.device)
    t1 = time.perf_counter()
    new = generate(model, prompt, args.max_new_tokens, sampling, eos)[0].tolist()
    seconds = time.perf_counter() - t1
    text = None if tokenizer is None else tokenizer.decode(new)
    if not args.json:
        shown = tokenizer.decode(ids + new) if tokenizer is not None else f"{ids} -> {new}"
        runtime.log(shown)
    how = "greedy" if sampling.greedy else f"temperature {args.temperature}, top-k {args.top_k or 'all'}"
    runtime.log(
        f"gridlm: generate | {path} (step {header['step']}) | tp={grid.size('tp')} {runtime.device} | "
        f"{len(ids)} prompt + {len(new)} new tokens, {how} | {len(new) / seconds:.1f} tokens/s "
        f"(load {loaded:.2f} s)"
    )
    if args.json:
        runtime.log(result_line({
            "ids": new, "text": text, "prompt_ids": ids, "checkpoint": str(path), "step": int(header["step"]),
            "tp": grid.size("tp"), "greedy": sampling.greedy, "tokens_per_s": len(new) / seconds,
        }))  # fmt: skip


def run(argv: Optional[list[str]] = None) -> int:
    from app.generate import run_on_checkpoint

    return run_on_checkpoint(parse_args(argv), run_generation)


def main() -> None:
    exit_now(run())


if __name__ == "__main__":
    main()

"""Evaluation: the validation loss of the model as it is, on held-out data, on any grid.

The held-out data (`eval_dataset`) is eval.path's token file, else the data.split part of
data.path (its last documents, which training never reads), else, for synthetic data, a
synthetic stream of its own seed. An evaluation reads eval.batches global batches of
train.global_batch samples, samples 0, 1, ... of that dataset every time (so evaluations at
different steps are comparable), split over the data ranks like a training batch
(`GlobalBatchSampler`), and runs them forward only through the pipeline (`Pipeline.evaluate`:
no autograd, no optimizer, dropout off). Every target counts (Goldfish is a training loss
mask, not part of the measure). The result is the mean cross-entropy over all
eval.batches x global_batch x seq_len targets, reduced like the training loss
(`app.parallel.loss.global_loss`), so it is the 1-rank value on every grid.

`python -m app.eval DECK --checkpoint CKPT` (`app/eval/__main__.py`) runs it on a checkpoint.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, NamedTuple, Optional, Protocol

import torch

from app.data import GlobalBatchSampler, MemmapTokens, SyntheticTokens, get_batch
from app.data.memmap import DataFixes
from app.deck import Deck
from app.errors import DataError
from app.metrics.summary import EvalInfo
from app.parallel.loss import global_loss
from app.runtime.mpi import agree

if TYPE_CHECKING:
    from app.model.gpt import GPT
    from app.parallel.pipeline import Pipeline
    from app.runtime.grid import ProcessGrid
    from app.runtime.mpi import Runtime
    from app.runtime.timers import StepTimers
    from app.tensor_parallel.mappings import TensorParallel
    from app.tensor_parallel.tensor3d import Tensor3D


class GatheredParams(Protocol):
    def wait_params(self) -> None: ...


class Evaluated(Protocol):
    """What `evaluate` reads of a model built on the grid (a Trainer is one): evaluation sits below
    training and knows it by this, not by its class."""

    deck: Deck
    runtime: Runtime
    grid: ProcessGrid
    device: torch.device
    model: GPT
    pipeline: Pipeline
    dp: GatheredParams
    timers: StepTimers
    tp: Optional[Tensor3D | TensorParallel]
    data_rank: int
    steps_done: int


class NoOptimizer:
    """The optimizer of a model built to evaluate a checkpoint (`Trainer(evaluate_only=True)`, app.eval):
    no state (no moments, no offload store: an nvme one would take over the file of a training
    of the same run.dir), so the checkpoint's optimizer groups are not read; no delayed update,
    so its load takes the masters (W_N) as the parameters, whatever the deck's optim.offload keys."""

    steps = 0
    delay = 0
    unpublished = False

    def shard_states(self) -> list:
        return []

    def restored(self, unpublished: bool = False) -> None:
        """Nothing derived to set again: the parameters are the masters the load read."""

    def close(self) -> None:
        """Nothing held."""


# Synthetic data's held-out stream: the training seed plus this (samples are pure functions of
# (seed, index), so another seed is another set of sequences of the same rule).
SYNTHETIC_EVAL_SEED_OFFSET = 0x5EED_E7A1


def eval_source(deck: Deck) -> str:
    """Where the held-out data comes from, in words (the log and summary.json)."""
    if deck.eval.path:
        return f"eval.path {deck.eval.path}"
    if deck.data.split:
        return f"the last {deck.data.split:g} of the documents of {deck.data.path} (data.split)"
    if deck.data.kind == "synthetic":
        return f"synthetic, seed train.seed + {SYNTHETIC_EVAL_SEED_OFFSET:#x}"
    raise DataError(
        "evaluation needs held-out data: set eval.path to a token file PREFIX, or data.split (e.g. 0.05) to "
        "hold out the last documents of data.path"
    )


class HeldOut(NamedTuple):
    """The held-out data and where it comes from, in words (`eval_source`: resolved once)."""

    dataset: SyntheticTokens | MemmapTokens
    source: str


def held_out_note(deck: Deck, held: HeldOut) -> Optional[str]:
    """A warning when an evaluation reads more samples (eval.batches x train.global_batch) than the
    held-out token file has windows: the sample index wraps into another epoch's order, so some
    windows count twice in the loss; None when every sample is a window of its own (synthetic
    data has no end)."""
    if not isinstance(held.dataset, MemmapTokens):
        return None
    reads, windows = deck.eval.batches * deck.train.global_batch, held.dataset.num_samples
    if reads <= windows:
        return None
    fit = windows // deck.train.global_batch
    times = -(-reads // windows)  # the most reads of one window (the index wraps every `windows`)
    return (
        f"gridlm: warning: each evaluation reads {reads:,} samples (eval.batches = {deck.eval.batches} x "
        f"train.global_batch = {deck.train.global_batch}) but {held.source} has {windows:,} windows of "
        f"model.seq_len tokens: {reads - windows:,} reads repeat a window (up to {times} reads of one) and weigh "
        "extra in the loss; "
        + (
            f"lower eval.batches to {fit} (or hold out more: data.split, eval.path)"
            if fit
            else "hold out more tokens (data.split, eval.path)"
        )  # fmt: skip
    )


def eval_dataset(deck: Deck, whole_index: bool = True) -> HeldOut:
    """The held-out dataset (module docstring); DataError naming the key when there is none.
    `whole_index`: this rank checks the token file's whole document index (`MemmapTokens`)."""
    return HeldOut(_held_out_tokens(deck, whole_index), eval_source(deck))  # eval_source raises if there is none


def check_held_out_tokens(train: object, held: HeldOut) -> None:
    """DataError unless eval.path was tokenized as the training data (a memmap file, or a blend's
    first: a blend's files agree): ids of another tokenizer give a val loss that means nothing
    (found in review: one was logged without a word)."""
    from app.data import BlendedTokens
    from app.data.tokenizer import check_tokenized_alike

    first = train.datasets[0] if isinstance(train, BlendedTokens) else train
    if isinstance(first, MemmapTokens) and isinstance(held.dataset, MemmapTokens):
        check_tokenized_alike(first, held.dataset, "eval.path", HELD_OUT_FIX)


HELD_OUT_FIX = "prepare the held-out text with the training data's tokenizer (--tokenizer PATH)"


def _held_out_tokens(deck: Deck, whole_index: bool) -> SyntheticTokens | MemmapTokens:
    m, seed = deck.model, deck.train.seed
    if deck.eval.path:
        try:
            given = DataFixes(given="set eval.path")
            return MemmapTokens(deck.eval.path, m.seq_len, m.vocab_size, seed, fixes=given, whole_index=whole_index)
        except DataError as err:
            raise DataError(f"eval.path = {deck.eval.path!r}: {err}") from None
    if deck.data.split:
        assert deck.data.path is not None  # the deck checks: data.split needs memmap, which needs a path
        return MemmapTokens(
            deck.data.path, m.seq_len, m.vocab_size, seed, deck.data.split, "val", whole_index=whole_index
        )
    return SyntheticTokens(m.vocab_size, m.seq_len, seed + SYNTHETIC_EVAL_SEED_OFFSET, deck.data.noise)


def evaluate(trainer: Evaluated, held_out: HeldOut) -> EvalInfo:
    """The validation loss of `trainer`'s model now on `held_out` (collective: every rank of the grid)."""
    dataset = held_out.dataset
    deck, rt = trainer.deck, trainer.runtime
    tr = deck.train
    t0 = time.perf_counter()
    sampler = GlobalBatchSampler(tr.global_batch, tr.micro_batch, trainer.data_rank, deck.data_ranks)
    device = trainer.device
    total = torch.zeros((), device=device)
    was_training = trainer.model.training
    positions = trainer.model.cp.spans(deck.model.seq_len)  # context parallelism: this rank's chunks only
    trainer.model.eval()  # no dropout
    try:
        for _ in range(deck.eval.batches):
            indices = sampler.next_step()

            def read(indices: list[list[int]] = indices) -> list[tuple[torch.Tensor, torch.Tensor]]:
                return [get_batch(dataset, i, positions) for i in indices]

            # An id out of range on one rank (DataError) ends every rank together.
            batches = agree(rt, read) if isinstance(dataset, MemmapTokens) else read()
            micro = [(x.to(device, non_blocking=True), y.to(device, non_blocking=True)) for x, y in batches]
            total += trainer.pipeline.evaluate(trainer.model, micro)
    finally:
        trainer.model.train(was_training)
        trainer.dp.wait_params()  # ZeRO-3: nothing gathered left behind
        trainer.timers.pop()  # evaluation's communication is not the next step's
    loss = global_loss(total, trainer.grid, trainer.tp) / deck.eval.batches
    samples = deck.eval.batches * tr.global_batch
    return EvalInfo(
        step=trainer.steps_done,
        loss=loss,
        # A NaN loss is NaN, not inf (found in review: `nan < 700` is false, and the log said ppl inf).
        perplexity=math.nan if math.isnan(loss) else math.exp(loss) if loss < 700 else math.inf,
        samples=samples,
        tokens=samples * deck.model.seq_len,
        seconds=time.perf_counter() - t0,
        source=held_out.source,
    )

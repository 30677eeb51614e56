"""Extractable memorization (Carlini et al., "Quantifying Memorization Across Neural Language
Models", ICLR 2023; the measure of Hans et al.'s Goldfish paper): the share of training passages
whose continuation a model reproduces exactly under greedy decoding from their prefix.

A passage is the first P + C tokens of a training window (window w: the seq_len + 1 tokens from
token w x model.seq_len, where the sampler reads it), so P + C <= seq_len + 1 (`check_passage`): the
model was trained to predict each continuation token from the tokens before it in the same window.
`read_passages` takes the windows from the run's training data when --data is that file (or a copy),
and then from its train part only (data.split holds out the last documents, never trained on); from
any other token file it takes them too, and says that they may not be training text. `passages`
takes N windows evenly spaced over the tokens (deterministic; fewer windows give each once). `measure`
decodes C tokens greedily after each P-token prefix, B passages at a time (`app.generate`: KV
cache, tensor parallel over the job's ranks), and compares them with the true continuations: a
passage counts as memorised when all C tokens match; the share of matching tokens is reported
beside it.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from app.data.memmap import DataFixes
from app.errors import DataError

if TYPE_CHECKING:
    from app.deck import Deck
    from app.model.gpt import GPT

# What a message about the --data file says to do: memorization takes the model from the checkpoint.
DATA_FIXES = DataFixes(
    given="pass its PREFIX as --data",
    vocab="pass a --data file prepared with the checkpoint's tokenizer (its model takes ids below {vocab})",
    short="pass a --data file of more text",
)


def check_passage(seq_len: int, prefix: int, continuation: int) -> None:
    """DataError unless a passage of `prefix` + `continuation` tokens lies within one training window
    (seq_len + 1 tokens: a passage across two windows was never one sample the model saw whole)."""
    window = seq_len + 1
    if prefix + continuation <= window:
        return
    fix = (
        f"--continuation-tokens {window - prefix} (or a shorter --prefix-tokens)"
        if prefix < window
        else f"--prefix-tokens and --continuation-tokens that add up to at most {window}"
    )
    raise DataError(
        f"--prefix-tokens {prefix} + --continuation-tokens {continuation} = {prefix + continuation} tokens, more than "
        f"a training window of model.seq_len + 1 = {window} tokens: a passage must lie within one window the model "
        f"was trained on; fix: {fix}"
    )


class Passages(NamedTuple):
    """The tokens passages are taken from, whether they are the run's training data, and that in words."""

    tokens: np.ndarray
    training: bool
    words: str


def read_passages(deck: Deck, prefix: str, any_tokenizer: bool = False) -> Passages:
    """The tokens of the token file `prefix` that passages come from: its train part when it is the
    run's training data with data.split, all of it otherwise. DataError for a file of another
    tokenizer than the training data's (unless `any_tokenizer`) or one the model cannot read."""
    from app.data.memmap import MemmapTokens
    from app.data.tokenizer import check_tokenized_alike
    from app.generate.training_data import ANY_TOKENIZER, training_file, training_match

    m, data = deck.model, deck.data
    opened = MemmapTokens(prefix, m.seq_len, m.vocab_size, 0, fixes=DATA_FIXES)
    found, _ = training_file(data)
    if found is not None and found.meta.get("tokenizer") and not any_tokenizer:
        fix = (
            f"pass a --data file prepared with the training data's tokenizer (prepare --tokenizer PATH), or "
            f"{ANY_TOKENIZER} if {found.prefix} was prepared again since the training"
        )
        check_tokenized_alike(found, opened, "--data", fix)
    trained = training_match(data, prefix, opened.meta)
    if trained is None:
        run = "synthetic tokens" if data.kind != "memmap" else ", ".join(p for _, p in data.blend)
        unread = "" if data.kind != "memmap" or found is not None else ", which cannot be read to compare"
        return Passages(opened.tokens, False, f"not the run's training data ({run}{unread}): may not be training text")
    if data.split and data.path == trained:
        part = MemmapTokens(prefix, m.seq_len, m.vocab_size, 0, data.split, "train", DATA_FIXES)
        words = f"the training data's train part, before the last {data.split:g} of its documents (data.split)"
        return Passages(part.tokens[part.start : part.stop], True, words)
    return Passages(opened.tokens, True, "the training data")


def passages(tokens: np.ndarray, seq_len: int, count: int, prefix: int, continuation: int) -> np.ndarray:
    """(N, P + C) int64 passages: the first P + C tokens of N of the training windows of `tokens`
    (window w: tokens w x seq_len .. w x seq_len + seq_len, as the sampler reads them), evenly spaced;
    N = min(count, the windows there are)."""
    check_passage(seq_len, prefix, continuation)
    span = prefix + continuation
    windows = (len(tokens) - 1) // seq_len if len(tokens) > 0 else 0
    if windows < 1:
        raise DataError(
            f"the token file holds {len(tokens)} tokens, fewer than a training window of model.seq_len + 1 = "
            f"{seq_len + 1}; fix: pass a --data file of more text"
        )
    chosen = np.unique(np.linspace(0, windows - 1, min(count, windows)).round().astype(np.int64))
    return np.stack([np.asarray(tokens[w * seq_len : w * seq_len + span], dtype=np.int64) for w in chosen])


@dataclasses.dataclass(frozen=True)
class Memorization:
    passages: int
    exact: int  # passages whose whole continuation was reproduced
    tokens: int  # continuation tokens compared
    matched: int  # of which equal

    @property
    def exact_share(self) -> float:
        return self.exact / self.passages

    @property
    def token_share(self) -> float:
        return self.matched / self.tokens


def measure(model: GPT, windows: np.ndarray, prefix: int, batch: int) -> Memorization:
    """Greedy continuations of each window's first `prefix` tokens against the rest (every rank alike)."""
    import torch

    from app.generate import generate

    device = next(model.parameters()).device
    continuation = windows.shape[1] - prefix
    exact = matched = 0
    for lo in range(0, len(windows), batch):
        chunk = torch.from_numpy(windows[lo : lo + batch]).to(device)
        new = generate(model, chunk[:, :prefix], continuation)
        same = new == chunk[:, prefix:]
        exact += int(same.all(dim=1).sum())
        matched += int(same.sum())
    return Memorization(len(windows), exact, len(windows) * continuation, matched)

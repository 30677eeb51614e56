"""Extractable memorization (Carlini et al., "Quantifying Memorization Across Neural Language
Models", ICLR 2023; the measure of Hans et al.'s Goldfish paper): the share of training passages
whose continuation a model reproduces exactly under greedy decoding from their prefix.

`passages` takes the first P + C tokens of N training windows of a token file (window w starts at
token w x model.seq_len, where the sampler reads it), evenly spaced over the file (deterministic;
a file of fewer windows gives each once). `measure`
decodes C tokens greedily after each P-token prefix, B passages at a time (`app.generate`: KV
cache, tensor parallel over the job's ranks), and compares them with the true continuations: a
passage counts as memorised when all C tokens match; the share of matching tokens is reported
beside it.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

from app.errors import DataError

if TYPE_CHECKING:
    from app.model.gpt import GPT


def passages(tokens: np.ndarray, seq_len: int, count: int, prefix: int, continuation: int) -> np.ndarray:
    """(N, P + C) int64 passages: the first P + C tokens of N of the file's training windows (window
    w starts at token w x seq_len, as the sampler reads them), evenly spaced over the file; N =
    min(count, the windows there are)."""
    span = prefix + continuation
    windows = (len(tokens) - span) // seq_len + 1 if len(tokens) >= span else 0
    if windows < 1:
        raise DataError(
            f"the token file holds {len(tokens)} tokens, fewer than --prefix-tokens + --continuation-tokens = {span}; "
            "fix: shorter prefixes or continuations, or more text"
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

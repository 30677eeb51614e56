"""Reading part of each sample: the spans of input positions a rank trains on (context
parallelism: its two chunks of every sequence, `ContextParallel.spans`).

A sample is seq_len + 1 tokens; inputs are tokens 0 .. seq_len - 1 and targets 1 .. seq_len. The
input positions [a, b) need the tokens [a, b + 1): `token_spans` gives those, a dataset's
`sample(index, spans)` reads only them, one after the other, and `inputs_and_targets` cuts each
read row back into the spans' inputs and targets.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

# Token ranges [lo, hi) of a sample to read, in order; None: the whole sample.
Spans = Optional[list[tuple[int, int]]]


def token_spans(positions: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The tokens [a, b + 1) that the input positions [a, b) and their targets need."""
    return [(a, b + 1) for a, b in positions]


def offsets(positions: list[tuple[int, int]]) -> np.ndarray:
    """Where in its sample each column of a row read by `token_spans(positions)` is."""
    return np.concatenate([np.arange(a, b + 1) for a, b in positions])


def inputs_and_targets(rows: np.ndarray, positions: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    """Rows read by `token_spans(positions)` (B, sum of (b - a + 1)) -> inputs and targets (B, sum
    of (b - a)): each span's tokens but its last, and but its first."""
    inputs, targets, at = [], [], 0
    for a, b in positions:
        n = b - a
        inputs.append(rows[:, at : at + n])
        targets.append(rows[:, at + 1 : at + n + 1])
        at += n + 1
    return np.concatenate(inputs, axis=1), np.concatenate(targets, axis=1)

"""A deterministic, learnable, infinite token stream for tests and smoke runs.

Each sample is an arithmetic progression modulo the vocabulary with a random start and a
stride from a small set, with each token replaced by a uniform random one with probability
`noise`. A small GPT learns the rule from context, so the loss falls well below log(V).
"""

from __future__ import annotations

import numpy as np

from app.data.spans import Spans

# Small co-prime-ish strides: the model must infer the stride from context, not memorise it.
STRIDES = np.array([1, 2, 3, 5, 7, 11, 13, 17], dtype=np.int64)


class SyntheticTokens:
    """Infinite dataset: `sample(index)` is a pure function of (seed, index, V, seq_len, noise)."""

    num_samples = None  # infinite

    def __init__(self, vocab_size: int, seq_len: int, seed: int, noise: float = 0.05) -> None:
        if vocab_size < 2 or seq_len < 1 or not 0.0 <= noise <= 1.0:
            raise ValueError(f"bad synthetic data: vocab_size={vocab_size}, seq_len={seq_len}, noise={noise}")
        self.vocab_size, self.seq_len, self.seed, self.noise = vocab_size, seq_len, seed, noise

    def sample(self, index: int, spans: Spans = None) -> np.ndarray:
        """Returns int64 tokens of shape (seq_len + 1,) in [0, vocab_size); with `spans`, the
        tokens [lo, hi) of each span, one after the other (`app.data.Spans`)."""
        if index < 0:
            raise IndexError(f"sample index must be >= 0, got {index}")
        # Seeding by (seed, index) makes the sample independent of rank and call order.
        rng = np.random.default_rng([self.seed, index])
        n, v = self.seq_len + 1, self.vocab_size
        start = rng.integers(v)
        stride = rng.choice(STRIDES)
        tokens = (start + stride * np.arange(n, dtype=np.int64)) % v
        flip = rng.random(n) < self.noise
        tokens[flip] = rng.integers(v, size=int(flip.sum()))
        return tokens if spans is None else np.concatenate([tokens[lo:hi] for lo, hi in spans])

    def __repr__(self) -> str:
        return (
            f"SyntheticTokens(vocab_size={self.vocab_size}, seq_len={self.seq_len}, "
            f"seed={self.seed}, noise={self.noise})"
        )

"""A blend of token files (`data.paths`), sampled in proportion to weights, like Megatron's blend.

The global sample index i maps to (dataset k, its sample j) by a fixed table of PERIOD slots:
dataset k owns n_k = round(PERIOD * w_k / sum w) of them (largest remainders, so they sum to
PERIOD), spread evenly over the period (slot order by (s + 0.5) / n_k, s = 0 .. n_k - 1, ties
by k). Then for i = p * PERIOD + slot, k = owner[slot] and j = p * n_k + (rank of slot among
k's slots). So

- every PERIOD consecutive samples hold exactly n_k samples of dataset k, and every prefix of
  the period is within 1.5 samples of proportion per dataset (the slots are spread evenly; as
  docs/DATA.md says and tests/test_blend.py checks);
- each dataset is read in its own sample order (j = 0, 1, 2, ...: its seeded epochs, see
  memmap.py), and no sample of it repeats before all its samples were seen;
- (k, j) depends only on i and the weights: not on the grid, the rank or the call order. The
  sampler's position (`consumed_samples`) is therefore the whole state to checkpoint, and a
  resumed run reads the same batches as an uninterrupted one.

Weights are thus realised to 1 / PERIOD; a weight that rounds to no slot is refused. A blend of
one file (weight anything) reads exactly what `data.path` with that file reads. All files must
hold the same tokenizer's ids (same kind, tokenizer.json hash, vocab_size and EOS).
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from app.data.memmap import MemmapTokens
from app.data.spans import Spans
from app.data.tokenizer import check_tokenized_alike
from app.errors import DataError

PERIOD = 1 << 16  # slots per period: weights are realised to 1 / 65536


def slot_counts(weights: list[float], period: int = PERIOD) -> np.ndarray:
    """n_k: each dataset's slots per period, proportional to its weight, summing to `period`
    (largest remainders, ties to the lower k)."""
    w = np.asarray(weights, dtype=np.float64)
    exact = period * w / w.sum()
    counts = np.floor(exact).astype(np.int64)
    short = period - int(counts.sum())
    order = np.lexsort((np.arange(len(w)), -(exact - counts)))  # largest remainder first, then k
    counts[order[:short]] += 1
    return counts


def slot_table(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(owner, rank): for each slot of the period, its dataset and its index among that dataset's
    slots. Each dataset's slots are spread evenly: slot s of dataset k sits at (s + 0.5) / n_k."""
    owner = np.repeat(np.arange(len(counts)), counts)
    rank = np.concatenate([np.arange(n) for n in counts])
    at = (rank + 0.5) / counts[owner]
    order = np.lexsort((owner, at))
    return owner[order], rank[order]


class BlendedTokens:
    """Samples from several MemmapTokens in proportion to weights; `sample(index)` -> int64 array of
    shape (seq_len + 1,). `datasets[k]` is opened with the run's seed and checked like `data.path`."""

    num_samples = None  # infinite: each dataset wraps over its own epochs

    def __init__(
        self, blend: list[tuple[float, str]], seq_len: int, vocab_size: int, seed: int, whole_index: bool = True
    ) -> None:
        self.weights = [float(w) for w, _ in blend]
        self.datasets = [
            MemmapTokens(prefix, seq_len, vocab_size, seed, whole_index=whole_index) for _, prefix in blend
        ]
        self.seq_len, self.seed = seq_len, seed
        self.vocab_size = self.datasets[0].vocab_size
        first = self.datasets[0]
        for ds in self.datasets[1:]:
            fix = "prepare every file of a blend with the same tokenizer (--tokenizer PATH)"
            check_tokenized_alike(first, ds, "data.paths", fix)
        self.counts = slot_counts(self.weights)
        for k, n in enumerate(self.counts):
            if n == 0:
                raise DataError(
                    f"data.paths[{k}].weight = {self.weights[k]} is below 1/{PERIOD} of the total weight "
                    f"{sum(self.weights)}, so {self.datasets[k].prefix} would never be read; fix: raise its "
                    "weight or leave the file out"
                )
        self.owner, self.rank = slot_table(self.counts)

    def locate(self, index: int) -> tuple[int, int]:
        """Global sample `index` (>= 0) -> (dataset k, sample j of dataset k)."""
        if index < 0:
            raise IndexError(f"sample index must be >= 0, got {index}")
        period, slot = divmod(index, PERIOD)
        k = int(self.owner[slot])
        return k, period * int(self.counts[k]) + int(self.rank[slot])

    def sample(self, index: int, spans: Spans = None) -> np.ndarray:
        """Sample `index` (any index >= 0) -> int64 (seq_len + 1,), from the dataset `locate` names
        (with `spans`, those tokens of it)."""
        k, j = self.locate(index)
        return self.datasets[k].sample(j, spans)

    def check_batch(self, tokens: np.ndarray, indices: list[int], offsets: Optional[np.ndarray] = None) -> None:
        """As MemmapTokens.check_batch; the message names the file the bad row came from."""
        if tokens.size == 0 or int(tokens.max()) < self.datasets[0].model_vocab_size:
            return
        row = int(np.argmax(tokens.max(axis=1)))
        k, j = self.locate(indices[row])
        self.datasets[k].check_batch(tokens[row : row + 1], [j], offsets)

    def __repr__(self) -> str:
        parts = ", ".join(f"{w:g}: {ds.prefix!r}" for w, ds in zip(self.weights, self.datasets))
        return f"BlendedTokens({{{parts}}}, seq_len={self.seq_len})"

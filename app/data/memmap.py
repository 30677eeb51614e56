"""Pre-tokenised text on disk, read through `np.memmap` so every rank shares the page cache.

A dataset is three files sharing a PREFIX (written by `python -m app.data.prepare`):

- `PREFIX.bin`: raw little-endian token ids (uint16 or uint32), all documents concatenated,
  each followed by EOS.
- `PREFIX.json`: metadata, e.g. `{"format": "gridlm-tokens", "version": 1, "dtype": "uint16",
  "vocab_size": 257, "num_tokens": N, "num_documents": D, "tokenizer": "byte", "eos": 256}`.
- `PREFIX.idx.npy`: int64 array of length D + 1 with the document start offsets (last = N).

Samples are non-overlapping windows of seq_len + 1 tokens starting at multiples of seq_len, so
num_samples = (N - 1) // seq_len. Index i >= 0 wraps over epochs: epoch = i // num_samples, and
each epoch visits the windows in a permutation seeded by (seed, epoch).
"""

from __future__ import annotations

import json
import os

import numpy as np

from app.errors import DataError

FORMAT, VERSION = "gridlm-tokens", 1
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
FIX_PREPARE = "fix: run `python -m app.data.prepare TEXT... --out PREFIX` and set data.path"


def load_metadata(prefix: str) -> dict:
    """Reads and checks PREFIX.json; raises DataError naming the file and the fix."""
    path = prefix + ".json"
    if not os.path.isfile(path):
        raise DataError(f"data file {path} does not exist; {FIX_PREPARE}")
    try:
        with open(path) as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise DataError(f"data file {path} is not valid JSON ({e}); {FIX_PREPARE} again") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise DataError(f'data file {path} is not a gridlm token file (expected "format": "{FORMAT}"); {FIX_PREPARE}')
    if meta.get("version") != VERSION or meta.get("dtype") not in DTYPES:
        raise DataError(
            f"data file {path} has version {meta.get('version')!r} and dtype "
            f"{meta.get('dtype')!r}; gridlm reads version {VERSION} with dtype in "
            f"{sorted(DTYPES)}; {FIX_PREPARE} again"
        )
    for key in ("vocab_size", "num_tokens", "num_documents", "eos"):
        if not isinstance(meta.get(key), int) or meta[key] < 0:
            raise DataError(
                f"data file {path}: {key} = {meta.get(key)!r} is not a non-negative integer; {FIX_PREPARE} again"
            )
    return meta


class MemmapTokens:
    """Token windows from PREFIX.bin; `sample(index)` -> int64 array of shape (seq_len + 1,)."""

    def __init__(self, prefix: str, seq_len: int, vocab_size: int, seed: int) -> None:
        self.prefix, self.seq_len, self.seed = prefix, seq_len, seed
        meta = load_metadata(prefix)
        self.meta, self.vocab_size = meta, meta["vocab_size"]
        bin_path, idx_path = prefix + ".bin", prefix + ".idx.npy"
        dtype, n = DTYPES[meta["dtype"]], meta["num_tokens"]

        if not os.path.isfile(bin_path):
            raise DataError(f"data file {bin_path} does not exist; {FIX_PREPARE}")
        size = os.path.getsize(bin_path)
        if size != n * dtype.itemsize:
            raise DataError(
                f"data file {bin_path} has {size} bytes but {prefix}.json says "
                f"{n} tokens x {dtype.itemsize} bytes = {n * dtype.itemsize}: it is "
                f"truncated or corrupt; {FIX_PREPARE} again"
            )

        if not os.path.isfile(idx_path):
            raise DataError(f"data file {idx_path} does not exist; {FIX_PREPARE}")
        try:
            idx = np.load(idx_path, allow_pickle=False)
        except (OSError, ValueError) as e:
            raise DataError(f"data file {idx_path} is not a readable .npy file ({e}); {FIX_PREPARE} again") from e
        ok = (
            idx.ndim == 1
            and idx.dtype.kind in "iu"
            and len(idx) == meta["num_documents"] + 1
            and idx[0] == 0
            and idx[-1] == n
            and bool(np.all(np.diff(idx) >= 0))
        )
        if not ok:
            raise DataError(
                f"data file {idx_path} is not a monotone list of "
                f"{meta['num_documents'] + 1} document offsets from 0 to {n}; "
                f"{FIX_PREPARE} again"
            )

        if self.vocab_size > vocab_size:
            raise DataError(
                f"data file {prefix}.json has vocab_size {self.vocab_size} but "
                f"model.vocab_size is {vocab_size}; fix: set model.vocab_size >= "
                f"{self.vocab_size} in the deck"
            )
        if n < seq_len + 1:
            raise DataError(
                f"data file {bin_path} holds {n} tokens, fewer than model.seq_len + "
                f"1 = {seq_len + 1}; fix: prepare more text or lower model.seq_len"
            )

        self.doc_offsets = idx.astype(np.int64)
        self.tokens = np.memmap(bin_path, dtype=dtype, mode="r", shape=(n,))
        self.num_samples = (n - 1) // seq_len
        self._epoch, self._perm = -1, np.empty(0, dtype=np.int64)  # this epoch's window order

    def window(self, w: int) -> np.ndarray:
        """Window w in file order: tokens [w * seq_len, w * seq_len + seq_len + 1) as int64."""
        start = w * self.seq_len
        return np.array(self.tokens[start : start + self.seq_len + 1], dtype=np.int64)

    def sample(self, index: int) -> np.ndarray:
        """Sample `index` (any index >= 0, wrapping over epochs) -> int64 (seq_len + 1,)."""
        if index < 0:
            raise IndexError(f"sample index must be >= 0, got {index}")
        epoch, i = divmod(index, self.num_samples)
        if epoch != self._epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
            self._epoch = epoch
        return self.window(int(self._perm[i]))

    def __repr__(self) -> str:
        return (
            f"MemmapTokens({self.prefix!r}, seq_len={self.seq_len}, "
            f"num_tokens={len(self.tokens)}, num_samples={self.num_samples})"
        )

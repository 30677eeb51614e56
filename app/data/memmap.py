"""Pre-tokenised text on disk, read through `np.memmap` so every rank shares the page cache.

A dataset is three files sharing a PREFIX (written by `python -m app.data.prepare`):

- `PREFIX.bin`: raw little-endian token ids (uint16 or uint32), all documents concatenated,
  each followed by EOS.
- `PREFIX.json`: metadata, e.g. `{"format": "gridlm-tokens", "version": 1, "dtype": "uint16",
  "vocab_size": 257, "num_tokens": N, "num_documents": D, "tokenizer": "byte", "eos": 256,
  "max_token_id": 256}`. `max_token_id` (the largest id in the .bin) is optional: files from
  older versions of prepare lack it. A file tokenised with a Hugging Face tokenizer.json has
  `"tokenizer": "huggingface"`, `"tokenizer_path"` (absolute) and `"tokenizer_sha256"` (of the
  tokenizer.json's bytes); `vocab_size` and `eos` are that tokenizer's.
- `PREFIX.idx.npy`: int64 array of length D + 1 with the document start offsets (last = N),
  never decreasing: checked whole on one rank of a job only (`MemmapTokens`'s `whole_index`).

Samples are non-overlapping windows of seq_len + 1 tokens starting at multiples of seq_len, so
num_samples = (N - 1) // seq_len. Index i >= 0 wraps over epochs: epoch = i // num_samples, and
each epoch visits the windows in a permutation seeded by (seed, epoch).

`data.split` = f holds out the last ceil(f x D) documents for validation (`split_point`): the
"train" part reads windows of the tokens before the first held-out document only, the "val"
part windows of the tokens from it on, so no window of one part reads a token of the other.

Token ids must be < model.vocab_size (the embedding's rows). Three checks, cheapest first:
the recorded `max_token_id` at open; at open, a fixed sample of the .bin (`sample_ranges`:
evenly spaced chunks of ~1M tokens in all, the whole file when smaller), which is the only
check for files without a recorded max and catches corruption in files with one; and every
batch in `get_batch` (`MemmapTokens.check_batch`), one max over the batch. Each raises a
DataError naming the file, the id and the fix.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from fractions import Fraction
from typing import Optional

import numpy as np

from app.data.spans import Spans
from app.errors import DataError
from app.untrusted import read_json

FORMAT, VERSION = "gridlm-tokens", 1
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
SAMPLE_TOKENS = 1 << 20  # tokens read at open to check the ids: 2-4 MB, milliseconds
SAMPLE_CHUNKS = 16  # spread over the file: start, end and evenly in between


@dataclass(frozen=True)
class DataFixes:
    """What a message about a token file tells the user to do. Training's deck keys are the defaults
    (`TRAINING`); a tool that takes the file as an option and the model from a checkpoint
    (app.memorization) gives its own."""

    given: str = "set data.path"  # how the prepared file is given
    # Ids beyond the model's vocabulary ({vocab}); None: training's fix (re-tokenize, or a larger vocabulary).
    vocab: Optional[str] = None
    short: str = "prepare more text or lower model.seq_len"  # a file shorter than a window

    @property
    def prepare(self) -> str:
        return f"fix: run `python -m app.data.prepare TEXT... --out PREFIX` and {self.given}"


TRAINING = DataFixes()


def fix_vocab(vocab_size: int, max_id: int, fixes: DataFixes = TRAINING) -> str:
    if fixes.vocab is not None:
        return "fix: " + fixes.vocab.format(vocab=vocab_size)
    return (
        f"fix: re-tokenize with a vocabulary of at most {vocab_size}, or set model.vocab_size >= "
        f"{max_id + 1} in the deck"
    )


def sample_ranges(num_tokens: int) -> list[tuple[int, int]]:
    """The token ranges [start, stop) checked at open: the whole file up to SAMPLE_TOKENS,
    else SAMPLE_CHUNKS evenly spaced chunks totalling SAMPLE_TOKENS. Deterministic, so
    every rank reaches the same verdict."""
    if num_tokens <= SAMPLE_TOKENS:
        return [(0, num_tokens)]
    chunk = SAMPLE_TOKENS // SAMPLE_CHUNKS
    starts = np.linspace(0, num_tokens - chunk, SAMPLE_CHUNKS).astype(np.int64)
    return [(int(a), int(a) + chunk) for a in starts]


MAX_METADATA_BYTES = 1 << 20


def load_metadata(prefix: str, fixes: DataFixes = TRAINING) -> dict:
    """Reads and checks PREFIX.json; raises DataError naming the file and the fix (`fixes`)."""
    fix_prepare = fixes.prepare
    path = prefix + ".json"
    if not os.path.isfile(path):  # follows links; a FIFO or a directory is no file
        raise DataError(f"data file {path} does not exist; {fix_prepare}")
    fail = lambda message: DataError(f"data file {path}: {message}; {fix_prepare}")  # noqa: E731
    # Real ones are a few hundred bytes: a regular file, bounded, UTF-8 JSON.
    meta = read_json(path, "token file's metadata", fail, "", MAX_METADATA_BYTES)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise DataError(f'data file {path} is not a gridlm token file (expected "format": "{FORMAT}"); {fix_prepare}')
    if meta.get("version") != VERSION or not isinstance(meta.get("dtype"), str) or meta["dtype"] not in DTYPES:
        raise DataError(
            f"data file {path} has version {meta.get('version')!r} and dtype "
            f"{meta.get('dtype')!r}; gridlm reads version {VERSION} with dtype in "
            f"{sorted(DTYPES)}; {fix_prepare} again"
        )
    optional = ("max_token_id",) if "max_token_id" in meta else ()  # absent in files of older prepares
    for key in ("vocab_size", "num_tokens", "num_documents", "eos", *optional):
        if type(meta.get(key)) is not int or meta[key] < 0:  # true is an int to isinstance
            raise DataError(
                f"data file {path}: {key} = {meta.get(key)!r} is not a non-negative integer; {fix_prepare} again"
            )
    for key in ("tokenizer", "tokenizer_path", "tokenizer_sha256"):
        if key in meta and not isinstance(meta[key], str):
            raise DataError(f"data file {path}: {key} = {meta[key]!r} is not a string; {fix_prepare} again")
    return meta


def first_held_out(documents: int, fraction: float) -> int:
    """The first of the last ceil(fraction x D) of the D documents (at least one when fraction > 0);
    D when fraction is 0."""
    # On the decimal the deck wrote (0.07 is 7/100, not the float's 0.07000000000000000666): in
    # floats 0.07 x 100 = 7.000000000000001, whose ceiling held out an 8th document.
    held_out = math.ceil(Fraction(repr(float(fraction))) * documents) if fraction > 0 else 0
    return documents - min(held_out, documents)


def split_point(doc_offsets: np.ndarray, fraction: float) -> int:
    """The first token of the held-out documents (`first_held_out`); the number of tokens when
    fraction is 0."""
    return int(doc_offsets[first_held_out(len(doc_offsets) - 1, fraction)])


def _monotone(offsets: np.ndarray, chunk: int = 1 << 20) -> bool:
    """Whether the document offsets never decrease, read `chunk` at a time (not copied whole)."""
    last = None
    for lo in range(0, len(offsets), chunk):
        part = np.asarray(offsets[lo : lo + chunk])
        if (last is not None and part[0] < last) or bool(np.any(part[1:] < part[:-1])):
            return False
        last = part[-1]
    return True


NEAR_SPLIT = 1 << 12  # offsets checked each side of the split point on every rank: 64 KB


def tokenizer_of(meta: dict) -> str:
    """The tokenizer a token file's metadata names, in words: `byte`, or `huggingface PATH`."""
    return " ".join(str(meta[k]) for k in ("tokenizer", "tokenizer_path") if k in meta) or "unknown"


def window_order(seed: int, epoch: int, windows: int) -> np.ndarray:
    """An epoch's order of a file's windows: numpy's permutation for the seed [seed, epoch], held as
    uint32 where the windows fit in it (the same order, as Fisher-Yates draws alike whatever the
    dtype: half the memory, which every rank holds per file; 500M windows, a trillion tokens at
    sequence 2048, took 4 GB a rank as int64)."""
    rng = np.random.default_rng([seed, epoch])
    if windows >= 2**32:
        return rng.permutation(windows)
    order = np.arange(windows, dtype=np.uint32)
    rng.shuffle(order)
    return order


class MemmapTokens:
    """Token windows from PREFIX.bin; `sample(index)` -> int64 array of shape (seq_len + 1,).

    `vocab_size` is the file's (its tokenizer's), `model_vocab_size` the deck's: every id
    must be below the latter. `split` > 0: only the "train" or "val" `part` of the file
    (module docstring).
    """

    def __init__(
        self,
        prefix: str,
        seq_len: int,
        vocab_size: int,
        seed: int,
        split: float = 0.0,
        part: str = "train",
        fixes: DataFixes = TRAINING,
        whole_index: bool = True,
    ) -> None:
        """`whole_index`: read the whole document index to check its order (one rank of a job: rank 0,
        whose refusal `agree` gives every rank; the others check its ends and the split point's
        neighbourhood, the only offsets training reads)."""
        self.prefix, self.seq_len, self.seed, self.fixes = prefix, seq_len, seed, fixes
        self.model_vocab_size = vocab_size
        fix_prepare = fixes.prepare
        meta = load_metadata(prefix, fixes)
        self.meta, self.vocab_size = meta, meta["vocab_size"]
        bin_path, idx_path = prefix + ".bin", prefix + ".idx.npy"
        dtype, n = DTYPES[meta["dtype"]], meta["num_tokens"]

        if not os.path.isfile(bin_path):
            raise DataError(f"data file {bin_path} does not exist; {fix_prepare}")
        size = os.path.getsize(bin_path)
        if size != n * dtype.itemsize:
            raise DataError(
                f"data file {bin_path} has {size} bytes but {prefix}.json says "
                f"{n} tokens x {dtype.itemsize} bytes = {n * dtype.itemsize}: it is "
                f"truncated or corrupt; {fix_prepare} again"
            )

        if not os.path.isfile(idx_path):
            raise DataError(f"data file {idx_path} does not exist; {fix_prepare}")
        try:
            idx = np.load(idx_path, allow_pickle=False, mmap_mode="r")  # a huge file is not read whole
        except Exception as e:  # an untrusted header: EOFError, ValueError, tokenize's TokenError (a cut dict)
            raise DataError(
                f"data file {idx_path} is not a readable .npy file ({type(e).__name__}: {e}); {fix_prepare} again"
            ) from e
        ok = (
            idx.ndim == 1
            and idx.dtype.kind in "iu"
            and len(idx) == meta["num_documents"] + 1
            and idx[0] == 0
            and idx[-1] == n
        )
        if ok:
            # The whole index on one rank (found in review: every rank read all of it, 800 MB for 100M
            # documents, each node from the same file-system server); every rank checks the offsets
            # around the one it reads (the split point), and all of a small index.
            at = first_held_out(meta["num_documents"], split)
            near = np.asarray(idx[max(0, at - NEAR_SPLIT) : at + NEAR_SPLIT + 1])
            ok = bool(np.all(near[1:] >= near[:-1])) and (not whole_index or _monotone(idx))
        if not ok:
            raise DataError(
                f"data file {idx_path} is not a monotone list of "
                f"{meta['num_documents'] + 1} document offsets from 0 to {n}; "
                f"{fix_prepare} again"
            )

        if self.vocab_size > vocab_size:
            fix = (
                fixes.vocab.format(vocab=vocab_size)
                if fixes.vocab is not None
                else f"set model.vocab_size >= {self.vocab_size} in the deck (a multiple of parallel.tp), or prepare "
                "the text with a smaller tokenizer"
            )
            raise DataError(
                f"data file {prefix}.json has vocab_size {self.vocab_size} (its tokenizer: {tokenizer_of(meta)}) "
                f"but model.vocab_size is {vocab_size}, which does not cover the tokenizer's ids; fix: {fix}"
            )
        if n < seq_len + 1:
            raise DataError(
                f"data file {bin_path} holds {n} tokens, fewer than model.seq_len + "
                f"1 = {seq_len + 1}; fix: {fixes.short}"
            )

        # Kept mapped (found in review: a copy of the whole index took 8 bytes a document on every
        # rank, 1.6 GB for 200M documents); read at the split point and in messages only.
        self.doc_offsets = idx
        self.tokens = np.memmap(bin_path, dtype=dtype, mode="r", shape=(n,))
        if part not in ("train", "val"):
            raise ValueError(f"part must be train or val, got {part!r}")
        boundary = split_point(self.doc_offsets, split)
        self.split, self.part = split, part
        # This part's tokens [start, stop): windows never cross `boundary`.
        self.start, self.stop = (0, boundary) if part == "train" else (boundary, n)
        self.num_samples = (self.stop - self.start - 1) // seq_len
        if split and self.num_samples < 1:
            held = len(idx) - 1 - int(np.searchsorted(self.doc_offsets, boundary))
            raise DataError(
                f"data.split = {split} of {prefix} leaves its {part} part {self.stop - self.start} tokens "
                f"({held} of {meta['num_documents']} documents held out), fewer than model.seq_len + 1 = "
                f"{seq_len + 1}; fix: choose a data.split that leaves both parts a window, or set eval.path"
            )
        self._epoch, self._perm = -1, np.empty(0, dtype=np.uint32)  # this epoch's window order
        self._check_ids()

    def _check_ids(self) -> None:
        """The recorded max id, then a fixed sample of the .bin, against model.vocab_size."""
        bin_path, json_path, v = self.prefix + ".bin", self.prefix + ".json", self.model_vocab_size
        recorded = self.meta.get("max_token_id")
        if recorded is not None and recorded >= v:
            raise DataError(
                f"data file {bin_path} holds token ids up to {recorded} (max_token_id in {json_path}) but "
                f"model.vocab_size is {v}, so ids must be < {v}; {fix_vocab(v, recorded, self.fixes)}"
            )
        for start, stop in sample_ranges(len(self.tokens)):
            chunk = self.tokens[start:stop]
            top = int(chunk.max())
            if top < v and (recorded is None or top <= recorded):
                continue
            at = start + int(np.argmax(chunk))
            if recorded is not None:  # recorded < v, so the file changed after prepare wrote it
                raise DataError(
                    f"data file {bin_path} holds token id {top} at token {at}, above max_token_id = {recorded} "
                    f"recorded in {json_path}: the file is corrupt; {self.fixes.prepare} again"
                )
            raise DataError(
                f"data file {bin_path} holds token id {top} at token {at} (found by sampling: {json_path} "
                f"records no max_token_id) but model.vocab_size is {v}, so ids must be < {v}; {fix_vocab(v, top, self.fixes)}"
            )

    def check_batch(self, tokens: np.ndarray, indices: list[int], offsets: Optional[np.ndarray] = None) -> None:
        """Raise DataError if a batch of samples (B, seq_len + 1) holds an id >= model.vocab_size,
        naming the file, the sample index and where the id is. One max over the batch: ids are
        unsigned on disk, so no min is needed. `offsets`: where in its sample each column was read
        (samples read by spans); None: column c is token c."""
        if tokens.size == 0 or int(tokens.max()) < self.model_vocab_size:
            return
        row, col = np.unravel_index(int(np.argmax(tokens)), tokens.shape)
        top, index = int(tokens[row, col]), int(indices[row])
        at = self.start + self.window_of(index) * self.seq_len + int(col if offsets is None else offsets[col])
        v = self.model_vocab_size
        raise DataError(
            f"data file {self.prefix}.bin holds token id {top} at token {at} (sample {index}) but "
            f"model.vocab_size is {v}, so ids must be < {v}: the file is corrupt or was tokenized with a "
            f"larger vocabulary (the checks at open read only a sample of it); {fix_vocab(v, top, self.fixes)}"
        )

    def window(self, w: int, spans: Spans = None) -> np.ndarray:
        """Window w of this part in file order: tokens [w * seq_len, w * seq_len + seq_len + 1) from the
        part's start, as int64; with `spans`, only the tokens [lo, hi) of each span of it, in order
        (only those pages of the file are read)."""
        start = self.start + w * self.seq_len
        if spans is not None:
            return np.concatenate(
                [np.asarray(self.tokens[start + lo : start + hi], dtype=np.int64) for lo, hi in spans]
            )
        return np.array(self.tokens[start : start + self.seq_len + 1], dtype=np.int64)

    def window_of(self, index: int) -> int:
        """The window (in file order) that sample `index` (>= 0, wrapping over epochs) reads."""
        if index < 0:
            raise IndexError(f"sample index must be >= 0, got {index}")
        epoch, i = divmod(index, self.num_samples)
        if epoch != self._epoch:
            self._perm = window_order(self.seed, epoch, self.num_samples)
            self._epoch = epoch
        return int(self._perm[i])

    def sample(self, index: int, spans: Spans = None) -> np.ndarray:
        """Sample `index` (any index >= 0, wrapping over epochs) -> int64 (seq_len + 1,); with
        `spans`, the tokens of those spans of it (`window`)."""
        return self.window(self.window_of(index), spans)

    def __repr__(self) -> str:
        return (
            f"MemmapTokens({self.prefix!r}, seq_len={self.seq_len}, "
            f"num_tokens={len(self.tokens)}, num_samples={self.num_samples}"
            + (f", split={self.split}, part={self.part!r})" if self.split else ")")
        )

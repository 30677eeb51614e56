"""Data: tokenizers, synthetic, memmapped and blended token datasets, and the global batch sampler.

A dataset has `vocab_size`, `seq_len`, `num_samples` (None if infinite) and
`sample(index, spans=None) -> int64 array (seq_len + 1,)` (or the tokens of `spans`, app.data.spans), a
pure function of the index and seed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Union

import numpy as np

from app.data.blend import BlendedTokens
from app.data.memmap import MemmapTokens
from app.data.sampler import GlobalBatchSampler
from app.data.spans import inputs_and_targets, offsets, token_spans
from app.data.synthetic import SyntheticTokens
from app.data.tokenizer import ByteTokenizer
from app.errors import DataError

if TYPE_CHECKING:
    import torch

__all__ = [
    "BlendedTokens",
    "ByteTokenizer",
    "GlobalBatchSampler",
    "MemmapTokens",
    "SyntheticTokens",
    "build_dataset",
    "get_batch",
]


Dataset = Union[SyntheticTokens, MemmapTokens, BlendedTokens]


def build_dataset(data_cfg: Any, model_cfg: Any, seed: int, whole_index: bool = True) -> Dataset:
    """The dataset named by the deck's data section: synthetic, one token file (data.path) or a
    blend of several (data.paths). `whole_index`: this rank checks the token files' whole document
    indexes (one rank of a job: `MemmapTokens`)."""
    if data_cfg.kind == "synthetic":
        return SyntheticTokens(model_cfg.vocab_size, model_cfg.seq_len, seed, data_cfg.noise)
    if data_cfg.kind == "memmap":
        if getattr(data_cfg, "paths", None) is not None:
            return BlendedTokens(data_cfg.blend, model_cfg.seq_len, model_cfg.vocab_size, seed, whole_index)
        if data_cfg.path is None:
            raise DataError(
                "data.kind is memmap but data.path is not set; fix: set data.path "
                "to the PREFIX written by `python -m app.data.prepare TEXT... "
                "--out PREFIX`"
            )
        # data.split: training reads only the documents before the held-out ones.
        return MemmapTokens(
            data_cfg.path,
            model_cfg.seq_len,
            model_cfg.vocab_size,
            seed,
            data_cfg.split,
            "train",
            whole_index=whole_index,
        )
    raise DataError(f"data.kind = {data_cfg.kind!r}: use synthetic or memmap")


def get_batch(
    dataset: Dataset, indices: list[int], positions: Optional[list[tuple[int, int]]] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples -> (inputs, targets), each int64 CPU tensors of shape (B, seq_len); with
    `positions` (spans [a, b) of input positions, `app.data.spans`), only those positions, one
    after the other, and only their tokens are read (a context-parallel rank's chunks).

    A memmap batch holding an id >= model.vocab_size raises DataError naming the file and the
    sample (before the embedding would fail with an IndexError). Only this dp rank's samples
    are checked, so the verdict differs between ranks: callers agree on it (`agree`) before
    any collective. Synthetic ids are in range by construction and are not checked.
    """
    import torch  # here: `python -m app.data.prepare` starts without loading torch

    spans = None if positions is None else token_spans(positions)
    batch = np.stack([dataset.sample(i, spans) for i in indices]).astype(np.int64)
    if not isinstance(dataset, SyntheticTokens):
        dataset.check_batch(batch, indices, None if positions is None else offsets(positions))
    if positions is not None:
        inputs, targets = inputs_and_targets(batch, positions)
        return torch.from_numpy(np.ascontiguousarray(inputs)), torch.from_numpy(np.ascontiguousarray(targets))
    tokens = torch.from_numpy(batch)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

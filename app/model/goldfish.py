"""The Goldfish loss mask (Hans et al., "Be like a Goldfish, Don't Memorize!", NeurIPS 2024).

A target is dropped from the training loss when a hash of the h targets before it, mod k, is 0
(their hashed-context variant), so about 1/k of the tokens never receive a gradient, and the
same passage is masked the same way wherever it occurs: a model cannot learn to reproduce it
verbatim. `train.goldfish_k` is k (0: off), `train.goldfish_context` is h.

The rule, exactly (a pure function of one sample's targets, computed on the host before any
tp / sp / pp / dp / 3D split, so every grid drops the same tokens):

- targets y[0..S-1] of a sample (y[i] is the token after input i);
- y[i] with i < h is always counted: fewer than h targets precede it in the sample;
- for i >= h, H = GOLDFISH_SEED, then for j = i - h .. i - 1 in order: H = mix64(H xor y[j]);
  y[i] is dropped when H mod k == 0;
- mix64 is SplitMix64's finaliser (Steele et al. 2014) on unsigned 64-bit integers, every
  product and xor wrapping mod 2^64: x ^= x >> 30; x *= 0xBF58476D1CE4E5B9; x ^= x >> 27;
  x *= 0x94D049BB133111EB; x ^= x >> 31.

numpy's uint64 arrays wrap by definition (C unsigned arithmetic), on every platform and with
no torch involved, so the mask does not depend on the torch version or the device.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

GOLDFISH_SEED = 0x9E3779B97F4A7C15  # 2^64 / golden ratio: any fixed odd constant would do
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


class CountedTargets(NamedTuple):
    """A micro-batch's targets with a loss weight per position: the loss is sum(weights x CE).

    ids: (B, S) int64 token ids; weights: (B, S) float32, 0 where Goldfish drops the target and
    M / N elsewhere (N counted targets in the global batch, M its micro-batches), so that the
    pipeline's mean over micro-batches and dp gives the mean over the global batch's counted
    targets on every grid."""

    ids: torch.Tensor
    weights: torch.Tensor

    def to(self, device: torch.device, non_blocking: bool = False) -> CountedTargets:
        return CountedTargets(
            self.ids.to(device, non_blocking=non_blocking), self.weights.to(device, non_blocking=non_blocking)
        )


def mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser, element-wise on uint64 (wrapping)."""
    x = x ^ (x >> _S30)
    x = x * _M1
    x = x ^ (x >> _S27)
    x = x * _M2
    return x ^ (x >> _S31)


def context_hashes(targets: np.ndarray, h: int) -> np.ndarray:
    """(B, S) targets -> (B, S - h) uint64: the hash of the h targets before each of y[h:]."""
    y = np.ascontiguousarray(targets, dtype=np.int64).view(np.uint64)  # ids are >= 0: the same values
    s = y.shape[-1]
    acc = np.full(y[..., h:].shape, GOLDFISH_SEED, dtype=np.uint64)
    for j in range(h):  # oldest first: y[i - h + j] for every i >= h at once
        acc = mix64(acc ^ y[..., j : s - h + j])
    return acc


def goldfish_keep(targets: torch.Tensor, k: int, h: int) -> torch.Tensor:
    """(B, S) int64 targets (host) -> (B, S) bool, True where the target counts in the loss."""
    if k < 2 or h < 1:
        raise ValueError(f"goldfish needs k >= 2 and h >= 1, got k={k}, h={h}")
    y = targets.cpu().numpy()
    keep = np.ones(y.shape, dtype=bool)
    if y.shape[-1] > h:
        keep[..., h:] = context_hashes(y, h) % np.uint64(k) != 0
    return torch.from_numpy(keep)

"""The Goldfish loss mask (Hans et al., "Be like a Goldfish, Don't Memorize!", NeurIPS 2024).

A target is dropped from the training loss when a hash of its context says so, about 1 in k
(`train.goldfish_k`; 0: off), and the same passage is masked the same way wherever it occurs: a
model cannot learn to reproduce it verbatim. `train.goldfish_context` is the context width h
(the paper's configurations: k = 4, h = 13). Both rules are pure functions of one sample's
targets, computed on the host before any tp / sp / pp / dp / 3D split, so every grid drops the
same tokens.

`train.goldfish_rule: hash-table` (the default) is the authors' rule, `apply_goldfish(...,
strategy="hash-table")` of their repository (github.com/ahans30/goldfish-loss, lit_gpt/utils.py):

- targets y[0..S-1] of a sample (y[i] is the token after input i);
- y[i] with i < h - 1 is always counted;
- for i >= h - 1, the window is y[i - h + 1 .. i], the target itself included; its key is the
  product of the h ids as int64 (wrapping mod 2^64, as torch.prod does), taken mod 1,000,003
  (non-negative, as torch's % is); y[i] is dropped when TABLE[key] < 1/k (in float32), TABLE
  being 1,000,003 float32 draws of torch.rand on the CPU after manual_seed(2971215073).

The table is torch's CPU generator (MT19937: the same values in every torch release and on every
machine); the product and the remainder are numpy int64, whose wrapping is C's.

`train.goldfish_rule: splitmix` is gridlm's earlier rule, kept for runs that used it:

- y[i] with i < h is always counted;
- for i >= h, H = GOLDFISH_SEED, then for j = i - h .. i - 1 in order: H = mix64(H xor y[j]);
  y[i] is dropped when H mod k == 0;
- mix64 is SplitMix64's finaliser (Steele et al. 2014) on unsigned 64-bit integers, every
  product and xor wrapping mod 2^64: x ^= x >> 30; x *= 0xBF58476D1CE4E5B9; x ^= x >> 27;
  x *= 0x94D049BB133111EB; x ^= x >> 31.

The two agree on 62% of positions (two independent masks of the same rate).
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

import numpy as np
import torch

RULES = ("hash-table", "splitmix")
TABLE_SIZE = 1_000_003  # the authors' table: a prime
TABLE_SEED = 2971215073  # theirs: the 47th Fibonacci number, a prime
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


@lru_cache(maxsize=1)
def hash_table() -> np.ndarray:
    """The authors' table: TABLE_SIZE float32 uniforms of torch's CPU generator seeded TABLE_SEED
    (a constant, computed once per process: 4 MB)."""
    generator = torch.Generator(device="cpu").manual_seed(TABLE_SEED)
    return torch.rand(TABLE_SIZE, generator=generator).numpy()


def window_keys(targets: np.ndarray, h: int) -> np.ndarray:
    """(B, S) targets -> (B, S - h + 1) int64: the product of each window of h targets (wrapping
    mod 2^64) mod TABLE_SIZE, the window ending at (and including) target h - 1, h, ..."""
    y = np.ascontiguousarray(targets, dtype=np.int64)
    s = y.shape[-1]
    with np.errstate(over="ignore"):  # wrapping is the rule
        product = y[..., : s - h + 1].copy()
        for j in range(1, h):
            product *= y[..., j : s - h + 1 + j]
    return np.remainder(product, TABLE_SIZE)


def goldfish_keep(targets: torch.Tensor, k: int, h: int, rule: str = "hash-table") -> torch.Tensor:
    """(B, S) int64 targets (host) -> (B, S) bool, True where the target counts in the loss."""
    if k < 2 or h < 1:
        raise ValueError(f"goldfish needs k >= 2 and h >= 1, got k={k}, h={h}")
    if rule not in RULES:
        raise ValueError(f"goldfish rule {rule!r}: expected one of {', '.join(RULES)}")
    y = targets.cpu().numpy()
    keep = np.ones(y.shape, dtype=bool)
    if rule == "hash-table":
        if y.shape[-1] >= h:
            keep[..., h - 1 :] = ~(hash_table()[window_keys(y, h)] < np.float32(1 / k))
    elif y.shape[-1] > h:
        keep[..., h:] = context_hashes(y, h) % np.uint64(k) != 0
    return torch.from_numpy(keep)

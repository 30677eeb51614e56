"""Deterministic, shard-local parameter initialisation.

Every parameter carries a `ParamMeta`: its global (unsharded) shape, the offset of this
rank's shard inside it, and the grid axes it is split along. Values come from a
counter-based generator: element i of parameter `name` is a pure function of
(seed, name, i), so a rank can materialise just its shard and it equals the same slice
of the 1-rank model — without ever building the full tensor.

Generator: SplitMix64 (Steele, Lea, Flood, OOPSLA 2014) over the element's global flat
index, two 53-bit uniforms per element, Box-Muller to a standard normal; computed in
int64 torch ops (wrap-around multiply, masked logical shifts) on the target device.
"""

from __future__ import annotations

import dataclasses
import math
import zlib

import torch
from torch import nn

from app.sharding.layout import ParamMeta

_GAMMA = 0x9E3779B97F4A7C15 - (1 << 64)  # golden-ratio increment, as a signed int64
_MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX2 = 0x94D049BB133111EB - (1 << 64)
_CHUNK = 1 << 22  # elements generated at a time, to bound temporary memory


def new_param(meta: ParamMeta, device: torch.device | None = None) -> nn.Parameter:
    """An uninitialised parameter of `meta`'s local shape, tagged with `meta`."""
    p = nn.Parameter(torch.empty(meta.local_shape, device=device))
    p.meta = meta  # type: ignore[attr-defined]
    return p


def _shr(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    return z ^ _shr(z, 31)


def _key(seed: int, name: str) -> int:
    """64-bit stream key of one parameter: depends on its name and the seed, never the rank."""
    z = torch.tensor([(seed * 1_000_003 + zlib.crc32(name.encode())) % (1 << 62)], dtype=torch.int64)
    return int(_mix(z * _GAMMA)[0])


def _uniform(key: int, counters: torch.Tensor) -> torch.Tensor:
    """53-bit uniforms in [0, 1) (float64) for int64 `counters`."""
    return _shr(_mix(key + (counters + 1) * _GAMMA), 11).to(torch.float64) * (2.0**-53)


def counter_normal(
    seed: int, name: str, meta: ParamMeta, local_shape: tuple[int, ...], device: torch.device
) -> torch.Tensor:
    """N(0, std^2) values of the local shard of parameter `name` (float32)."""
    n = math.prod(local_shape)
    return initial_values(seed, name, dataclasses.replace(meta, shape=tuple(local_shape)), 0, n, device).reshape(
        local_shape
    )


def initial_values(seed: int, name: str, meta: ParamMeta, lo: int, hi: int, device: torch.device) -> torch.Tensor:
    """The initial float32 values of local flat elements [lo, hi) of parameter `name` (its tp shard
    `meta`): what `init_parameters` writes there, computed without the rest of the parameter, so a
    rank can build a ZeRO shard of a bucket directly."""
    out = torch.empty(hi - lo, dtype=torch.float32, device=device)
    if meta.init != "normal":
        return out.fill_(0.0 if meta.init == "zeros" else 1.0)
    key = _key(seed, name)
    shape, offset = meta.local_shape, meta.local_offset
    strides = [math.prod(meta.global_shape[d + 1 :]) for d in range(len(shape))]
    for start in range(lo, hi, _CHUNK):
        # Global flat index of local elements [start, stop): unravel over the local shape, shift
        # by the shard's offset, ravel over the global shape.
        stop = min(start + _CHUNK, hi)
        rest = torch.arange(start, stop, dtype=torch.int64, device=device)
        c = torch.zeros_like(rest)
        for d in reversed(range(len(shape))):
            c += (rest % shape[d] + offset[d]) * strides[d]
            rest = rest // shape[d]
        u1 = 1.0 - _uniform(key, 2 * c)  # (0, 1]: log is finite
        u2 = _uniform(key, 2 * c + 1)
        out[start - lo : stop - lo] = (
            torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2 * math.pi * u2) * meta.std
        ).float()
    return out


@torch.no_grad()
def init_parameters(model: nn.Module, seed: int) -> None:
    """Fill every tagged parameter of `model` from (seed, parameter name) alone."""
    for name, p in model.named_parameters():
        meta: ParamMeta = p.meta  # type: ignore[attr-defined]
        if meta.init == "zeros":
            p.zero_()
        elif meta.init == "ones":
            p.fill_(1.0)
        else:
            p.copy_(counter_normal(seed, name, meta, tuple(p.shape), p.device))

"""Hyperslab I/O and checksums for global tensors written by many ranks.

A rank holds a contiguous flat range [lo, hi) of its local shard (a rectangular block of
the global tensor at `offset`); `flat_boxes` turns such a range into at most 2 x ndim - 1
rectangular boxes, and `global_boxes` places them in the global tensor. Row-major order
of the elements in the boxes equals their order in the flat range, which is also the
order HDF5 transfers a union of hyperslabs in, so one contiguous buffer per rank and
dataset suffices: `write_boxes` / `read_boxes` make one H5Dwrite / H5Dread call with the
union of the boxes as the file selection — a collective call that every rank of the file
makes for every dataset, with an empty selection when it holds nothing of that tensor
(h5py's high-level `dset[...] = x` skips the call for an empty selection, and the ranks
that do call would then wait forever).

Checksum. For the element bit patterns u_i (as unsigned integers) of a tensor with global
row-major indices i, C = sum_i (2 i + 1) u_i mod 2^32. Each rank adds up its own
elements and the partial sums are added over ranks (MPI SUM on uint32 wraps mod 2^32),
so it is computed in parallel and does not depend on how the tensor is split: a
checkpoint written on one grid is verified on another. Any change of a single element
changes C (2 i + 1 is odd, so it is invertible mod 2^32, and two bit patterns of at most
32 bits differ by less than 2^32), whichever byte flipped; like a CRC-32, two or more
changed elements escape with probability about 2^-32. It runs at memory speed (a
uint32 dot product and a sum, ~1.5 GB/s per core), unlike a per-element hash.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (start, count) per dimension

UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def flat_boxes(shape: Sequence[int], lo: int, hi: int) -> list[Box]:
    """Boxes covering the row-major flat range [lo, hi) of an array of `shape`, in order."""
    shape = tuple(int(n) for n in shape)
    if lo >= hi:
        return []
    if len(shape) == 0:
        return [((), ())]
    if len(shape) == 1:
        return [((lo,), (hi - lo,))]
    stride = math.prod(shape[1:])
    a, b = divmod(lo, stride)
    c, d = divmod(hi, stride)
    inner = shape[1:]
    if a == c:  # inside one row
        return [((a, *s), (1, *n)) for s, n in flat_boxes(inner, b, d)]
    boxes: list[Box] = []
    if b:  # partial first row
        boxes += [((a, *s), (1, *n)) for s, n in flat_boxes(inner, b, stride)]
        a += 1
    if a < c:  # whole rows
        boxes.append(((a, *(0,) * len(inner)), (c - a, *inner)))
    if d:  # partial last row
        boxes += [((c, *s), (1, *n)) for s, n in flat_boxes(inner, 0, d)]
    return boxes


def global_boxes(local_shape: Sequence[int], offset: Sequence[int], lo: int, hi: int) -> list[Box]:
    """The boxes of local flat range [lo, hi) in global coordinates (the shard starts at `offset`)."""
    offset = tuple(offset) or (0,) * len(local_shape)
    return [(tuple(s + o for s, o in zip(start, offset)), count) for start, count in flat_boxes(local_shape, lo, hi)]


def as_unsigned(values: np.ndarray) -> np.ndarray:
    """The bit patterns of `values` as unsigned integers of the same width."""
    return values.view(UNSIGNED[values.dtype.itemsize])


def checksum(values: np.ndarray, boxes: Sequence[Box], global_shape: Sequence[int]) -> np.uint32:
    """This rank's partial sum of C (module docstring) for `values`, the elements of `boxes` in order."""
    u = as_unsigned(np.ascontiguousarray(values).reshape(-1))
    if u.dtype.itemsize < 4:
        u = u.astype(np.uint32)
    elif u.dtype.itemsize > 4:
        raise ValueError(f"checksums cover elements of at most 4 bytes, not {values.dtype}")
    strides = [math.prod(global_shape[d + 1 :]) for d in range(len(global_shape))]
    total = np.uint32(0)
    pos = 0
    with np.errstate(over="ignore"):
        for start, count in boxes:
            n = math.prod(count)
            if n == 0:
                continue
            last = count[-1] if count else 1
            rows = u[pos : pos + n].reshape(-1, last)
            pos += n
            # Global flat index (mod 2^32) of the first element of every row of the box.
            base = np.zeros(1, dtype=np.uint64)
            for d in range(len(count) - 1):
                idx = (np.arange(count[d], dtype=np.uint64) + start[d]) * np.uint64(strides[d])
                base = (base[:, None] + idx[None, :]).reshape(-1)
            base = ((base + np.uint64(start[-1] if count else 0)) & np.uint64(0xFFFFFFFF)).astype(np.uint32)
            # sum_rows sum_k (2 (base + k) + 1) u = sum_rows (2 base + 1) S0 + 2 sum_rows sum_k k u, mod 2^32.
            s0 = rows.sum(axis=1, dtype=np.uint32)
            s1 = (rows @ np.arange(last, dtype=np.uint32)).sum(dtype=np.uint32)
            part = ((base * np.uint32(2) + np.uint32(1)) * s0).sum(dtype=np.uint32) + np.uint32(2) * s1
            total = np.uint32(total + part)
    return total


def dataset_checksum(values: np.ndarray) -> int:
    """C of a whole dataset read into memory (stored dtype): what its `checksum` attribute holds."""
    shape = tuple(values.shape)
    return int(checksum(values, [((0,) * len(shape), shape)], shape))


def _file_selection(dset_id, boxes: Sequence[Box]):
    from h5py import h5s

    space = dset_id.get_space()
    space.select_none()
    for start, count in boxes:
        if math.prod(count):
            space.select_hyperslab(tuple(start), tuple(count), op=h5s.SELECT_OR)
    return space


def _memory_space(n: int):
    from h5py import h5s

    space = h5s.create_simple((max(n, 1),))
    if n == 0:
        space.select_none()
    return space


def transfer_plist(collective: bool):
    """A dataset transfer property list: collective (two-phase) or independent MPI-IO."""
    from h5py import h5fd, h5p

    dxpl = h5p.create(h5p.DATASET_XFER)
    dxpl.set_dxpl_mpio(h5fd.MPIO_COLLECTIVE if collective else h5fd.MPIO_INDEPENDENT)
    return dxpl


def write_boxes(dset_id, boxes: Sequence[Box], values: np.ndarray, dxpl) -> None:
    """Write `values` (the boxes' elements in order) into the dataset: one call, on every rank."""
    values = np.ascontiguousarray(values).reshape(-1)
    if values.size == 0:
        values = np.zeros(1, dtype=values.dtype)
        n = 0
    else:
        n = values.size
    dset_id.write(_memory_space(n), _file_selection(dset_id, boxes), values, dxpl=dxpl)


def read_boxes(dset_id, boxes: Sequence[Box], dtype: np.dtype, dxpl) -> np.ndarray:
    """The boxes' elements in order (1-D): one call, on every rank."""
    n = sum(math.prod(c) for _, c in boxes)
    out = np.empty(max(n, 1), dtype=dtype)
    dset_id.read(_memory_space(n), _file_selection(dset_id, boxes), out, dxpl=dxpl)
    return out[:n]

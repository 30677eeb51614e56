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

Checksum (format version 2). For a tensor with element bit patterns u_i (as unsigned
integers) at global row-major indices i,

    s_i = mix64(K + i * G)          (the i-th output of SplitMix64 seeded with K - G)
    C   = sum_i mix64(s_i XOR u_i)   mod 2^64

with mix64 the SplitMix64 finaliser (Stafford's Mix13: xor-shift, multiply, xor-shift,
multiply, xor-shift; a bijection of 64-bit words with full avalanche), G = 0x9E3779B97F4A7C15
and K = 0x6A09E667F3BCC909. It is a sum of per-element terms, each depending only on (i,
u_i): each rank adds up its own elements and an MPI SUM of the uint64 partials (which wraps
mod 2^64) gives C, whatever the split, so a checkpoint written on one grid is verified on
another. Why it cannot be cancelled by simple corruption patterns:

- One changed element always changes C: s_i is fixed and u -> mix64(s_i XOR u) is a
  bijection, so the term changes (certainly, not with some probability).
- Elements changed at indices I change C by D = sum_{i in I} mix64(s_i XOR u'_i) -
  mix64(s_i XOR u_i). The 2|I| words entering the outer mix64 are distinct unless
  s_i XOR s_j = u XOR v for some i != j and bit patterns u, v of the pattern: s is a
  bijective, avalanched function of i, so for a pattern fixed without knowledge of s this
  has probability ~2^-64 per pair. Distinct inputs through a strong mixer give D as a
  (model) random value: the pattern escapes with probability ~2^-64.
- Nothing in a term is linear in i or u (the old sum (2i + 1) u_i mod 2^32 was, so a sign
  flip of any two float32 elements added 2 x 2^31 = 0): two flips of the same bit, two
  arbitrary flips, swapped elements (terms h_i(u_j) + h_j(u_i) replace h_i(u_i) +
  h_j(u_j)), a zeroed or duplicated block, a row shifted by one element (u_{i+1} moved to
  index i) or a transposed tensor all feed unrelated words to the outer mix. The inner
  mix64 matters for the last ones: with a plain Weyl sequence s_i = K + i G, neighbours
  differ by the constant G, a structure a shift could line up with.

It guards against accidents (bit rot, torn or misplaced writes), not an adversary: the sum
of a public function is easy to forge. Cost: about 15 uint64 operations per element. In C
(`_checksum.c`, one pass, a row at a time) ~3.5 GB/s of float32 per core; in NumPy
(`checksum_numpy`, the fallback where the C kernel is not built, CHUNK elements at a time
so that memory stays bounded and the temporaries stay in cache) ~0.45-0.7 GB/s
(docs/CHECKPOINT.md has the measurements). Format-version-1 files carry the v1 sum, kept as `checksum_v1`, and
are verified with it (`checksum_for`).
"""

from __future__ import annotations

import errno
import itertools
import math
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

try:  # the C kernel of `checksum`, built by `pip install -e .` (launch/setup.sh)
    from app.checkpoint import _checksum as _compiled
except ImportError:  # not built: the NumPy version, equal and slower
    _compiled = None

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
    """The bit patterns of `values` as unsigned integers of the same width (ValueError for a width
    no checkpoint stores)."""
    if values.dtype.itemsize not in UNSIGNED:
        raise ValueError(f"no checksum for elements of {values.dtype.itemsize} bytes ({values.dtype})")
    return values.view(UNSIGNED[values.dtype.itemsize])


def checksum_v1(values: np.ndarray, boxes: Sequence[Box], global_shape: Sequence[int]) -> np.uint32:
    """This rank's partial sum of the format-version-1 checksum, sum_i (2 i + 1) u_i mod 2^32,
    for `values`, the elements of `boxes` in order. Weak (two sign flips of float32 elements
    cancel); kept to verify old checkpoints."""
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


# 64K elements per chunk: the three 512 KB uint64 temporaries stay in cache; 1M-element chunks
# measured 25-40% slower.
CHUNK = 1 << 16
ROWS = 1 << 16  # rows of a box whose first indices are computed at once (512 KB)
_G, _K = np.uint64(0x9E3779B97F4A7C15), np.uint64(0x6A09E667F3BCC909)
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_S1, _S2, _S3 = np.uint64(30), np.uint64(27), np.uint64(31)


def _mix64(z: np.ndarray, tmp: np.ndarray) -> None:
    """SplitMix64's finaliser, in place on uint64 `z` (`tmp`: scratch of the same size)."""
    np.right_shift(z, _S1, out=tmp)
    z ^= tmp
    z *= _M1
    np.right_shift(z, _S2, out=tmp)
    z ^= tmp
    z *= _M2
    np.right_shift(z, _S3, out=tmp)
    z ^= tmp


def _box_rows(
    start: Sequence[int], count: Sequence[int], global_shape: Sequence[int]
) -> Iterator[tuple[np.ndarray, int]]:
    """A box as rows along its last dimension: (global row-major flat index (uint64) of the first
    element of each of up to ROWS consecutive rows, the row length), in order."""
    if not count:  # a 0-d tensor: one row of one element
        yield np.zeros(1, dtype=np.uint64), 1
        return
    strides = [math.prod(global_shape[d + 1 :]) for d in range(len(global_shape))]
    outer, last = tuple(count[:-1]), count[-1]
    rows = math.prod(outer)
    for r0 in range(0, rows, ROWS):
        r = np.arange(r0, min(r0 + ROWS, rows))
        base = np.full(r.size, start[-1], dtype=np.uint64)
        if outer:
            for d, m in enumerate(np.unravel_index(r, outer)):
                base += (m.astype(np.uint64) + np.uint64(start[d])) * np.uint64(strides[d])
        yield base, last


def _box_indices(start: Sequence[int], count: Sequence[int], global_shape: Sequence[int]) -> Iterator[np.ndarray]:
    """Global row-major flat indices (uint64) of the elements of a box, in order, at most
    CHUNK at a time (whole rows when they fit, else pieces of one row)."""
    for bases, last in _box_rows(start, count, global_shape):
        if last >= CHUNK:
            for base in bases.tolist():
                for c in range(0, last, CHUNK):
                    yield np.arange(base + c, base + min(c + CHUNK, last), dtype=np.uint64)
        else:
            cols = np.arange(last, dtype=np.uint64)
            per = CHUNK // last
            for r0 in range(0, bases.size, per):
                yield (bases[r0 : r0 + per, None] + cols[None, :]).reshape(-1)


def checksum(values: np.ndarray, boxes: Sequence[Box], global_shape: Sequence[int]) -> np.uint64:
    """This rank's partial sum of C (module docstring) for `values`, the elements of `boxes` in
    order; partials of any split of a tensor add up (mod 2^64) to the whole tensor's C. By the C
    kernel (`_checksum.c`, built by setup) where it is built, else by `checksum_numpy`."""
    if _compiled is None:
        return checksum_numpy(values, boxes, global_shape)
    return checksum_and_nonfinite(values, boxes, global_shape, "")[0]


# The exponent bits of the stored floats (bf16 as uint16): all ones is Inf or NaN.
EXPONENT_MASK = {"float32": 0x7F800000, "bfloat16": 0x7F80, "float16": 0x7C00}


def checksum_and_nonfinite(
    values: np.ndarray, boxes: Sequence[Box], global_shape: Sequence[int], logical: str
) -> tuple[np.uint64, Optional[int]]:
    """`checksum`, and in the same pass (C kernel) the Inf/NaN elements of `values` whose logical
    dtype is `logical` (float32, bfloat16 or float16); None for the count where it was not made
    (no C kernel, another dtype): the caller counts them its own way."""
    mask = EXPONENT_MASK.get(logical, 0) if values.dtype.itemsize * 8 in (16, 32) else 0
    if _compiled is None:
        return checksum_numpy(values, boxes, global_shape), None
    u = as_unsigned(np.ascontiguousarray(values).reshape(-1))
    total, pos, bad = 0, 0, 0
    for start, count in boxes:
        if math.prod(count) == 0:
            continue
        for bases, last in _box_rows(start, count, global_shape):
            n = bases.size * last
            part, hits = _compiled.rows(u[pos : pos + n], u.itemsize, bases, last, mask)
            total, bad, pos = total + part, bad + hits, pos + n
    return np.uint64(total & 0xFFFFFFFFFFFFFFFF), (bad if mask else None)


def checksum_numpy(values: np.ndarray, boxes: Sequence[Box], global_shape: Sequence[int]) -> np.uint64:
    """`checksum` in NumPy, CHUNK elements at a time: the reference the C kernel must equal, and
    the fallback where it is not built (about 3x slower)."""
    u = as_unsigned(np.ascontiguousarray(values).reshape(-1))
    total = 0
    pos = 0
    tmp = np.empty(CHUNK, dtype=np.uint64)
    for start, count in boxes:
        if math.prod(count) == 0:
            continue
        for z in _box_indices(start, count, global_shape):
            n, t = z.size, tmp[: z.size]
            z *= _G  # s_i = mix64(K + i G)
            z += _K
            _mix64(z, t)
            z ^= u[pos : pos + n]  # term_i = mix64(s_i ^ u_i)
            _mix64(z, t)
            pos += n
            total = (total + int(z.sum(dtype=np.uint64))) & 0xFFFFFFFFFFFFFFFF  # integer sums wrap mod 2^64
    return np.uint64(total)


def checksum_for(format_version: int) -> Callable[[np.ndarray, Sequence[Box], Sequence[int]], np.unsignedinteger]:
    """The partial-checksum function of checkpoints of `format_version`: 1 the weak v1 sum (uint32
    partials, MPI SUM on uint32), 2 `checksum` (uint64)."""
    return checksum_v1 if format_version < 2 else checksum


# Said once when a format-version-1 checkpoint is loaded, inspected or exported.
V1_NOTE = "checkpoint written by an older gridlm: its checksum is the weak v1 one (docs/CHECKPOINT.md)"


def dataset_checksum(values: np.ndarray, format_version: int = 2) -> int:
    """The checksum of a whole dataset read into memory (stored dtype): what its `checksum`
    attribute holds, for a checkpoint of `format_version` (the root attribute)."""
    shape = tuple(values.shape)
    return int(checksum_for(format_version)(values, [((0,) * len(shape), shape)], shape))


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


# MPI-IO hints for every checkpoint file (ROMIO: Open MPI's romio321, MPICH, Cray MPICH; other
# MPI-IO layers ignore them). Data sieving off: a rank's slices of a tp-split tensor are strided
# in the file, and with sieving ROMIO reads and rewrites the whole span around them. Three
# alternating rounds on a 2-core machine (4 ranks, 0.42 GB, page cache dropped), medians:
# independent save 0.774 -> 0.694 s, its writes 0.197 -> 0.168 s, load 0.673 -> 0.638 s
# (docs/CHECKPOINT.md).
MPIO_HINTS = {"romio_ds_write": "disable", "romio_ds_read": "disable"}


# The file format of a new checkpoint (H5Pset_libver_bounds): HDF5 1.10's, whose superblock and
# object headers carry checksums, so that a flipped bit in a dataset's datatype, shape or layout is an
# error on open, not other numbers read (the earliest format checksums no metadata). The upper bound is
# v110, not "latest": every HDF5 >= 1.10 reads the file, whichever HDF5 wrote it. Files of the earliest
# format (gridlm before this) still read: the bounds apply to what is created.
LIBVER = ("v110", "v110")


def open_mpio(path, mode: str, comm, **kwargs):
    """h5py.File(path, mode) with the mpio driver on `comm` (collective) and MPIO_HINTS; a file it
    creates has the LIBVER format."""
    import h5py
    from mpi4py import MPI

    if mode == "w":
        kwargs.setdefault("libver", LIBVER)
    info = MPI.Info.Create()
    try:
        for key, value in MPIO_HINTS.items():
            info.Set(key, value)
        return h5py.File(path, mode, driver="mpio", comm=comm, info=info, **kwargs)
    finally:
        info.Free()  # HDF5 keeps its own copy


def open_serial(path, mode: str, **kwargs):
    """h5py.File(path, mode) on this rank alone, with HDF5's file lock best-effort: a parallel file
    system mounted without flock (Lustre's default on some sites) makes a plain open fail with
    ENOSYS; the MPI-IO driver never locks. A file it creates has the LIBVER format."""
    import h5py

    if mode == "w":
        kwargs.setdefault("libver", LIBVER)
    version = h5py.version.hdf5_version_tuple
    if version >= (1, 12, 1) or (version[:2] == (1, 10) and version[2] >= 7):
        kwargs.setdefault("locking", "best-effort")
    return h5py.File(path, mode, **kwargs)


def new_attributes(obj, values: dict) -> None:
    """Create scalar attributes on a new HDF5 object through h5py's low level: the types
    `obj.attrs[name] = value` gives (a str as variable-length UTF-8, a NumPy scalar as its dtype)
    in about 60% of its time, which matters where each is a collective metadata operation on
    every rank of a file with hundreds of datasets (docs/CHECKPOINT.md)."""
    from h5py import h5a, h5s, h5t, string_dtype

    space = h5s.create(h5s.SCALAR)
    for name, value in values.items():
        data = np.array(value.encode(), dtype=string_dtype()) if isinstance(value, str) else np.asarray(value)
        h5a.create(obj.id, name.encode(), h5t.py_create(data.dtype, logical=True), space).write(data)


def rewrite_checksum(dset_id, value: np.uint64) -> None:
    """Overwrite a dataset's `checksum` attribute (made by `new_attributes`, uint64) in place: the
    same type and blocks, through the low level (`attrs.modify` checks and converts on each call)."""
    from h5py import h5a

    h5a.open(dset_id, b"checksum").write(np.array(value, dtype=np.uint64))


def new_dataset(parent, name: str, shape: tuple[int, ...], dtype: np.dtype, chunks: Optional[tuple[int, ...]],
                cache: dict) -> Any:  # fmt: skip
    """A dataset made through h5py's low level, as `create_dataset(name, shape, dtype, chunks=...,
    fill_time="never")` makes it but with its storage allocated now (H5D_ALLOC_TIME_EARLY, so that
    its bytes have an address before any is written), in about half the time: the property lists,
    types and dataspaces are made once per kind (`cache`, one per file)."""
    from h5py import Dataset, h5d, h5p, h5s, h5t

    dcpl = cache.get(("dcpl", chunks))
    if dcpl is None:
        dcpl = cache[("dcpl", chunks)] = h5p.create(h5p.DATASET_CREATE)
        dcpl.set_alloc_time(h5d.ALLOC_TIME_EARLY)
        dcpl.set_fill_time(h5d.FILL_TIME_NEVER)
        dcpl.set_obj_track_times(False)  # as h5py: the same bytes for the same content
        if chunks is not None:
            dcpl.set_chunk(chunks)
    dtype = np.dtype(dtype)
    tid = cache.get(("type", dtype.str))
    if tid is None:
        tid = cache[("type", dtype.str)] = h5t.py_create(dtype, logical=True)
    space = cache.get(("space", shape))
    if space is None:
        space = cache[("space", shape)] = h5s.create_simple(shape)
    return Dataset(h5d.create(parent.id, name.encode(), tid, space, dcpl=dcpl))


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


# ---- POSIX I/O at the offsets HDF5 allocated (checkpoint.io: posix) ---------------------------
#
# HDF5 decides the file (every dataset allocated when created, its bytes at fixed offsets); each
# rank then moves its own bytes with pwrite / pread, as a rank writing its own torch.save file
# would, with no MPI-IO layer, no per-dataset HDF5 call and no collective call per dataset.
# A dataset qualifies when its elements are raw little-endian bytes at known offsets: contiguous,
# or chunked without filters and every chunk allocated. Anything else (an h5repack'd file with
# compression, say) is read through HDF5.

MAX_IO = 1 << 30  # bytes per pwrite / pread call (Linux moves at most 2 GiB - 4 KiB per call)


@dataclass(frozen=True)
class Storage:
    """Where a dataset's elements are in the file: blocks of shape `block` (the whole dataset when
    it is contiguous, its chunk shape when chunked), each at a byte offset, keyed by the block's
    grid coordinates (its first element // block), elements row-major within a block."""

    block: tuple[int, ...]
    offsets: dict[tuple[int, ...], int]
    itemsize: int


def chunk_count(shape: Sequence[int], block: Sequence[int]) -> int:
    """How many blocks of shape `block` cover an array of `shape` (the partial ones at the edges too)."""
    return math.prod(-(-n // b) for n, b in zip(shape, block))


def storage_of(dset) -> Optional[Storage]:
    """The `Storage` of a dataset (h5py's Dataset or its low-level DatasetID), or None when its
    bytes are not plainly at known offsets (filters, external files, a layout other than
    contiguous or chunked, storage not allocated, a byte order other than little-endian)."""
    from h5py import Dataset, h5d

    dsid = dset.id if isinstance(dset, Dataset) else dset
    shape = tuple(int(n) for n in dsid.shape)
    dtype = dsid.dtype
    if dtype.byteorder == ">" or dtype.fields is not None or dtype.kind not in "fiub":
        return None
    dcpl = dsid.get_create_plist()
    if dcpl.get_nfilters() or dcpl.get_external_count():
        return None
    layout = dcpl.get_layout()
    if math.prod(shape) == 0:
        return Storage(shape, {}, dtype.itemsize)
    if layout == h5d.CONTIGUOUS:
        offset = dsid.get_offset()
        return None if offset is None else Storage(shape, {(0,) * len(shape): int(offset)}, dtype.itemsize)
    if layout != h5d.CHUNKED:
        return None
    block = tuple(int(n) for n in dcpl.get_chunk())
    count = dsid.get_num_chunks()
    if count != chunk_count(shape, block):
        return None  # some chunks never allocated
    offsets = {}
    for k in range(count):
        info = dsid.get_chunk_info(k)
        if info.filter_mask or info.byte_offset is None or info.size != math.prod(block) * dtype.itemsize:
            return None
        offsets[tuple(o // b for o, b in zip(info.chunk_offset, block))] = int(info.byte_offset)
    return Storage(block, offsets, dtype.itemsize)


def datasets_of(fid) -> dict[str, dict]:
    """Every dataset of an open file (its low-level FileID) by path: shape, stored dtype (as
    `dtype.str`), whether the stored HDF5 type is exactly the standard one of that dtype (`exact`:
    not, say, a float of 4 bytes with another exponent width, which h5py still calls <f4), the
    `dtype` attribute (the logical dtype; else the stored dtype's name) and whether there is one
    (`declared`), the `checksum` attribute (None without one) and `storage_of`. A dataset whose
    metadata cannot be read has its `error` (else None) and no other facts: one damaged dataset is
    named, not the whole file refused unnamed. Through h5py's low level: a checkpoint's catalogue
    (hundreds of datasets) in a fraction of what `visititems` takes."""
    from h5py import h5a, h5d, h5g, h5o, h5t

    found: dict[str, dict] = {}
    # HDF5 addresses count from the superblock: after a user block (h5jam) they are not file offsets.
    plain = fid.get_create_plist().get_userblock() == 0

    def scalar(dsid, name: bytes):
        attr = h5a.open(dsid, name)
        value = np.zeros(attr.shape, dtype=attr.dtype)
        attr.read(value, mtype=h5t.py_create(attr.dtype))
        value = value[()]
        return value.decode() if isinstance(value, bytes) else value

    def facts(name: bytes) -> dict:
        dsid = h5d.open(fid, name)
        dtype = dsid.dtype
        checksum = scalar(dsid, b"checksum") if h5a.exists(dsid, b"checksum") else None
        declared = h5a.exists(dsid, b"dtype")
        return {
            "shape": tuple(int(n) for n in dsid.shape),
            "stored": dtype.str,
            "exact": dsid.get_type() == h5t.py_create(dtype),  # H5Tequal
            "dtype": scalar(dsid, b"dtype") if declared else dtype.name,
            "declared": declared,
            "checksum": None if checksum is None else int(checksum),
            "storage": storage_of(dsid) if plain else None,  # where its bytes are (checkpoint.io: posix)
            "error": None,
        }

    errors = (OSError, TypeError, ValueError, KeyError, RuntimeError, OverflowError)

    def damaged(name: bytes, err: Exception) -> None:
        found[name.decode(errors="replace")] = {
            "shape": None, "stored": None, "exact": False, "dtype": None, "declared": False, "checksum": None,
            "storage": None, "error": f"{type(err).__name__}: {err}",
        }  # fmt: skip

    def walk(prefix: bytes, gid) -> None:
        """The group's links by name, each object opened on its own (H5Ovisit stops at the first
        damaged object header without naming it)."""
        names: list[bytes] = []
        try:
            gid.links.iterate(names.append)
        except errors as err:
            return damaged(prefix.rstrip(b"/") or b"/", err)
        for name in names:
            try:
                info = h5o.get_info(gid, name)  # reads the object header: checksummed in LIBVER files
                if info.type == h5o.TYPE_GROUP and info.addr not in seen:  # a damaged link may point back up
                    seen.add(info.addr)
                    walk(prefix + name + b"/", h5g.open(gid, name))
                elif info.type == h5o.TYPE_DATASET:
                    found[(prefix + name).decode()] = facts(prefix + name)
            except errors as err:
                damaged(prefix + name, err)

    seen = {h5o.get_info(fid).addr}
    walk(b"", fid)
    return found


def _runs(block: Sequence[int], start: Sequence[int], count: Sequence[int]) -> tuple[np.ndarray, int]:
    """The elements of a box (start, count) of a row-major block as runs contiguous in the block, in
    order: (each run's first element's index in the block, the run's length in elements)."""
    nd = len(block)
    if nd == 0:
        return np.zeros(1, dtype=np.int64), 1
    k = nd - 1
    while k > 0 and count[k] == block[k]:  # whole trailing dimensions join the run
        k -= 1
    strides = [math.prod(block[d + 1 :]) for d in range(nd)]
    firsts = np.full(1, start[k] * strides[k], dtype=np.int64)
    for d in range(k - 1, -1, -1):
        outer = (np.arange(count[d], dtype=np.int64) + start[d]) * strides[d]
        firsts = (outer[:, None] + firsts[None, :]).reshape(-1)
    return firsts, count[k] * strides[k]


def placements(storage: Storage, box: Box) -> list[tuple[Optional[tuple[slice, ...]], np.ndarray, int]]:
    """Where the elements of `box` (global coordinates) lie in the file, one entry per block it
    meets: (the part of the box in that block as slices of the box, None when it is the whole box;
    the byte offsets of its runs; the bytes per run)."""
    start, count = box
    if not count:  # a 0-d dataset
        return [(None, np.array([storage.offsets[()]], dtype=np.int64), storage.itemsize)]
    block = storage.block
    spans = [range(s // b, (s + n - 1) // b + 1) for s, n, b in zip(start, count, block)]
    whole = all(len(r) == 1 for r in spans)
    found = []
    for coord in itertools.product(*spans):
        lo = [max(s, c * b) for s, c, b in zip(start, coord, block)]
        hi = [min(s + n, (c + 1) * b) for s, n, c, b in zip(start, count, coord, block)]
        firsts, run = _runs(block, [a - c * b for a, c, b in zip(lo, coord, block)], [h - a for a, h in zip(lo, hi)])
        where = None if whole else tuple(slice(a - s, h - s) for a, h, s in zip(lo, hi, start))
        found.append((where, storage.offsets[coord] + firsts * storage.itemsize, run * storage.itemsize))
    return found


def _pwrite(fd: int, data: memoryview, offset: int) -> None:
    while len(data):
        done = os.pwrite(fd, data[:MAX_IO], offset)
        data, offset = data[done:], offset + done


def _pread(fd: int, into: memoryview, offset: int) -> None:
    while len(into):
        done = os.preadv(fd, [into[:MAX_IO]], offset)
        if done == 0:
            raise OSError(errno.EIO, f"the file ends before byte {offset + len(into):,}: it is truncated")
        into, offset = into[done:], offset + done


def _bytes(values: np.ndarray) -> memoryview:
    return memoryview(values.reshape(-1).view(np.uint8))


def _box_parts(flat: np.ndarray, boxes: Sequence[Box]) -> Iterator[tuple[Box, np.ndarray]]:
    """Each non-empty box with its elements' part of `flat` (the boxes' elements in order)."""
    pos = 0
    for box in boxes:
        n = math.prod(box[1])
        if n:
            yield box, flat[pos : pos + n]
        pos += n


def pwrite_boxes(fd: int, storage: Storage, boxes: Sequence[Box], values: np.ndarray) -> None:
    """Write `values` (the boxes' elements in order) where the file keeps them: one pwrite per run
    (one per box and block where the box is a flat range of one chunk)."""
    for box, part in _box_parts(np.ascontiguousarray(values).reshape(-1), boxes):
        for where, offsets, nbytes in placements(storage, box):
            data = _bytes(part if where is None else np.ascontiguousarray(part.reshape(box[1])[where]))
            for i, offset in enumerate(offsets.tolist()):
                _pwrite(fd, data[i * nbytes : (i + 1) * nbytes], offset)


# Runs closer together than this are read as one span (and the gaps dropped): one large read
# beats many small ones on every file system; a span more than 2x the bytes wanted is read per run.
SIEVE_BYTES = 4 << 20


def _read_runs(fd: int, into: memoryview, offsets: np.ndarray, nbytes: int) -> None:
    if len(offsets) == 1:
        return _pread(fd, into, int(offsets[0]))
    first, span = int(offsets[0]), int(offsets[-1]) + nbytes - int(offsets[0])
    if span > max(SIEVE_BYTES, 2 * len(into)):
        for i, offset in enumerate(offsets.tolist()):
            _pread(fd, into[i * nbytes : (i + 1) * nbytes], offset)
        return
    buf = np.empty(span, dtype=np.uint8)
    _pread(fd, memoryview(buf), first)
    target = np.frombuffer(into, dtype=np.uint8).reshape(len(offsets), nbytes)
    gaps = np.diff(offsets)
    if len(gaps) and (gaps == gaps[0]).all():  # evenly spaced runs (a 2-D box): one strided copy
        target[...] = np.lib.stride_tricks.as_strided(buf, (len(offsets), nbytes), (int(gaps[0]), 1))
    else:
        for i, offset in enumerate((offsets - first).tolist()):
            target[i] = buf[offset : offset + nbytes]


def pread_boxes(
    fd: int, storage: Storage, boxes: Sequence[Box], dtype: np.dtype, out: Optional[np.ndarray] = None
) -> np.ndarray:
    """The boxes' elements in order (1-D), read from where the file keeps them (into `out`, a 1-D
    array of as many elements, where given)."""
    if out is None:
        out = np.empty(sum(math.prod(c) for _, c in boxes), dtype=dtype)
    for box, part in _box_parts(out, boxes):
        for where, offsets, nbytes in placements(storage, box):
            if where is None:
                _read_runs(fd, _bytes(part), offsets, nbytes)
            else:
                piece = np.empty([s.stop - s.start for s in where], dtype=dtype)
                _read_runs(fd, _bytes(piece), offsets, nbytes)
                part.reshape(box[1])[where] = piece
    return out

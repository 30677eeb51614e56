"""Reads that several ranks would make alike, made once.

The replicas of a parameter shard (the dp ranks of a grid; with ZeRO off, of the optimizer state
too) need the same bytes of a checkpoint. Read alone, a load moves those bytes dp times from the
file system; here the ranks that need the same span of a dataset each read a 1/k piece of it and
all-gather the others' pieces over MPI (the interconnect, or shared memory on one node, is faster
than the file system), so that a load reads every byte of the file once. ROMIO's two-phase
collective read does the like for any selection; this is its special case of identical ones,
with no staging buffer.
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

# Bytes of the span per MPI_Allgatherv call: MPI's counts and displacements are C ints, so each
# call gathers one window of the span, displacements relative to the window's start.
GATHER_BYTES = 1 << 30
ALIGN_BYTES = 1 << 20  # piece boundaries on MiB multiples of a span: whole pages, large extents


def _digest(value: Any) -> int:
    """A 63-bit digest of `repr(value)`, the same in every process (unlike `hash` of strings)."""
    return int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=8).digest(), "little") >> 1


@dataclass
class SharedReads:
    """The ranks reading alike (`comm`, None when this rank reads alone; this rank's `index` in it
    and its `members`, kept apart so that a reader thread asks no MPI call) and the datasets they
    read in pieces (`shared`: the same span on every member)."""

    comm: Any = None
    shared: frozenset = field(default_factory=frozenset)
    index: int = 0
    members: int = 1

    def cuts(self, key: Hashable, n: int, itemsize: int) -> list[int]:
        """Where the members' pieces of an `n`-element span of `key` start (and the span ends)."""
        k = self.members if key in self.shared else 1
        align = max(1, ALIGN_BYTES // itemsize)
        inner = [min(n, (n * j // k) // align * align) for j in range(1, k)]
        return [0, *inner, n]

    def piece(self, key: Hashable, n: int, itemsize: int) -> tuple[int, int]:
        """The elements [a, b) of the span this rank reads itself (the whole span when not shared)."""
        if key not in self.shared:
            return 0, n
        cuts = self.cuts(key, n, itemsize)
        return cuts[self.index], cuts[self.index + 1]

    def gather(self, key: Hashable, values: np.ndarray) -> None:
        """Fill `values` (the whole span, this rank's piece read) with the other members' pieces."""
        from mpi4py import MPI

        if key not in self.shared:
            return
        itemsize = values.dtype.itemsize
        cuts = [c * itemsize for c in self.cuts(key, values.size, itemsize)]
        buf = values.reshape(-1).view(np.uint8)
        # Window by window of the span (never a displacement past 2^31 - 1: a span of a shard over
        # 2 GiB, e.g. an embedding at tp 1, failed with MPI_ERR_ARG), each member the part of its
        # piece inside the window (most none), in place.
        for w0 in range(0, max(1, buf.size), GATHER_BYTES):
            w1 = min(w0 + GATHER_BYTES, buf.size)
            lo = [min(max(c, w0), w1) for c in cuts[:-1]]
            sizes = [min(max(e, w0), w1) - a for a, e in zip(lo, cuts[1:])]
            self.comm.Allgatherv(MPI.IN_PLACE, [buf[w0:w1], sizes, [a - w0 for a in lo], MPI.BYTE])

    def free(self) -> None:
        if self.comm is not None:
            self.comm.Free()
            self.comm = None


def plan(comm: Any, spans: dict[Hashable, Optional[Hashable]], group_by: Sequence[Hashable]) -> SharedReads:
    """Collective over `comm`: find the ranks that read alike. `spans` maps every dataset (the same
    keys, in the same order, on every rank) to what this rank reads of it (a hashable that is equal
    on two ranks exactly when they read the same elements; None: nothing). The ranks whose spans of
    the `group_by` datasets (the parameters) are all equal form a communicator; of it, the datasets
    whose span is the same on every member are read in pieces."""
    mine = np.array([_digest(sorted((repr(k), spans[k]) for k in group_by if spans[k] is not None))], dtype=np.int64)
    everyone = np.empty(comm.Get_size(), dtype=np.int64)
    comm.Allgather(mine, everyone)
    color = int(np.flatnonzero(everyone == mine[0])[0])  # the first rank of this fingerprint
    sub = comm.Split(color, comm.Get_rank())
    if sub.Get_size() == 1:
        sub.Free()
        return SharedReads()
    keys = list(spans)
    digests = np.array([-1 if spans[k] is None else _digest((repr(k), spans[k])) for k in keys], dtype=np.int64)
    table = np.empty((sub.Get_size(), len(keys)), dtype=np.int64)
    sub.Allgather(digests, table)
    alike = (table == table[0]).all(axis=0) & (table[0] >= 0)
    return SharedReads(sub, frozenset(k for k, same in zip(keys, alike) if same), sub.Get_rank(), sub.Get_size())

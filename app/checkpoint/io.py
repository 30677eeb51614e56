"""Save and load the whole training state as one parallel-HDF5 file (h5py, driver="mpio").

Datasets (global shapes, one per logical tensor, named as in the 1-rank model):

    /model/<name>                   the parameters in the compute dtype (train.precision)
    /optimizer/master/<name>        fp32 master weights (bf16 / fp16 runs only; in fp32 runs
                                    /model holds them)
    /optimizer/exp_avg/<name>       Adam/LAMB first moment (fp32)
    /optimizer/exp_avg_sq/<name>    second moment (fp32)
    /rng/torch_cpu, /rng/torch_cuda one row per rank: torch generator states

Who writes what is the components' to say: `DataParallel` and `ShardedOptimizer` describe
their state as shard descriptors (`app.shards.ShardState`: a named global tensor, where this
rank's shard sits in it, the local range it writes and the range it holds), the loss scaler
and the sampler as small JSON objects; this module walks them and knows nothing of buffers,
buckets or shards. Today the owners of a tensor's elements (every tp shard, tp rank 0 of a
replicated tensor, never the tied head copy) split each dp bucket into dp slices, the ZeRO-1
shards whether or not the optimizer shards, and write the part of every parameter in their
slice: one collective H5Dwrite per rank and dataset, with the union of its boxes as the
selection (`app/checkpoint/slabs.py`), empty on the ranks that hold nothing of the tensor.
Each dataset carries `dtype` (the logical dtype; bf16 is stored as uint16) and `checksum`
(computed in parallel from the same slices).

Loading reads, on each rank, the range each descriptor of the *current* grid holds, every
dataset once: the full local shard of each parameter (from /optimizer/master when present,
so the fp32 values come back exactly), and the held shard of each master and moment.
Nothing depends on the grid that wrote the file, so any grid (tp, pp, dp, virtual stages,
ZeRO-1, precision) loads any checkpoint of the same model. Before any tensor of the model
changes, every read slab is verified against the checksums (each rank the range it would
write, so the ranks cover every element once).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Protocol, TypeVar

import numpy as np
import torch
import yaml

from app import archs
from app.checkpoint.shared_reads import SharedReads
from app.checkpoint.shared_reads import plan as plan_shares
from app.checkpoint.slabs import (
    EXPONENT_MASK,
    V1_NOTE,
    Storage,
    checksum,
    checksum_and_nonfinite,
    checksum_for,
    chunk_count,
    datasets_of,
    global_boxes,
    new_attributes,
    new_dataset,
    open_mpio,
    open_serial,
    pread_boxes,
    pwrite_boxes,
    read_boxes,
    rewrite_checksum,
    storage_of,
    transfer_plist,
    write_boxes,
)
from app.checkpoint.stages import Abandon, PhaseTimes, Stages, abandon
from app.checkpoint.store import (
    commit,
    describe_failure,
    format_bytes,
    latest_note,
    prepare_write,
    reserve,
    retain,
    spare_file,
    step_file,
)
from app.deck import CheckpointConfig, Deck, ModelConfig
from app.deck_yaml import dump_yaml
from app.errors import CheckpointError, GridlmError, NonFiniteError
from app.names import AXES, PRECISIONS
from app.runtime.grid import ProcessGrid
from app.runtime.mpi import Runtime, failures, on_root
from app.shards import GROUPS, MASTER, MODEL, MOMENTS, JsonState, ShardState, TensorState
from app.untrusted import parse_json

T = TypeVar("T")
FORMAT, FORMAT_VERSION = "gridlm-checkpoint", 2
READABLE_VERSIONS = (1, 2)  # 1: the weak v1 checksum (slabs.checksum_v1)
# The model keys a checkpoint's tensors depend on (ffn_hidden compared resolved).
SHAPE_KEYS = ("arch", "vocab_size", "seq_len", "layers", "hidden", "heads", "kv", "ffn", "tie_embeddings",
              "moe_experts", "expert_ffn", "moe_every", "moe_shared_experts")  # fmt: skip
CHECKSUM_DOC = (
    "sum over row-major element index i of mix64(mix64(K + i*G) XOR u_i) mod 2^64, u_i = element bits as unsigned "
    "int, mix64 = SplitMix64 finaliser (x ^= x>>30; x *= 0xBF58476D1CE4E5B9; x ^= x>>27; x *= 0x94D049BB133111EB; "
    "x ^= x>>31), G = 0x9E3779B97F4A7C15, K = 0x6A09E667F3BCC909"
)
STORED = {torch.float32: ("float32", np.float32), torch.bfloat16: ("bfloat16", np.uint16), torch.float16: ("float16", np.float16)}  # fmt: skip


class ParameterState(TensorState, Protocol):
    """The component that holds the parameters (`DataParallel`)."""

    zero: bool  # the optimizer state is sharded over dp (ZeRO-1)

    def wait_params(self) -> None:
        """Return once no parameter update is in flight (the parameters are complete)."""


class OptimizerState(TensorState, Protocol):
    steps: int
    delay: int  # optim.offload_delay in effect: the parameters may lag the masters by an update
    unpublished: bool  # a delayed update's parameters are not on the device yet (the header's offload_pending)

    def restored(self, unpublished: bool = False) -> None:
        """Called once every descriptor is loaded (state derived from others is set again)."""


class SamplerState(JsonState, Protocol):
    consumed_samples: int


class TrainingState(Protocol):
    """What a checkpoint saves and restores (a `Trainer` is one): the components' shard
    descriptors and JSON states (`app.shards`), the step, and what the header records."""

    deck: Deck
    runtime: Runtime
    grid: ProcessGrid
    dp: ParameterState
    optimizer: OptimizerState
    scaler: Optional[JsonState]
    sampler: SamplerState
    steps_done: int


def _shard_states(state: TrainingState) -> dict[tuple[str, str], ShardState]:
    """(group, name) -> this rank's descriptor, for every tensor of its components."""
    shards = {(s.group, s.name): s for s in (*state.dp.shard_states(), *state.optimizer.shard_states())}
    unknown = sorted({group for group, _ in shards} - set(GROUPS))
    if unknown:  # a component describing state this format has no place for: a programming error
        raise ValueError(f"checkpoint groups {unknown} are not among {GROUPS}")
    return shards


def _catalogue(
    runtime: Runtime, shards: dict[tuple[str, str], ShardState]
) -> tuple[
    list[tuple[str, str, tuple[int, ...]]], dict[str, torch.dtype], dict[tuple[str, str], Optional[tuple[int, ...]]]
]:
    """(group, name, global shape) of every tensor of the whole model's state, in file order (the
    groups in GROUPS order, names sorted), each group's dtype, and each tensor's chunk shape
    (`chunk_shape`): the same on every rank (a rank holds the tensors of its stage only).

    Collective. The ranks allgather a 16-byte digest of their descriptors; one rank of each distinct
    description (the dp and cp replicas describe the same shards) sends it to rank 0, which merges
    them and broadcasts the result. Found in review: an allgather of every rank's descriptors cost
    each rank 266 MB received, 10 s and 1.5 GB of memory a save at 8192 ranks (tp 8, pp 8)."""
    mine = [(key, (s.global_shape, s.dtype, (s.shape, s.offset) if s.writes else None)) for key, s in shards.items()]
    digest = np.frombuffer(hashlib.blake2b(repr(mine).encode(), digest_size=16).digest(), dtype=np.uint8)
    rows = np.empty((runtime.world_size, digest.size), dtype=np.uint8)
    runtime.comm.Allgather(digest, rows)
    first: dict[bytes, int] = {}  # digest -> the first and the last rank with it
    last: dict[bytes, int] = {}
    for rank, row in enumerate(rows):
        first.setdefault(row.tobytes(), rank)
        last[row.tobytes()] = rank
    sent = runtime.comm.gather(mine if first[digest.tobytes()] == runtime.rank else None, root=0)
    result = None
    if runtime.rank == 0:
        senders = sorted(first.values())
        union = {(group, name, shape) for r in senders for (group, name), (shape, _, _) in sent[r]}
        # As a merge of every rank's in rank order: the groups in the order the ranks first name them,
        # each with the last rank's dtype.
        dtypes = {group: dtype for r in senders for (group, _), (_, dtype, _) in sent[r]}
        for d in sorted(last, key=last.__getitem__):
            dtypes.update((group, dtype) for (group, _), (_, dtype, _) in sent[first[d]])
        pieces: dict[tuple[str, str], set] = {}
        for r in senders:
            for key, (_, _, piece) in sent[r]:
                if piece is not None:
                    pieces.setdefault(key, set()).add(piece)
        catalogue = sorted(union, key=lambda item: (GROUPS.index(item[0]), item[1]))
        chunks = {(g, n): chunk_shape(shape, pieces.get((g, n), set())) for g, n, shape in catalogue}
        result = (catalogue, dtypes, chunks)
    return runtime.comm.bcast(result, root=0)


# HDF5 caps a chunk at 4 GiB; a shard larger than this (in elements of up to 4 bytes) stays contiguous.
MAX_CHUNK_ELEMENTS = (1 << 30) - 1


def chunk_shape(shape: tuple[int, ...], pieces: set) -> Optional[tuple[int, ...]]:
    """The chunk shape of a tensor written as `pieces` ((local shape, offset) of each writer's
    shard): the shard shape when the shards are one equal tiling of the tensor, so that each shard,
    and each rank's flat range of it, is one contiguous extent of the file (a tp-split row of a
    row-parallel weight is otherwise strided there); None (contiguous) for a whole or unevenly
    split tensor."""
    local = {piece[0] for piece in pieces}
    if len(local) != 1:
        return None
    (block,) = local
    if block == shape or not block or 0 in block or math.prod(block) > MAX_CHUNK_ELEMENTS:
        return None
    if any(o % b for _, offset in pieces for o, b in zip(offset, block)):
        return None
    return block if len({offset for _, offset in pieces}) == chunk_count(shape, block) else None


def _boxes(shard: ShardState, lo: int, hi: int) -> list:
    return global_boxes(shard.shape, shard.offset, lo, hi)


def _numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).cpu().numpy().view(np.uint16)
    return t.cpu().numpy()


# The stored type of each logical dtype (STORED by name: bf16 as uint16 bit patterns) and of the RNG rows.
STORED_AS = {logical: np.dtype(stored).str for logical, stored in STORED.values()}
RNG_STORED = np.dtype(np.uint8).str


def decode(values: np.ndarray, logical: str) -> torch.Tensor:
    """Stored values -> a float32 tensor (bf16 is stored as uint16 bit patterns). The bits are
    reinterpreted as `logical`, never converted as numbers: values of another width than the stored
    type of `logical` are a ValueError (a uint32 read of float32 bits converted gave 1e9 for 0.001)."""
    want = STORED_AS.get(logical)
    if want is None or values.dtype.itemsize != np.dtype(want).itemsize:
        raise ValueError(f"{values.dtype} values cannot hold {logical!r} elements (stored as {want})")
    if logical == "bfloat16":
        return torch.from_numpy(values.view(np.int16).copy()).view(torch.bfloat16).float()
    bits = np.ascontiguousarray(values).view(want)
    return torch.from_numpy(bits.astype(np.float32, copy=logical != "float32"))


def grid_signature(state: TrainingState) -> dict[str, Any]:
    """The grid a checkpoint was written on; another one loads it resharded, without the RNG states.
    Under 3D tensor parallelism its [x, y, z] too, under context parallelism its cp and under expert
    parallelism its ep (each absent otherwise, so older files still match),
    and a tensor_order other than xyz: the same tp split otherwise seeds dropout by other data
    ranks (the batch is split over z)."""
    par = state.deck.parallel
    g = state.grid
    return {
        "tp": g.size("tp"), "pp": g.size("pp"), "dp": g.size("dp"), "order": par.order,
        **({"cp": par.cp} if par.cp > 1 else {}),
        **({"ep": par.ep} if par.ep > 1 else {}),
        "virtual_stages": par.virtual_stages, "sequence_parallel": par.sequence_parallel,
        "zero": state.dp.level, "world_size": state.runtime.world_size,
        **({"tensor": list(par.tensor)} if par.tensor is not None else {}),
        **({"tensor_order": par.tensor_order} if par.tensor_order != "xyz" else {}),
    }  # fmt: skip


def same_streams(saved: dict[str, Any], now: dict[str, Any]) -> bool:
    """Whether two grids' ranks draw the same random streams, so a rank may take the saved rank's RNG
    state: the same signature but for ep (dropout is seeded by data rank, cp rank and stage, and a
    rank's masks fall on its own tokens whichever ranks hold the experts)."""
    return {k: v for k, v in saved.items() if k != "ep"} == {k: v for k, v in now.items() if k != "ep"}


def describe_grid(g: dict[str, Any]) -> str:
    """A `grid_signature` for the log: "tp=2 tensor=[1, 2, 1] yxz cp=2 pp=2 dp=2 ep=2" (tensor, its
    order, cp and ep where the checkpoint's grid had them; a key a damaged header lacks shows None)."""
    tensor = (
        [f"tensor={g['tensor']}" + (f" {g['tensor_order']}" if "tensor_order" in g else "")] if "tensor" in g else []
    )
    return " ".join(
        [f"tp={g.get('tp')}", *tensor]
        + ([f"cp={g['cp']}"] if "cp" in g else [])
        + [f"pp={g.get('pp')}", f"dp={g.get('dp')}"]
        + ([f"ep={g['ep']}"] if "ep" in g else [])
    )


HEADER_DIGEST = "header_sha256"  # of every root attribute but itself and `committed` (`header_digest`)


def header_digest(attrs: dict[str, Any]) -> str:
    """SHA-256 of a checkpoint's root attributes (the step, optimizer steps, sampler and data state,
    loss scale, grid, the deck, ...) as canonical JSON, all but `committed` and the digest itself:
    a flipped bit in any of them (step 20 -> 21 resumed at the wrong step and learning rate) no
    longer loads unnoticed."""
    kept = {k: v for k, v in attrs.items() if k not in ("committed", HEADER_DIGEST)}
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()


def _header(state: TrainingState) -> dict[str, Any]:
    from app.metrics.report import versions

    scaler = state.scaler
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        # The RNG rows are by grid position (files without this key: by world rank; the same where the
        # ranks are placed in blocks, not under round-robin placements).
        "rng_rows": "grid",
        "step": state.steps_done,
        "consumed_samples": state.sampler.consumed_samples,
        "sampler": json.dumps(state.sampler.state_dict()),
        "optimizer_steps": state.optimizer.steps,
        # The delayed update (optim.offload_delay): /model holds the parameters the next step runs on,
        # the masters the update not yet published; a delayed run resumes with both, any other publishes it.
        "offload_pending": int(state.optimizer.unpublished),
        "precision": state.deck.train.precision,
        "loss_scaler": json.dumps(None if scaler is None else scaler.state_dict()),
        "deck": dump_yaml(state.deck.to_dict(), sort_keys=False),
        "grid": json.dumps(grid_signature(state)),
        "versions": json.dumps(versions()),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "checksum_algorithm": CHECKSUM_DOC,
    }


@dataclass
class Saved:
    path: Path
    step: int
    bytes: int  # tensor bytes written
    seconds: float  # the whole save, from the snapshot to the commit
    blocked: Optional[float] = None  # of which the step loop waited (None: all of it, a synchronous save)
    # This rank's seconds per phase of the save (the snapshot, each stage of `write`, the checksums
    # and the H5Dwrite calls apart, the commit): docs/CHECKPOINT.md, "Where the time goes".
    phases: dict[str, float] = dataclasses.field(default_factory=dict)


@dataclass
class Snapshot:
    """One checkpoint's content on this rank, taken from the training state (`snapshot`), so that
    `write` needs nothing else: the values this rank writes, the file's catalogue and header."""

    step: int
    config: CheckpointConfig
    header: dict[str, Any]
    health: tuple[int, int]  # nonfinite_events, nonfinite_in_a_row (store.protected)
    catalogue: list[tuple[str, str, tuple[int, ...]]]  # every tensor of the model's state, in file order
    chunks: dict[tuple[str, str], Optional[tuple[int, ...]]]  # (group, name) -> chunk shape (None: contiguous)
    stored_of: dict[str, tuple[str, Any]]  # group -> (logical dtype, stored numpy dtype)
    slices: dict[tuple[str, str], tuple[list, np.ndarray]]  # (group, name) -> (boxes, values) this rank writes
    rows: dict[str, np.ndarray]  # this rank's RNG states
    grid_rank: int  # the row they go to: this rank's grid position (placements may differ on a resume)
    started: float  # perf_counter() when it was taken

    @property
    def host_bytes(self) -> int:
        """Host memory the values hold (a copy: `snapshot(copy=True)`; else views of the state)."""
        return sum(values.nbytes for _, values in self.slices.values())


def snapshot(state: TrainingState, copy: bool = False) -> Snapshot:
    """This rank's part of a checkpoint of `state` (collective: every rank, same step). With
    `copy`, the values are copied to host memory, so that training may go on while they are
    written (checkpoint.async); without, they are views of the state (NumPy views of CPU
    tensors; device tensors are copied to the host either way)."""
    rt = state.runtime
    started = time.perf_counter()
    state.dp.wait_params()  # no all-gather in flight: the parameter buffer is complete
    if state.runtime.device.type == "cuda":
        torch.cuda.synchronize(state.runtime.device)
    shards = _shard_states(state)
    catalogue, dtypes, chunks = _catalogue(rt, shards)
    header = rt.comm.bcast(_header(state) if rt.rank == 0 else None, root=0)
    slices = {}
    for key, shard in shards.items():
        if shard.writes:
            held = shard.view(*shard.write)
            values = _numpy(held)
            if copy and held.device.type == "cpu":  # a device tensor's host copy is already a copy
                values = values.copy()
            slices[key] = (_boxes(shard, *shard.write), values)
    return Snapshot(
        step=state.steps_done,
        config=state.deck.checkpoint,
        header=header,
        # For retention (store.protected): non-finite steps so far, and in the current streak.
        health=(int(getattr(state, "nonfinite_events", 0)), int(getattr(state, "nonfinite_in_a_row", 0))),
        catalogue=catalogue,
        chunks=chunks,
        stored_of={group: STORED[dtype] for group, dtype in dtypes.items()},
        slices=slices,
        rows=_rng_rows(rt),
        grid_rank=state.grid.rank,
        started=started,
    )


def save(
    state: TrainingState,
    directory: Path,
    *,
    before_commit: Optional[Callable[[], None]] = None,
    before_write: Optional[Callable[[], None]] = None,
    reserve_space: bool = True,
) -> Saved:
    """Write the training state to directory/step_NNNNNNN.h5 (all ranks), commit it, apply
    retention: `write` of a `snapshot` (see there)."""
    return write(
        snapshot(state), state.runtime, directory,
        before_commit=before_commit, before_write=before_write, reserve_space=reserve_space,
    )  # fmt: skip


def write(
    snap: Snapshot,
    rt: Runtime,
    directory: Path,
    *,
    before_commit: Optional[Callable[[], None]] = None,
    before_write: Optional[Callable[[], None]] = None,
    reserve_space: bool = True,
) -> Saved:
    """Write a snapshot to directory/step_NNNNNNN.h5 (all ranks of `rt.comm`, every HDF5 and MPI
    call on that communicator: `app/checkpoint/background.py` gives a thread of its own one),
    commit it, apply retention. Raises, on every rank alike, CheckpointError when it cannot be
    written (no space, I/O or permission error) and NonFiniteError for a NaN/Inf in any saved
    tensor; then the .tmp file is gone and `latest` is unchanged (docs/CHECKPOINT.md, "When a
    save fails"). Tests only: `before_write` runs on rank 0 after the free-space check,
    `reserve_space=False` skips the fallocate (to meet a full disk mid-write), and
    `before_commit` runs on rank 0 between the flushed write and the rename."""
    from mpi4py import MPI

    cfg, catalogue, rows, stored_of, slices = snap.config, snap.catalogue, snap.rows, snap.stored_of, snap.slices
    final = step_file(directory, snap.step)
    tmp = final.with_name(final.name + ".tmp")
    header = snap.header
    # Chunks of the shards' shape for pwrite; MPI-IO keeps the contiguous layout: its independent
    # writes into chunked datasets measured 5-15x slower (docs/CHECKPOINT.md).
    chunks = snap.chunks if cfg.io == "posix" else {}
    layout = [
        (math.prod(shape), np.dtype(stored_of[group][1]).itemsize, 1 if block is None else chunk_count(shape, block))
        for group, name, shape in catalogue
        for block in [chunks.get((group, name))]
    ]
    layout += [(rt.world_size * row.size, 1, 1) for row in rows.values()]
    nbytes = sum(n * size for n, size, _ in layout)
    needed = checkpoint_size(layout, header, cfg.alignment_threshold, cfg.alignment_interval)

    stages = Stages(rt)
    phases = stages.phases
    phases.add("snapshot", time.perf_counter() - snap.started)

    # One entry per dataset, the RNG rows last; MPI SUM on uint64 wraps mod 2^64, as C.
    sums = np.zeros(len(catalogue) + len(rows), dtype=np.uint64)

    def check_finite() -> None:
        """A NaN/Inf in any slice this rank would write: refused before anything is committed (with
        MPI-IO before the disk is touched; with posix before the pwrites, rank 0's beside its
        fsync). The checksums of the slices are made in the same pass (the C kernel; else a pass
        each)."""
        for index, (group, name, shape) in enumerate(catalogue):
            if (group, name) in slices:
                boxes, values = slices[(group, name)]
                logical = stored_of[group][0]
                sums[index], bad = checksum_and_nonfinite(values, boxes, shape, logical)
                if bad is None:
                    bad = count_nonfinite(values, logical)
                if bad:
                    raise NonFiniteError(f"/{group}/{name} has {bad} non-finite value{'s' if bad > 1 else ''}")

    def prepare() -> None:
        prepare_write(directory, tmp, needed, metadata_headroom(len(layout), header))
        if before_write is not None:
            before_write()

    if cfg.io != "posix":  # posix checks them while it writes (`write_posix`)
        try:
            stages.run(None, "checking the values and their checksums", check_finite)
        except Abandon as stop:
            abandon(rt, stop, None, tmp, needed, final, keep_blocks=False)
    with phases.timed("free space and spare blocks"):
        on_root(rt, prepare)  # the file system is checked once, the verdict goes to every rank

    def create_datasets(f: Any) -> list[tuple[Any, str, str, tuple[int, ...]]]:
        """All metadata first, every attribute at its final size (`committed` false, checksums
        0), so that after the first flush the close only rewrites blocks the file already has.
        Every dataset's storage is allocated now (H5D_ALLOC_TIME_EARLY), each shard of a
        tp-split tensor a chunk of its own (`chunk_shape`): one contiguous extent per shard."""
        f.attrs.update(header)
        f.attrs["nonfinite_events"], f.attrs["nonfinite_in_a_row"] = snap.health
        events, in_a_row = snap.health
        f.attrs[HEADER_DIGEST] = header_digest(
            {**header, "nonfinite_events": int(events), "nonfinite_in_a_row": int(in_a_row)}
        )
        f.attrs["committed"] = False  # true last: a copy of a half-written file is refused
        created, made, groups = [], {}, {}
        for group, name, shape in catalogue:
            logical, stored = stored_of[group]
            parent = groups.get(group) or groups.setdefault(group, f.require_group(group))
            dset = new_dataset(parent, name, shape, stored, chunks.get((group, name)), made)
            new_attributes(dset, {"dtype": logical, "checksum": np.uint64(0)})
            created.append((dset, group, name, shape))
        for key, row in rows.items():
            shape = (rt.world_size, row.size)
            dset = new_dataset(f.require_group("rng"), key, shape, np.dtype(np.uint8), None, made)
            new_attributes(dset, {"checksum": np.uint64(0)})
            created.append((dset, "rng", key, shape))
        if rt.rank == 0:
            spare_file(tmp).unlink(missing_ok=True)  # its blocks are the metadata's room in the flush that follows
        return created

    def slice_of(kind: str, name: str, shape: tuple[int, ...]) -> tuple[list, np.ndarray]:
        """This rank's boxes of one dataset and their values (none: empty); an RNG row's checksum
        is made here (the tensors' were made with the NaN/Inf check, `check_finite`)."""
        if kind != "rng":
            return slices.get((kind, name), ([], np.empty(0, dtype=stored_of[kind][1])))
        boxes = [((snap.grid_rank, 0), (1, shape[1]))]
        sums[len(catalogue) + list(rows).index(name)] = checksum(rows[name], boxes, shape)
        return boxes, rows[name]

    def write_mpio() -> None:
        """checkpoint.io independent / collective: every dataset through parallel HDF5 (MPI-IO)."""
        dxpl = transfer_plist(cfg.io == "collective")
        f = None

        def write_one(dset: Any, kind: str, name: str, shape: tuple[int, ...]) -> None:
            """This rank's slice of one dataset: one H5Dwrite on every rank, even with nothing to
            write (collective I/O needs every rank's call)."""
            stages.doing = f"writing /{kind}/{name}"
            boxes, values = slice_of(kind, name, shape)
            with phases.timed("data (in the writes)"):
                write_boxes(dset.id, boxes, values, dxpl)

        def write_all(datasets: list[tuple[Any, str, str, tuple[int, ...]]]) -> None:
            for item in datasets:
                write_one(*item)

        def attributes(datasets: list[tuple[Any, str, str, tuple[int, ...]]]) -> None:
            for (dset, *_), value in zip(datasets, sums):
                rewrite_checksum(dset.id, value)  # in place: the same blocks
            f.attrs.modify("committed", True)

        # Every stage is agreed on all ranks before any rank makes the next collective call
        # (app/checkpoint/stages.py); a failure makes them all leave the file together.
        metadata_on_disk = False
        try:
            f = stages.run("H5Fcreate", "creating the file", lambda: open_mpio(tmp, "w", rt.comm, **alignment))
            if reserve_space:  # rank 0; from here on no rank meets a full disk inside MPI-IO (store.reserve)
                stages.run(
                    "fallocate", f"reserving {format_bytes(needed)}", lambda: rt.rank == 0 and reserve(tmp, needed)
                )
            datasets = stages.run("H5Dcreate", "creating the datasets", create_datasets, f)
            # Writes the metadata (and trims the reservation to the file's size): its blocks are allocated now.
            stages.run("H5Fflush", "writing the metadata", f.flush)
            metadata_on_disk = True
            if cfg.io == "collective":  # every H5Dwrite is collective: agree before the next one
                for dset, kind, name, shape in datasets:
                    stages.run("H5Dwrite", f"writing /{kind}/{name}", write_one, dset, kind, name, shape)
            else:  # independent I/O makes no collective call: one agreement after the last write
                stages.run(None, "writing the datasets", write_all, datasets)
            with rt.watchdog.blocking("MPI_Allreduce (checksums)", axis="world"):
                rt.comm.Allreduce(MPI.IN_PLACE, sums, op=MPI.SUM)
            stages.run("H5Awrite", "writing the checksums", attributes, datasets)
            # MPI_File_sync on every rank: the data is on the file system, not in client caches.
            stages.run("H5Fflush", "flushing the file (MPI_File_sync)", f.flush)
            stages.run("H5Fclose", "closing the file", f.close)
        except Abandon as stop:
            abandon(rt, stop, f, tmp, needed, final, keep_blocks=metadata_on_disk)

    def write_posix() -> None:
        """checkpoint.io posix: rank 0 makes the file and all its metadata with serial HDF5, every
        dataset allocated, while the other ranks check their slices for NaN/Inf and checksum them;
        each rank then pwrites its slices at the offsets HDF5 gave them (`slabs.storage_of`) and
        fsyncs them, rank 0 checking and checksumming its own slices while its fsync waits on the
        disk (the check is CPU, the sync I/O: rank 0's check leaves the critical path); rank 0 then
        writes the summed checksums and `committed` in place and fsyncs those blocks. No MPI-IO, no
        collective HDF5 call: the ranks meet at the offsets' MPI_Bcast and the checksums'
        MPI_Allreduce. (A thread making the checksums beside the pwrites measured slower here: both
        are CPU work.)"""
        from h5py import h5d

        def create() -> list[Storage]:
            f = open_serial(tmp, "w", meta_block_size=META_BLOCK, **alignment)
            try:
                storage = [storage_of(dset) for dset, *_ in create_datasets(f)]
            finally:
                _close(rt, f)  # writes the metadata; the file's end is past every dataset
            if any(where is None for where in storage):  # made just above: a bug, not a user error
                raise RuntimeError(f"{tmp}: HDF5 left a dataset without storage")
            if reserve_space:  # the blocks under every dataset: no rank meets a full disk in its pwrites
                size = os.stat(tmp).st_size
                stages.doing = f"reserving {format_bytes(size)}"
                reserve(tmp, size)
            return storage

        def check() -> None:
            stages.doing = "checking the values and their checksums"
            with phases.timed("checking the values and their checksums"):
                check_finite()

        def create_or_check() -> Optional[list[Storage]]:
            """Rank 0 makes the file while the others check their slices: a NaN/Inf anywhere is a
            NonFiniteError, the stage fails everywhere and the file goes."""
            if rt.rank != 0:
                check()
                return None
            stages.doing = "creating the file and its datasets (rank 0, serial HDF5)"
            with phases.timed("creating the file and its datasets (rank 0, serial HDF5)"):
                return create()

        def write_data() -> None:
            fd = os.open(tmp, os.O_WRONLY)
            try:
                for index, (kind, name, shape) in enumerate(everything):
                    boxes, values = slice_of(kind, name, shape)
                    if boxes:
                        stages.doing = f"writing /{kind}/{name}"
                        with phases.timed("data (pwrite)"):
                            pwrite_boxes(fd, storage[index], boxes, values)
            finally:
                os.close(fd)

        def fsync(phase: str) -> None:
            with phases.timed(phase):
                fd = os.open(tmp, os.O_WRONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)

        def sync_and_check() -> None:
            """Every rank's written slices to the disk; rank 0 checks its own meanwhile (a NaN/Inf
            there fails the stage everywhere, after the sync, and the file goes)."""
            if rt.rank != 0:
                fsync("fsync (the disk write)")
                return
            with ThreadPoolExecutor(1, thread_name_prefix="checkpoint-fsync") as pool:
                synced = pool.submit(fsync, "fsync (the disk write)")
                try:
                    check()
                finally:
                    synced.result()  # its error, if any, once the check is done

        def commit_sums() -> None:
            """Rank 0 writes the checksums and `committed` into the metadata (in place: the same
            blocks) and syncs those blocks; the data is on the disk already."""
            if rt.rank != 0:
                return
            with phases.timed("writing the checksums (rank 0)"):
                f = open_serial(tmp, "r+")
                try:
                    for (kind, name, _), value in zip(everything, sums):
                        rewrite_checksum(h5d.open(f.id, f"{kind}/{name}".encode()), value)
                    f.attrs.modify("committed", True)
                finally:
                    _close(rt, f)
            fsync("fsync (the checksums, rank 0)")

        everything = [*catalogue, *(("rng", key, (rt.world_size, row.size)) for key, row in rows.items())]
        try:
            storage = stages.run(None, "creating the file (rank 0), checking the values", create_or_check)
            with rt.watchdog.blocking("MPI_Bcast (dataset offsets)", axis="world"):
                storage = rt.comm.bcast(storage, root=0)
            stages.run(None, "writing the datasets", write_data)
            stages.run(None, "flushing the datasets (fsync), checking the values (rank 0)", sync_and_check)
            with rt.watchdog.blocking("MPI_Allreduce (checksums)", axis="world"):
                rt.comm.Allreduce(MPI.IN_PLACE, sums, op=MPI.SUM)
            stages.run(None, "writing the checksums (rank 0)", commit_sums)
        except Abandon as stop:
            abandon(rt, stop, None, tmp, needed, final, keep_blocks=False)

    alignment = {"alignment_threshold": cfg.alignment_threshold, "alignment_interval": cfg.alignment_interval}
    if cfg.io == "posix":
        write_posix()
    else:
        write_mpio()

    def finish() -> None:
        try:
            if before_commit is not None:
                before_commit()
            commit(tmp, final)
        except OSError as err:
            if tmp.exists():
                tmp.unlink(missing_ok=True)
            raise CheckpointError(
                f"cannot commit checkpoint {final}: {describe_failure(str(err), err.errno)} ({err}); "
                f"{latest_note(directory)}"
            ) from None
        try:
            retain(directory, cfg.keep)
        except (OSError, CheckpointError) as err:  # the checkpoint is committed: say so, go on
            rt.log(f"gridlm: warning: checkpoint {final} committed, but retention failed: {err}")

    with phases.timed("commit (rename, latest, retention)"):
        on_root(rt, finish)
    return Saved(final, snap.step, nbytes, time.perf_counter() - snap.started, phases=phases.seconds)


def _close(rt: Runtime, f: Any) -> None:
    """Close an h5py file; one whose close failed is kept referenced for good (releasing it again
    crashes HDF5 1.10), and the error goes on."""
    try:
        f.close()
    except Exception:
        rt.keep_alive.append(f)
        raise


# HDF5 metadata per dataset (object header with the dtype and checksum attributes, its link
# in the group's B-tree and heap): measured 0.9-1.2 KiB of disk pages per dataset (its small
# blocks lie between the datasets); counted as one 4 KiB page, so that the reservation and the
# spare blocks cover it.
DATASET_METADATA = 4096
# checkpoint.io posix: HDF5 takes the metadata's space in blocks of this size, so that the object
# headers of all datasets lie together at the start of the file (one read, not one per dataset,
# when a load reads the header from a cold cache), not each before its dataset.
META_BLOCK = 1 << 20
# A chunked dataset's index (a version-1 B-tree node: 64 chunk entries, about 2.6 KiB).
CHUNK_INDEX = 4096
FILE_METADATA = 64 * 1024  # superblock, groups, attribute headers, besides the header strings


def metadata_headroom(datasets: int, header: dict[str, Any]) -> int:
    """Disk space the metadata of a file with `datasets` datasets and root attributes `header`
    may take: what `store.prepare_write` keeps spare for it."""
    return FILE_METADATA + sum(len(str(value)) + 64 for value in header.values()) + DATASET_METADATA * datasets


def checkpoint_size(
    layout: list[tuple[int, int, int]], header: dict[str, Any], alignment_threshold: int, alignment_interval: int
) -> int:
    """An upper bound of the file's size: HDF5's allocation replayed in creation order, each
    dataset ((elements, item size, chunks) in `layout`) after its metadata (and its chunk index),
    each of its chunks of at least the threshold starting at a multiple of the alignment
    interval, none of the gaps reused (measured: 1.03 x the real size for a 0.44 GB model, 1.26 x
    for gpt_tiny, whose tensors are about 1 MiB)."""
    end = metadata_headroom(0, header) + META_BLOCK
    for n, size, chunks in layout:
        end += DATASET_METADATA + (CHUNK_INDEX if chunks > 1 else 0)
        for _ in range(chunks):
            if n * size // chunks >= alignment_threshold:
                end = -(-end // alignment_interval) * alignment_interval
            end += -(-n // chunks) * size
    return end


def count_nonfinite(values: torch.Tensor | np.ndarray, logical: str) -> int:
    """NaN and Inf elements of a tensor (on a GPU: counted there, before any copy to the host)
    or of stored values (bf16 as uint16 bit patterns). On the host the all-finite case costs
    one pass: np.isfinite for float32 (~10 GB/s here; torch.isfinite on the CPU is 20x
    slower), the exponent bits for 16-bit values (all ones: Inf or NaN); counting only after
    a hit."""
    if isinstance(values, torch.Tensor):
        if values.device.type != "cpu":
            return int(values.numel() - torch.isfinite(values).sum().item())
        values = _numpy(values)
    mask = EXPONENT_MASK[logical] if logical in ("bfloat16", "float16") else None
    if mask is not None:
        exponent = np.bitwise_and(values.view(np.uint16), mask)
        return 0 if exponent.max(initial=0) != mask else int(np.count_nonzero(exponent == mask))
    finite = np.isfinite(values)
    return 0 if finite.all() else int(finite.size - np.count_nonzero(finite))


def _rng_rows(rt: Runtime) -> dict[str, np.ndarray]:
    """This rank's torch generator states (dropout masks differ between ranks), as uint8 rows."""
    states = {"torch_cpu": torch.get_rng_state()}
    if rt.device.type == "cuda":
        states["torch_cuda"] = torch.cuda.get_rng_state(rt.device)
    return {key: value.numpy() for key, value in states.items()}


# ---- load ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Advice:
    """What a message about a checkpoint file tells the user to do. A resume (training) names run.resume
    (`RESUME`); the tools (inspect, export, generate, eval, memorization) have none and name another
    file (`TOOL`, `EVAL`). `exact_model`: the deck's model must compute the checkpoint's function, not
    only hold its shapes (app.eval: a changed layernorm_eps or rope_theta moves the loss)."""

    damaged: str  # the file is truncated, corrupt or its header damaged
    not_a_file: str  # the path is a directory, a FIFO, ...
    incomplete: str  # no `committed` attribute
    checksums: str  # a dataset's values do not match its checksum
    exact_model: bool = False


CORRUPT = "resume from an older checkpoint (run.resume: <file>) or start over (run.resume: none)"
RESUME = Advice(
    CORRUPT, "resume from a step_NNNNNNN.h5 file or run.resume: none", "resume from an older checkpoint",
    "resume from an older checkpoint (run.resume: <file>) or run.resume: none",
)  # fmt: skip
OLDER = "use an older checkpoint of its directory (`python -m app.checkpoint inspect FILE` verifies one)"
TOOL = Advice(OLDER, "give a step_NNNNNNN.h5 file", OLDER, OLDER)
EVAL = dataclasses.replace(TOOL, exact_model=True)


def read_header(path: Path, advice: Advice = TOOL, damaged_ok: bool = False) -> dict[str, Any]:
    """Root attributes and the dataset catalogue of a committed checkpoint (serial h5py), and under
    "damaged" each dataset whose metadata is damaged (`dataset_damage`) with why. Raises
    CheckpointError for anything but a complete gridlm checkpoint, saying what `advice` says, and,
    unless `damaged_ok` (inspect, which lists them), for a damaged dataset."""

    catalogue: dict[str, dict[str, Any]] = {}
    fix = advice.damaged
    if not path.is_file():  # a FIFO would block HDF5's open; a directory is no checkpoint
        raise CheckpointError(f"{path} is not a file; {advice.not_a_file}")
    try:
        with open_serial(path, "r") as f:
            attrs = root_attributes(f, path, fix)
            if attrs.get("format") != FORMAT:
                raise CheckpointError(f"{path} is not a gridlm checkpoint (no format = {FORMAT!r} attribute)")
            if not attrs.get("committed"):
                raise CheckpointError(
                    f"{path} is incomplete (no 'committed' attribute: copied or renamed during a write); "
                    f"{advice.incomplete}"
                )
            version = attrs.get("format_version")
            if type(version) is not int or version not in READABLE_VERSIONS:  # not True (== 1), not 2.0
                newer = type(version) is int and version > max(READABLE_VERSIONS)
                raise CheckpointError(
                    f"{path} has format version {_cut_repr(version)}; this gridlm reads "
                    f"versions {', '.join(map(str, READABLE_VERSIONS))}: "
                    + ("update gridlm" if newer else f"the header is damaged; {fix}")
                )
            # Files written before the digest have none: they load as they did.
            if HEADER_DIGEST in attrs and attrs[HEADER_DIGEST] != header_digest(attrs):
                raise CheckpointError(
                    f"{path}: its header (step, optimizer steps, sampler, loss scale, grid, deck) does not match its "
                    f"checksum: the file was changed after it was written; {fix}"
                )
            check_header(attrs, path, fix)
            try:
                catalogue = datasets_of(f.id)
            except (TypeError, ValueError, RuntimeError, KeyError) as err:  # an attribute of another type
                raise CheckpointError(
                    f"{path}: a dataset's dtype or checksum attribute cannot be read ({err}); {fix}"
                ) from None
    except OSError as err:
        raise CheckpointError(
            f"{path} is not a readable HDF5 file ({err}); it may be truncated or corrupt: {fix}"
        ) from None
    damaged = {key: why for key, entry in catalogue.items() if (why := dataset_damage(key, entry, version))}
    if damaged and not damaged_ok:
        raise CheckpointError(damage_message(path, damaged, fix))
    rng = {key.removeprefix("rng/"): entry["shape"] for key, entry in catalogue.items()
           if key.startswith("rng/") and key not in damaged}  # fmt: skip
    return {**attrs, "datasets": catalogue, "rng": rng, "damaged": damaged}


def dataset_damage(key: str, entry: dict[str, Any], version: int) -> Optional[str]:
    """Why the metadata of dataset `key` (its `datasets_of` entry) in a gridlm file of format `version`
    is damaged, None when it is not: it cannot be read; a tensor's `dtype` attribute is missing or
    not one gridlm writes; the stored HDF5 type is not the one the logical dtype is stored as (a
    flipped bit in the earliest file format, which checksums no metadata, turned float32 into uint32
    and the values read were 1e9 where 0.001 was written; the checksum, over the bits, matched); the
    `checksum` attribute is missing (every dataset has one, but the RNG rows of the first version-1
    files). A dataset outside gridlm's groups is not judged here (inspect names it against the model)."""
    if entry["error"] is not None:
        return f"its metadata cannot be read ({entry['error']})"
    group = key.rpartition("/")[0]
    if group == "rng":
        logical, want = "uint8", RNG_STORED
    elif group in GROUPS:
        logical = entry["dtype"]
        if not entry["declared"] or logical not in STORED_AS:
            shown = _cut_repr(logical) if entry["declared"] else "missing"
            return f"its dtype attribute is {shown}, not one of {', '.join(STORED_AS)}"
        want = STORED_AS[logical]
    else:
        return None
    if entry["stored"] != want or not entry["exact"]:
        return (f"its HDF5 datatype is {entry['stored']}{'' if entry['exact'] else ' (not the standard one)'}, "
                f"where {logical} is stored as {want}: the datatype is damaged")  # fmt: skip
    if entry["checksum"] is None and not (group == "rng" and version == 1):
        return "it has no checksum attribute (gridlm writes one on every dataset)"
    return None


def damage_message(path: Path, damaged: dict[str, str], fix: str) -> str:
    """One line naming the first damaged dataset, why, and how many more (`read_header`)."""
    first, *rest = damaged
    more = ""
    if rest:
        shown = ", ".join("/" + key for key in rest[:3]) + (", ..." if len(rest) > 3 else "")
        more = f" (and {len(rest)} more: {shown})"
    return f"{path}: dataset /{first} is damaged: {damaged[first]}{more}; {fix}"


MAX_ATTRIBUTE_BYTES = 1 << 20  # a header attribute's stored bytes (the deck's is a few KB)


def root_attributes(f: Any, path: Path, fix: str = CORRUPT) -> dict[str, Any]:
    """The file's root attributes as Python values (numpy scalars and arrays unwrapped), each at most
    MAX_ATTRIBUTE_BYTES where HDF5 knows the size before reading (fixed-size types); one that
    h5py cannot read as a value is a CheckpointError, not a traceback."""
    attrs: dict[str, Any] = {}
    try:
        names = list(f.attrs.keys())[:256]  # a header has 17
    except (OSError, TypeError, ValueError, KeyError, RuntimeError) as err:  # a damaged attribute message
        raise CheckpointError(f"{path}: its header attributes cannot be listed ({err}); {fix}") from None
    for name in names:
        try:
            try:
                size = f.attrs.get_id(name).get_storage_size()
            except RuntimeError:  # HDF5 reports an empty attribute's size of 0 as an error
                size = 0
            if size > MAX_ATTRIBUTE_BYTES:
                raise CheckpointError(
                    f"{path}: header attribute {name[:80]!r} holds {size:,} bytes (at most {MAX_ATTRIBUTE_BYTES:,}): "
                    f"not a gridlm header; {fix}"
                )
            value = f.attrs[name]
        except (OSError, TypeError, ValueError, KeyError, RuntimeError) as err:
            raise CheckpointError(f"{path}: header attribute {name[:80]!r} cannot be read ({err}); {fix}") from None
        # Plain Python values: an array is compared and digested by its elements, not its repr.
        attrs[name] = (
            value.tolist()
            if isinstance(value, np.ndarray)
            else value.item()
            if isinstance(value, np.generic)
            else value
        )
    return attrs


def _json_attribute(attrs: dict[str, Any], key: str, path: Path, fix: str = CORRUPT) -> Any:
    value = attrs.get(key)
    if not isinstance(value, str):
        raise CheckpointError(f"{path}: header attribute {key} is {type(value).__name__}, not JSON text; {fix}")
    fail = lambda why: CheckpointError(f"{path}: header attribute {key}: {why}; {fix}")  # noqa: E731
    return parse_json(value.encode("utf-8", "replace"), f"header attribute {key}", fail)


def _cut_repr(value: Any) -> str:
    """A header value in a one-line message: its repr, cut to 80 characters."""
    shown = repr(value)
    return shown[:80] + ("..." if len(shown) > 80 else "")


def _count(value: Any) -> bool:
    return type(value) is int and value >= 0  # bool is an int to isinstance


def check_header(attrs: dict[str, Any], path: Path, fix: str = CORRUPT) -> None:
    """Every header value that load, inspect, generate and export use has the type and range the
    writer gives it: a file whose digest is missing (written before it) or that was rewritten with
    a matching digest still ends in a CheckpointError naming the attribute, never a traceback."""

    def bad(key: str, want: str) -> CheckpointError:
        return CheckpointError(f"{path}: header attribute {key} = {_cut_repr(attrs.get(key))} is not {want}; {fix}")

    for key in ("step", "optimizer_steps", "consumed_samples"):
        if not _count(attrs.get(key)):
            raise bad(key, "a non-negative integer")
    if "offload_pending" in attrs and attrs["offload_pending"] not in (0, 1):  # missing in older files
        raise bad("offload_pending", "0 or 1")
    for key in ("nonfinite_events", "nonfinite_in_a_row"):  # missing in older files
        if key in attrs and not _count(attrs[key]):
            raise bad(key, "a non-negative integer")
    if attrs.get("precision") not in PRECISIONS:
        raise bad("precision", f"one of {', '.join(PRECISIONS)}")
    if not isinstance(attrs.get("deck"), str):
        raise bad("deck", "the deck's YAML text")
    sampler = _json_attribute(attrs, "sampler", path, fix)
    if not isinstance(sampler, dict) or not _count(sampler.get("consumed_samples")):
        raise bad("sampler", 'a JSON object {"consumed_samples": N}')
    scaler = _json_attribute(attrs, "loss_scaler", path, fix)
    if scaler is not None and not (
        isinstance(scaler, dict)
        and type(scaler.get("scale")) in (int, float)
        and math.isfinite(scaler["scale"])
        and scaler["scale"] > 0
        and _count(scaler.get("clean"))
        and _count(scaler.get("skipped"))
    ):
        raise bad("loss_scaler", 'null or a JSON object {"scale": S > 0, "clean": N, "skipped": N}')
    grid = _json_attribute(attrs, "grid", path, fix)
    if not isinstance(grid, dict) or not all(_count(grid.get(k)) for k in AXES):
        raise bad("grid", 'a JSON object {"tp": N, "pp": N, "dp": N, ...}')
    if "versions" in attrs and not isinstance(_json_attribute(attrs, "versions", path, fix), dict):
        raise bad("versions", "a JSON object")


def stored_deck(header: dict[str, Any], path: Path) -> Any:
    """The deck a checkpoint stores (its `deck` attribute), read as boundedly as a deck file (an
    alias bomb in a 2 KB attribute once took 57 s and 1.2 GB); CheckpointError for anything else."""
    from app.deck_yaml import read_yaml_bytes

    text = header.get("deck")
    if not isinstance(text, str):
        raise CheckpointError(f"{path}: no deck attribute (a string); resume from an older checkpoint")
    fail = lambda message: CheckpointError(f"{path}: its stored deck: {message}")  # noqa: E731
    raw = read_yaml_bytes(text.encode("utf-8", "replace"), f"{path} (deck attribute)", "stored deck", fail)
    if not isinstance(raw, dict):
        raise fail("not a mapping of sections")
    return raw


def model_section(header: dict[str, Any], path: Path) -> dict[str, Any]:
    """The `model` section of the deck a checkpoint was written with, the derived values resolved
    as `ModelConfig` does (arch gpt2 in files older than model.arch; ffn; kv, the key/value heads;
    tie_embeddings)."""
    try:
        model = dict(stored_deck(header, path)["model"])
        for key in ("vocab_size", "seq_len", "layers", "hidden", "heads"):
            int(model[key])
        cfg = _model_config(model)
        model.update(arch=cfg.arch, ffn=cfg.ffn, kv=cfg.kv, tie_embeddings=cfg.tie_embeddings,
                     moe_experts=cfg.moe_experts, expert_ffn=cfg.expert_ffn, moe_every=cfg.moe_every,
                     moe_shared_experts=cfg.moe_shared_experts, layernorm_eps=cfg.layernorm_eps,
                     rope_theta=cfg.rope_theta, moe_top_k=cfg.moe_top_k)  # fmt: skip
    except (KeyError, TypeError, ValueError, yaml.YAMLError) as err:
        raise CheckpointError(f"{path}: the deck attribute has no usable model section ({err!r})") from None
    return model


def _model_config(model: dict[str, Any]) -> ModelConfig:
    """The ModelConfig of a stored deck's model section (keys it does not know, e.g. those
    `model_section` adds, left out)."""
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    return ModelConfig(**{k: v for k, v in model.items() if k in known})


def check_model(header: dict[str, Any], deck: Deck, path: Path, advice: Advice = RESUME) -> None:
    """The checkpoint's model shape must be the deck's; with `advice.exact_model` (app.eval) also every key
    that changes the function it computes (`function_keys`), all mismatches named with their --set fix."""
    saved = model_section(header, path)
    shown = {"ffn": "ffn_hidden", "kv": "kv_heads", "expert_ffn": "moe_ffn_hidden"}
    if advice.exact_model:
        wrong = [(key, saved.get(key), getattr(deck.model, key)) for key in (*SHAPE_KEYS, *function_keys(saved))]
        wrong = [(shown.get(key, key), have, want) for key, have, want in wrong if have != want]
        if wrong:
            said = ", ".join(f"model.{key} = {have!r} (the deck has {want!r})" for key, have, want in wrong)
            fix = " ".join(f"--set model.{key}={_yaml_scalar(have)}" for key, have, _ in wrong)
            raise CheckpointError(
                f"{path} was trained as another model than the deck's: {said}; evaluated so, its loss would be "
                f"another function's; fix: {fix} (or these keys in the deck's model section)"
            )
        return
    for key in SHAPE_KEYS:
        want = getattr(deck.model, key)
        if saved.get(key) != want:
            raise CheckpointError(
                f"{path} holds a model with model.{shown.get(key, key)} = {saved.get(key)!r}, the deck has {want!r}: "
                f"a checkpoint loads only into the same model shape (any grid); use its model keys (h5dump -a deck) or "
                f"run.resume: none"
            )


def changed_function(header: dict[str, Any], deck: Deck, path: Path) -> list[tuple[str, Any, Any]]:
    """(key, the checkpoint's value, the deck's) for each `function_keys` key the deck changes: a resume
    takes them (a larger rope_theta to extend the context is deliberate) but says so."""
    saved = model_section(header, path)
    return [(key, saved.get(key), getattr(deck.model, key)) for key in function_keys(saved)
            if saved.get(key) != getattr(deck.model, key)]  # fmt: skip


# What a resume recomputes the learning rate and the update from: the deck's, not the checkpoint's.
SCHEDULE_KEYS = ("optim.name", "optim.lr", "optim.min_lr", "optim.warmup_steps", "optim.schedule",
                 "optim.beta1", "optim.beta2", "optim.eps", "optim.weight_decay", "optim.grad_clip", "train.steps")  # fmt: skip


def changed_schedule(header: dict[str, Any], deck: Deck, path: Path) -> list[tuple[str, Any, Any]]:
    """(key, the checkpoint's value, the deck's) for each `SCHEDULE_KEYS` key the deck changes: the
    resume takes them (more train.steps extends a run, and stretches its decay) but says so. Keys a
    checkpoint's deck lacks (older files) are not compared."""
    saved = stored_deck(header, path)
    changed = []
    for key in SCHEDULE_KEYS:
        section, name = key.split(".")
        was = saved.get(section, {}).get(name) if isinstance(saved.get(section), dict) else None
        now = getattr(getattr(deck, section), name)
        if was is not None and was != now:
            changed.append((key, was, now))
    return changed


def function_keys(model: dict[str, Any]) -> tuple[str, ...]:
    """The model keys beyond the shapes (SHAPE_KEYS) that change what a checkpoint's model (`model_section`)
    computes in evaluation: the norms' epsilon, the rotary base where positions are rotary, the experts a
    token is routed to where there are experts. Not: dropout and init_std (off, unused at evaluation),
    attention_kernel (the same function, other rounding), moe_capacity_factor (evaluation routes every
    token), moe_aux_loss_coef and moe_z_loss_coef (training losses, not in the evaluated loss)."""
    rotary = model.get("arch") in archs.names() and archs.get(model["arch"]).positions == "rotary"
    return (
        "layernorm_eps",
        *(("rope_theta",) if rotary else ()),
        *(("moe_top_k",) if model.get("moe_experts") else ()),
    )


def _yaml_scalar(value: Any) -> str:
    """A value as a --set takes it (true, null, 1e-05)."""
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def require_dataset(
    path: Path, catalogue: dict[str, Any], key: str, shape: tuple[int, ...], whose: str = "the model"
) -> None:
    """Dataset `key` (group/name) must be in the file's catalogue with `shape`; CheckpointError otherwise."""
    entry = catalogue.get(key)
    if entry is None:
        raise CheckpointError(f"{path} has no dataset /{key}: not a complete checkpoint of this model")
    if entry["shape"] != tuple(shape):
        raise CheckpointError(f"{path}: dataset /{key} has shape {entry['shape']}, {whose} needs {tuple(shape)}")


def expected_datasets(header: dict[str, Any], path: Path) -> dict[str, tuple[Optional[int], ...]]:
    """Every dataset a checkpoint of its stored deck's model holds (`read_header`'s header), with its
    global shape: /model, the two moments and the fp32 masters (bf16 and fp16 runs, and files that have
    them: `masters_group`) of every parameter of the 1-rank model, as a resume on any grid requires
    them (`require_dataset`), and the RNG rows, one per rank of the grid that wrote it (None: a size
    not known in advance, a generator state's bytes). torch_cuda is expected where the file has it."""
    model = model_section(header, path)  # CheckpointError without a usable model section
    try:
        cfg = _model_config(model)
        params = cfg.spec.stage_params(cfg, range(cfg.layers), True, True)
    except (KeyError, TypeError, ValueError, ArithmeticError) as err:  # heads: 0 in a damaged older file
        raise CheckpointError(f"{path}: the deck attribute has no usable model section ({err!r})") from None
    groups = (MODEL, *((MASTER,) if masters_group(header) == MASTER else ()), *MOMENTS)
    expected: dict[str, tuple[Optional[int], ...]] = {
        f"{group}/{p.name}": tuple(p.shape) for group in groups for p in params
    }
    world = _json_attribute(header, "grid", path).get("world_size")  # a dict: `check_header`
    rows = world if _count(world) else None
    for key in ("torch_cpu", *(("torch_cuda",) if "rng/torch_cuda" in header["datasets"] else ())):
        expected[f"rng/{key}"] = (rows, None)
    return expected


def _verify(path: Path, catalogue: dict[str, Any], keys: list[str], sums: np.ndarray, fix: str) -> None:
    """The checksums summed over the ranks (`sums`, one per dataset of `keys`) against the file's;
    CheckpointError naming the damaged datasets and `fix`. A dataset without a checksum is one of the RNG
    rows of the first version-1 files (`read_header` refuses a missing one anywhere else)."""
    bad = ["/" + key for key, value in zip(keys, sums) if catalogue[key]["checksum"] not in (None, int(value))]
    if bad:
        more = (
            f" and {len(bad) - 1} more ({', '.join(bad[1:4])}{', ...' if len(bad) > 4 else ''})" if len(bad) > 1 else ""
        )
        raise CheckpointError(f"{path}: checksum mismatch in dataset {bad[0]}{more}: the file is corrupt; {fix}")


def _fill(shard: ShardState, values: torch.Tensor) -> None:
    """Set the held range of `shard` to `values` (its flat elements hold[0] .. hold[1])."""
    h0, h1 = shard.hold
    if shard.store is not None:
        shard.store(h0, values.to(shard.dtype))
    else:
        target = shard.view(h0, h1)
        target.copy_(values.to(target.device))


def load(state: TrainingState, path: Path, advice: Advice = RESUME) -> dict[str, Any]:
    """Restore `state` from checkpoint `path` (all ranks), whatever grid wrote it. Everything is
    read and verified before the model, optimizer or sampler change; returns what was loaded.
    `advice`: what its messages tell the user to do (a resume's, or app.eval's `EVAL`)."""
    from mpi4py import MPI

    rt, deck = state.runtime, state.deck
    t0 = time.perf_counter()
    phases = PhaseTimes()  # this rank's seconds per phase (the result's "phases")

    def validate() -> tuple[dict[str, Any], list[tuple[str, Any, Any]], list[tuple[str, Any, Any]]]:
        header = read_header(path, advice)
        check_model(header, deck, path, advice)
        return header, changed_function(header, deck, path), changed_schedule(header, deck, path)

    header, changed, rescheduled = on_root(rt, validate)
    phases.lap("header (rank 0 reads and checks it)")
    in_file = header["datasets"]
    shards = _shard_states(state)
    catalogue, _, _ = _catalogue(rt, shards)
    # The values of the parameters and of the masters: the masters where the file has them (never
    # a rounded fallback); fp32 checkpoints hold them in /model. A delayed update's checkpoint with
    # its update unpublished (offload_pending) gives a delayed run its parameters from /model; an
    # evaluation's optimizer (app.eval: `NoOptimizer`) has no delay, so it takes the masters (W_N).
    source = masters_group(header)
    keep_params = bool(header.get("offload_pending", 0)) and bool(state.optimizer.delay)

    def source_of(group: str) -> str:
        if group == MODEL and keep_params:
            return MODEL
        return source if group in (MODEL, MASTER) else group

    # Each dataset read once, in file order, by every state that loads from it.
    reads: dict[tuple[str, str], tuple[int, ...]] = {}
    for group, name, shape in catalogue:
        reads.setdefault((source_of(group), name), shape)
    for (group, name), shape in reads.items():  # the same checks on every rank: all raise or none does
        require_dataset(path, in_file, f"{group}/{name}", shape)
    readers: dict[tuple[str, str], list[ShardState]] = {}
    for (group, name), shard in shards.items():
        readers.setdefault((source_of(group), name), []).append(shard)

    read: dict[tuple[str, str], tuple[int, torch.Tensor]] = {}  # dataset -> (first element read, values)
    keys = [f"{group}/{name}" for group, name in reads]
    version = int(header["format_version"])
    sum_of = checksum_for(version)  # format version 1: the weak v1 sum, uint32 partials
    sums = np.zeros(len(keys), dtype=np.uint32 if version < 2 else np.uint64)  # MPI SUM wraps as the sum does
    rng_keys = [f"rng/{key}" for key in header["rng"]]
    # The row of this rank's generator: the saved rank of our coordinates; by world rank in older files
    # (found in review: read by grid position, a file of a round-robin placement went to other coordinates).
    rng_row = state.grid.rank if header.get("rng_rows") == "grid" else rt.rank
    if "torch_cpu" not in header["rng"] or not same_streams(json.loads(header["grid"]), grid_signature(state)):
        rng_keys = []  # another grid: its RNG states are not this one's
    posix = deck.checkpoint.io == "posix" and all(in_file[key]["storage"] is not None for key in keys + rng_keys)
    phases.lap("catalogue")

    def span(group: str, name: str) -> tuple[int, int]:
        """The local elements [lo, hi) this rank reads of a dataset: one read of the span every
        state loading from it holds (the parameters: the whole shard)."""
        held = [s.hold for s in readers.get((group, name), []) if s.hold[0] < s.hold[1]]
        return (min(h[0] for h in held), max(h[1] for h in held)) if held else (0, 0)

    spans = {key: span(*key) for key in reads}

    def alike(key: tuple[str, str]) -> Optional[tuple]:
        """What this rank reads of a dataset, equal on two ranks exactly when they read the same
        elements (`_boxes` of the first reader's shard), None for nothing."""
        lo, hi = spans[key]
        first = readers[key][0] if lo < hi else None
        return None if first is None else (lo, hi, tuple(first.shape), tuple(first.offset))

    # The ranks reading the same span of a dataset (the dp replicas of a parameter shard; of the
    # optimizer state too without ZeRO) read a piece each and all-gather the rest (shared_reads).
    shares = plan_shares(rt.comm, {key: alike(key) for key in reads}, [k for k in reads if k[0] in (MODEL, MASTER)])

    own_bytes: dict[tuple[str, str], int] = {}  # what this rank reads of each dataset itself

    def fetch(key: tuple[str, str], read_slab: Callable[..., np.ndarray]) -> np.ndarray:
        """The span of a dataset this rank reads, all of it, or only its piece of a shared one."""
        lo, hi = spans[key]
        dtype = np.dtype(in_file[f"{key[0]}/{key[1]}"]["stored"])
        mine = readers.get(key, [])
        boxes_of = lambda a, b: _boxes(mine[0], lo + a, lo + b) if mine else []  # noqa: E731
        values, own_bytes[key] = read_span(read_slab, f"{key[0]}/{key[1]}", shares, key, hi - lo, boxes_of, dtype)
        return values

    def read_all(read_slab: Callable[..., np.ndarray]) -> Optional[dict[str, np.ndarray]]:
        """Every dataset this rank needs, through `read_slab(key, boxes, stored dtype[, out])`: the
        held ranges into `read`, the shares it would write checksummed into `sums`; the RNG rows.
        A read that fails is raised after the last dataset: until then this rank still takes its
        part in the shared reads' all-gathers, which its peers would otherwise wait in forever."""
        nonlocal sums
        failed: Optional[BaseException] = None
        for k, ((group, name), shape) in enumerate(reads.items()):
            key = f"{group}/{name}"
            mine = readers.get((group, name), [])
            lo, hi = spans[(group, name)]
            if ahead is None:
                take = functools.partial(fetch, (group, name), read_slab)
            else:  # the reader thread's read; its future lets go of it
                take, ahead[k] = ahead[k].result, None
            raw, error = gathered(
                shares, rt, (group, name), take, hi - lo, np.dtype(in_file[key]["stored"]),
                phases, "H5Dread" if not posix else "data (pread)",
            )  # fmt: skip
            failed = failed or error
            try:  # a failure here too waits for the loop's end: the next dataset's gathers need this rank
                writer = next((s for s in mine if s.writes), None)
                if writer is not None:  # verify the share this rank would write (they tile the dataset)
                    s0, s1 = writer.write
                    sums[k] = sum_of(raw[s0 - lo : s1 - lo], _boxes(writer, s0, s1), shape)
                    phases.lap("checksums")
                if mine:
                    read[(group, name)] = (lo, decode(raw, in_file[key]["dtype"]))
                    phases.lap("decode")
            except Exception as err:
                failed = failed or undecodable(path, key, err, advice.checksums)
        rng = {}
        for key in rng_keys:
            box = [((rng_row, 0), (1, in_file[key]["shape"][1]))]
            try:
                row = read_slab(key, box, np.dtype(np.uint8))
            except Exception as err:  # raised below, a bug too (as in `gathered`): the next row's read may be
                failed = failed or err  # collective (MPI-IO), and this rank must join it
                continue
            rng[key.removeprefix("rng/")] = row
            sums = np.append(sums, sum_of(row, box, in_file[key]["shape"]))
        if failed is not None:
            raise failed
        if not rng_keys:
            return None
        keys.extend(rng_keys)
        return rng

    ahead: Optional[list[Any]] = None  # the reader thread's reads, in `reads` order

    def read_ahead(fd: int) -> Optional[dict[str, np.ndarray]]:
        """A reader thread preads the datasets in order (the GIL is released in the reads) while
        this one verifies and decodes those already read: the disk never waits for the CPU."""
        nonlocal ahead
        pread = lambda key, boxes, dtype, out=None: pread_boxes(fd, in_file[key]["storage"], boxes, dtype, out)  # noqa: E731
        with ThreadPoolExecutor(1, thread_name_prefix="checkpoint-read") as pool:
            ahead = [pool.submit(fetch, key, pread) for key in reads]
            try:
                return read_all(pread)
            finally:
                for future in ahead:  # those not taken yet, after an error
                    if future is not None:
                        future.cancel()

    try:
        if posix:  # each rank preads its ranges where the file keeps them (slabs.storage_of)
            rng = read_posix(rt, path, read_ahead, advice.damaged)
        else:

            def read_file(f: Any) -> Optional[dict[str, np.ndarray]]:
                phases.lap("H5Fopen")
                return read_all(h5_reader(f, transfer_plist(deck.checkpoint.io == "collective")))

            rng = read_mpio(rt, path, read_file, advice.damaged)
    finally:
        shares.free()
    phases.lap("rng rows, H5Fclose")
    rt.comm.Allreduce(MPI.IN_PLACE, sums, op=MPI.SUM)
    _verify(path, in_file, keys, sums, advice.checksums)
    phases.lap("checksums summed and verified (MPI_Allreduce)")
    note = V1_NOTE if version < 2 else None
    if note is not None:
        rt.log(f"gridlm: {path}: {note}")

    with torch.no_grad():  # every state from what was read and verified
        for key, states in readers.items():
            lo, values = read[key]
            for shard in states:
                h0, h1 = shard.hold
                if h0 < h1:
                    _fill(shard, values[h0 - lo : h1 - lo])
        phases.lap("into the model and optimizer")
        state.optimizer.restored(unpublished=keep_params)
        phases.lap("optimizer restored (masters, gathers)")
    scaler = json.loads(header["loss_scaler"])
    if state.scaler is not None and scaler is not None:
        state.scaler.load_state_dict(scaler)
    state.sampler.load_state_dict(json.loads(header["sampler"]))
    state.optimizer.steps = int(header["optimizer_steps"])
    state.steps_done = int(header["step"])
    if rng is not None:
        torch.set_rng_state(torch.from_numpy(rng["torch_cpu"].copy()))
        if "torch_cuda" in rng and rt.device.type == "cuda":
            torch.cuda.set_rng_state(torch.from_numpy(rng["torch_cuda"].copy()), rt.device)
    saved_grid = json.loads(header["grid"])
    return {
        "path": str(path),
        "step": state.steps_done,
        "grid": saved_grid,
        "resharded": saved_grid != grid_signature(state),
        "rng_restored": rng is not None,
        "precision": header["precision"],
        "nonfinite_events": int(header.get("nonfinite_events", 0)),  # missing in older files
        "nonfinite_in_a_row": int(header.get("nonfinite_in_a_row", 0)),
        "seconds": time.perf_counter() - t0,
        "phases": phases.seconds,
        "read_bytes": sum(own_bytes.values()),  # this rank's tensor bytes read from the file (not the RNG rows)
        "shared_datasets": len(shares.shared),  # read in pieces and all-gathered with the ranks reading alike
        "note": note,  # V1_NOTE for a format-version-1 file, else None
        "changed_function": changed,  # (model key, the checkpoint's, the deck's) that the resume takes
        "changed_schedule": rescheduled,  # (optim or train.steps key, the checkpoint's, the deck's), taken too
    }


def read_span(
    read_slab: Callable[..., np.ndarray],
    key: str,
    shares: SharedReads,
    span: Any,
    n: int,
    boxes_of: Callable[[int, int], list],
    dtype: np.dtype,
) -> tuple[np.ndarray, int]:
    """The `n` elements of dataset `key` this rank needs (`boxes_of(a, b)`: the boxes of elements
    [a, b) of them), read here, or of a span shared as `span` only this rank's piece (the rest is
    left for `shares.gather`); and the bytes read here."""
    a, b = shares.piece(span, n, dtype.itemsize)
    if (a, b) == (0, n):
        return read_slab(key, boxes_of(0, n), dtype), n * dtype.itemsize
    values = np.empty(n, dtype=dtype)
    read_slab(key, boxes_of(a, b), dtype, values[a:b])
    return values, (b - a) * dtype.itemsize


def gathered(
    shares: SharedReads,
    rt: Runtime,
    span: Any,
    take: Callable[[], np.ndarray],
    n: int,
    dtype: np.dtype,
    phases: Optional[PhaseTimes] = None,
    read_phase: str = "",
) -> tuple[np.ndarray, Optional[BaseException]]:
    """A dataset's `n` elements once this rank's read (`take()`) is done and, for a span shared as
    `span`, the other members' pieces are all-gathered into it. A read that failed (an I/O error,
    and a bug too: its peers must not wait in the all-gather for the watchdog) is returned, not
    raised, with zeros in its place: this rank still joins the all-gathers its peers wait in, and
    raises after its last dataset (`agree_read`). `phases`: lap the read as `read_phase`, then the
    all-gather."""
    error = None
    try:
        raw = take()
    except Exception as err:
        raw, error = np.zeros(n, dtype=dtype), err
    if phases is not None:
        phases.lap(read_phase)
    if span in shares.shared:
        with rt.watchdog.blocking("MPI_Allgatherv (checkpoint pieces)", axis="dp"):
            shares.gather(span, raw)
        if phases is not None:
            phases.lap("pieces all-gathered (MPI_Allgatherv)")
    return raw, error


def undecodable(path: Path, key: str, err: Exception, fix: str) -> Exception:
    """A dataset whose values this rank read but could not checksum or decode: a CheckpointError naming
    it for what a damaged file raises there (ValueError, KeyError, TypeError: values of another type
    than its metadata says), `err` itself, a bug, for anything else. Raised once the reads are done."""
    if isinstance(err, (ValueError, KeyError, TypeError)):
        return CheckpointError(
            f"{path}: dataset /{key} cannot be verified or decoded ({err}): the file is corrupt; {fix}"
        )
    return err


def h5_reader(f: Any, dxpl: Any) -> Callable[..., np.ndarray]:
    """`read_slab(key, boxes, dtype[, out])` through parallel HDF5 (H5Dread of the boxes of `key` in
    the open file `f`), for a dataset HDF5 must decode."""

    def read(key: str, boxes: list, dtype: np.dtype, out: Optional[np.ndarray] = None) -> np.ndarray:
        values = read_boxes(f[key].id, boxes, dtype, dxpl)
        if out is None:
            return values
        out[...] = values
        return out

    return read


def agree_read(rt: Runtime, path: Path, error: Optional[BaseException], op: str, fix: str = CORRUPT) -> None:
    """Agree on a read of `path` that may have failed on some ranks (`error`: this rank's): an I/O
    error on any rank (a truncated file, EIO) is a CheckpointError naming it on every rank, before any
    rank goes on to a collective call alone; another exception is a bug, raised with its traceback
    on its rank (after the agreement, so that its peers end too) and named as an internal error on
    the others, without the advice for a damaged file (as `stages.abandon` names a save's bug). A
    GridlmError (a dataset `undecodable`) names the file and what to do: every rank raises its line."""
    problem: Optional[tuple[str, str]] = None  # (what happened, "io", "bug" or "said": a GridlmError's own line)
    if error is not None:
        if isinstance(error, GridlmError):  # names the file, what is wrong and what to do
            problem = (str(error), "said")
        elif isinstance(error, OSError):
            code = getattr(error, "errno", None)
            problem = (f"{describe_failure(getattr(error, 'strerror', None) or str(error), code)} ({error})", "io")
        else:
            problem = (f"{type(error).__name__}: {error}", "bug")
    failed = failures(rt, problem, op)  # agreed first: no rank goes on to the next collective call alone
    if problem is not None and problem[1] == "bug":
        raise error  # type: ignore[misc]
    if failed:
        rank, (text, kind) = failed[0]
        if kind == "bug":
            raise CheckpointError(
                f"cannot read checkpoint {path}: internal error on rank {rank}: {text} (a bug in gridlm, not a "
                f"fault of the file: rank {rank} prints its traceback)"
            )
        if kind == "said":  # the same line on every rank
            raise CheckpointError(text)
        raise CheckpointError(f"cannot read checkpoint {path} on rank {rank}: {text}; {fix}")


def read_posix(rt: Runtime, path: Path, read: Callable[[int], T], fix: str = CORRUPT) -> T:
    """`read(fd)` on a read-only descriptor of `path` (every rank), then `agree_read`. The open is
    agreed before any rank reads: `read` may make collective calls (the shared reads' all-gathers)
    that a rank which could not open the file would never join."""
    fd, result, error = None, None, None
    try:
        try:
            fd = os.open(path, os.O_RDONLY)
        except Exception as err:
            error = err
        agree_read(rt, path, error, "MPI_Allreduce (file opened)", fix)
        try:
            result = read(fd)  # type: ignore[arg-type]
        except Exception as err:
            error = err
    finally:
        if fd is not None:
            os.close(fd)
    agree_read(rt, path, error, "MPI_Allreduce (reads agreed)", fix)
    return result  # type: ignore[return-value]


def read_mpio(rt: Runtime, path: Path, read: Callable[[Any], T], fix: str = CORRUPT) -> T:
    """`read(f)` on `path` opened through parallel HDF5 (every rank), then `agree_read`: a rank whose
    H5Dread failed raises only after the file's collective close, and with every other rank, instead
    of leaving them in the checksums' MPI_Allreduce."""
    result, error = None, None
    with open_mpio(path, "r", rt.comm) as f:
        try:
            result = read(f)
        except Exception as err:
            error = err
    agree_read(rt, path, error, "MPI_Allreduce (reads agreed)", fix)
    return result  # type: ignore[return-value]


def masters_group(header: dict[str, Any]) -> str:
    """Where a checkpoint's fp32 masters are (`read_header`'s): /optimizer/master in bf16/fp16 runs
    and delayed updates' (never a rounded fallback: a missing one is an error), else /model (fp32
    runs: the parameters are them)."""
    apart = any(key.startswith(f"{MASTER}/") for key in header["datasets"])
    return MASTER if header["precision"] != "fp32" or apart else MODEL


def read_parameters(path: Path, model: torch.nn.Module, runtime: Runtime, tp_rank: int, dp_rank: int) -> dict[str, Any]:
    """Fill `model`'s parameters (each tagged with its `ParamMeta`: global shape, shard offset)
    from checkpoint `path`, for inference on this grid: the fp32 masters when the file has them,
    else /model, each rank reading its own shards (the dp replicas of a shard in shared pieces,
    `shared_reads`; preads, or parallel HDF5 for a dataset it must decode). Every element is
    verified against its dataset's checksum (summed over the ranks whose copy counts, as `load`
    does) before any parameter changes. Returns the header."""
    from mpi4py import MPI

    header = on_root(runtime, lambda: read_header(path))
    in_file = header["datasets"]
    source = masters_group(header)
    params = list(model.named_parameters())
    for name, p in params:  # the same checks on every rank: all raise or none does
        require_dataset(path, in_file, f"{source}/{name}", p.meta.global_shape)  # type: ignore[attr-defined]
    version = int(header["format_version"])
    sum_of = checksum_for(version)
    sums = np.zeros(len(params), dtype=np.uint32 if version < 2 else np.uint64)
    values: list[torch.Tensor] = []
    keys = [f"{source}/{name}" for name, _ in params]
    # The dp replicas read a piece of each shard and all-gather the rest, as `load` does.
    shard_of = {key: (tuple(p.meta.local_shape), tuple(p.meta.local_offset)) for key, (_, p) in zip(keys, params)}  # type: ignore[attr-defined]
    shares = plan_shares(runtime.comm, shard_of, keys)

    def read_all(read_slab: Callable[..., np.ndarray]) -> None:
        failed: Optional[BaseException] = None  # raised after the last all-gather, as in `load`
        for k, (key, (_, p)) in enumerate(zip(keys, params)):
            meta = p.meta  # type: ignore[attr-defined]
            dtype = np.dtype(in_file[key]["stored"])
            boxes_of = lambda a, b, meta=meta: global_boxes(meta.local_shape, meta.local_offset, a, b)  # noqa: E731
            # Called within this iteration (by `gathered`), so the loop variables are this dataset's.
            take = lambda: read_span(read_slab, key, shares, key, meta.numel, boxes_of, dtype)[0]  # noqa: E731,B023
            raw, error = gathered(shares, runtime, key, take, meta.numel, dtype)
            failed = failed or error
            try:  # as in `load`: raised after the last all-gather
                if dp_rank == 0 and meta.owned_by(tp_rank):  # the copies that count cover each element once
                    sums[k] = sum_of(raw, boxes_of(0, meta.numel), meta.global_shape)
                values.append(decode(raw, in_file[key]["dtype"]).view(meta.local_shape))
            except Exception as err:
                failed = failed or undecodable(path, key, err, TOOL.checksums)
        if failed is not None:
            raise failed

    try:
        if all(in_file[key]["storage"] is not None for key in keys):
            read_posix(
                runtime,
                path,
                lambda fd: read_all(
                    lambda key, boxes, dtype, out=None: pread_boxes(fd, in_file[key]["storage"], boxes, dtype, out)
                ),
                TOOL.damaged,
            )
        else:  # a dataset HDF5 must decode (compressed, say): parallel HDF5, each rank its own shards
            read_mpio(runtime, path, lambda f: read_all(h5_reader(f, transfer_plist(False))), TOOL.damaged)
    finally:
        shares.free()
    with runtime.watchdog.blocking("MPI_Allreduce (checksums)", axis="world"):
        runtime.comm.Allreduce(MPI.IN_PLACE, sums, op=MPI.SUM)
    _verify(path, in_file, keys, sums, TOOL.checksums)
    with torch.no_grad():
        for (_, p), v in zip(params, values):
            p.copy_(v.to(p.device, p.dtype))
    return header


def initialise(state: TrainingState, tensor: Callable[[str], np.ndarray]) -> None:
    """Set `state`'s parameters and any fp32 masters to the whole (global) fp32 tensors `tensor(name)`
    gives (`run.init_from`), each rank the part it holds; the optimizer's moments stay as built
    (fresh). Each tensor is asked for once per rank, and only by ranks that hold some of it."""
    local: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for (group, name), shard in _shard_states(state).items():
            h0, h1 = shard.hold
            if group not in (MODEL, MASTER) or h0 >= h1:
                continue
            if name not in local:
                whole = tensor(name)
                assert whole.shape == shard.global_shape, (name, whole.shape, shard.global_shape)
                box = tuple(slice(o, o + n) for o, n in zip(shard.offset, shard.shape))
                local[name] = torch.from_numpy(np.ascontiguousarray(whole[box], dtype=np.float32)).reshape(-1)
            _fill(shard, local[name][h0:h1])
        state.optimizer.restored()

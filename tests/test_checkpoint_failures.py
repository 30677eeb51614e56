"""A checkpoint save that fails ends cleanly: on every rank together, with one line naming the
file, the cause and the free space; no .tmp left; the previous checkpoint stays `latest` and
loads. Serial: retention keeps the last checkpoint before a non-finite event, causes in
words, the size estimate. MPI (>= 2 ranks; rank 0 mounts a small tmpfs, so root): a disk too
full for the pre-check, a disk that fills up mid-write (20 times, at different points; none
may hang; and under a background write, checkpoint.async), a read-only file system, a NaN /
Inf in the state, checkpoint.on_error: continue."""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from functools import partial
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

import app.checkpoint.io as checkpoint_io
from app.checkpoint.io import load, save
from app.checkpoint.store import committed, describe_failure, format_bytes, read_latest, retain, step_file
from app.errors import CheckpointError, NonFiniteError
from app.shards import EXP_AVG_SQ, MODEL
from conftest import grid_trainer, train_steps

SMALL = (
    "model.vocab_size=64", "model.seq_len=16", "model.layers=4", "model.hidden=32", "model.heads=4",
    "train.steps=8", "train.global_batch=16", "train.micro_batch=2", "optim.lr=3.0e-3", "optim.warmup_steps=2",
    "run.log_every=100", "parallel.dp_bucket_mb=0.02", "run.resume=none", "checkpoint.at_exit=false",
)  # fmt: skip
GRIDS = {2: (1, 2, 1), 4: (2, 1, 2)}  # tp, pp, dp: pp at 2 ranks, tp and dp at 4
TMPFS_KIB = 8192  # a checkpoint of SMALL is ~0.7 MB; the pre-check asks for ~1.6 MB free
# Fewer, larger tensors (5 MB of data, 0.4 MB of metadata) for failures at many points of a write.
WIDE = ("model.vocab_size=256", "model.hidden=128", "model.layers=2")


# ---- serial: retention, causes, sizes ----------------------------------------------------


def _fake(directory: Path, step: int, events: int | None, in_a_row: int = 0, created: str | None = None) -> Path:
    path = step_file(directory, step)
    with h5py.File(path, "w") as f:
        f.attrs["committed"] = True
        if created is not None:
            f.attrs["created"] = created
        if events is not None:
            f.attrs["nonfinite_events"] = events
            f.attrs["nonfinite_in_a_row"] = in_a_row
    (directory / "latest").write_text(path.name + "\n")
    return path


def test_retention_keeps_the_last_checkpoints_written_before_nonfinite_steps(tmp_path):
    # 10, 20 clean; a streak of skipped steps from 30 on (each checkpoint written inside it).
    for step, events, in_a_row in ((10, None, 0), (20, 0, 0), (30, 1, 1), (40, 2, 2), (50, 3, 3)):
        _fake(tmp_path, step, events, in_a_row)
    deleted = retain(tmp_path, keep=1)
    assert sorted(p.name for p in deleted) == ["step_0000010.h5", "step_0000030.h5", "step_0000040.h5"]
    assert [s for s, _ in committed(tmp_path)] == [20, 50]  # 20: the last before the first problem
    # Training recovers (60, 70 after updates), then a second streak begins at 80.
    for step, events, in_a_row in ((60, 3, 0), (70, 3, 0), (80, 4, 1), (90, 5, 2)):
        _fake(tmp_path, step, events, in_a_row)
        retain(tmp_path, keep=1)
    assert [s for s, _ in committed(tmp_path)] == [20, 70, 90]  # 70: the last before this streak
    # Recovered again: only the newest and the last before the run's first problem stay.
    _fake(tmp_path, 100, 5, 0)
    retain(tmp_path, keep=1)
    assert [s for s, _ in committed(tmp_path)] == [20, 100]
    # Files without the attributes (older gridlm) count as clean: plain keep-the-newest.
    other = tmp_path / "old"
    other.mkdir()
    for step in (1, 2, 3):
        _fake(other, step, None)
    retain(other, keep=1)
    assert [s for s, _ in committed(other)] == [3]


def test_retention_keeps_the_checkpoints_written_last_not_the_highest_steps(tmp_path):
    """Found in review (2026-11-30): an earlier run left steps 400 and 500 in the directory (a new run
    with run.resume: none, or one resumed from an older file, writes beside them); the new run writes
    100 (clean), then a NaN is skipped and it writes 200 and 300. With keep = 2 retention ranked by
    step: it took the stale 500 for the newest, deleted 100 (the last checkpoint before the problem,
    which must stay) and then 200, keeping one of the run's own files. Ranked by when each was
    written (the header's `created`), the run keeps 200 and 300, and 100 as the last before its
    problem; the earlier run's files are the older ones and go."""
    for step, day in ((400, 1), (500, 2)):
        _fake(tmp_path, step, 0, 0, created=f"2026-11-{day:02d}T10:00:00+0000")
    for step, events, minute in ((100, 0, 10), (200, 1, 20), (300, 1, 30)):
        _fake(tmp_path, step, events, 0, created=f"2026-11-30T10:{minute:02d}:00+0000")
        retain(tmp_path, keep=2)
    assert [s for s, _ in committed(tmp_path)] == [100, 200, 300]
    # The same second (a tiny run): the step decides, as before.
    same = tmp_path / "same"
    same.mkdir()
    for step in (3, 1, 2):
        _fake(same, step, 0, 0, created="2026-11-30T10:00:00+0000")
    retain(same, keep=1)
    assert [s for s, _ in committed(same)] == [2, 3]  # 3 the newest; 2 is what `latest` names


def test_io_errors_are_named_from_errno_or_from_the_mpi_and_hdf5_texts():
    assert describe_failure("whatever", errno.ENOSPC) == "no space left on device (ENOSPC)"
    assert describe_failure("MPI_ERR_NO_SPACE: not enough space") == "no space left on device (ENOSPC)"
    assert describe_failure("file write failed: errno = 28, error message = 'No space left on device'").startswith(
        "no space left"
    )
    assert describe_failure("MPI_ERR_READ_ONLY: read-only file system").startswith("read-only file system (EROFS)")
    assert describe_failure("[Errno 13] Permission denied: '/x'").startswith("permission denied (EACCES)")
    assert describe_failure("x", errno.EDQUOT) == "disk quota exceeded (EDQUOT)"
    assert describe_failure("x", errno.EIO) == "I/O error (EIO)"
    # OpenMPI says "input/output error" for every MPI_ERR_IO: not a cause by itself.
    generic = "Can't write data (MPI_File_write_at failed: MPI error string is 'MPI_ERR_IO: input/output error')"
    assert describe_failure(generic).startswith("I/O error (MPI_ERR_IO")
    assert [format_bytes(n) for n in (1.5e12, 2.345e9, 45.67e6, 789e3, 12)] == [
        "1.50 TB", "2.35 GB", "45.7 MB", "789 kB", "0 kB",
    ]  # fmt: skip


def test_nonfinite_values_are_found_in_float32_bf16_and_fp16_bit_patterns():
    values = np.arange(10, dtype=np.float32)
    assert checkpoint_io.count_nonfinite(values, "float32") == 0
    values[[2, 7]] = [np.nan, -np.inf]
    assert checkpoint_io.count_nonfinite(values, "float32") == 2
    bf16 = torch.tensor([1.0, float("inf"), -2.0, float("nan"), 3.0e38]).to(torch.bfloat16)
    bits = bf16.view(torch.int16).numpy().view(np.uint16)
    assert checkpoint_io.count_nonfinite(bits, "bfloat16") == 2
    assert checkpoint_io.count_nonfinite(np.array([1, np.inf, 65504], dtype=np.float16), "float16") == 1


# ---- MPI: real saves that fail -----------------------------------------------------------


def _trainer(grids, run_dir: Path, *extra: str):
    return grid_trainer(grids, *GRIDS[grids.world.world_size], (*SMALL, f"run.dir={run_dir}", *extra))


def _all_ranks_ok(runtime, problems: list[str]) -> None:
    """Assert on every rank after every rank got here (no rank left in a collective)."""
    problems = sum(runtime.comm.allgather(problems), [])
    assert not problems, "\n".join(problems)


def _raises_everywhere(runtime, kind: type, fn, *words: str) -> str:
    """`fn()` raises `kind` on every rank, with one line holding every word; returns rank 0's."""
    try:
        fn()
        message, problem = "", f"rank {runtime.rank}: no {kind.__name__}"
    except kind as err:
        message = str(err)
        missing = [w for w in words if w not in message]
        problem = f"rank {runtime.rank}: {missing} not in {message!r}" if missing or "\n" in message else None
    messages = runtime.comm.allgather(message)
    problems = [p for p in runtime.comm.allgather(problem) if p]
    if len(set(messages)) > 1:
        problems.append(f"the ranks' messages differ: {messages}")
    assert not problems, "\n".join(problems)
    return messages[0]


def _mount(runtime, path: Path, options: str) -> None:
    """Rank 0 runs mount; every rank skips when it cannot (not root, no mount in this container)."""
    why = None
    if runtime.rank == 0:
        if os.geteuid() != 0:
            why = "mounting a tmpfs needs root"
        else:
            path.mkdir(parents=True, exist_ok=True)
            done = subprocess.run(["mount", *options.split(), str(path)], capture_output=True, text=True)
            why = None if done.returncode == 0 else f"mount {options} failed: {done.stderr.strip()}"
    why = runtime.comm.bcast(why, root=0)
    if why:
        pytest.skip(why)


@contextmanager
def tmpfs(runtime, path: Path, kib: int = TMPFS_KIB) -> Iterator[Path]:
    """A `kib`-KiB tmpfs at `path` (same path on every rank: they share this machine)."""
    _mount(runtime, path, f"-t tmpfs -o size={kib}k tmpfs")
    try:
        yield path
    finally:
        runtime.comm.Barrier()
        if runtime.rank == 0 and subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], check=True)


def fill(directory: Path, leave: int) -> None:
    """Rank 0: a filler file that leaves `leave` bytes free (tmpfs counts 4 KiB pages)."""
    filler = directory / "filler"
    filler.unlink(missing_ok=True)
    size = os.statvfs(directory).f_bavail * os.statvfs(directory).f_frsize - leave
    if size > 0:
        fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
        try:
            os.posix_fallocate(fd, 0, size)
        finally:
            os.close(fd)


def _clean(runtime, directory: Path, latest: Path) -> list[str]:
    """What a failed save must leave: no .tmp, `latest` unchanged (rank 0 looks; all get it)."""
    problems = []
    if runtime.rank == 0:
        left = sorted(p.name for p in directory.glob("*.tmp*"))
        if left:
            problems.append(f"left behind: {left}")
        if read_latest(directory) != latest:
            problems.append(f"latest is {read_latest(directory)}, not {latest}")
    return runtime.comm.bcast(problems, root=0)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_a_disk_too_full_is_refused_before_writing_and_the_previous_checkpoint_resumes(runtime, grids, shared_tmp):
    with tmpfs(runtime, shared_tmp / "disk") as disk:
        trainer = _trainer(grids, shared_tmp / "run", f"checkpoint.dir={disk}")
        train_steps(trainer, 2)
        good = trainer.save("test").path
        state = trainer.dp.param_buffer.clone()
        train_steps(trainer, 1)
        if runtime.rank == 0:
            fill(disk, 512 * 1024)
        runtime.comm.Barrier()
        message = _raises_everywhere(
            runtime, CheckpointError, lambda: trainer.save("test"),
            "no space left on device (ENOSPC)", str(step_file(disk, 3)), "free on", str(disk), "stays latest",
        )  # fmt: skip
        assert "needs" in message and "524 kB free" in message, message
        problems = _clean(runtime, disk, good)
        fresh = _trainer(grids, shared_tmp / "fresh", f"checkpoint.dir={disk}", "run.resume=auto")
        if fresh.resume()["step"] != 2 or not torch.equal(fresh.dp.param_buffer, state):
            problems.append(f"rank {runtime.rank}: resumed state differs")
        _all_ranks_ok(runtime, problems)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(240)
def test_a_disk_that_fills_up_mid_write_ends_every_rank_cleanly_twenty_times(runtime, grids, shared_tmp, monkeypatch):
    """The filler grows after the pre-check, leaving 0 to 90% of a checkpoint: the writes fail
    on some ranks only, at different datasets, in the flush or the close. Without the
    reservation (independent I/O) the ranks must still agree and leave together; with it
    (both I/O modes) the fallocate itself is refused. A hang fails through the timeout."""
    with tmpfs(runtime, shared_tmp / "disk", 4 * TMPFS_KIB) as disk:
        trainer = _trainer(grids, shared_tmp / "run", f"checkpoint.dir={disk}", *WIDE)
        train_steps(trainer, 1)
        saved = trainer.save("test")
        # Its tensor bytes: the alignment gaps between datasets (and chunks) need no disk space
        # unless reserved, so a share of the file's size may leave room for all the data.
        good, size = saved.path, saved.bytes
        train_steps(trainer, 1)
        problems: list[str] = []
        for attempt in range(20):
            leave = attempt * int(0.9 * size) // 19
            reserve_space = attempt % 5 == 4
            if reserve_space and attempt % 10 == 9:  # collective I/O: safe only behind the reservation
                deck = trainer.deck
                monkeypatch.setattr(
                    trainer, "deck", replace(deck, checkpoint=replace(deck.checkpoint, io="collective"))
                )
            message = _raises_everywhere(
                runtime, CheckpointError,
                partial(save, trainer, disk, before_write=partial(fill, disk, leave), reserve_space=reserve_space),
                "no space left on device", str(step_file(disk, 2)) + ".tmp", "free on", "stays latest",
            )  # fmt: skip
            monkeypatch.undo()
            if runtime.rank == 0:
                (disk / "filler").unlink()
            if reserve_space and "while reserving" not in message:
                problems.append(f"attempt {attempt}: not refused by the reservation: {message}")
            problems += [f"attempt {attempt} (leave {leave} B): {p}" for p in _clean(runtime, disk, good)]
            if runtime.rank == 0 and attempt in (0, 7, 14):
                print(f"attempt {attempt}: {message}")
        assert load(_trainer(grids, shared_tmp / "fresh", *WIDE), good)["step"] == 1
        assert save(trainer, disk).path == step_file(disk, 2)  # with room again, the next save commits
        _all_ranks_ok(runtime, problems)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_an_io_error_behind_a_whole_reservation_is_not_called_a_full_disk(runtime, grids, shared_tmp, monkeypatch):
    """Found in review (2026-11-30): a failed save whose free space was below the size estimate's slack
    (`needed`, an upper bound, minus the blocks the .tmp held) was called ENOSPC, "disk full", whatever
    the error was. Here the whole file is reserved, then another writer fills the disk to 16 KiB free
    while rank 1 meets EIO in its pwrites: a reserved file cannot run out of space, so the message
    names the EIO."""
    with tmpfs(runtime, shared_tmp / "disk") as disk:
        trainer = _trainer(grids, shared_tmp / "run", f"checkpoint.dir={disk}")
        train_steps(trainer, 1)
        good = trainer.save("test").path
        train_steps(trainer, 1)
        if runtime.rank == 1:

            def eio(*args):
                fill(disk, 16 * 1024)  # another job's file, grown under this write
                raise OSError(errno.EIO, "Input/output error")

            monkeypatch.setattr(checkpoint_io, "pwrite_boxes", eio)
        message = _raises_everywhere(
            runtime, CheckpointError, partial(save, trainer, disk), "I/O error (EIO)", "on rank 1", "stays latest"
        )
        assert "ENOSPC" not in message and "disk full" not in message, message
        _all_ranks_ok(runtime, _clean(runtime, disk, good))


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(180)
def test_a_background_write_that_fails_is_agreed_and_named_when_waited_for(runtime, grids, shared_tmp):
    """checkpoint.async: the disk fills up under the writer thread after its free-space check (no
    reservation: the MPI-IO writes themselves fail, on some ranks) while the step loop trains on.
    Waiting for the write raises the synchronous save's error on every rank; `latest` stays on
    the previous checkpoint, no .tmp is left, and the next background save commits."""
    with tmpfs(runtime, shared_tmp / "disk", 4 * TMPFS_KIB) as disk:
        trainer = _trainer(grids, shared_tmp / "run", f"checkpoint.dir={disk}", "checkpoint.async=true", *WIDE)
        assert trainer.writer is not None
        train_steps(trainer, 1)
        trainer.save("test")
        good = trainer.finish_save().path
        size = runtime.comm.bcast(good.stat().st_size if runtime.rank == 0 else 0, root=0)
        problems: list[str] = []
        for leave in (0, size // 3, 2 * size // 3):
            train_steps(trainer, 1)
            step = trainer.steps_done
            trainer.writer.start(trainer, disk, "test", before_write=partial(fill, disk, leave), reserve_space=False)
            train_steps(trainer, 1)  # training goes on while the write fails
            message = _raises_everywhere(
                runtime, CheckpointError, trainer.finish_save,
                "no space left on device", str(step_file(disk, step)) + ".tmp", "free on", "stays latest",
            )  # fmt: skip
            if runtime.rank == 0:
                (disk / "filler").unlink()
                print(f"leave {leave} B: {message}")
            problems += [f"leave {leave} B: {p}" for p in _clean(runtime, disk, good)]
        assert [c["step"] for c in trainer.checkpoints] == [1]  # the failures are not recorded
        trainer.save("test")
        assert trainer.finish_save().path == step_file(disk, trainer.steps_done) == read_latest(disk)
        _all_ranks_ok(runtime, problems)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_a_read_only_file_system_is_named(runtime, grids, shared_tmp):
    with tmpfs(runtime, shared_tmp / "disk") as disk:
        trainer = _trainer(grids, shared_tmp / "run", f"checkpoint.dir={disk}")
        good = trainer.save("test").path
        train_steps(trainer, 1)
        _mount(runtime, disk, "-o remount,ro")
        _raises_everywhere(
            runtime, CheckpointError, lambda: trainer.save("test"),
            "read-only file system (EROFS)", str(step_file(disk, 1)), "stays latest",
        )  # fmt: skip
        problems = _clean(runtime, disk, good)
        _mount(runtime, disk, "-o remount,rw")
        _all_ranks_ok(runtime, problems)


# The victim: the last rank (it checks while rank 0 makes the file), or rank 0 (it checks beside its
# fsync, after its pwrites: checkpoint.io posix).
CASES = {"fp32-nan-param": ((), MODEL, float("nan"), -1), "bf16-inf-moment": (("train.precision=bf16",), EXP_AVG_SQ, float("inf"), -1),
         "fp32-nan-param-on-rank-0": ((), MODEL, float("nan"), 0)}  # fmt: skip


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("extra,kind,bad,where", CASES.values(), ids=CASES.keys())
def test_a_nonfinite_value_on_one_rank_is_never_committed(runtime, grids, shared_tmp, extra, kind, bad, where):
    trainer = _trainer(grids, shared_tmp, *extra)
    train_steps(trainer, 1)
    good = trainer.save("test").path
    train_steps(trainer, 1)
    victim = where % runtime.world_size
    shards = {s.name: s for s in (*trainer.dp.shard_states(), *trainer.optimizer.shard_states()) if s.group == kind}
    name = sorted(n for n, shard in shards.items() if shard.writes)[-1]
    name = runtime.comm.bcast(name if runtime.rank == victim else None, root=victim)
    if runtime.rank == victim:
        lo = shards[name].write[0]
        with torch.no_grad():
            shards[name].view(lo, lo + 1)[0] = bad
    _raises_everywhere(
        runtime, NonFiniteError, lambda: trainer.save("test"),
        f"/{kind}/{name} has 1 non-finite value on rank {victim}; not committed: {step_file(good.parent, 2)}",
        "stays latest",
    )  # fmt: skip
    assert NonFiniteError.exit_code == 3
    _all_ranks_ok(runtime, _clean(runtime, good.parent, good))


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_on_error_continue_trains_on_and_the_next_interval_commits(runtime, grids, shared_tmp, capsys):
    with tmpfs(runtime, shared_tmp / "disk") as disk:
        trainer = _trainer(
            grids, shared_tmp / "run", f"checkpoint.dir={disk}", "checkpoint.on_error=continue",
            "checkpoint.every=2", "train.steps=4",
        )  # fmt: skip
        if runtime.rank == 0:
            fill(disk, 64 * 1024)
        step = trainer.step

        def step_then_make_room():
            out = step()
            if trainer.steps_done == 3 and runtime.rank == 0:
                (disk / "filler").unlink()
            return out

        trainer.step = step_then_make_room
        summary = trainer.run()
        assert trainer.steps_done == 4 and [c["step"] for c in summary["checkpoints"]] == [4]
        assert read_latest(disk) == step_file(disk, 4)
        if runtime.rank == 0:
            out = capsys.readouterr().out
            warnings = [line for line in out.splitlines() if "warning: checkpoint step 2" in line]
            assert len(warnings) == 1 and "no space left on device" in warnings[0], out


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_the_size_estimate_bounds_the_file_and_the_reservation_is_trimmed(runtime, grids, shared_tmp, monkeypatch):
    needed = []
    real = checkpoint_io.prepare_write
    monkeypatch.setattr(checkpoint_io, "prepare_write", lambda d, t, n, s: (needed.append(n), real(d, t, n, s)))
    problems = []
    for i, extra in enumerate(((), ("train.precision=bf16", *WIDE), ("checkpoint.alignment_threshold=4096", "checkpoint.alignment_interval=8192"))):  # fmt: skip
        path = _trainer(grids, shared_tmp / str(i), *extra).save("test").path
        if runtime.rank == 0:  # the estimate is an upper bound, the reservation's tail was given back
            size, allocated = path.stat().st_size, path.stat().st_blocks * 512
            print(f"{extra}: file {size} B, estimate {needed[-1]} B ({needed[-1] / size:.3f} x)")
            if not (size <= needed[-1] and allocated < size + 64 * 1024):
                problems.append(f"{extra}: size {size}, allocated {allocated}, estimate {needed[-1]}")
    _all_ranks_ok(runtime, problems)

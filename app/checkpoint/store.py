"""Checkpoint files on disk: names, the atomic commit, the `latest` pointer, retention.

    <checkpoint dir>/step_0000100.h5.tmp   being written (never loaded)
    <checkpoint dir>/step_0000100.h5       committed: complete, flushed, checksummed
    <checkpoint dir>/latest                one line: the file name of the newest committed one

Commit: the ranks write and flush the `.tmp` file together (MPI_File_sync), rank 0 fsyncs
it, renames it to `.h5`, fsyncs the directory, then replaces `latest` the same way (write
`latest.tmp`, fsync, rename, fsync the directory). A crash at any point leaves `latest`
naming a complete checkpoint: before the rename nothing committed changed, and after it
the new file is complete. Retention deletes the oldest committed files beyond
`checkpoint.keep` and leftover `.tmp` files, never the one `latest` names, nor the last one
written before a non-finite step (`protected`: root attributes `nonfinite_events` and
`nonfinite_in_a_row`).

Before a write, rank 0 checks the directory (`prepare_write`: writable, enough free space
for the checkpoint's known size, spare blocks for the HDF5 metadata) and reserves the
file's blocks (`reserve`, fallocate), so a full disk is refused before any rank enters
MPI-IO; `describe_failure` names the cause of an I/O error in words (ENOSPC, EDQUOT, EROFS,
EACCES, EIO) from errno or the error text.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import shutil
from contextlib import suppress
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Optional

from app.deck import Deck
from app.errors import CheckpointError
from app.untrusted import read_bytes

STEP_FILE = re.compile(r"^step_(\d{7,})\.h5$")
LATEST = "latest"


def checkpoint_dir(deck: Deck) -> Path:
    """checkpoint.dir, or <run.dir>/checkpoints."""
    return Path(deck.checkpoint_directory)


def step_file(directory: Path, step: int) -> Path:
    return directory / f"step_{step:07d}.h5"


def committed(directory: Path) -> list[tuple[int, Path]]:
    """(step, path) of the committed checkpoints in `directory`, oldest first."""
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), directory / name) for name in os.listdir(directory) if (m := STEP_FILE.match(name))]
    return sorted(found)


@dataclass(frozen=True)
class Pick:
    """How a message about a checkpoint directory's `latest` tells the user to name another checkpoint:
    a resume sets run.resume (`RESUME_PICK`), a tool is given another file (`TOOL_PICK`)."""

    file: str  # name a checkpoint file instead
    one_of: str  # name one of the committed files, listed in {names}
    none: str  # the directory holds no committed checkpoint


RESUME_PICK = Pick(
    "set run.resume to a file", "set run.resume to one of {names} or run.resume: none",
    "it holds no committed checkpoint: set run.resume: none to start over",
)  # fmt: skip
TOOL_PICK = Pick(
    "give a checkpoint file (.h5) instead", "give one of {names} of that directory instead",
    "it holds no committed checkpoint to give instead",
)  # fmt: skip


def read_latest(directory: Path, pick: Pick = RESUME_PICK) -> Optional[Path]:
    """The checkpoint `latest` names, or None when there is no pointer; `pick`: what a message says to do."""
    pointer = directory / LATEST
    if not os.path.lexists(pointer):
        return None

    def fail(message: str) -> CheckpointError:
        return CheckpointError(f"{pointer}: {message}; write the name of a step_NNNNNNN.h5 file of {directory} "
                               f"into it, or {pick.file}")  # fmt: skip

    # A step file's name and a newline: a FIFO or /dev/zero in its place must not hang or fill memory.
    name = read_bytes(pointer, "checkpoint pointer", fail, "", 4096).decode("utf-8", "replace").strip()
    if not STEP_FILE.match(name):
        raise CheckpointError(
            f"{pointer} does not name a checkpoint file (it holds {name[:80]!r}); "
            f"write the name of a step_NNNNNNN.h5 file of {directory} into it, or {pick.file}"
        )
    path = directory / name
    if not path.is_file():
        names = [p.name for _, p in committed(directory)]
        raise CheckpointError(
            f"{pointer} names {name}, which does not exist; "
            + (pick.one_of.format(names=names) if names else pick.none)
        )
    return path


def resolve_resume(deck: Deck) -> Optional[Path]:
    """The checkpoint file run.resume asks for: None to start fresh (none, or auto without one)."""
    want = deck.run.resume
    if want == "none":
        return None
    if want == "auto":
        directory = checkpoint_dir(deck)
        latest = read_latest(directory)
        names = [p.name for _, p in committed(directory)] if latest is None else []
        if names:  # starting over would train from step 0 and let retention delete them
            raise CheckpointError(
                f"run.resume = 'auto': {directory} holds committed checkpoints but no `{LATEST}` pointer (a job "
                f"ended between a checkpoint's rename and the pointer's write, or it was removed); "
                + RESUME_PICK.one_of.format(names=names)
            )
        return latest
    return named_checkpoint(
        want, f"run.resume = {want!r}", "no such checkpoint file; use auto, none, or an existing .h5"
    )


def named_checkpoint(given: str, name: str, missing: str, pick: Pick = RESUME_PICK) -> Path:
    """The checkpoint a user named (run.resume, app.eval's --checkpoint): a file, or the one a
    directory's `latest` names. `name` says where it was given, `missing` what to say (and do)
    when there is no such file, `pick` how to name another; CheckpointError otherwise."""
    path = Path(given)
    if path.is_dir():
        latest = read_latest(path, pick)
        if latest is None:
            raise CheckpointError(f"{name} is a directory without a `latest` checkpoint pointer")
        return latest
    if path.name == LATEST and path.is_file():  # the pointer itself: the checkpoint it names
        latest = read_latest(path.parent, pick)
        assert latest is not None
        return latest
    if path.name.endswith(".tmp"):
        raise CheckpointError(
            f"{name} is an uncommitted checkpoint (its write never finished); use the file `latest` names instead"
        )
    if not path.is_file():
        raise CheckpointError(f"{name}: {missing}")
    return path


def fsync_path(path: Path) -> None:
    """Flush a file's (or a directory's entries') data to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(tmp: Path, final: Path) -> None:
    """Rank 0, after every rank flushed and closed `tmp`: make it the committed `latest`."""
    directory = final.parent
    fsync_path(tmp)
    os.replace(tmp, final)
    fsync_path(directory)
    pointer_tmp = directory / (LATEST + ".tmp")
    with open(pointer_tmp, "w") as f:
        f.write(final.name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(pointer_tmp, directory / LATEST)
    fsync_path(directory)


def facts(path: Path) -> tuple[float, int, int]:
    """(when it was written, `nonfinite_events`, `nonfinite_in_a_row`) of a checkpoint: the header's
    `created` time (else the file's mtime: files of older tools), the non-finite steps before it in
    the run and in the streak it was written in (0: after a normal update; 0 for files without
    them or that cannot be read)."""
    import h5py

    when = os.stat(path).st_mtime
    try:
        with h5py.File(path, "r") as f:
            created = f.attrs.get("created")
            if isinstance(created, bytes):
                created = created.decode("utf-8", "replace")
            with suppress(TypeError, ValueError):
                when = datetime.strptime(created, "%Y-%m-%dT%H:%M:%S%z").timestamp()
            return when, int(f.attrs.get("nonfinite_events", 0)), int(f.attrs.get("nonfinite_in_a_row", 0))
    except (OSError, ValueError, TypeError):
        return when, 0, 0


def protected(found: list[Path], states: list[tuple[int, int]]) -> set[Path]:
    """Of committed checkpoints (in the order they were written) and their (`nonfinite_events`,
    `nonfinite_in_a_row`), the ones retention never deletes because a non-finite step followed
    them: the last one written before the run's first problem (the newest with no event), and,
    while a streak of non-finite steps goes on (train.nonfinite: skip or rollback), the last one
    written before that streak began."""
    if not found:
        return set()
    keep: set[Path] = set()
    if states[-1][0] > 0:  # problems happened: the last checkpoint before the first one
        clean = [p for p, (events, _) in zip(found, states) if events == 0]
        keep.update(clean[-1:])
    if states[-1][1] > 0:  # inside a streak: the last checkpoint before it
        calm = [p for p, (_, in_a_row) in zip(found, states) if in_a_row == 0]
        keep.update(calm[-1:])
    return keep


def retain(directory: Path, keep: int) -> list[Path]:
    """Rank 0: delete committed checkpoints beyond the `keep` written last (0 keeps all) and leftover
    .tmp files of interrupted writes. Returns what was deleted. Never deleted: the one `latest`
    names, and the `protected` ones (written before a NaN/Inf: to go back to should training
    have diverged). Newest means written last (the header's `created`, the step between two of
    the same second), not the highest step: files of an earlier run with higher steps (after
    run.resume: none, or a resume from an older file) are older than the run writing now."""
    latest = read_latest(directory)
    doomed = [p for p in directory.glob("step_*.h5.tmp*")]  # and their spare files
    if keep > 0:
        found = committed(directory)
        if len(found) > keep:
            known = {path: facts(path) for _, path in found}
            found.sort(key=lambda sp: (known[sp[1]][0], sp[0]))  # written last, last
            paths = [path for _, path in found]
            spared = protected(paths, [known[p][1:] for p in paths]) | {latest}
            doomed += [p for p in paths[:-keep] if p not in spared]
    for path in doomed:
        path.unlink(missing_ok=True)
    return doomed


# ---- before and after a write: space, permissions, causes -------------------------------


def format_bytes(n: float) -> str:
    """Bytes for a message: 1.23 GB, 45.6 MB, 789 kB (decimal units, as df -H)."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if abs(n) >= size:
            return f"{n / size:.{2 if unit != 'MB' else 1}f} {unit}"
    return f"{n / 1e3:.0f} kB"


def free_bytes(directory: Path) -> int:
    """Bytes an unprivileged user may still write on the directory's file system (df's Avail)."""
    return shutil.disk_usage(directory).free


def latest_note(directory: Path) -> str:
    """What a failed save leaves: the previous checkpoint stays `latest` (or there is none)."""
    try:
        latest = read_latest(directory)
    except (CheckpointError, OSError):
        latest = None
    if latest is None:
        return f"there is no earlier checkpoint in {directory}"
    return f"the previous checkpoint {latest.name} stays latest"


def spare_file(tmp: Path) -> Path:
    """Rank 0's spare blocks beside a checkpoint being written (see `prepare_write`)."""
    return tmp.with_name(tmp.name + ".spare")


def prepare_write(directory: Path, tmp: Path, needed: int, spare: int) -> None:
    """Rank 0, before any rank opens `tmp`: create the directory, drop leftovers of interrupted
    writes (never loaded; they hold space), check that the directory is writable (an empty
    `tmp`, so errno says why not) and that `needed` + `spare` bytes are free, and take `spare`
    of them in `spare_file(tmp)`. Freed just before the HDF5 metadata is first written (or
    when the write fails), they give the metadata room even when the disk has filled up in
    the meantime: a failed metadata flush leaves HDF5 unable to close the file."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise CheckpointError(
            f"cannot create checkpoint directory {directory}: {describe_failure(err.strerror or str(err), err.errno)}; "
            f"set checkpoint.dir to a writable path"
        ) from None
    try:
        for stale in directory.glob("step_*.h5.tmp*"):
            stale.unlink(missing_ok=True)
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644))
    except OSError as err:
        raise CheckpointError(
            f"cannot write checkpoint {tmp}: {describe_failure(err.strerror or str(err), err.errno)}; "
            f"{latest_note(directory)}; set checkpoint.dir to a writable path"
        ) from None
    free = 0
    try:
        free = free_bytes(directory)
        if free < needed + spare:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        _take(spare_file(tmp), spare)
    except OSError as err:
        with suppress(OSError):
            tmp.unlink(missing_ok=True)
            spare_file(tmp).unlink(missing_ok=True)
        cause = describe_failure(err.strerror or str(err), err.errno)
        raise CheckpointError(
            f"cannot write checkpoint {tmp}: {cause}: it needs {format_bytes(needed + spare)}, {format_bytes(free)} "
            f"free on {directory}; {latest_note(directory)}; free space, lower checkpoint.keep or set checkpoint.dir "
            f"to another file system"
        ) from None


def _take(path: Path, nbytes: int) -> None:
    """A file of `nbytes` allocated bytes: fallocate, or zeros where the file system cannot."""
    path.write_bytes(b"")
    if reserve(path, nbytes):
        return
    with open(path, "wb") as f:
        chunk = bytes(1 << 20)
        for start in range(0, nbytes, len(chunk)):
            f.write(chunk[: min(len(chunk), nbytes - start)])
        f.flush()
        os.fsync(f.fileno())


# Errors of fallocate(2) that mean "this file system cannot preallocate", not "no space".
_NO_FALLOCATE = {errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL, errno.ENODEV, errno.ESPIPE}


def reserve(path: Path, nbytes: int) -> bool:
    """Rank 0: allocate the file's first `nbytes` now (Linux fallocate(2); no zero-filling
    fallback), so that the ranks' MPI-IO writes cannot meet a full disk halfway — ROMIO's
    collective write does not survive that on every rank. Raises OSError (ENOSPC, EDQUOT, ...)
    when the space is not there; False where the file system cannot preallocate."""
    try:
        fallocate = ctypes.CDLL(None, use_errno=True).fallocate
    except (AttributeError, OSError):
        return False  # not Linux/glibc
    fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    fd = os.open(path, os.O_WRONLY)
    try:
        if fallocate(fd, 0, 0, nbytes) != 0:
            code = ctypes.get_errno()
            if code in _NO_FALLOCATE:
                return False
            raise OSError(code, os.strerror(code), str(path))
    finally:
        os.close(fd)
    return True


# (errno, words of OS / MPI / HDF5 error texts that mean it, the cause in words); the first
# match wins. OpenMPI's text for MPI_ERR_IO is "input/output error" whatever the errno was, so
# that phrase alone means nothing: after an unnamed MPI_ERR_IO the caller checks free space.
_CAUSES = (
    (errno.ENOSPC, ("no space left", "mpi_err_no_space", "not enough space", "errno = 28,"), "no space left on device (ENOSPC)"),
    (errno.EDQUOT, ("quota", "mpi_err_quota", "errno = 122,"), "disk quota exceeded (EDQUOT)"),
    (errno.EROFS, ("read-only file system", "mpi_err_read_only", "errno = 30,"), "read-only file system (EROFS)"),
    (errno.EACCES, ("permission denied", "mpi_err_access", "errno = 13,"), "permission denied (EACCES)"),
    (errno.EPERM, ("operation not permitted", "errno = 1,"), "operation not permitted (EPERM)"),
    (errno.ENOENT, ("no such file", "mpi_err_no_such_file", "errno = 2,"), "no such file or directory (ENOENT)"),
    (errno.EIO, ("errno = 5,",), "I/O error (EIO)"),
)  # fmt: skip


def describe_failure(text: str, code: Optional[int] = None) -> str:
    """The cause of an I/O error in words, from its errno or its (OS, MPI or HDF5) text."""
    low = text.lower()
    for number, words, cause in _CAUSES:
        if code == number or any(word in low for word in words):
            return cause
    if "mpi_err_io" in low:
        return "I/O error (MPI_ERR_IO; the MPI library does not say which)"
    return text.splitlines()[0] if text else "unknown error"

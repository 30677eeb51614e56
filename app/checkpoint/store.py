"""Checkpoint files on disk: names, the atomic commit, the `latest` pointer, retention.

    <checkpoint dir>/step_0000100.h5.tmp   being written (never loaded)
    <checkpoint dir>/step_0000100.h5       committed: complete, flushed, checksummed
    <checkpoint dir>/latest                one line: the file name of the newest committed one

Commit: the ranks write and flush the `.tmp` file together (MPI_File_sync), rank 0 fsyncs
it, renames it to `.h5`, fsyncs the directory, then replaces `latest` the same way (write
`latest.tmp`, fsync, rename, fsync the directory). A crash at any point leaves `latest`
naming a complete checkpoint: before the rename nothing committed changed, and after it
the new file is complete. Retention deletes the oldest committed files beyond
`checkpoint.keep` and leftover `.tmp` files, never the one `latest` names.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Optional

from app.deck import Deck
from app.errors import CheckpointError

STEP_FILE = re.compile(r"^step_(\d{7,})\.h5$")
LATEST = "latest"


def checkpoint_dir(deck: Deck) -> Path:
    """checkpoint.dir, or <run.dir>/checkpoints."""
    return Path(deck.checkpoint.dir) if deck.checkpoint.dir else Path(deck.run.dir or "runs/default") / "checkpoints"


def step_file(directory: Path, step: int) -> Path:
    return directory / f"step_{step:07d}.h5"


def committed(directory: Path) -> list[tuple[int, Path]]:
    """(step, path) of the committed checkpoints in `directory`, oldest first."""
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), directory / name) for name in os.listdir(directory) if (m := STEP_FILE.match(name))]
    return sorted(found)


def read_latest(directory: Path) -> Optional[Path]:
    """The checkpoint `latest` names, or None when there is no pointer."""
    pointer = directory / LATEST
    try:
        name = pointer.read_text().strip()
    except FileNotFoundError:
        return None
    if not STEP_FILE.match(name):
        raise CheckpointError(
            f"{pointer} does not name a checkpoint file (it holds {name[:80]!r}); "
            f"write the name of a step_NNNNNNN.h5 file of {directory} into it, or set run.resume to a file"
        )
    path = directory / name
    if not path.is_file():
        raise CheckpointError(
            f"{pointer} names {name}, which does not exist; set run.resume to one of "
            f"{[p.name for _, p in committed(directory)] or 'no committed checkpoint'} or run.resume: none"
        )
    return path


def resolve_resume(deck: Deck) -> Optional[Path]:
    """The checkpoint file run.resume asks for: None to start fresh (none, or auto without one)."""
    want = deck.run.resume
    if want == "none":
        return None
    if want == "auto":
        return read_latest(checkpoint_dir(deck))
    path = Path(want)
    if path.is_dir():
        latest = read_latest(path)
        if latest is None:
            raise CheckpointError(f"run.resume = {want!r} is a directory without a `latest` checkpoint pointer")
        return latest
    if path.name.endswith(".tmp"):
        raise CheckpointError(
            f"run.resume = {want!r} is an uncommitted checkpoint (its write never finished); "
            f"resume from the file `latest` names instead"
        )
    if not path.is_file():
        raise CheckpointError(f"run.resume = {want!r}: no such checkpoint file; use auto, none, or an existing .h5")
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


def retain(directory: Path, keep: int) -> list[Path]:
    """Rank 0: delete committed checkpoints beyond the newest `keep` (0 keeps all) — never the one
    `latest` names — and leftover .tmp files of interrupted writes. Returns what was deleted."""
    latest = read_latest(directory)
    doomed = [p for p in directory.glob("step_*.h5.tmp")]
    if keep > 0:
        doomed += [p for _, p in committed(directory)[:-keep] if p != latest]
    for path in doomed:
        path.unlink(missing_ok=True)
    return doomed

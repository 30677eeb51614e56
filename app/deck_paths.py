"""File-system checks of a deck's paths at the start of a real run (rank 0, no MPI, creates
nothing): run.dir and checkpoint.dir writable directories (or creatable), not device files, with
no symbolic link where gridlm writes its own files (lock, deck.yaml, metrics, summary, checkpoints);
memmap token files (data.path or each of data.paths) readable; a run.resume path that exists; a
run.init_from directory with a config.json.
Not part of the dry run, which plans on one machine for another.
"""

from __future__ import annotations

import glob
import os
import stat
from contextlib import suppress
from pathlib import Path
from typing import Optional

from app.deck import Deck
from app.errors import DeckError


def check_paths(deck: Deck) -> None:
    """File-system checks of the deck's paths before a real run writes anything (rank 0, no MPI;
    creates nothing). run.dir and checkpoint.dir must be writable directories or creatable in
    one; memmap's (and eval.path's) PREFIX.bin/.json/.idx.npy must be readable files (the data module checks
    their contents); a run.resume path must exist. Not part of the dry run, which plans on one
    machine for another.
    """
    run_dir = deck.run.directory
    checkpoints = deck.checkpoint_directory
    _check_directory("run.dir", run_dir)
    _check_directory("checkpoint.dir", checkpoints)
    _no_symlinks("run.dir", run_dir, RUN_DIR_FILES)
    _no_symlinks("checkpoint.dir", checkpoints, CHECKPOINT_FILES)
    if deck.optim.offload == "nvme":
        _check_directory("optim.offload_dir", deck.offload_directory)
    if deck.data.kind == "memmap":
        keys = [f"data.paths[{i}].path" for i in range(len(deck.data.paths))] if deck.data.paths else ["data.path"]
        for key, (_, prefix) in zip(keys, deck.data.blend):
            for suffix in (".json", ".bin", ".idx.npy"):
                _check_data_file(key, prefix, prefix + suffix)
    if deck.eval.path:
        for suffix in (".json", ".bin", ".idx.npy"):
            _check_data_file("eval.path", deck.eval.path, deck.eval.path + suffix)
    resume = deck.run.resume
    if resume not in ("auto", "none") and not os.path.exists(resume):
        raise DeckError(
            "run.resume", resume, "does not exist; give a checkpoint file (.h5) or a checkpoint directory, "
            "or auto or none"
        )  # fmt: skip
    init = deck.run.init_from
    if init is not None and not os.path.isfile(os.path.join(init, "config.json")):
        raise DeckError(
            "run.init_from", init, "is not a Hugging Face model directory (no config.json there); give a local "
            "directory written by save_pretrained (config.json and model.safetensors), nothing is downloaded"
        )  # fmt: skip


# What gridlm writes in run.dir and checkpoint.dir (globs): never through a symlink planted there.
RUN_DIR_FILES = (
    ".gridlm.lock", "deck.yaml", "deck.yaml.tmp", "metrics.jsonl", "metrics.jsonl.tmp", "summary.json",
    "summary.json.tmp", "tb", "profile.txt", "profile.txt.tmp",  # TensorBoard's events, run.profile's table
)  # fmt: skip
CHECKPOINT_FILES = ("latest", "latest.tmp", "step_*.h5", "step_*.h5.tmp*")


def _no_symlinks(key: str, directory: str, names: tuple[str, ...]) -> None:
    """Refuse a symlink among the files gridlm creates or replaces in `directory`: writing through
    it would overwrite its target (a link named metrics.jsonl to someone's file). The directory
    itself may be a link (a run directory on scratch)."""
    if not os.path.isdir(directory):
        return
    for name in names:
        for path in sorted(glob.glob(os.path.join(glob.escape(directory), name))):
            if os.path.islink(path):
                raise DeckError(
                    key, directory, f"holds {path}, a symbolic link to {os.readlink(path)!r}, where gridlm writes "
                    "its own file: remove the link (gridlm never writes through one), or choose another directory"
                )  # fmt: skip


def _file_kind(mode: int) -> str:
    if stat.S_ISREG(mode):
        return "a regular file"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device file"
    if stat.S_ISFIFO(mode):
        return "a named pipe"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "a directory" if stat.S_ISDIR(mode) else "not a regular file"


def _stat(path: str) -> Optional[os.stat_result]:
    """os.stat, or None when the path does not exist (also when a parent is a file: ENOTDIR)."""
    try:
        return os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None


def _check_directory(key: str, path: str) -> None:
    """`path` is a directory this process can create files in, or can be created."""
    fix = f"set {key} to a writable directory"
    long = [part for part in Path(path).parts if len(os.fsencode(part)) > 255]
    if long:
        raise DeckError(key, path, f"a path component of {len(os.fsencode(long[0]))} bytes; at most 255")
    try:
        found = _stat(path)
        if found is not None:
            if not stat.S_ISDIR(found.st_mode):
                raise DeckError(key, path, f"exists and is {_file_kind(found.st_mode)}, not a directory; {fix}")
            if not os.access(path, os.W_OK | os.X_OK):
                raise DeckError(key, path, f"is a directory {_unwritable(path)}; {fix}")
            return
        # It does not exist yet: the run creates it (and its parents) in its nearest existing ancestor.
        ancestor = os.path.dirname(os.path.abspath(path))
        while (found := _stat(ancestor)) is None:
            ancestor = os.path.dirname(ancestor)
    except OSError as err:  # EACCES on a parent, ELOOP, ENAMETOOLONG
        raise DeckError(key, path, f"cannot be used ({err.strerror}); {fix}") from None
    if not stat.S_ISDIR(found.st_mode):
        raise DeckError(
            key, path, f"cannot be created: {ancestor} is {_file_kind(found.st_mode)}, not a directory; {fix}"
        )
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise DeckError(key, path, f"cannot be created: {ancestor} is a directory {_unwritable(ancestor)}; {fix}")


def _unwritable(path: str) -> str:
    """Why a directory refuses new files: a read-only file system (EROFS, which os.access reports
    as a denial too; found in review: it sent the user to the permissions), or its permissions."""
    with suppress(OSError):
        if os.statvfs(path).f_flag & os.ST_RDONLY:
            return "on a read-only file system"
    return "this user cannot write in"


def _check_data_file(key: str, prefix: str, path: str) -> None:
    fix = "write PREFIX.bin/.json/.idx.npy with `python -m app.data.prepare TEXT... --out PREFIX`"
    try:
        found = _stat(path)
    except OSError as err:
        raise DeckError(key, prefix, f"{path} cannot be used ({err.strerror}); {fix}") from None
    if found is None:
        raise DeckError(key, prefix, f"{path} does not exist; {fix}")
    if not stat.S_ISREG(found.st_mode):
        raise DeckError(key, prefix, f"{path} is {_file_kind(found.st_mode)}, not a file; {fix}")
    if not os.access(path, os.R_OK):
        raise DeckError(key, prefix, f"{path} is not readable by this user")

"""The checkpoint store under faults found in review: a job that ended between a checkpoint's
rename and the `latest` pointer's write leaves a committed checkpoint without a pointer, which
`run.resume: auto` must not silently pass over (serial)."""

from __future__ import annotations

import h5py
import pytest

from app.checkpoint.store import commit, committed, resolve_resume, step_file
from app.deck import load_deck
from app.errors import CheckpointError


def test_auto_resume_does_not_start_over_beside_a_committed_checkpoint_without_a_pointer(tmp_path):
    """The first checkpoint of a run is renamed into place, then the job ends before `latest` is
    written (here: `latest.tmp` cannot be created, as a kill between the two renames would leave
    it). `run.resume: auto` took the missing pointer for an empty directory and trained from
    step 0, and retention then deleted the checkpoint; it must name the file instead."""
    directory = tmp_path / "checkpoints"
    directory.mkdir()
    final = step_file(directory, 500)
    tmp = final.with_name(final.name + ".tmp")
    with h5py.File(tmp, "w") as f:
        f.attrs["committed"] = True
    (directory / "latest.tmp").mkdir()  # the pointer's write fails after the rename
    with pytest.raises(OSError):
        commit(tmp, final)
    assert [p for _, p in committed(directory)] == [final] and not (directory / "latest").exists()
    deck = load_deck(None, (f"run.dir={tmp_path}", "run.resume=auto"))
    with pytest.raises(CheckpointError) as raised:
        resolve_resume(deck)
    message = str(raised.value)
    assert "step_0000500.h5" in message and "latest" in message and "run.resume" in message, message

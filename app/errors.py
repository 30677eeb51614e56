"""User-facing errors: each names the cause (key, file, value) and the fix.

`__main__` turns any `GridlmError` into one message on rank 0 and exit status 2 on every
rank, with no traceback; anything else is a bug and aborts the MPI job with a traceback.
"""

from typing import Optional

from app.schema import shown


class GridlmError(Exception):
    """A mistake the user can fix (deck, data, launch); never a bug in gridlm.

    `exit_code` is the status every rank exits with (docs/RUNNING.md, "When things go wrong")."""

    exit_code = 2


class InputError(GridlmError):
    """A file the user wrote (deck, machine file, study file) has an unknown or missing key or a
    bad value; its keys are declared and checked by app/schema.py."""


class DeckError(InputError):
    """A deck key is unknown, has the wrong type, or an impossible value. `file` says where the
    value came from (the deck file or --set), where known."""

    def __init__(self, key: str, value: object, accepted: str, file: Optional[str] = None) -> None:
        self.key, self.value, self.accepted, self.file = key, value, accepted, file
        where = f" [{file}]" if file else ""
        super().__init__(f"deck error: {key} = {shown(value)}: {accepted}{where}")


class DataError(GridlmError):
    """A token file is missing, truncated or inconsistent with the deck."""


class LaunchError(GridlmError):
    """The job was launched in a way gridlm cannot run (world size, devices, MPI)."""


class RunDirInUse(GridlmError):
    """Another live job holds run.dir's lock (`app/runtime/lock.py`); the message names it."""


class CheckpointError(GridlmError):
    """A checkpoint is missing, incomplete, corrupt (checksum) or does not fit the deck's model."""


class NonFiniteError(GridlmError):
    """Training produced a NaN/Inf (loss, gradient norm, a tensor about to be checkpointed) and
    train.nonfinite says to stop, or the fp16 loss scale fell below train.min_loss_scale."""

    exit_code = 3


class RankFatal(GridlmError):
    """A failure on one rank that its peers cannot learn of in step (they may be waiting in a
    collective): CUDA out of memory. `app.job.run_job` prints it on this rank and aborts the whole
    MPI job with `exit_code` (2) at once, instead of leaving the others to time out."""

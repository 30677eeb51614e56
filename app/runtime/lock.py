"""One job per run directory: an exclusive fcntl lock on `<run.dir>/.gridlm.lock`.

Rank 0 calls `acquire_run_lock(run_dir)` before it writes anything into run.dir and keeps
the returned `RunLock` for the life of the job. A second job on the same run.dir is
refused with `RunDirInUse`, naming the holder (job id, start time, host, pid) read from the
lock file, and writes nothing there. The lock is a POSIX record lock (`fcntl.lockf`), so
the kernel drops it when the holding process dies, however it dies: a lock file left
behind by a dead job never blocks the next one.

What is guaranteed depends on the file system holding run.dir:

- local file systems (ext4, xfs, tmpfs, ...): yes, between all processes of the node;
- NFSv4 (and NFSv3 with a running lockd/statd): yes, between all clients. A crashed client's
  lock is freed when its lease expires (NFSv4, typically 90 s) or when it reboots (NFSv3);
- GPFS / IBM Storage Scale: yes, fcntl locks are coherent cluster-wide;
- Lustre: only when mounted with `-o flock`. With `-o localflock` the lock only excludes
  jobs whose rank 0 runs on the same node. With `-o noflock` lockf fails (ENOSYS or
  EINVAL): gridlm then warns once and runs without the lock rather than refusing to run;
- BeeGFS: across nodes only with `tuneUseGlobalFileLocks = true` in the client config.

POSIX lock semantics to keep in mind: the lock belongs to the process, so a second
`acquire_run_lock` on the same directory in the same process succeeds, and closing *any*
descriptor of the lock file in the holding process drops the lock. Never open the lock
file elsewhere in the job; deleting it while a job runs lets a second job lock a new file.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Optional

from app.errors import GridlmError, RunDirInUse

LOCK_NAME = ".gridlm.lock"
# lockf's errors when the file system has no (cluster) lock support: Lustre -o noflock gives
# ENOSYS or EINVAL, an NFSv3 client without lockd ENOLCK, some FUSE file systems EOPNOTSUPP.
UNSUPPORTED = frozenset({errno.ENOSYS, errno.EINVAL, errno.ENOLCK, errno.EOPNOTSUPP})
HELD = frozenset({errno.EAGAIN, errno.EACCES})  # POSIX allows either for a conflicting lock
HOLDER_WAIT_S = 1.0  # how long a refused job waits for the holder to finish writing its info


def job_id() -> str:
    """The scheduler's job id (Slurm, PBS), else "pid P" for a job launched by hand."""
    for var in ("SLURM_JOB_ID", "PBS_JOBID"):
        if os.environ.get(var):
            return os.environ[var]
    return f"pid {os.getpid()}"


def holder_info() -> dict[str, Any]:
    """What the lock file records about this process: job id, start time (ISO 8601), host, pid."""
    return {
        "job": job_id(),
        "since": datetime.now(timezone.utc).astimezone().isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "pid": os.getpid(),
    }


class RunLock:
    """This process's exclusive lock on `path` (`<run.dir>/.gridlm.lock`), held until `release()`
    or process exit.

    `locked` is False when the file system refused fcntl locks (`warning` says why): the run
    goes on unprotected. `holder` is the information written into the lock file.
    """

    def __init__(self, path: Path, fd: Optional[int], holder: dict[str, Any], warning: Optional[str] = None) -> None:
        self.path, self.holder, self.warning = path, holder, warning
        self._fd = fd

    @property
    def locked(self) -> bool:
        return self._fd is not None and self.warning is None

    def release(self) -> None:
        """Unlock and close the lock file (idempotent); the file and its holder info stay."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            if self.warning is None:
                fcntl.lockf(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)  # closing alone would drop the lock too; unlock first to say so

    def __getstate__(self) -> None:
        # Another process (a rank receiving it by bcast) would close an unrelated descriptor.
        raise TypeError("a RunLock belongs to the process that took it; keep it on rank 0")

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "locked" if self.locked else ("unlocked (no lock support)" if self.warning else "released")
        return f"RunLock({str(self.path)!r}, {state})"


def _print_warning(message: str) -> None:
    print(message, flush=True)


def acquire_run_lock(run_dir: Path, warn: Callable[[str], None] = _print_warning) -> RunLock:
    """Take run_dir's job lock, creating run_dir (with parents) and the lock file if needed.

    Call on rank 0 only and keep the result for the life of the job. Raises `RunDirInUse`
    when another live process holds the lock; a refused call changes nothing in run_dir
    (the existing lock file is opened without truncation and only written once locked).
    When the file system does not support fcntl locks, calls `warn` once with a
    "gridlm: warning: ..." line and returns an unlocked `RunLock`. Other OS errors (no
    permission, read-only file system) are a `GridlmError` naming run.dir.
    """
    path = Path(run_dir) / LOCK_NAME
    try:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)  # never a planted link
    except OSError as err:
        raise _unwritable(run_dir, err) from None
    warning = None
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        if err.errno in HELD:
            holder = _read_holder(fd)
            os.close(fd)
            raise RunDirInUse(_in_use_message(run_dir, holder)) from None
        if err.errno not in UNSUPPORTED:
            os.close(fd)
            raise _unwritable(run_dir, err) from None
        warning = (
            f"gridlm: warning: the file system of run.dir = {str(run_dir)!r} does not support fcntl locks "
            f"({errno.errorcode.get(err.errno, err.errno)}: {err.strerror}): running without the one-job-per-run.dir "
            "lock, so make sure no other job uses this run.dir (on Lustre, mount with -o flock to get the lock)"
        )
        warn(warning)
    holder = holder_info()
    try:
        data = (json.dumps(holder) + "\n").encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
        os.fsync(fd)  # the holder info must survive a crash of this node for the refusal message
    except OSError as err:
        os.close(fd)
        raise _unwritable(run_dir, err) from None
    return RunLock(path, fd, holder, warning)


def _read_holder(fd: int) -> dict[str, Any]:
    """The holder info in the lock file; the holder writes it right after locking, so wait briefly
    for it. Missing fields read "?" (a holder from another program, or one that died mid-write)."""
    deadline = time.monotonic() + HOLDER_WAIT_S
    while True:
        try:
            info = json.loads(os.pread(fd, 4096, 0).decode(errors="replace"))
            if isinstance(info, dict) and all(k in info for k in ("job", "since", "host", "pid")):
                return info
        except (OSError, ValueError):
            pass
        if time.monotonic() >= deadline:
            return {}
        time.sleep(0.05)


def _in_use_message(run_dir: Path, holder: dict[str, Any]) -> str:
    job, since, host, pid = (holder.get(k, "?") for k in ("job", "since", "host", "pid"))
    return (
        f"run.dir = {str(run_dir)!r} is in use by job {job} since {since} (host {host}, pid {pid}); "
        "wait for it to finish, or set run.dir to another directory"
    )


def _unwritable(run_dir: Path, err: OSError) -> GridlmError:
    return GridlmError(
        f"cannot write run directory run.dir = {str(run_dir)!r}: {err.strerror}; set run.dir to a writable path"
    )

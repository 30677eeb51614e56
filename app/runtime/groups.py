"""The torch.distributed groups a process makes for its grids.

A grid makes a group per axis, per pipeline message stream and per 3D sub-axis, and a process that
builds several grids (the tests, a study's calibration) makes many. Two things keep them cheap:

- An axis of size 1 needs no communication: every such axis shares one group of this rank alone,
  made once, instead of a group each.
- On CPU, groups use gloo with one TCP device shared by all of them (one event-loop thread for the
  process, not one per group) and one worker thread each (not two): torch's gloo groups cost three
  threads each, and a test process that made 160 of them ended with 480 threads.

torch names a locally synchronised group after its ranks and the number of groups the process holds,
so the ranks of a new group must hold equally many: every rank of a grid makes the same calls here
(its axes have the same sizes), and a group this module made is never destroyed before the end.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from app.runtime.watchdog import AnyWatchdog

# The gloo backend of the grid's groups, registered with torch once per process (`_gloo_backend`).
GLOO_GROUPS = "gridlm_gloo"


def _gloo_backend() -> str:
    """Register GLOO_GROUPS with torch (once per process; torch's registry is the record) and return
    its name: ProcessGroupGloo on one shared device, one worker thread a group. The device honours
    GLOO_SOCKET_IFNAME like torch's own gloo groups (its first interface)."""
    import torch.distributed as dist
    from torch.distributed import ProcessGroupGloo

    if not hasattr(dist.Backend, GLOO_GROUPS.upper()):
        interface = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0]
        device = (
            ProcessGroupGloo.create_device(interface=interface)
            if interface
            else ProcessGroupGloo.create_default_device()
        )

        def make(store: Any, rank: int, size: int, timeout: Any) -> Any:
            options = ProcessGroupGloo._Options()
            options._devices, options._threads, options._timeout = [device], 1, timeout
            return ProcessGroupGloo(store, rank, size, options)

        # The devices torch's own gloo serves: parallel.backend = gloo is allowed on GPU ranks too.
        dist.Backend.register_backend(GLOO_GROUPS, make, devices=["cpu", "cuda"])
    return GLOO_GROUPS


class Groups:
    """Makes the grid's torch groups for one process (`Runtime.groups`; the runtime of a
    sub-communicator in the same process should share its parent's)."""

    def __init__(self) -> None:
        self._own: Optional[Any] = None  # the group of this rank alone, made on first need
        self.made: list[Any] = []  # every group made here, for `destroy`

    def new(
        self, ranks: Sequence[int], backend: str, watchdog: AnyWatchdog, axis: str, alone_shared: bool = True
    ) -> Any:
        """A group of the torch `ranks` on the job's `backend` ("gloo" or "nccl"; collective over the
        ranks; `axis` names the wait for the watchdog). One rank alone: the shared group of this
        rank, unless `alone_shared` is False (a caller whose peers make a group at the same point,
        which must then make one too)."""
        import torch.distributed as dist

        if len(ranks) == 1 and alone_shared and self._own is not None:
            return self._own
        backend_name = _gloo_backend() if backend == "gloo" else None
        with watchdog.blocking("new_group", axis):
            group = dist.new_group(list(ranks), use_local_synchronization=True, backend=backend_name)
        self.made.append(group)
        if len(ranks) == 1 and alone_shared:
            self._own = group
        return group

    def destroy(self) -> None:
        """Destroy every group made here (the end of the process's use of torch.distributed; a group
        made later could take a destroyed one's name and find its stale rendezvous keys)."""
        import torch.distributed as dist

        for group in self.made:
            dist.destroy_process_group(group)
        self.made, self._own = [], None

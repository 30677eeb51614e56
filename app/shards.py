"""The shard descriptor: how a stateful component describes its checkpoint state.

A component that holds tensors a checkpoint must keep (`DataParallel`: the parameters and
any fp32 master weights; `ShardedOptimizer`: the moments) lists them as `ShardState`s:
each is one named global tensor (its 1-rank name and shape), where this rank's local shard
sits in it (`offset`, `shape`), which of its local flat elements this rank writes (`write`:
its share, so that the ranks together write each element once) and which it holds and
loads (`hold`), and a view of any local flat range inside `hold`. The checkpoint walks
these descriptors and knows nothing of buffers, buckets or shards; the component decides
all of it from its layout (`app.sharding.layout.ParamLayout`).

Components whose state is a few numbers (the loss scaler, the sampler) give it as a JSON
object (`state_dict` / `load_state_dict`). Both kinds are declared here as protocols, so the
checkpoint types what it is given without importing the components.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Protocol

if TYPE_CHECKING:
    import torch

# The checkpoint's dataset groups, in file order: a ShardState's `group` is one of them. Declared
# here, torch-free, for the components that describe their state and the checkpoint that writes it.
MODEL, MASTER = "model", "optimizer/master"
EXP_AVG, EXP_AVG_SQ = "optimizer/exp_avg", "optimizer/exp_avg_sq"
MOMENTS = (EXP_AVG, EXP_AVG_SQ)
GROUPS = (MODEL, MASTER, *MOMENTS)


@dataclass(frozen=True)
class ShardState:
    """This rank's part of one named global tensor of the training state.

    `group`: the kind of state, a dataset group of the checkpoint ("model",
    "optimizer/master", "optimizer/exp_avg", ...). `name`: the tensor's name in the 1-rank
    model. `write` and `hold` are [lo, hi) ranges of the local shard's flat elements; `write`
    lies inside `hold` (or is empty). `view(lo, hi)` is the local state of [lo, hi) inside
    `hold`, writable in place (or, with `store`, a copy; `store` writes)."""

    group: str
    name: str
    global_shape: tuple[int, ...]
    offset: tuple[int, ...]  # of the local shard in the global tensor, per dimension
    shape: tuple[int, ...]  # of the local shard
    dtype: torch.dtype  # of the state as held (the checkpoint stores it in this dtype)
    write: tuple[int, int]
    hold: tuple[int, int]
    view: Callable[[int, int], torch.Tensor]
    # State not held in memory (an NVMe-offloaded optimizer's file): `view` returns a copy, and
    # `store(lo, values)` sets the local elements from lo on; None: `view` is writable in place.
    store: Optional[Callable[[int, torch.Tensor], None]] = None

    @property
    def writes(self) -> bool:
        return self.write[0] < self.write[1]


class TensorState(Protocol):
    """A component whose checkpoint state is tensors."""

    def shard_states(self) -> Sequence[ShardState]: ...


class JsonState(Protocol):
    """A component whose checkpoint state is a small JSON object."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

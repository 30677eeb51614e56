"""Run gridlm with every torch.distributed call of its training steps counted, by grid axis.

    mpirun -n N .venv/bin/python benchmarks/count_collectives.py OUT SKIP DECK [--set section.key=value ...]

Installed in this process before the app starts (nothing in app/ knows of it): each
torch.distributed collective or transfer is recorded with its op, the axis of its process group
(tp, pp, dp, or 3D's tp_x, tp_y, tp_z, known by the group objects `ProcessGrid` made; `world` for
the default group), the group's size and the message's full size in the performance model's
convention (app/plan/perf.py: an all-reduce's buffer, an all-gather's gathered output, a
reduce-scatter's whole input, a send's payload), then it runs as usual. Only the calls made inside
`Trainer.step` after its first SKIP calls count (no start-up, logging, checkpoint or evaluation
traffic), split into the passes (`Trainer.forward_backward`) and the update (`Trainer.update`).
Around each counted step the process's `wchar` is read from /proc/self/io: the bytes it handed to
write/writev, which is how gloo's TCP transport sends, so on one CPU node with gloo it is what the
rank put on the wire. Every rank writes OUT/rank<R>.json (R: its MPI rank).
"""

from __future__ import annotations

import inspect
import json
import sys
import threading
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def _nbytes(t: Any) -> int:
    return t.numel() * t.element_size()


# torch.distributed function -> (op, its full size from the bound arguments)
SPIED: dict[str, tuple[str, Callable[[dict[str, Any]], int]]] = {
    "all_reduce": ("all_reduce", lambda a: _nbytes(a["tensor"])),
    "all_gather_single": ("all_gather", lambda a: _nbytes(a["output_tensor"])),
    "all_gather_into_tensor": ("all_gather", lambda a: _nbytes(a["output_tensor"])),
    "all_gather": ("all_gather", lambda a: sum(_nbytes(t) for t in a["tensor_list"])),
    "reduce_scatter_single": ("reduce_scatter", lambda a: _nbytes(a["input"])),
    "reduce_scatter_tensor": ("reduce_scatter", lambda a: _nbytes(a["input"])),
    "reduce_scatter": ("reduce_scatter", lambda a: sum(_nbytes(t) for t in a["input_list"])),
    "broadcast": ("broadcast", lambda a: _nbytes(a["tensor"])),
    "all_to_all_single": ("all_to_all", lambda a: _nbytes(a["input"])),
    "isend": ("send", lambda a: _nbytes(a["tensor"])),
    "send": ("send", lambda a: _nbytes(a["tensor"])),
    "irecv": ("recv", lambda a: _nbytes(a["tensor"])),
    "recv": ("recv", lambda a: _nbytes(a["tensor"])),
    "barrier": ("barrier", lambda a: 0),
}


def wchar() -> int:
    """Bytes this process has handed to write(2)/writev(2) so far (/proc/self/io)."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("wchar:"):
                return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no wchar line")


class Counter:
    """The calls of the counted steps: (axis, phase, op, group size, full bytes) -> calls."""

    def __init__(self, skip: int) -> None:
        self.skip, self.calls = skip, 0
        self.active, self.phase = False, "passes"
        self.rank: int = -1
        self.sizes: dict[str, int] = {}
        self.axis_of: dict[int, str] = {}
        self.groups: list[Any] = []  # keeps the registered groups alive (their ids stay theirs)
        self.records: dict[tuple[str, str, str, int, int], int] = {}
        self.steps, self.wchar = 0, 0
        self.lock = threading.Lock()

    def register(self, group: Any, axis: str) -> None:
        if group is not None and id(group) not in self.axis_of:
            self.axis_of[id(group)] = axis
            self.groups.append(group)

    def spy(self, dist: Any, name: str) -> None:
        real = getattr(dist, name)
        op, size = SPIED[name]
        signature = inspect.signature(real)

        def counted(*args: Any, **kwargs: Any) -> Any:
            if self.active:
                bound = signature.bind(*args, **kwargs).arguments
                group = bound.get("group")
                axis = "world" if group is None else self.axis_of.get(id(group), "unknown")
                key = (axis, self.phase, op, dist.get_world_size(group), size(bound))
                with self.lock:
                    self.records[key] = self.records.get(key, 0) + 1
            return real(*args, **kwargs)

        setattr(dist, name, counted)

    def install(self) -> None:
        import torch.distributed as dist

        from app.runtime.grid import ProcessGrid
        from app.train import Trainer

        for name in SPIED:  # the package's names, which app/ calls (torch's internal calls stay uncounted)
            if hasattr(dist, name):
                self.spy(dist, name)
        counter = self
        grid_init, grid_3d, grid_pipeline = ProcessGrid.__init__, ProcessGrid.tensor3d, ProcessGrid.pipeline_groups

        def init(grid: ProcessGrid, runtime: Any, *args: Any, **kwargs: Any) -> None:
            grid_init(grid, runtime, *args, **kwargs)
            counter.rank = runtime.rank
            for axis, group in grid.group.items():
                counter.register(group, axis)
                counter.sizes[axis] = grid.size(axis)

        def tensor3d(grid: ProcessGrid, *args: Any, **kwargs: Any) -> Any:  # ProcessGrid.tensor3d's signature
            out = grid_3d(grid, *args, **kwargs)
            for axis, (_, group, ranks) in out.items():
                counter.register(group, axis)
                counter.sizes[axis] = len(ranks)
            return out

        def pipeline_groups(grid: ProcessGrid, wrap_around: bool) -> Any:
            groups, tied = grid_pipeline(grid, wrap_around)
            for group in [*groups.values(), tied]:
                counter.register(group, "pp")
            return groups, tied

        ProcessGrid.__init__ = init  # type: ignore[method-assign]
        ProcessGrid.tensor3d = tensor3d  # type: ignore[method-assign]
        ProcessGrid.pipeline_groups = pipeline_groups  # type: ignore[method-assign]
        trainer_step, trainer_update = Trainer.step, Trainer.update

        def step(trainer: Trainer) -> Any:
            counter.calls += 1
            if counter.calls <= counter.skip:
                return trainer_step(trainer)
            start = wchar()
            counter.active, counter.phase = True, "passes"
            try:
                return trainer_step(trainer)
            finally:
                counter.active = False
                counter.wchar += wchar() - start
                counter.steps += 1

        def update(trainer: Trainer, *args: Any, **kwargs: Any) -> Any:
            counter.phase = "update"
            try:
                return trainer_update(trainer, *args, **kwargs)
            finally:
                counter.phase = "passes"

        Trainer.step = step  # type: ignore[method-assign]
        Trainer.update = update  # type: ignore[method-assign]

    def write(self, out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        records = [{"axis": a, "phase": p, "op": o, "n": n, "bytes": b, "calls": c}
                   for (a, p, o, n, b), c in sorted(self.records.items())]  # fmt: skip
        text = json.dumps({"rank": self.rank, "sizes": self.sizes, "steps": self.steps, "wchar": self.wchar,
                           "records": records}, indent=1)  # fmt: skip
        (out / f"rank{self.rank}.json").write_text(text + "\n")


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        raise SystemExit(__doc__.split("\n\n")[1])
    out, skip, app_args = Path(argv[0]), int(argv[1]), argv[2:]
    counter = Counter(skip)
    counter.install()
    from app.__main__ import run

    rc = run(app_args)
    if rc == 0:
        counter.write(out)
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

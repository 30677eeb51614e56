"""Before step 1, what would fail hours in is refused in one line (app/runtime/preflight.py); a CUDA
out-of-memory error during the run ends every rank with one gridlm line (exit 2), at once.

This machine has no GPU and its h5py has MPI: the device queries are stubbed at the boundary
(`h5py_has_mpi`, `gpu_identity`, `gpu_memory`, and torch's OutOfMemoryError raised on one rank),
the checks and the job's handling of them are the real code.
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import pytest

from app.deck import load_deck, resolve_for_world
from app.errors import LaunchError
from app.plan.estimate import rank_device_bytes
from app.runtime import preflight
from conftest import REPO, run_mpi

GIB = 2**30
SMALL = ("model.layers=2", "model.hidden=64", "model.heads=4", "model.seq_len=16", "train.steps=3",
         "train.global_batch=4", "train.micro_batch=2", "run.resume=none")  # fmt: skip


def _deck(*sets: str, world: int = 1):
    return resolve_for_world(load_deck(REPO / "inputs/gpt_tiny.yaml", (*SMALL, *sets)), world)


def test_checkpoints_with_an_h5py_without_mpi_are_refused_with_both_fixes():
    with pytest.raises(LaunchError, match=r"h5py was built without MPI .*HDF5_MPI=ON.*checkpoint.every: 0"):
        preflight.checkpoint_io(_deck(), has_mpi=False)
    preflight.checkpoint_io(_deck("checkpoint.every=0", "checkpoint.at_exit=false"), has_mpi=False)  # none: fine
    preflight.checkpoint_io(_deck(), has_mpi=True)
    with pytest.raises(LaunchError, match=r"cannot resume from ckpt.h5: .*run.resume: none"):
        preflight.checkpoint_read("ckpt.h5", has_mpi=False)


def test_a_plan_above_the_free_device_memory_is_refused_and_near_it_warned():
    deck = _deck("train.micro_batch=2")
    planned = rank_device_bytes(deck, 0, gpu=True)
    assert planned > 0
    with pytest.raises(LaunchError, match=r"the plan needs .* GiB on rank 3 \(train.micro_batch 2.*it does not fit: "
                                          r"lower train.micro_batch"):  # fmt: skip
        preflight.device_memory(deck, planned, (int(planned * 0.5), 80 * GIB), rank=3)
    warning = preflight.device_memory(deck, planned, (int(planned / 0.95), 80 * GIB), rank=0)
    assert warning is not None and warning.startswith("warning: ") and "above 90%" in warning
    assert preflight.device_memory(deck, planned, (int(planned * 2), 80 * GIB), rank=0) is None
    assert preflight.device_memory(deck, planned, None, rank=0) is None  # a CPU: nothing to compare


@pytest.mark.mpi(min_size=2)
def test_two_ranks_of_a_node_on_one_gpu_are_named_on_every_rank(runtime):
    """The world's ranks all on this node: one GPU identity for two of them is refused on every
    rank (the same message), naming the ranks, the GPU and the binding fix; distinct GPUs pass."""
    with pytest.raises(LaunchError) as err:
        preflight.shared_gpus(runtime, "H100 GPU-1" if runtime.rank < 2 else f"H100 GPU-{runtime.rank + 5}")
    assert re.search(r"ranks 0, 1 on node \S+ all use one GPU \(H100 GPU-1\)", str(err.value))
    assert "--gpus-per-task=1" in str(err.value) and "mpirun" in str(err.value)
    preflight.shared_gpus(runtime, f"H100 GPU-{runtime.rank}")
    preflight.shared_gpus(runtime, None)  # CPU ranks


@pytest.mark.mpi
def test_the_trainer_refuses_before_step_1_on_every_rank(runtime, shared_tmp, monkeypatch, grids):
    """Through the trainer (agreed over all ranks): h5py without MPI with checkpoints on, and a GPU
    whose free memory is below the plan; the run directory never gets a step."""
    from app.train import Trainer

    deck = _deck(
        f"run.dir={shared_tmp / 'run'}", f"train.global_batch={2 * runtime.world_size}", world=runtime.world_size
    )
    grid = grids.grid(1, 1, runtime.world_size)
    monkeypatch.setattr(preflight, "h5py_has_mpi", lambda: False)
    with pytest.raises(LaunchError, match="h5py was built without MPI"):
        Trainer(deck, runtime, grid)
    monkeypatch.setattr(preflight, "h5py_has_mpi", lambda: True)
    monkeypatch.setattr(preflight, "gpu_memory", lambda device: (1 << 20, 80 * GIB))
    with pytest.raises(LaunchError, match=r"GiB free of 80.00: it does not fit"):
        Trainer(deck, runtime, grid)
    assert not (shared_tmp / "run" / "metrics.jsonl").exists()


OOM_ON_RANK_1 = """
import sys, torch
import app.train as train
from app.__main__ import run
forward_backward, build = train.Trainer.forward_backward, train.Trainer.__init__
def failing(self):
    if self.runtime.rank == 1 and self.steps_done == 1:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (stubbed)")
    return forward_backward(self)
def failing_build(self, deck, runtime, grid):  # the last allocation of the model and optimizer
    build(self, deck, runtime, grid)
    if runtime.rank == 1:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB (stubbed)")
if sys.argv.pop(1) == "step":
    train.Trainer.forward_backward = failing
else:
    train.Trainer.__init__ = failing_build
sys.exit(run(sys.argv[1:]))
"""


@pytest.mark.parametrize("when", ["step", "start-up"])
def test_an_out_of_memory_on_one_rank_ends_every_rank_with_one_line_and_exit_2(tmp_path, when):
    """torch.OutOfMemoryError in rank 1's forward at step 2, while rank 0 waits for it in the step's
    collectives, or at the end of rank 1's start-up (building the model and optimizer) while rank 0
    goes on: one gridlm line from rank 1 (rank, phase, step, the plan, the keys to lower), exit 2
    from the job, no traceback, no rank named lost or dead, long before the comm timeout (600 s)."""
    sets = [*SMALL, f"run.dir={tmp_path}", "checkpoint.every=0", "checkpoint.at_exit=false"]
    started = time.monotonic()
    out = run_mpi(2, sys.executable, "-c", OOM_ON_RANK_1, when, "inputs/gpt_tiny.yaml",
                  *(a for s in sets for a in ("--set", s)), timeout=240)  # fmt: skip
    elapsed = time.monotonic() - started
    text = out.stdout + out.stderr
    assert out.returncode == 2, text[-3000:]
    lines = [line for line in text.splitlines() if "out of memory" in line]
    assert len(lines) == 1, text[-3000:]
    where = "forward/backward at step 2" if when == "step" else r"start-up \(building the model and optimizer\)"
    assert re.match(rf"gridlm: rank 1: cpu out of memory in {where}; the plan estimated "
                    r"[\d.]+ GiB per device \(train.micro_batch 2.*lower train.micro_batch", lines[0]), lines[0]  # fmt: skip
    assert "Traceback" not in text and "internal error" not in text
    assert not re.search(r"lost its peer|died|dead", text), text[-3000:]
    assert elapsed < 120


def _files(root, files: dict[str, str]):
    """A made-up /proc and /sys under `root`: path -> text."""
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    return root


MEMINFO = {"proc/meminfo": f"MemTotal: {128 * 2**20} kB\nMemFree: 1 kB\nMemAvailable: {64 * 2**20} kB\n"}
V2_JOB = "sys/fs/cgroup/system.slice/slurmstepd.scope/job_7"


@pytest.mark.parametrize(
    "files, gib",
    [
        # cgroup v2 under Slurm: the limit on the job, the process in a task below it; file cache reclaimable
        ({"proc/self/cgroup": "0::/system.slice/slurmstepd.scope/job_7/step_0/user/task_0\n",
          f"{V2_JOB}/memory.max": f"{4 * GIB}\n", f"{V2_JOB}/memory.current": f"{3 * GIB}\n",
          f"{V2_JOB}/memory.stat": f"anon {2 * GIB}\ninactive_file {GIB // 2}\n",
          f"{V2_JOB}/step_0/user/task_0/memory.max": "max\n",
          f"{V2_JOB}/step_0/user/task_0/memory.current": f"{GIB}\n"}, 1.5),
        # cgroup v1 (memory controller's own hierarchy); the step's "no limit" is the largest page count
        ({"proc/self/cgroup": "4:memory:/slurm/uid_0/job_9/step_0\n3:cpuset:/slurm\n0::/\n",
          "sys/fs/cgroup/memory/slurm/uid_0/job_9/memory.limit_in_bytes": f"{8 * GIB}\n",
          "sys/fs/cgroup/memory/slurm/uid_0/job_9/memory.usage_in_bytes": f"{2 * GIB}\n",
          "sys/fs/cgroup/memory/slurm/uid_0/job_9/step_0/memory.limit_in_bytes": "9223372036854771712\n",
          "sys/fs/cgroup/memory/slurm/uid_0/job_9/step_0/memory.usage_in_bytes": f"{GIB}\n"}, 6),
        # a container: the kernel names a path of the host's, the mount is the container's own cgroup
        ({"proc/self/cgroup": "0::/docker/0123abcd\n", "sys/fs/cgroup/memory.max": f"{2 * GIB}\n",
          "sys/fs/cgroup/memory.current": f"{GIB}\n"}, 1),
        # no limit, or files that say nothing usable: MemAvailable
        ({"proc/self/cgroup": "4:memory:/\n", "sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712\n",
          "sys/fs/cgroup/memory/memory.usage_in_bytes": f"{GIB}\n"}, 64),
        ({"proc/self/cgroup": "0::/a\n", "sys/fs/cgroup/a/memory.max": "lots\n",
          "sys/fs/cgroup/a/memory.current": f"{GIB}\n"}, 64),
        ({"proc/self/cgroup": "0::/a\n", "sys/fs/cgroup/a/memory.max": f"{GIB}\n"}, 64),  # no usage
        ({}, 64),
    ],
    ids=["v2-slurm", "v1-slurm", "container", "v1-unlimited", "odd-limit", "no-usage", "no-cgroup"],
)  # fmt: skip
def test_host_memory_is_the_least_of_memavailable_and_the_cgroup_s_room(tmp_path, files, gib):
    """Found in review: only /proc/meminfo's MemAvailable was read, so a job under a cgroup limit
    (Slurm's --mem, a container's) was told the node's memory was its own (generation's KV cache
    check). Made-up /proc and /sys files under a root directory."""
    root = _files(tmp_path, {**MEMINFO, **files})
    assert preflight.host_available(root) == int(gib * GIB)


def test_host_memory_without_meminfo_is_the_cgroup_s_room_and_else_unknown(tmp_path):
    cgroup = {"proc/self/cgroup": "0::/\n", "sys/fs/cgroup/memory.max": f"{3 * GIB}\n",
              "sys/fs/cgroup/memory.current": f"{4 * GIB}\n"}  # fmt: skip
    assert preflight.host_available(_files(tmp_path / "over", cgroup)) == 0  # at its limit: nothing left
    assert preflight.host_available(tmp_path / "nothing") is None
    available = [line for line in Path("/proc/meminfo").read_text().splitlines() if line.startswith("MemAvailable:")]
    here = preflight.host_available()  # this machine's: never above its MemAvailable (read a moment earlier)
    assert here is not None and 0 < here <= int(available[0].split()[1]) * 1024 * 1.05

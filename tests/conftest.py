"""Shared fixtures. Under mpirun every rank runs pytest: each gets its own basetemp, and
the MPI tests share one initialised runtime (MPI + torch.distributed) per process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID")


def _launcher_rank() -> str | None:
    return next((os.environ[v] for v in _RANK_VARS if v in os.environ), None)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--with-slurm",
        action="store_true",
        default=False,
        help="run the tests marked slurm against a running Slurm (launch/slurm_local.sh start)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--with-slurm"):
        return
    skip = pytest.mark.skip(reason="needs --with-slurm (launch/test.sh starts a local Slurm)")
    for item in items:
        if item.get_closest_marker("slurm"):
            item.add_marker(skip)


def pytest_configure(config: pytest.Config) -> None:
    rank = _launcher_rank()
    if rank is not None and config.option.basetemp is None:
        # Ranks sharing one basetemp race on its clean-up; give each its own.
        size = os.environ.get("OMPI_COMM_WORLD_SIZE", os.environ.get("PMI_SIZE", "n"))
        base = Path(tempfile.gettempdir()) / f"gridlm-pytest-{os.getuid()}"
        base.mkdir(parents=True, exist_ok=True)
        config.option.basetemp = base / f"n{size}-rank{rank}"


@pytest.fixture(scope="session")
def runtime():
    """MPI + torch.distributed over COMM_WORLD, initialised once per rank (CPU, gloo)."""
    import torch

    from app.runtime.mpi import bind_device, init_mpi, init_torch_distributed, set_threads

    rt = init_mpi()
    bind_device(rt, "cpu")
    set_threads(rt, None)
    init_torch_distributed(rt)
    torch.use_deterministic_algorithms(True)
    yield rt


@pytest.fixture
def shared_tmp(runtime, tmp_path):
    """A directory every rank of the job sees under the same name (rank 0's tmp_path)."""
    return Path(runtime.comm.bcast(str(tmp_path), root=0))


def app_env() -> dict[str, str]:
    """Environment for launching `python -m app` (under mpirun) from a test."""
    env = dict(os.environ)
    for var in list(env):
        # A test may itself run under mpirun; the child job must not think it is part of it.
        if (
            var.startswith(("OMPI_", "PMIX_", "PMI_"))
            and not var.startswith("OMPI_MCA_")
            and "ALLOW_RUN_AS_ROOT" not in var
        ):
            del env[var]
    env.update(
        OMPI_ALLOW_RUN_AS_ROOT="1",
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
        OMPI_MCA_rmaps_base_oversubscribe="1",
        OMPI_MCA_btl_vader_single_copy_mechanism="none",
        OMP_NUM_THREADS="1",
        PYTHONPATH=str(REPO),
    )
    return env


def run_mpi(ranks: int, *command: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """`mpirun -n ranks command...` from the repository root; output captured."""
    cmd = ["mpirun", "-n", str(ranks), *command]
    return subprocess.run(cmd, cwd=REPO, env=app_env(), capture_output=True, text=True, timeout=timeout, check=False)


def run_app(ranks: int, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """`mpirun -n ranks python -m app args...` from the repository root; output captured."""
    return run_mpi(ranks, sys.executable, "-m", "app", *args, timeout=timeout)


def read_metrics(run_dir: Path) -> list[dict]:
    """The records of a run's metrics.jsonl, in order."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def grid_trainer(runtime, tp: int, pp: int, dp: int, overrides: tuple[str, ...]):
    """A `Trainer` of inputs/gpt_tiny.yaml with `overrides` on a tp x pp x dp grid of `runtime`."""
    from app.deck import load_deck, resolve_for_world
    from app.runtime.grid import ProcessGrid
    from app.train import Trainer

    sets = (*overrides, f"parallel.tp={tp}", f"parallel.pp={pp}", f"parallel.dp={dp}")
    deck = resolve_for_world(load_deck(REPO / "inputs/gpt_tiny.yaml", sets), runtime.world_size)
    return Trainer(deck, runtime, ProcessGrid(runtime, tp, pp, dp, deck.parallel.order))


def train_steps(trainer, steps: int) -> list[float]:
    """Run `steps` optimizer steps; the global-batch losses. Leaves no ZeRO all-gather in flight."""
    from app.train import global_loss

    trainer.model.train()
    losses = [global_loss(trainer.step()[0], trainer.grid) for _ in range(steps)]
    trainer.dp.wait_params()
    return losses

"""Shared fixtures. Under mpirun every rank runs pytest: each gets its own basetemp, and
the MPI tests share one initialised runtime (MPI + torch.distributed) per process."""

from __future__ import annotations

import gc
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from app.runtime.mpi import settle  # noqa: F401  (tests import it from here)

REPO = Path(__file__).resolve().parent.parent
_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID")


def _launcher_rank() -> str | None:
    return next((os.environ[v] for v in _RANK_VARS if v in os.environ), None)


# Skips that are part of the design rather than a test lost to the environment: an MPI test
# needs more ranks than this group has (a bigger group runs it), or counts what one rank does
# (the one-rank group runs it: ONE_RANK_GROUP), root may write anywhere, a parametrised case that
# does not apply.
ONE_RANK_GROUP = "one rank's count: the mpirun -n 1 group runs it"
EXPECTED_SKIPS = ("Test requires ", ONE_RANK_GROUP, "root may write anywhere", "5 layers")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--with-slurm",
        action="store_true",
        default=False,
        help="run the tests marked slurm against a running Slurm (launch/slurm_local.sh start)",
    )
    parser.addoption(
        "--with-cluster",
        action="store_true",
        default=False,
        help="run the tests marked multinode against running simulated nodes (launch/cluster_local.sh start 2)",
    )
    parser.addoption(
        "--strict-skips",
        action="store_true",
        default=False,
        help="fail the run if a test was skipped for another reason than those of EXPECTED_SKIPS "
        "(launch/test.sh passes it as root, where setup installed everything the tests need)",
    )
    parser.addoption(
        "--min-tests",
        type=int,
        default=0,
        help="fail the run if fewer tests than this ran (passed or failed; launch/test.sh gives each group "
        "its floor, so that a group that lost tests to collection or skips cannot pass)",
    )
    parser.addoption(
        "--mpi-peer-timeout",
        type=float,
        default=180.0,  # far above a test's rank-0-only tail (an export, a report) on a loaded machine
        help="under mpirun: seconds every rank waits for the others before each test (PeerGuard) before it "
        "aborts the job",
    )
    parser.addoption(
        "--quick",
        action="store_true",
        default=False,
        help="leave out the tests marked full: the quick tier, which launch/test.sh runs unless given --full "
        "(docs/TESTING.md)",
    )
    parser.addoption(
        "--mpi-min-size",
        type=int,
        default=0,
        help="run only the MPI tests whose min_size is at least this (the smaller groups ran the others)",
    )


def _min_size(item: pytest.Item) -> int:
    marker = item.get_closest_marker("mpi")
    return (marker.kwargs.get("min_size") or 1) if marker else 0


# The serial group's longest files (seconds of test time on a quiet 2-core machine, 2026-11-28), handed
# to its worker processes first: xdist deals files out in collection order, and test_watchdog.py,
# last by name and mostly waiting on timeouts, ran alone at the end while the other workers idled.
LONGEST_FIRST = (
    "test_watchdog.py",  # 126, mostly timeouts it waits out
    "test_benchmarks.py",  # 150
    "test_generate.py",  # 141
    "test_perf.py",  # 89
    "test_nonfinite.py",  # 85
    "test_init_from.py",  # 83
    "test_app.py",  # 68
    "test_run_dir.py",  # 68
)


def _deselect(config: pytest.Config, items: list[pytest.Item], out: Any) -> None:
    """Drop the items for which `out(item)` holds, reported as deselected (not skipped: a group's
    floor and --strict-skips count what it was asked to run)."""
    dropped = [out(item) for item in items]
    config.hook.pytest_deselected(items=[item for item, drop in zip(items, dropped) if drop])
    items[:] = [item for item, drop in zip(items, dropped) if not drop]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):  # the serial group's workers (the same order on every one)
        rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
        items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FIRST)))  # stable: the rest keep theirs
    floor = config.getoption("--mpi-min-size")
    if floor:
        _deselect(config, items, lambda item: _min_size(item) < floor)
    if config.getoption("--quick"):
        _deselect(config, items, lambda item: item.get_closest_marker("full") is not None)
    for marker, option, reason in (
        ("slurm", "--with-slurm", "needs --with-slurm (launch/test.sh starts a local Slurm)"),
        ("multinode", "--with-cluster", "needs --with-cluster (launch/test.sh starts 2 simulated nodes)"),
    ):
        if not config.getoption(option):
            for item in items:
                if item.get_closest_marker(marker):
                    item.add_marker(pytest.mark.skip(reason=reason))


class PeerGuard:
    """Under mpirun with more than one rank: before each test every rank meets the others on a
    communicator of its own (a nonblocking barrier, which no test's collective can match), and aborts
    the whole job if they have not all arrived within `seconds`. A test that failed or was skipped on
    some ranks only leaves the others inside it, blocked in a collective nobody will join: without
    the guard the ranks that left would run on into the next test, whose collectives could complete
    the stranded ones' (a false pass), and the group would end only at the per-test timeout."""

    def __init__(self, seconds: float, capture: Any) -> None:
        from mpi4py import MPI

        self.mpi, self.seconds, self.capture = MPI, seconds, capture
        self.comm = MPI.COMM_WORLD.Dup()

    def meet(self, nodeid: str) -> None:
        import time

        if not settle(self.comm, 0.001, timeout=self.seconds):
            self.say(
                f"rank {self.comm.rank}: not every rank reached {nodeid} within {self.seconds:g} s: a rank is "
                "still inside an earlier test (one that failed or was skipped on some ranks only, see above); "
                "aborting the MPI job"
            )
            time.sleep(1.0)  # mpirun forwards the line before the abort's kill
            self.mpi.COMM_WORLD.Abort(1)

    def say(self, text: str) -> None:
        """Straight to the job's stderr, past pytest's capture: an abort leaves no terminal summary."""
        with self.capture.global_and_fixture_disabled():
            sys.stderr.write(f"\ngridlm tests: {text}\n")
            sys.stderr.flush()


_GUARD = pytest.StashKey[PeerGuard]()


def pytest_runtest_setup(item: pytest.Item) -> None:
    guard = item.config.stash.get(_GUARD, None)
    if guard is not None:
        guard.meet(item.nodeid)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Any:
    outcome = yield
    report = outcome.get_result()
    guard = item.config.stash.get(_GUARD, None)
    if guard is not None and report.failed:  # said now: a PeerGuard abort would leave no failure report
        guard.say(f"rank {guard.comm.rank}: {report.nodeid} failed ({report.when}):\n{report.longreprtext}")


def pytest_configure(config: pytest.Config) -> None:
    if _launcher_rank() is not None and config.getoption("--with-mpi", False):
        from mpi4py import MPI

        if MPI.COMM_WORLD.size > 1:
            capture = config.pluginmanager.getplugin("capturemanager")
            config.stash[_GUARD] = PeerGuard(config.getoption("--mpi-peer-timeout"), capture)
    rank = _launcher_rank()
    if rank is not None and config.option.basetemp is None:
        # Ranks sharing one basetemp race on its clean-up; give each its own.
        size = os.environ.get("OMPI_COMM_WORLD_SIZE", os.environ.get("PMI_SIZE", "n"))
        base = Path(tempfile.gettempdir()) / f"gridlm-pytest-{os.getuid()}"
        base.mkdir(parents=True, exist_ok=True)
        config.option.basetemp = base / f"n{size}-rank{rank}"


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped and isinstance(report.longrepr, tuple):
        reason = str(report.longrepr[2]).removeprefix("Skipped: ")
        if not reason.startswith(EXPECTED_SKIPS):
            report.user_properties.append(("unexpected_skip", reason))


def _ran(stats: dict) -> int:
    """Tests that ran to a verdict (their call phase passed or failed, or their set-up errored)."""
    return sum(1 for key in ("passed", "failed", "error") for r in stats.get(key, []) if r.when in ("call", "setup"))


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    unexpected = [
        (report.nodeid, dict(report.user_properties)["unexpected_skip"])
        for report in terminalreporter.stats.get("skipped", [])
        if "unexpected_skip" in dict(report.user_properties)
    ]
    ran = _ran(terminalreporter.stats)
    floor = config.getoption("--min-tests")
    if ran < floor:
        terminalreporter.write_line(
            f"only {ran} test(s) ran, fewer than this group's floor of {floor} (--min-tests): tests were lost "
            "to collection, selection or skips"
        )
    if _launcher_rank() == "0":
        # Grids are reused (GridPool) and their groups are cheap (app/runtime/groups.py), so the
        # count after the last test stays low however many grids the tests train.
        after = config.stash.get(_THREADS, None)
        last = "" if after is None else f"{after} after its last test, "
        terminalreporter.write_line(f"rank 0 had {last}ends with {_threads()} threads")
    if unexpected:
        terminalreporter.section("tests skipped by the environment")
        for nodeid, reason in unexpected:
            terminalreporter.write_line(f"{nodeid}: {reason}")
        if config.getoption("--strict-skips"):
            terminalreporter.write_line(
                f"{len(unexpected)} test(s) did not run: a group must run all its tests (--strict-skips)"
            )


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
    stats = getattr(config.pluginmanager.get_plugin("terminalreporter"), "stats", {})
    unexpected = [r for r in stats.get("skipped", []) if "unexpected_skip" in dict(r.user_properties)]
    if unexpected and config.getoption("--strict-skips") and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    if _ran(stats) < config.getoption("--min-tests") and session.exitstatus in (0, pytest.ExitCode.NO_TESTS_COLLECTED):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    # pytest-mpi prints an "MPI Information" section on every rank; rank 0's is enough.
    if (_launcher_rank() or "0") != "0":
        for plugin in config.pluginmanager.get_plugins():
            if type(plugin).__name__ == "MPIPlugin" and hasattr(plugin, "_is_testing_mpi"):
                plugin._is_testing_mpi = False


_THREADS = pytest.StashKey[int]()
_SESSION = pytest.StashKey[pytest.Session]()


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config.stash[_SESSION] = session


@pytest.hookimpl(tryfirst=True)
def pytest_collection(session: pytest.Session) -> None:
    gc.disable()  # until the test modules are imported (pytest_collection_finish)


def pytest_collection_finish(session: pytest.Session) -> None:
    """As a rank's start-up (`app.runtime.process.start_up`): what collection imported (torch, the
    app, the test modules: about a million objects that live as long as the session) frozen, out of
    the collector's reach, and the collector back on. Unfrozen, each full collection during the
    tests walked them all: 8 a rank of about 250 ms each in the 2-rank group (2.6 s of 47 s)."""
    gc.freeze()
    gc.enable()


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """Under mpirun, once everything is written: end the rank as the app's MPI entry points do
    (`exit_now`: exit hooks, MPI_Finalize, flush, no teardown of torch and the test modules, about
    1 s of CPU a rank, 8 ranks to 2 cores), with the exit status pytest would return."""
    session = config.stash.get(_SESSION, None)
    if _launcher_rank() is None or session is None or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    from app.runtime.process import exit_now

    exit_now(int(session.exitstatus))


def _threads() -> int:
    return len(os.listdir(f"/proc/{os.getpid()}/task"))


@pytest.fixture(scope="session")
def runtime(request):
    """MPI + torch.distributed over COMM_WORLD, initialised once per rank (CPU, gloo)."""
    import torch

    from app.runtime.mpi import bind_device, init_mpi, init_torch_distributed, set_threads

    rt = init_mpi()
    bind_device(rt, "cpu")
    set_threads(rt, None)
    init_torch_distributed(rt)
    torch.use_deterministic_algorithms(True)
    yield rt
    # The groups' threads (app/runtime/groups.py) before and after they are destroyed: the report
    # shows both (pytest_terminal_summary), so that the peak a group reached stays visible.
    request.config.stash[_THREADS] = _threads()
    settle(rt.comm)  # no peer still in a collective on a group about to go
    rt.groups.destroy()
    gc.collect()  # a gloo group's threads end with the object, once nothing refers to it


class GridPool:
    """Process grids made once per shape and reused by every test of the session.

    torch names a locally synchronised group after its ranks and the number of groups the
    process holds, so a destroyed group's name comes back with its stale rendezvous keys and
    the next group of those ranks hangs; groups are therefore kept, and reused instead of made
    anew for each trainer. Every rank asks for the same shapes in the same order (the tests
    are collective), so every rank makes the same number of groups. The ranks are split into
    world / (tp x pp x dp) copies of the grid (`runtime(size)`), each a job of its own; one of
    them trains (`trains`), the others stand by.
    """

    def __init__(self, world) -> None:
        self.world = world
        self._runtimes: dict[int, object] = {world.world_size: world}
        self._grids: dict[tuple, object] = {}

    def runtime(self, size: int):
        """This rank's copy (a sub-communicator of `size` ranks) of the world."""
        if size not in self._runtimes:
            from app.runtime.mpi import bind_device, init_mpi

            sub = init_mpi(self.world.comm.Split(self.world.rank // size, self.world.rank))
            bind_device(sub, "cpu")
            sub.groups = self.world.groups  # one process, one record of its torch groups
            self._runtimes[size] = sub
        return self._runtimes[size]

    def grid(self, tp: int, pp: int, dp: int, order: str = "tp-dp-pp", cp: int = 1):
        """The tp x cp x pp x dp grid (in `order`) of this rank's copy, made on first use."""
        from app.runtime.grid import ProcessGrid

        key = (tp, pp, dp, order, cp)
        if key not in self._grids:
            self._grids[key] = ProcessGrid(self.runtime(tp * cp * pp * dp), tp, pp, dp, order, cp)
        return self._grids[key]

    def trains(self, size: int) -> bool:
        """Whether this rank's copy trains a grid of `size` ranks. Only the last copy does (its
        torch ranks do not start at 0, which the groups of 1 to 4 ranks cannot show): the other
        copies would repeat its arithmetic on the same shared cores (2 cores, 8 ranks) and only
        slow it down. They call `stand_by` instead."""
        return self.world.rank // size == self.world.world_size // size - 1

    def stand_by(self, grid, virtual_stages: int) -> None:
        """What a copy that does not train still does: make the groups a trainer on `grid`
        makes (its pipeline's), so that every process holds as many groups as its peers."""
        grid.pipeline_groups(wrap_around=virtual_stages > 1)

    def close(self) -> None:
        self._grids.clear()  # their torch groups go with the last reference (the runtime fixture destroys them)
        for size, sub in self._runtimes.items():
            if size != self.world.world_size:
                sub.comm.Free()


@pytest.fixture(scope="session")
def grids(runtime):
    """The session's `GridPool` over the MPI world."""
    pool = GridPool(runtime)
    yield pool
    pool.close()


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


def fake_cpu_topology(sysfs: Path, sockets: int, cores: int) -> None:
    """A sysfs of `sockets` x `cores` cores with 2 hardware threads each, as Linux numbers them: cpu c
    and c + sockets x cores are one core's two threads (`physical_cores` reads it)."""
    cpus = sockets * cores
    for cpu in range(2 * cpus):
        topology = sysfs / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "physical_package_id").write_text(f"{cpu % cpus // cores}\n")
        (topology / "core_id").write_text(f"{cpu % cores}\n")


def grid_trainer(grids: GridPool, tp: int, pp: int, dp: int, overrides: tuple[str, ...]):
    """A `Trainer` of inputs/gpt_tiny.yaml with `overrides` on the pool's tp x pp x dp grid
    (this rank's copy of it when the world holds several)."""
    from app.deck import load_deck, resolve_for_world
    from app.train import Trainer

    sets = (*overrides, f"parallel.tp={tp}", f"parallel.pp={pp}", f"parallel.dp={dp}")
    deck = load_deck(REPO / "inputs/gpt_tiny.yaml", sets)
    cp = deck.parallel.cp  # context parallelism, where the overrides set it
    deck = resolve_for_world(deck, tp * cp * pp * dp)
    return Trainer(deck, grids.runtime(tp * cp * pp * dp), grids.grid(tp, pp, dp, deck.parallel.order, cp))


def sigterm_after_step(trainer, runtime, step: int) -> None:
    """Make the last rank of `runtime` send itself SIGTERM once `trainer` finished step `step`,
    as a scheduler would to one rank only."""
    import signal

    run_step = trainer.step

    def step_then_signal():
        out = run_step()
        if trainer.steps_done == step and runtime.rank == runtime.world_size - 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    trainer.step = step_then_signal


def reference_run(grids: GridPool, deck_sets: tuple[str, ...], steps: int, cache: dict) -> tuple[list[float], dict]:
    """The 1-rank run of inputs/gpt_tiny.yaml with `deck_sets` (include a run.dir): its `steps`
    global-batch losses and its parameters by name, the reference that any grid must equal.
    Computed once per `deck_sets` (kept in `cache`) on world rank 0 alone, on its own 1-rank
    grid, and broadcast: the other ranks would only compute the same numbers on the same cores.
    Every rank still makes the 1-rank grid, so that all hold the same number of torch groups."""
    if deck_sets not in cache:
        grids.grid(1, 1, 1)
        result = None
        if grids.world.rank == 0:
            trainer = grid_trainer(grids, 1, 1, 1, deck_sets)
            losses = train_steps(trainer, steps)
            result = (losses, {name: p.detach().clone() for name, p in trainer.model.named_parameters()})
        settle(grids.world.comm)
        cache[deck_sets] = grids.world.comm.bcast(result, root=0)
    return cache[deck_sets]


def shard_errors(
    model, ref_params: dict, atol: float, rank: int, mean_atol: float = math.inf
) -> tuple[list[str], float]:
    """Every local shard of `model` against the same slice of the 1-rank parameters `ref_params`:
    (a line per shard off by more than `atol` in any element or by more than `mean_atol` on
    average over its elements, the largest absolute error). Collected, not asserted, so that
    every rank reaches the collectives that follow."""
    problems, worst = [], 0.0
    for name, p in model.named_parameters():
        offset = p.meta.offset or (0,) * p.dim()
        expected = ref_params[name][tuple(slice(o, o + n) for o, n in zip(offset, p.shape))]
        error = (p.detach().float() - expected.float()).abs()
        worst = max(worst, error.max().item())
        if error.max().item() > atol or error.mean().item() > mean_atol:
            problems.append(
                f"rank {rank}: shard of {name} off by {error.max().item():.2e} (mean {error.mean().item():.2e})"
            )
    return problems, worst


def assert_recompute_is_bitwise(make_model, tokens, targets, recompute: str) -> None:
    """The loss and every gradient of `make_model(recompute)` equal those of `make_model("none")`,
    bitwise, with the same dropout masks (the generator seeded alike before each): recomputation
    re-runs the same forward, collectives included, with the generator restored."""
    import torch

    results = []
    for mode in ("none", recompute):
        model = make_model(mode).train()
        torch.manual_seed(11)  # dropout masks
        loss = model.loss(tokens, targets)
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (want_loss, want_grads), (loss, grads) = results
    assert torch.equal(loss, want_loss)
    for name, grad in grads.items():
        assert torch.equal(grad, want_grads[name]), name


def train_steps(trainer, steps: int) -> list[float]:
    """Run `steps` optimizer steps; the global-batch losses (under 3D tensor parallelism averaged over
    Z too, which splits the batch). Leaves no ZeRO all-gather in flight."""
    from app.parallel.loss import global_loss

    trainer.model.train()
    losses = [global_loss(trainer.step()[0], trainer.grid, trainer.tp) for _ in range(steps)]
    trainer.dp.wait_params()
    return losses


def rank_pid(marker: str, rank: int) -> int:
    """The pid of `python -m app` rank `rank` of the job whose command line contains `marker`."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if marker in cmdline and "-m app" in cmdline and f"OMPI_COMM_WORLD_RANK={rank}".encode() in environ:
            return int(entry.name)
    raise AssertionError(f"no rank {rank} process of {marker}")

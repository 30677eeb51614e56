"""gridlm across 2 simulated nodes (launch/cluster_local.sh: network + UTS namespaces on a bridge,
each node its own hostname and address): the code paths only multi-node jobs take.

Run with `--with-cluster` while 2 nodes are up (launch/test.sh starts and stops them; by hand:
`eval "$(launch/cluster_local.sh start 2)"`). Jobs start with mpirun and the cluster's rsh agent
(`--host gridlm-node1:4,gridlm-node2:4`), or under the cluster's Slurm (`sbatch -N 2`). Without
the flag these tests are skipped; with it, nodes that are not up are a failure.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import REPO, app_env, read_metrics, run_app

pytestmark = pytest.mark.multinode

CLUSTER = REPO / "launch/cluster_local.sh"
TINY = REPO / "inputs/gpt_tiny.yaml"
NODES = ("gridlm-node1", "gridlm-node2")
HOSTS = ",".join(f"{node}:4" for node in NODES)
MPIRUN = ("mpirun", "-n", "8", "--host", HOSTS)  # 4 ranks on each node, through the cluster's rsh agent
# tests/test_app.py's small model: 2 layers (one per stage at pp 2), global batch 8 = 2 x 2 x dp 2.
SMALL = (
    "--set", "model.layers=2", "--set", "model.hidden=64", "--set", "model.seq_len=32",
    "--set", "train.global_batch=8", "--set", "train.micro_batch=2", "--set", "run.log_every=1",
)  # fmt: skip
GRID = ("--set", "parallel.tp=2", "--set", "parallel.pp=2")  # dp 2 over 8 ranks
# Steps stay inside the 20 warm-up steps, whose learning rates do not depend on train.steps: a run
# of 300 steps cut off at step 6 and a run of 16 see the same rates.
REF_STEPS = 16  # the reference's steps; a resume continues to them (the link test's from step 4, 8 or 12)


@pytest.fixture(scope="module")
def cluster() -> dict[str, str]:
    """app_env() plus the exports of the running cluster (rsh agent, interfaces, SLURM_CONF)."""
    env = app_env()
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    out = subprocess.run([str(CLUSTER), "status"], env=env, capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        pytest.fail(f"--with-cluster but no simulated nodes are up: {out.stderr.strip()}; run {CLUSTER} start 2")
    for line in out.stdout.splitlines():
        name, _, value = line.removeprefix("export ").partition("=")
        env[name] = " ".join(shlex.split(value))  # the script quotes values for a shell's eval (printf %q)
    for node in NODES:
        if f"{node} " not in out.stderr:
            pytest.fail(f"--with-cluster but {node} is not up:\n{out.stderr}")
        # The tests count and kill the ranks on the nodes: none may be left from an earlier run.
        if node_processes(node):
            pytest.fail(f"python processes left on {node}: {node_processes(node)}; {CLUSTER} stop, then start 2")
    return env


@pytest.fixture
def jobs():
    """Start background jobs with `jobs(cmd, env)`; whatever a test leaves running is killed."""
    started: list[Job] = []

    def start(cmd: list[str], env: dict[str, str]) -> Job:
        started.append(Job(cmd, env))
        return started[-1]

    yield start
    for job in started:
        job.kill()


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[float]:
    """The 1-rank losses of the small deck (no cluster: a plain local mpirun)."""
    run_dir = tmp_path_factory.mktemp("reference")
    one_rank(run_dir)
    return [r["loss"] for r in read_metrics(run_dir)]


def one_rank(run_dir: Path, *sets: str) -> str:
    """REF_STEPS steps of the small deck on 1 rank in `run_dir` (no cluster: a plain local mpirun),
    its stdout; `sets` adds overrides (run.resume=auto continues a checkpoint there)."""
    out = run_app(1, str(TINY), *SMALL, "--set", f"train.steps={REF_STEPS}", "--set", "checkpoint.at_exit=false",
                  "--set", f"run.dir={run_dir}", *sets)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def mpirun(env: dict[str, str], *args: str, timeout: float = 240, **kw) -> subprocess.CompletedProcess:
    """`mpirun -n 8 --host gridlm-node1:4,gridlm-node2:4 ...` (the ranks see env's -x variables)."""
    cmd = [*MPIRUN, *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout, check=False, **kw)


def app_args(run_dir: Path, *sets: str) -> list[str]:
    return [sys.executable, "-m", "app", str(TINY), *SMALL, *GRID, "--set", f"run.dir={run_dir}", *sets]


def node_processes(node: str, comm: str = "python") -> list[int]:
    """The pids of `comm` processes in a node's network namespace."""
    pids = subprocess.run(["ip", "netns", "pids", node], capture_output=True, text=True, timeout=30).stdout.split()
    found = []
    for pid in pids:
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() == comm:
                found.append(int(pid))
        except OSError:
            pass
    return found


class Job:
    """A job running in the background whose merged output is read as it comes, with times."""

    def __init__(self, cmd: list[str], env: dict[str, str]) -> None:
        self.lines: list[tuple[float, str]] = []
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, errors="replace", start_new_session=True,
        )  # fmt: skip
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    @property
    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def wait_for(self, pattern: str, timeout: float) -> tuple[float, str]:
        """(when, line) of the first output line matching `pattern`; fails after `timeout` s."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for when, line in list(self.lines):
                if re.search(pattern, line):
                    return when, line
            if self.proc.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.2)
        self.kill()
        pytest.fail(f"no line matching {pattern!r} within {timeout} s (exit {self.proc.poll()}):\n{self.text[-6000:]}")

    def wait(self, timeout: float) -> int:
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"the job did not end within {timeout} s:\n{self.text[-6000:]}")
        self._reader.join(timeout=10)
        return rc

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 9)
            self.proc.wait(timeout=30)
        for node in NODES:  # what mpirun's daemons left behind
            for pid in node_processes(node):
                os.kill(pid, 9)


def test_tp2_pp2_dp2_across_two_nodes_equals_one_rank_at_master_addr_and_loads_on_one_rank(
    cluster, reference, tmp_path
):
    run_dir = tmp_path / "run"
    # GRIDLM_MASTER_ADDR: rank 0's node by its address on the bridge (the ranks would use its hostname).
    env = {**cluster, "GRIDLM_MASTER_ADDR": "10.231.0.11"}
    out = mpirun(env, "-x", "GRIDLM_MASTER_ADDR", *app_args(run_dir, "--set", "train.steps=4"))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "| world 8 on 2 node(s) |" in out.stdout, out.stdout
    assert "gridlm: nodes gridlm-node1 (ranks 0-3), gridlm-node2 (ranks 4-7)" in out.stdout, out.stdout
    assert re.search(r"rendezvous 10\.231\.0\.11:\d+ \(GRIDLM_MASTER_ADDR\)", out.stdout), out.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["world_size"], summary["nodes"], summary["ranks_per_node"]) == (8, 2, 4)
    # The default order tp-dp-pp on 4 ranks a node: tp and dp inside, the 2 stages on 2 nodes.
    assert summary["grid"]["within_node"] == {"tp": True, "pp": False, "dp": True}
    # fp32, only the summation order differs between grids: tests/test_app.py's 1e-5.
    losses = [r["loss"] for r in read_metrics(run_dir)]
    assert losses == pytest.approx(reference[:4], rel=1e-5)
    # The checkpoint the 2 nodes wrote at exit continues on 1 rank (resharded) with the 1-rank losses.
    one = one_rank(run_dir, "--set", "run.resume=auto")
    assert "resumed from" in one and "at step 4" in one, one
    resumed = [r["loss"] for r in read_metrics(run_dir)]
    assert resumed == pytest.approx(reference, rel=1e-5)


def test_ranks_dealt_round_robin_that_break_a_group_s_order_are_refused_on_every_rank(cluster, tmp_path):
    """`mpirun --map-by node` deals ranks 0, 2, 4, 6 to node 1 and 1, 3, 5, 7 to node 2. At tp 2 x dp 4
    each dp group then holds two ranks of each node, whose launcher ranks torch's group would order
    otherwise than the grid does: with ZeRO-1 its shards would be silently wrong, so every rank stops
    at start-up with the fix (grid.unordered_group), no step taken, no hang. tp 2 x pp 2 x dp 2 keeps
    every group in order under the same dealing, and runs."""
    sets = ("--set", "parallel.tp=2", "--set", "train.steps=2")
    dealt = ("--map-by", "node")
    zero = ("--set", "parallel.pp=1", "--set", "optim.zero=1")
    out = mpirun(cluster, *dealt, *app_args(tmp_path / "refused", *sets, *zero), timeout=180)
    text = out.stdout + out.stderr
    assert out.returncode != 0 and "the launcher's rank order does not fit the grid" in text, text[-3000:]
    assert "--map-by node" in text and "Traceback" not in text and "step 1/" not in text, text[-3000:]
    ok = mpirun(cluster, *dealt, *app_args(tmp_path / "runs", *sets), timeout=180)
    assert ok.returncode == 0, (ok.stdout + ok.stderr)[-3000:]


def test_tp_groups_stay_on_a_node_and_pp_or_dp_groups_cross_nodes(cluster, tmp_path):
    # Each rank all-gathers its real hostname over every axis group (gloo over the bridge).
    report_file = tmp_path / "groups.json"
    out = mpirun(cluster, sys.executable, str(REPO / "tests/multinode_probe.py"), str(report_file))
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads(report_file.read_text())
    assert report["nodes"] == 2
    assert report["hosts"] == [NODES[0]] * 4 + [NODES[1]] * 4
    crossing = {"tp-dp-pp": "pp", "tp-pp-dp": "dp"}  # the outermost axis spans the nodes
    for order, outer in crossing.items():
        for rank, groups in enumerate(report[order]["groups"]):
            spans = {axis: len(set(hosts)) for axis, hosts in groups.items()}
            assert spans["tp"] == 1 and report["hosts"][rank] in groups["tp"], (order, rank, groups)
            assert spans[outer] == 2, (order, rank, groups)
            inner = ({"pp", "dp"} - {outer}).pop()
            assert spans[inner] == 1, (order, rank, groups)
        # What the banner and summary.json say (from MPI's shared-memory split) is what the groups saw.
        assert report[order]["within_node"] == {"tp": True, outer: False, ({"pp", "dp"} - {outer}).pop(): True}


# The quick tier launches the first (tests/test_rendezvous.py refuses all three in-process).
@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("10.231.0.12", "is not an address of rank 0's node gridlm-node1"),
        pytest.param("127.0.0.1", "is a loopback address, but the job spans 2 nodes", marks=pytest.mark.full),
        pytest.param("no-such-host.invalid", "does not resolve on rank 0's node gridlm-node1", marks=pytest.mark.full),
    ],
)
def test_a_wrong_master_addr_fails_fast_with_the_fix(cluster, tmp_path, value, message):
    env = {**cluster, "GRIDLM_MASTER_ADDR": value}
    started = time.monotonic()
    out = mpirun(env, "-x", "GRIDLM_MASTER_ADDR", *app_args(tmp_path / "run", "--set", "train.steps=2"), timeout=120)
    took = time.monotonic() - started
    assert out.returncode == 2, out.stdout + out.stderr
    lines = [line for line in out.stderr.splitlines() if line.startswith("gridlm: GRIDLM_MASTER_ADDR")]
    assert len(lines) == 1 and message in lines[0] and "unset it" in lines[0], out.stderr
    assert "Traceback" not in out.stderr
    assert took < 100, f"took {took:.0f} s"  # bounded: no torch rendezvous timeout (1860 s by default)


def test_sbatch_runs_a_two_node_job_script_from_submit_py(cluster, tmp_path):
    if shutil.which("sbatch", path=cluster["PATH"]) is None or "SLURM_CONF" not in cluster:
        pytest.fail("the cluster's Slurm is not up (launch/cluster_local.sh start 2 starts it)")
    run_dir, script = tmp_path / "run", tmp_path / "job.sh"
    sets = [*SMALL, *GRID, "--set", "train.steps=3", "--set", "checkpoint.at_exit=false", "--set", f"run.dir={run_dir}"]
    made = subprocess.run(
        [sys.executable, str(REPO / "launch/submit.py"), str(TINY), "--machine", "local", "--nodes", "2",
         "--out", str(script), "--time", "00:05:00", *sets],
        cwd=tmp_path, env=cluster, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert made.returncode == 0, made.stdout + made.stderr
    assert "srun -N 2 -n 8" in script.read_text()
    name = f"gridlm-multinode-{os.getpid()}"
    try:
        out = subprocess.run(["sbatch", "--wait", "-J", name, str(script)], cwd=tmp_path, env=cluster,
                             capture_output=True, text=True, timeout=240)  # fmt: skip
    except subprocess.TimeoutExpired:
        subprocess.run(["scancel", "--name", name], env=cluster, timeout=30, check=False)
        raise
    logs = "".join(p.read_text(errors="replace") for p in sorted(run_dir.glob("job-*.out")))
    assert out.returncode == 0, out.stdout + out.stderr + logs
    # Slurm placed 4 tasks on each node (--ntasks-per-node), as the banner and summary say.
    assert "| world 8 on 2 node(s) |" in logs and "gridlm-node1 (ranks 0-3), gridlm-node2 (ranks 4-7)" in logs, logs
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["world_size"], summary["nodes"], summary["steps"]) == (8, 2, 3)


def kill_node_ranks(job: Job, node: str) -> float:
    """Once the job trains, kill -9 every rank on `node`; when it was done."""
    job.wait_for(r"^step\s+3/", timeout=180)
    victims = node_processes(node)
    assert len(victims) == 4, victims
    for pid in victims:
        os.kill(pid, 9)
    return time.monotonic()


def assert_no_ranks_left() -> None:
    """No rank outlives its job: a process being torn down gets 30 s to go."""
    deadline = time.monotonic() + 30
    while any(node_processes(node) for node in NODES) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = {node: node_processes(node) for node in NODES}
    assert not any(left.values()), f"ranks left after the job: {left}"


def test_killing_every_rank_of_a_node_under_mpirun_ends_the_job_within_60_s_and_names_the_node(cluster, jobs, tmp_path):
    sets = ("--set", "train.steps=100000", "--set", "checkpoint.at_exit=false", "--set", "run.log_every=1")
    job = jobs([*MPIRUN, *app_args(tmp_path / "run", *sets)], cluster)
    killed = kill_node_ranks(job, NODES[1])
    rc = job.wait(timeout=60)
    took = time.monotonic() - killed
    assert rc != 0, job.text[-4000:]
    assert took < 60, f"the job took {took:.0f} s to end:\n{job.text[-4000:]}"
    # Whoever speaks first names the node: the ranks of node 1 whose gloo peer on node 2 reset
    # the connection ("the lost peer is on gridlm-node2 ...; gridlm-node2 holds ranks 4-7"), or
    # mpirun, whose daemon on node 2 saw its ranks die and which then kills the others (a rank
    # of node 1 may then see a node-1 peer go first, and name it: true, but not the cause).
    # So every line names the node its lost peer really was on (node 2: ranks 4-7, node 1: ranks 0-3,
    # which mpirun killed: under load a node-1 rank saw that first, 2026-11-27), and node 2 is named
    # as the cause by a rank or by the launcher.
    remote = [line for _, line in job.lines if "lost its peer" in line and "the lost peer is on" in line]
    on_node = {"gridlm-node2 (10.231.0.12)": "gridlm-node2 holds ranks 4-7",
               "gridlm-node1 (10.231.0.11)": "gridlm-node1 holds ranks 0-3"}  # fmt: skip
    assert all(any(f"on {node}" in line and ranks in line for node, ranks in on_node.items()) for line in remote), (
        job.text[-6000:]
    )
    launcher = re.search(r"process rank [4-7] with PID \d+ on node gridlm-node2 exited on signal 9", job.text)
    assert launcher or any("on gridlm-node2 (10.231.0.12)" in line for line in remote), job.text[-6000:]
    assert_no_ranks_left()


def test_killing_every_rank_of_a_node_under_srun_ends_the_step_within_60_s_and_names_the_node(cluster, jobs, tmp_path):
    # launch/jobs/common.sh exports SLURM_KILL_BAD_EXIT=1 for every job script: srun -K.
    env = {**cluster, "SLURM_KILL_BAD_EXIT": "1"}
    sets = ("--set", "train.steps=100000", "--set", "checkpoint.at_exit=false", "--set", "run.log_every=1")
    name = f"gridlm-multinode-{os.getpid()}"
    srun = ["srun", "-N", "2", "-n", "8", "--mpi=pmix", "-J", name, "-t", "5"]
    job = jobs([*srun, *app_args(tmp_path / "run", *sets)], env)
    try:
        killed = kill_node_ranks(job, NODES[1])
        rc = job.wait(timeout=60)
    finally:
        subprocess.run(["scancel", "--name", name], env=cluster, timeout=30, check=False)
    took = time.monotonic() - killed
    assert rc != 0 and took < 60, f"exit {rc} after {took:.0f} s:\n{job.text[-4000:]}"
    # srun names the node's tasks as they die, in one line or several ("tasks 5-7", then "task 4";
    # or "tasks 4,6-7", then "task 5").
    named = set()
    for tasks in re.findall(r"srun: error: gridlm-node2: tasks? ([\d,-]+): Killed", job.text):
        for part in tasks.split(","):
            first, _, last = part.partition("-")
            named.update(range(int(first), int(last or first) + 1))
    assert named == {4, 5, 6, 7}, job.text[-4000:]
    assert_no_ranks_left()


def test_a_node_whose_link_goes_down_is_named_and_the_run_resumes_on_one_rank(cluster, jobs, reference, tmp_path):
    run_dir, timeout_s = tmp_path / "run", 15
    job = jobs([*MPIRUN, *app_args(run_dir, "--set", "train.steps=300",
               "--set", "checkpoint.every=4", "--set", f"run.comm_timeout_s={timeout_s}")], cluster)  # fmt: skip
    link = [str(CLUSTER), "link", NODES[1]]
    try:
        job.wait_for(r"^gridlm: checkpoint step 4 ", timeout=180)
        job.wait_for(r"^step\s+6/", timeout=60)
        subprocess.run([*link, "down"], env=cluster, check=True, timeout=30)
        down = time.monotonic()
        # The ranks of node 1 wait for node 2 past the timeout; their watchdog names the node.
        when, line = job.wait_for(r"watchdog: no progress", timeout=timeout_s + 60)
        assert when - down < timeout_s + 45, line
        assert "node gridlm-node2 sends no heartbeat from any of its ranks (4-7)" in line, line
        assert "10.231.0.12: no answer" in line and "unreachable" in line, line
    finally:
        subprocess.run([*link, "up"], env=cluster, check=False, timeout=30)
    # mpirun reaches node 2's daemon again and ends (the ranks have aborted).
    rc = job.wait(timeout=120)
    assert rc == 4, job.text[-4000:]
    assert_no_ranks_left()
    # Which checkpoint the run committed before the link went down depends on how fast it ran
    # meanwhile (under load it reached step 8 once): read it, not guess it; every one of them
    # leaves steps to resume (REF_STEPS), so the resume is checked whatever the machine's load.
    from app.checkpoint.store import read_latest

    latest = read_latest(run_dir / "checkpoints")
    assert latest is not None, job.text[-4000:]
    step = int(re.search(r"step_(\d+)", latest.name).group(1))
    assert step in (4, 8, 12), latest
    one = one_rank(run_dir, "--set", "run.resume=auto")
    assert "resumed from" in one and f"at step {step}" in one, one
    records = read_metrics(run_dir)
    # metrics.jsonl keeps the steps up to the checkpoint and continues from it.
    assert [r["step"] for r in records] == list(range(1, REF_STEPS + 1)), records
    assert [r["loss"] for r in records] == pytest.approx(reference, rel=1e-5)

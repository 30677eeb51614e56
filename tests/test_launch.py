"""Job scripts: launch/submit.py renders launch/jobs/<machine>.sh, and launch/jobs/common.sh
forwards the scheduler's checkpoint signal to the launcher. Serial: no MPI, no scheduler."""

from __future__ import annotations

import os
import shlex
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from app.plan.machine import load_machine, machine_names
from conftest import REPO
from launch import submit

TINY = REPO / "inputs" / "gpt_tiny.yaml"
COMMON = REPO / "launch" / "jobs" / "common.sh"
MACHINES = machine_names()

# The launch line of every machine at 4 nodes, written out: what a user of that machine expects.
LAUNCH_4_NODES = {
    "frontier": "srun -N 4 -n 32 -c 7 --gpus-per-task=1 --gpu-bind=closest",
    "perlmutter": "srun -N 4 -n 16 --ntasks-per-node=4 -c 32 --cpu-bind=cores --gpus-per-node=4",
    "polaris": "mpiexec -n 16 --ppn 4 --depth 8 --cpu-bind depth",
    "alps": "srun -N 4 -n 16 --ntasks-per-node=4 -c 72 --cpu-bind=socket",
    "dgx_h100": "srun -N 4 -n 32 --ntasks-per-node=8 -c 14 --cpu-bind=cores --gpus-per-node=8 --mpi=pmix",
    "selene": "srun -N 4 -n 32 --ntasks-per-node=8 -c 16 --cpu-bind=cores --gpus-per-node=8 --mpi=pmix",
    "h100_1gpu": "srun -N 4 -n 4 --ntasks-per-node=1 -c 16 --cpu-bind=cores --gpus-per-node=1 --mpi=pmix",
    "h200_1gpu": "srun -N 4 -n 4 --ntasks-per-node=1 -c 16 --cpu-bind=cores --gpus-per-node=1 --mpi=pmix",
    "local": "srun -N 4 -n 16 --mpi=pmix",
}


def run_submit(tmp_path: Path, monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    """submit.main(args) with tmp_path as the working directory: (status, stdout, stderr)."""
    monkeypatch.chdir(tmp_path)
    status = submit.main([str(TINY), *args])
    out, err = capsys.readouterr()
    return status, out, err


def write_script(tmp_path, monkeypatch, capsys, machine: str, nodes: int, *args: str) -> str:
    # gpt_tiny's global batch (16) must be a multiple of micro_batch x dp = 4 x ranks.
    batch = str(4 * nodes * load_machine(machine).devices_per_node)
    out = tmp_path / f"{machine}-{nodes}.sh"
    status, _, err = run_submit(
        tmp_path, monkeypatch, capsys, "--machine", machine, "--nodes", str(nodes), "--out", str(out),
        "--set", f"train.global_batch={batch}", *args,
    )  # fmt: skip
    assert status == 0, err
    return out.read_text()


def test_every_machine_file_names_a_template_that_exists():
    assert set(MACHINES) == set(LAUNCH_4_NODES)
    for name in MACHINES:
        assert (REPO / "launch" / "jobs" / load_machine(name).template).is_file(), name


@pytest.mark.parametrize("nodes", [1, 4])
@pytest.mark.parametrize("machine", MACHINES)
def test_script_is_valid_bash_with_the_launch_line_and_scheduler_header(tmp_path, monkeypatch, capsys, machine, nodes):
    text = write_script(tmp_path, monkeypatch, capsys, machine, nodes)
    path = tmp_path / f"{machine}-{nodes}.sh"
    check = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, check=False)
    assert check.returncode == 0, check.stderr
    assert path.stat().st_mode & stat.S_IXUSR
    assert "{{" not in text and "}}" not in text
    launch = load_machine(machine).launch_line(nodes)
    expected = f"gridlm_launch {launch} python -m app {TINY} --set train.global_batch="
    assert expected in text
    assert text.rstrip().endswith("--set run.machine=" + machine)
    if load_machine(machine).scheduler == "slurm":
        assert f"#SBATCH --nodes={nodes}\n" in text
        assert "#SBATCH --signal=B:USR1@120\n" in text
        assert f"#SBATCH --output={tmp_path}/runs/gpt_tiny/job-%j.out\n" in text
    else:
        assert f"#PBS -l select={nodes}:system=polaris\n" in text
        assert "#PBS -l walltime=01:00:00\n" in text
        assert "gridlm_signal_before_end 3600 120\n" in text  # SIGUSR1 2 minutes before the walltime
    assert f"gridlm_start {nodes} {nodes * load_machine(machine).devices_per_node}\n" in text
    assert f"cd {tmp_path}\n" in text and f"repo={REPO}\n" in text


@pytest.mark.parametrize("machine", MACHINES)
def test_launch_lines_at_four_nodes_are_the_documented_ones(tmp_path, monkeypatch, capsys, machine):
    text = write_script(tmp_path, monkeypatch, capsys, machine, 4)
    assert f"gridlm_launch {LAUNCH_4_NODES[machine]} python -m app {TINY} " in text


def test_frontier_environment_and_binding(tmp_path, monkeypatch, capsys):
    text = write_script(tmp_path, monkeypatch, capsys, "frontier", 2, "--account", "abc123")
    for line in ("#SBATCH --account=abc123", "#SBATCH --partition=batch", "#SBATCH --time=02:00:00",
                 "export NCCL_SOCKET_IFNAME=hsn0", "export FI_CXI_ATS=0", "export OMP_NUM_THREADS=7"):  # fmt: skip
        assert line in text
    assert "--qos" not in text and "--constraint" not in text  # absent options leave no line


def test_polaris_pbs_header(tmp_path, monkeypatch, capsys):
    text = write_script(tmp_path, monkeypatch, capsys, "polaris", 2, "--account", "proj", "--queue", "debug")
    for line in ("#PBS -A proj", "#PBS -q debug", "#PBS -l filesystems=home:eagle", "#PBS -l place=scatter",
                 f"#PBS -o {tmp_path}/runs/gpt_tiny/", "export OMP_NUM_THREADS=8  # = mpiexec --depth: the cores of one rank",
                 "export GRIDLM_GPU_ORDER=3,2,1,0"):  # fmt: skip
        assert line + "\n" in text
    assert "#SBATCH" not in text


@pytest.mark.parametrize("nodes, queue", [(1, "debug"), (2, "debug"), (3, "debug-scaling"), (10, "debug-scaling"),
                                          (11, "prod"), (496, "prod")])  # fmt: skip
def test_polaris_takes_the_queue_that_fits_the_node_count(tmp_path, monkeypatch, capsys, nodes, queue):
    """Found in review (2026-11-30): every Polaris script asked for `prod`, which takes 10+ nodes. The
    machine file maps each queue to the most nodes it takes; --queue still names one."""
    text = write_script(tmp_path, monkeypatch, capsys, "polaris", nodes)
    assert f"#PBS -q {queue}\n" in text


def test_a_queue_by_node_count_refuses_a_job_no_queue_takes(tmp_path, monkeypatch, capsys):
    args = ("--machine", "polaris", "--nodes", "497", "--set", f"train.global_batch={4 * 4 * 497}")
    err = expect_error(tmp_path, monkeypatch, capsys, *args)
    assert "defaults.queue: no queue takes 497 nodes (debug up to 2, debug-scaling up to 10, prod up to 496)" in err
    assert "pass one with --queue" in err


def test_local_script_is_the_one_the_slurm_test_runs(tmp_path, monkeypatch, capsys):
    out = tmp_path / "job.sh"
    status, stdout, err = run_submit(
        tmp_path, monkeypatch, capsys, "--machine", "local", "--nodes", "1", "--out", str(out),
        "--set", f"run.dir={tmp_path}/run", "--set", "train.steps=6",
    )  # fmt: skip
    assert status == 0, err
    text = out.read_text()
    assert "#SBATCH --ntasks-per-node=4\n#SBATCH --time=00:30:00\n" in text
    assert "#SBATCH --partition=debug\n" in text
    assert f"#SBATCH --output={tmp_path}/run/job-%j.out\n" in text
    assert (tmp_path / "run").is_dir()  # Slurm opens the job log there before the script runs
    assert 'source "$repo/launch/env.sh"' in text
    line = f"srun -N 1 -n 4 --mpi=pmix python -m app {TINY} --set run.dir={tmp_path}/run --set train.steps=6"
    assert f"gridlm_launch {line} --set run.machine=local\n" in text
    assert f"submit: wrote {out}\n" in stdout and f"submit: launch: {line}" in stdout


def test_default_path_time_and_machine_from_the_deck(tmp_path, monkeypatch, capsys):
    status, out, err = run_submit(tmp_path, monkeypatch, capsys, "--nodes", "1", "--set", "run.machine=perlmutter")
    assert status == 0, err
    path = tmp_path / "jobs" / "gpt_tiny-perlmutter-1n.sh"
    text = path.read_text()
    assert "#SBATCH --time=02:00:00\n#SBATCH --output=" in text
    assert "#SBATCH --qos=regular\n#SBATCH --constraint=gpu\n" in text
    assert "submit: submit with: sbatch " in out


def test_overrides_reach_the_app_exactly_as_given(tmp_path, monkeypatch, capsys):
    # A shell would expand $1 and split at the space; the deck takes it as written ($NAME is refused there).
    tricky = "checkpoint.dir=ck$1 dir/it's"
    text = write_script(tmp_path, monkeypatch, capsys, "local", 1, "--set", tricky)
    line = next(x for x in text.splitlines() if x.startswith("gridlm_launch "))
    argv = shlex.split(line)
    assert argv[argv.index("app") + 1] == str(TINY)
    assert argv[-4:] == ["--set", tricky, "--set", "run.machine=local"]


def test_a_machine_given_as_a_path_is_passed_on_as_an_absolute_path(tmp_path, monkeypatch, capsys):
    mine = tmp_path / "mine.yaml"
    mine.write_text((REPO / "inputs" / "machines" / "local.yaml").read_text().replace("name: local", "name: mine"))
    status, _, err = run_submit(tmp_path, monkeypatch, capsys, "--machine", "mine.yaml", "--nodes", "1")
    assert status == 0, err
    assert f"--set run.machine={mine}\n" in (tmp_path / "jobs" / "gpt_tiny-mine-1n.sh").read_text()


@pytest.mark.parametrize(
    "defaults, message",
    [('{time: 2:00:00, partition: debug}', 'line 19: 2:00:00 reads as a base-60 number (YAML 1.1), 7200: write the '
      'number in decimal, or quote it for a time or a string ("2:00:00")'),
     ('{time: "2:00", partition: debug}', "defaults.time '2:00': expected HH:MM:SS"),
     ('{time: "00:30:00", partition: true}', "defaults.partition = True: a name is expected")],
)  # fmt: skip
def test_a_machine_file_s_bad_defaults_are_named_as_its_own(tmp_path, monkeypatch, capsys, defaults, message):
    """Found in review (2026-11-30): an unquoted defaults.time (YAML: 2:00:00 is 7200 seconds) was
    blamed on --time, and partition: true was written as --partition=True."""
    mine = tmp_path / "mine.yaml"
    text = (REPO / "inputs" / "machines" / "local.yaml").read_text().replace("name: local", "name: mine")
    mine.write_text(text.replace('defaults: {time: "00:30:00", partition: debug}', f"defaults: {defaults}"))
    err = expect_error(tmp_path, monkeypatch, capsys, "--machine", "mine.yaml", "--nodes", "1")
    assert err.startswith(f"submit: machine file mine.yaml: {message}"), err


def expect_error(tmp_path, monkeypatch, capsys, *args: str) -> str:
    status, out, err = run_submit(tmp_path, monkeypatch, capsys, *args)
    assert status == 2, (out, err)
    assert err.startswith("submit: ") and "Traceback" not in err
    assert not (tmp_path / "jobs").exists()
    return err


def test_unknown_machine_lists_the_known_ones(tmp_path, monkeypatch, capsys):
    err = expect_error(tmp_path, monkeypatch, capsys, "--machine", "summit", "--nodes", "1")
    assert "summit" in err and all(name in err for name in MACHINES)


def test_no_machine_anywhere_is_an_error(tmp_path, monkeypatch, capsys):
    err = expect_error(tmp_path, monkeypatch, capsys, "--nodes", "1")
    assert "--machine" in err and "run.machine" in err


def test_deck_that_does_not_fit_the_world_writes_nothing(tmp_path, monkeypatch, capsys):
    # tp = 8 splits gpt_tiny's heads, MLP and vocabulary, but 1 local node has only 4 ranks.
    err = expect_error(tmp_path, monkeypatch, capsys, "--machine", "local", "--nodes", "1", "--set", "parallel.tp=8")
    assert "submit: deck error: parallel.tp = 8" in err and "world size 4" in err
    err = expect_error(tmp_path, monkeypatch, capsys, "--machine", "frontier", "--nodes", "1")
    assert "train.global_batch = 16" in err and "micro_batch x dp = 4 x 8" in err


@pytest.mark.parametrize(
    "machine, time, message",
    [
        ("frontier", "2h", "expected HH:MM:SS or D-HH:MM:SS"),
        ("frontier", "02:61:00", "expected HH:MM:SS"),
        ("frontier", "1-25:00:00", "hours must be 00-23"),
        ("frontier", "00:01:30", "longer than 120 s"),
        ("polaris", "1-02:00:00", "pbs takes HH:MM:SS (hours may exceed 24), e.g. 26:00:00"),
    ],
)
def test_bad_time_is_refused(tmp_path, monkeypatch, capsys, machine, time, message):
    args = ("--machine", machine, "--nodes", "4", "--set", "train.global_batch=128", "--time", time)
    err = expect_error(tmp_path, monkeypatch, capsys, *args)
    assert f"--time {time!r}" in err and message in err


def test_day_time_is_accepted_by_slurm(tmp_path, monkeypatch, capsys):
    assert "#SBATCH --time=1-12:00:00\n" in write_script(
        tmp_path, monkeypatch, capsys, "local", 1, "--time", "1-12:00:00"
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (("--machine", "frontier", "--queue", "debug"), "--queue: not a slurm option"),
        (("--machine", "polaris", "--partition", "debug"), "--partition: not a pbs option"),
        (("--machine", "local", "--account", "a b"), "--account = 'a b': no spaces"),
        (("--machine", "local", "--job-name", "1st"), "--job-name '1st'"),
        (("--machine", "local", "--nodes", "0"), "--nodes 0"),
    ],
)
def test_bad_scheduler_options_are_refused(tmp_path, monkeypatch, capsys, args, message):
    nodes = () if "--nodes" in args else ("--nodes", "1")
    err = expect_error(tmp_path, monkeypatch, capsys, *nodes, *args, "--set", "train.global_batch=32")
    assert message in err


def test_plan_problems_refuse_the_script_unless_forced(tmp_path, monkeypatch, capsys):
    """The dry run's problems (here: tp = 8 over two 4-rank nodes) stop submit.py before a job
    waits in the queue; --force writes the script and repeats them as warnings."""
    args = ("--machine", "local", "--nodes", "2", "--set", "parallel.tp=8")
    err = expect_error(tmp_path, monkeypatch, capsys, *args)
    assert "tensor-parallel groups span 2 nodes" in err and "--force" in err
    status, _, err = run_submit(tmp_path, monkeypatch, capsys, *args, "--force")
    assert status == 0 and "submit: warning: tensor-parallel groups span 2 nodes" in err
    assert (tmp_path / "jobs" / "gpt_tiny-local-2n.sh").is_file()


def test_check_plan_is_the_dry_run():
    from app.deck import load_deck, resolve_for_world

    assert submit.check_plan(resolve_for_world(load_deck(TINY), 4), 4, load_machine("local")) == []
    big = load_deck(REPO / "inputs/gpt_1t.yaml", ("train.recompute=none",))
    (problem,) = submit.check_plan(resolve_for_world(big, 3072), 3072, load_machine("selene"))
    assert problem.startswith("does not fit: stage 0 needs")


def test_submit_without_sbatch_on_path_is_a_clear_error(tmp_path, monkeypatch, capsys):
    (tmp_path / "bin").mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    status, _, err = run_submit(tmp_path, monkeypatch, capsys, "--machine", "local", "--nodes", "1", "--submit")
    assert status == 2 and "submit: sbatch not found on PATH" in err
    assert (tmp_path / "jobs" / "gpt_tiny-local-1n.sh").is_file()  # written; submit it by hand


@pytest.mark.parametrize("machine, command, answer", [("local", "sbatch", "4242;cluster"), ("polaris", "qsub", "4242")])
def test_submit_runs_the_scheduler_and_prints_the_job_id(tmp_path, monkeypatch, capsys, machine, command, answer):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / command
    fake.write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/args\necho "{answer}"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    args = ("--machine", machine, "--nodes", "1", "--submit", "--set", "train.global_batch=16")
    status, out, err = run_submit(tmp_path, monkeypatch, capsys, *args)
    assert status == 0, err
    assert "submit: job 4242 submitted" in out
    assert (tmp_path / "args").read_text().split()[-1] == str(tmp_path / "jobs" / f"gpt_tiny-{machine}-1n.sh")


@pytest.mark.parametrize("how", [["launch/submit.py"], ["-m", "launch.submit"]])
def test_runs_by_path_and_as_a_module(tmp_path, how):
    cwd = REPO if how[0] == "-m" else tmp_path
    args = [sys.executable, *how, str(TINY), "--machine", "local", "--nodes", "1", "--out", str(tmp_path / "j.sh"),
            "--set", f"run.dir={tmp_path}/run"]  # fmt: skip
    if how[0] != "-m":
        args[1] = str(REPO / how[0])
    result = subprocess.run(args, cwd=cwd, capture_output=True, text=True, check=False, timeout=60)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "j.sh").is_file()


def test_render_rejects_unknown_unfilled_and_malformed_placeholders():
    assert submit.render("a\n{{x}}\nb {{ y }}\n", {"x": "", "y": "1"}) == "a\nb 1\n"
    with pytest.raises(submit.SubmitError, match="unknown placeholder.*nope"):
        submit.render("{{nope}}", {"x": "1"})
    with pytest.raises(submit.SubmitError, match="no value for placeholder.*x"):
        submit.render("{{x}}", {"x": None})
    with pytest.raises(submit.SubmitError, match="not a"):
        submit.render("{{x-y}}", {"x": "1"})
    assert submit.render("${a} {b}\n", {}) == "${a} {b}\n"  # bash syntax is left alone


# --- the job's python: the repository on PYTHONPATH, its imports checked before the launch -------

# A launcher that starts one rank, as a dry run (no MPI, no GPU): whether `python -m app` starts in a job.
ONE_RANK_DRY_RUN = '#!/bin/sh\nwhile [ "$1" != python ]; do shift; done\nexec "$@" --dry-run --world-size 4\n'


def bare_python(tmp_path: Path, with_packages: bool) -> Path:
    """bin/ of a python without gridlm: with torch, mpi4py and h5py (`with_packages`; a site's module or
    conda env) or without them. A venv, over this test's packages but not their editable install of
    the repository."""
    import venv

    home = tmp_path / ("site" if with_packages else "bare")
    venv.create(home, with_pip=False, symlinks=True)
    if with_packages:
        (site_packages,) = (home / "lib").glob("python3*/site-packages")
        (site_packages / "packages.pth").write_text("".join(p + "\n" for p in sys.path if p.endswith("site-packages")))
    return home / "bin"


def run_job(script: Path, tmp_path: Path, launcher: str, text: str, python_bin: Path) -> subprocess.CompletedProcess:
    """The job script with `launcher` standing in (`text`) and no venv (GRIDLM_VENV names none)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / launcher).write_text(text)
    (bin_dir / launcher).chmod(0o755)
    env = {"PATH": f"{bin_dir}:{python_bin}:/usr/bin:/bin", "HOME": str(tmp_path), "GRIDLM_VENV": "/nonexistent"}
    return subprocess.run(["bash", str(script)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("machine", MACHINES)
def test_every_script_checks_its_python_before_the_launch(tmp_path, monkeypatch, capsys, machine):
    text = write_script(tmp_path, monkeypatch, capsys, machine, 1)
    assert text.index("\ngridlm_use_venv") < text.index("\ngridlm_check_python") < text.index("\ngridlm_launch ")


def test_a_site_python_without_the_repos_venv_runs_the_app_of_the_repository(tmp_path, monkeypatch, capsys):
    """Found in review: the script runs `python -m app` in the directory submit.py ran in, and nothing
    put the repository on PYTHONPATH: with a site's python (torch, mpi4py and h5py, no .venv) every
    rank failed after the queue wait with "No module named app"."""
    write_script(tmp_path, monkeypatch, capsys, "perlmutter", 1)
    done = run_job(tmp_path / "perlmutter-1.sh", tmp_path, "srun", ONE_RANK_DRY_RUN, bare_python(tmp_path, True))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "No module named app" not in done.stderr
    assert "imports app, torch, mpi4py and h5py" in done.stdout
    assert "no problems found" in done.stdout  # the app's dry run, started by the launch line


def test_a_python_without_torch_stops_the_job_before_the_launch(tmp_path, monkeypatch, capsys):
    """The python the ranks would run is checked on the batch node, once: a missing package ends the
    job in seconds (exit 2), naming each one and the fix, before the launcher starts (PBS: and its
    SIGUSR1 timer is ended, or the job would wait for it)."""
    write_script(tmp_path, monkeypatch, capsys, "polaris", 1)
    marker = tmp_path / "launched"
    done = run_job(tmp_path / "polaris-1.sh", tmp_path, "mpiexec", f"#!/bin/sh\ntouch {marker}\n",
                   bare_python(tmp_path, False))  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    assert not marker.exists() and "launch:" not in done.stdout
    missing = "cannot import: torch (ModuleNotFoundError: No module named 'torch'); mpi4py ("
    assert missing in done.stderr and "h5py (" in done.stderr and "app (" not in done.stderr
    assert "run launch/setup.sh" in done.stderr and "GRIDLM_CHECK_PYTHON=0" in done.stderr


def test_a_launch_line_that_starts_a_container_leaves_the_python_to_it(tmp_path, monkeypatch, capsys):
    """pyxis' srun --container-image (DGX clusters) runs the image's python: the batch node's lacks
    torch, and checking it would stop every such job; the check is skipped and says why."""
    machine = tmp_path / "dgx_pyxis.yaml"
    text = (REPO / "inputs/machines/dgx_h100.yaml").read_text()
    text = text.replace("--mpi=pmix", "--mpi=pmix --container-image=nvcr.io/nvidia/pytorch:24.05-py3")
    machine.write_text(text.replace("name: dgx_h100", "name: dgx_pyxis"))
    write_script(tmp_path, monkeypatch, capsys, str(machine), 1)
    marker = tmp_path / "launched"
    done = run_job(Path(f"{machine}-1.sh"), tmp_path, "srun", f"#!/bin/sh\ntouch {marker}\n",
                   bare_python(tmp_path, False))  # fmt: skip
    assert done.returncode == 0 and marker.exists(), done.stdout + done.stderr
    assert "python check skipped: the launcher's container provides python (--container-image=" in done.stdout


# --- common.sh: signal forwarding, exit status, the PBS timer, the node-count check -----------

CHILD = textwrap.dedent(
    """
    import pathlib, signal, sys, time
    marker, ready, code = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), int(sys.argv[3])
    got = []
    def on_signal(signum, frame):  # like the app: note it, finish the "step", exit 0
        got.append(signal.Signals(signum).name)
        marker.write_text(" ".join(got))
    signal.signal(signal.SIGUSR1, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    ready.write_text("ready")
    deadline = time.time() + 20
    while time.time() < deadline and code < 0:
        if len(got) >= -code:
            time.sleep(0.3)
            sys.exit(0)
        time.sleep(0.05)
    sys.exit(code if code >= 0 else 3)  # 3: no signal came
    """
)


def job_script(tmp_path: Path, code: int, before: str = "") -> Path:
    """A job script that launches CHILD through common.sh; CHILD exits `code`, or (code < 0)
    waits for -code signals and exits 0 a moment after the last."""
    (tmp_path / "child.py").write_text(CHILD)
    script = tmp_path / "job.sh"
    script.write_text(
        f"set -euo pipefail\nsource {COMMON}\n{before}\n"
        f"gridlm_launch {sys.executable} {tmp_path}/child.py {tmp_path}/marker {tmp_path}/ready {code}\n"
    )
    return script


def start(script: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(["bash", str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def wait_for(path: Path, timeout: float = 20) -> None:
    deadline = time.time() + timeout
    while not path.exists():
        assert time.time() < deadline, f"{path} did not appear"
        time.sleep(0.05)


@pytest.mark.parametrize("signals", [["SIGUSR1"], ["SIGTERM"], ["SIGUSR1", "SIGTERM"]])
def test_signals_reach_the_launcher_and_its_exit_status_is_the_scripts(tmp_path, signals):
    proc = start(job_script(tmp_path, code=-len(signals)))
    wait_for(tmp_path / "ready")
    for name in signals:
        proc.send_signal(getattr(signal, name))
        time.sleep(0.2)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, (out, err)  # the child's 0, not 128 + n from the interrupted wait
    assert (tmp_path / "marker").read_text() == " ".join(signals)
    for name in signals:
        assert f"{name} -> launcher (pid " in err
    assert out.splitlines()[-1].endswith("launcher exited with status 0")


def test_the_launchers_failure_status_is_the_scripts(tmp_path):
    proc = start(job_script(tmp_path, code=7))
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 7, (out, err)
    assert out.splitlines()[-1].endswith("launcher exited with status 7")


def test_pbs_timer_sends_usr1_before_the_walltime(tmp_path):
    # walltime 123 s, lead 121 s: SIGUSR1 two seconds after the start.
    proc = start(job_script(tmp_path, code=-1, before="gridlm_signal_before_end 123 121"))
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, (out, err)
    assert (tmp_path / "marker").read_text() == "SIGUSR1"
    assert "SIGUSR1 in 2 s" in out and "SIGUSR1 -> launcher" in err


def test_job_header_and_a_wrong_node_count_stops_the_job(tmp_path):
    env = {**os.environ, "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "nid[001-002]", "SLURM_JOB_ID": "77"}
    proc = start(job_script(tmp_path, code=0, before=f"repo={REPO}\ngridlm_start 2 8"), env)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, (out, err)
    assert "job 77 on " in out and "2 node(s) x 4 = 8 ranks | nodes: nid[001-002]" in out
    assert f"gridlm {REPO} @ " in out
    proc = start(job_script(tmp_path, code=0, before="gridlm_start 4 16"), env)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 2 and "written for 4 node(s) but the job has 2" in err
    assert "launch/submit.py --nodes 2" in err and "launch:" not in out


@pytest.mark.parametrize(
    "machine, deck, nodes, options",
    [
        ("frontier", "inputs/gpt_1t.yaml", 384, "-c 64 -p capacity -S 16M"),  # 14 TB: OLCF's 8 TB row
        ("frontier", "inputs/gpt_tiny.yaml", 1, ""),  # below 512 GB: Orion's own layout
        ("perlmutter", "inputs/gpt_1t.yaml", 768, "-c 72"),
        ("alps", "inputs/gpt_tiny.yaml", 2, "-c 32 -S 4M"),
        ("polaris", "inputs/gpt_1t.yaml", 768, ""),
        ("dgx_h100", "inputs/gpt_1t.yaml", 384, ""),
    ],
)
def test_job_scripts_stripe_the_checkpoint_directory_by_the_sites_rule(
    tmp_path, monkeypatch, capsys, machine, deck, nodes, options
):
    """Each site template calls gridlm_stripe on the deck's checkpoint directory with the machine
    file's lfs setstripe options for this checkpoint's size (none where the site gives none)."""
    monkeypatch.chdir(REPO)
    out = tmp_path / "job.sh"
    sets = ["--set", "train.global_batch=32"] if "tiny" in deck else []  # a batch for dp 8
    if machine == "polaris" and nodes > 496:  # more than its queues take by node count: name one
        sets += ["--queue", "prod"]
    assert submit.main([deck, "--machine", machine, "--nodes", str(nodes), "--out", str(out), "--force", *sets]) == 0
    lines = [line.split() for line in out.read_text().splitlines() if line.startswith("gridlm_stripe ")]
    checkpoints = REPO / "runs" / Path(deck).stem / "checkpoints"
    assert lines == [["gridlm_stripe", str(checkpoints), *options.split()]], lines


def test_gridlm_stripe_runs_lfs_setstripe_with_the_options_or_leaves_the_layout(tmp_path):
    """gridlm_stripe (launch/jobs/common.sh) against a stand-in `lfs` that records its arguments
    (this machine has no Lustre): the template's options, GRIDLM_STRIPE instead of them, "none",
    no options, and no lfs at all."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    (bin_dir / "lfs").write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    (bin_dir / "lfs").chmod(0o755)
    common = REPO / "launch" / "jobs" / "common.sh"

    def stripe(args: str, env: dict[str, str], with_lfs: bool = True) -> str:
        path = f"{bin_dir}:{os.environ['PATH']}" if with_lfs else "/usr/bin:/bin"
        script = f"source {common}; gridlm_stripe {tmp_path / 'ckpt'} {args}"
        done = subprocess.run(["bash", "-c", script], env={**env, "PATH": path}, capture_output=True, text=True,
                              timeout=30, check=True)  # fmt: skip
        return done.stdout + done.stderr

    log = stripe("-c 64 -p capacity -S 16M", {})
    assert calls.read_text().splitlines() == [f"setstripe -c 64 -p capacity -S 16M {tmp_path / 'ckpt'}"]
    assert "lfs setstripe -c 64 -p capacity -S 16M" in log and (tmp_path / "ckpt").is_dir()
    stripe("-c 64 -S 16M", {"GRIDLM_STRIPE": "-c 4 -S 1M"})
    assert calls.read_text().splitlines()[-1] == f"setstripe -c 4 -S 1M {tmp_path / 'ckpt'}"
    for args, env in (("-c 8", {"GRIDLM_STRIPE": "none"}), ("", {})):
        assert "its file system's layout" in stripe(args, env)
    assert len(calls.read_text().splitlines()) == 2  # neither called lfs
    assert "no lfs command" in stripe("-c 8", {}, with_lfs=False)


def test_the_signal_comes_early_enough_for_the_predicted_step_and_checkpoint(tmp_path, monkeypatch, capsys):
    """Found in review (2026-11-30): SIGUSR1 came a fixed 120 s before the limit, but gpt_1t's step on 384
    Frontier nodes is predicted at ~195 s: the ranks, which stop after the step the signal falls in,
    were killed by the limit before their checkpoint. The lead now holds the predicted step, twice the
    checkpoint's least time and a minute (gpt_tiny's stays 120 s: the test above)."""
    from app.deck import load_deck, resolve_for_world
    from app.plan.dryrun import checkpoint_time, make_plan

    monkeypatch.chdir(tmp_path)
    machine = load_machine("frontier")
    plan = make_plan(resolve_for_world(load_deck(REPO / "inputs/gpt_1t.yaml"), 3072), 3072, machine)
    step, save = plan.predicted.step_time_s, checkpoint_time(plan)["save_s"]
    assert step > 120  # the case the fixed lead failed
    lead = submit.signal_lead(plan)
    assert lead >= step + 2 * save + 60 and lead < step + 2 * save + 62
    out = tmp_path / "f.sh"
    args = [str(REPO / "inputs/gpt_1t.yaml"), "--machine", "frontier", "--nodes", "384", "--out", str(out)]
    assert submit.main(args) == 0
    assert f"#SBATCH --signal=B:USR1@{lead}\n" in out.read_text()
    assert f"SIGUSR1 comes {lead} s before the time limit" in capsys.readouterr().err
    assert submit.main([*args, "--time", "00:04:00"]) == 2
    assert f"must be longer than {lead} s" in capsys.readouterr().err
